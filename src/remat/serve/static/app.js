// The page of `remat serve`: chat, train, jobs and adapters through the server's public API.
// Hand-written, no dependencies. Every API error is shown with its message ({"error": {message}}).
"use strict";

const $ = (sel) => document.querySelector(sel);
const KEY_STORE = "remat.apiKey";
const TERMINAL = ["succeeded", "failed", "cancelled"];
const CATEGORIES = ["params", "frozen", "grads", "optimizer", "graph", "cache"];
const CATEGORY_TEXT = {params: "trainable params", frozen: "frozen params", grads: "grads",
                       optimizer: "optimizer", graph: "graph (activations)", cache: "KV cache"};

const S = {
  key: sessionStorage.getItem(KEY_STORE) || "",
  props: null,
  tab: "chat",
  jobs: [],
  follow: null,      // the followed job: {id, points, stream...}
  chat: [],          // [{role, content}]
  chatAbort: null,
  adapters: [],
  planned: null,     // the last answer of POST /train/plan
};
window.__remat = S;  // for tests and curious people

// -------------------------------------------------------------------------------------------------- api

class ApiError extends Error {
  constructor(status, body, fallback) {
    const err = body && typeof body === "object" && body.error ? body.error : null;
    const message = err && err.message ? err.message
      : (typeof body === "string" && body ? body.slice(0, 300) : fallback || `HTTP ${status}`);
    super(message);
    this.status = status;
    this.body = body;
    this.type = err ? err.type : null;
  }
  get text() {
    if (!this.status) return this.message;
    return `${this.status}${this.type ? " " + this.type : ""}: ${this.message}`;
  }
}

function headers(extra) {
  const h = Object.assign({}, extra || {});
  if (S.key) h["Authorization"] = "Bearer " + S.key;
  return h;
}

async function request(method, path, body, opts) {
  const init = {method, headers: headers(body !== undefined ? {"Content-Type": "application/json"} : {})};
  if (body !== undefined) init.body = JSON.stringify(body);
  if (opts && opts.signal) init.signal = opts.signal;
  if (opts && opts.headers) Object.assign(init.headers, opts.headers);
  let res;
  try {
    res = await fetch(path, init);
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new ApiError(0, null, `cannot reach the server (${e.message})`);
  }
  return res;
}

async function readError(res) {
  const text = await res.text();
  let body = text;
  try { body = JSON.parse(text); } catch (e) { /* not JSON: shown as text */ }
  return new ApiError(res.status, body);
}

async function api(method, path, body) {
  const res = await request(method, path, body);
  if (!res.ok) throw await readError(res);
  const text = await res.text();
  try { return JSON.parse(text); } catch (e) { return text; }
}

// Server-sent events from a fetch response (EventSource cannot send the API key).
async function* sse(res) {
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buf += decoder.decode(value, {stream: true}).replace(/\r\n?/g, "\n");
    let end;
    while ((end = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, end);
      buf = buf.slice(end + 2);
      const ev = {event: "message", data: null, id: null};
      const data = [];
      for (const line of block.split("\n")) {
        if (!line || line.startsWith(":")) continue;
        const i = line.indexOf(":");
        const field = i < 0 ? line : line.slice(0, i);
        let val = i < 0 ? "" : line.slice(i + 1);
        if (val.startsWith(" ")) val = val.slice(1);
        if (field === "data") data.push(val);
        else if (field === "event") ev.event = val;
        else if (field === "id") ev.id = val;
      }
      if (data.length) { ev.data = data.join("\n"); yield ev; }
    }
  }
}

// ---------------------------------------------------------------------------------------------- helpers

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") e.className = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else if (k === "dataset") Object.assign(e.dataset, v);
    else if (k === "style") e.style.cssText = v;  // CSSOM: allowed by the page's CSP, unlike the attribute
    else e.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

const SVG_NS = "http://www.w3.org/2000/svg";
function svg(tag, attrs, ...children) {
  const e = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) if (v !== null && v !== undefined) e.setAttribute(k, v);
  for (const c of children.flat()) if (c !== null && c !== undefined) e.append(c instanceof Node ? c : String(c));
  return e;
}

function showError(box, e) {
  const b = typeof box === "string" ? $(box) : box;
  if (!e) { b.hidden = true; b.textContent = ""; return; }
  if (e.name === "AbortError") return;
  b.textContent = e instanceof ApiError ? e.text : (e.message || String(e));
  b.hidden = false;
  if (e instanceof ApiError && e.status === 401) keyWanted();
}

function keyWanted() {
  $("#key-form").classList.add("wanted");
  const banner = $("#banner");
  banner.textContent = S.key ? "The server refused the API key: enter the right one above."
    : "This server needs an API key: enter it above (it is kept for this browser tab only).";
  banner.hidden = false;
}

function mib(bytes) {
  if (bytes === null || bytes === undefined) return "—";
  const m = bytes / 1048576;
  if (m >= 1024) return (m / 1024).toFixed(2) + " GiB";
  if (m >= 100) return m.toFixed(0) + " MiB";
  if (m >= 1) return m.toFixed(1) + " MiB";
  return (bytes / 1024).toFixed(1) + " KiB";
}

function fmt(x, digits) {
  if (x === null || x === undefined || Number.isNaN(x)) return "—";
  return Number(x).toFixed(digits === undefined ? 2 : digits);
}

function ms(seconds) {
  if (seconds === null || seconds === undefined) return "—";
  return seconds >= 1 ? seconds.toFixed(2) + " s" : (seconds * 1000).toFixed(1) + " ms";
}

function pct(ppm) {
  if (ppm === null || ppm === undefined) return "—";
  return (ppm / 10000).toFixed(ppm < 10000 ? 2 : 1) + "%";
}

const sleep = (ms_) => new Promise((r) => setTimeout(r, ms_));

// ------------------------------------------------------------------------------------------ header, tabs

function selectTab(name) {
  if (!["chat", "train", "jobs", "adapters"].includes(name)) name = "chat";
  S.tab = name;
  for (const a of document.querySelectorAll("#tabs a")) a.classList.toggle("active", a.dataset.tab === name);
  for (const s of document.querySelectorAll("section.tab")) s.hidden = s.id !== "tab-" + name;
  if (name === "jobs") refreshJobs();
  if (name === "adapters") refreshAdapters();
  if (name === "chat") { refreshChatAdapters(); $("#chat-input").focus(); }
}

async function refreshHeader() {
  try {
    const models = await api("GET", "/v1/models");  // public: says the model even before a key is given
    const m = models.data && models.data[0];
    if (m) $("#model").textContent = m.id + (m.meta && m.meta.n_ctx ? ` · ctx ${m.meta.n_ctx}` : "");
  } catch (e) { /* /health says it */ }
  try {
    await api("GET", "/health");
    $("#health").className = "dot ok";
    $("#health").title = "server ready";
  } catch (e) {
    $("#health").className = "dot bad";
    $("#health").title = e.text || e.message;
  }
  try {
    S.props = await api("GET", "/props");
    $("#t-budget").textContent = S.props.memory_budget ? mib(S.props.memory_budget) : "(free memory)";
    $("#banner").hidden = true;
    $("#key-form").classList.remove("wanted");
  } catch (e) {
    if (e.status === 401) keyWanted();
    else if (e.status) { $("#banner").textContent = e.text; $("#banner").hidden = false; }
  }
}

function setKey(key) {
  S.key = key.trim();
  if (S.key) sessionStorage.setItem(KEY_STORE, S.key);
  else sessionStorage.removeItem(KEY_STORE);
  for (const id of ["#chat-error", "#train-error", "#jobs-error", "#adapters-error"]) showError(id, null);
  refreshHeader().then(() => selectTab(S.tab));
  if (S.follow) followJob(S.follow.id);
}

// ------------------------------------------------------------------------------------------------- chat

function chatBubble(role, text) {
  const log = $("#chat-log");
  const empty = log.querySelector(".empty");
  if (empty) empty.remove();
  const b = el("div", {class: "msg " + role}, el("div", {class: "who"}, role), el("div", {class: "text"}, text));
  log.append(b);
  log.scrollTop = log.scrollHeight;
  return b;
}

async function refreshChatAdapters() {
  try {
    const list = await api("GET", "/lora-adapters");
    S.adapters = list;
    const on = list.filter((a) => a.scale);
    $("#chat-adapters").textContent = on.length
      ? "adapters: " + on.map((a) => `${a.name} ×${fmt(a.scale)}`).join(", ") : "no adapter applied";
  } catch (e) {
    $("#chat-adapters").textContent = "";
    if (e.status === 401) keyWanted();
  }
}

async function sendChat(ev) {
  ev.preventDefault();
  const input = $("#chat-input");
  const text = input.value.trim();
  if (!text || S.chatAbort) return;
  showError("#chat-error", null);
  input.value = "";
  S.chat.push({role: "user", content: text});
  chatBubble("user", text);
  const bubble = chatBubble("assistant", "");
  bubble.classList.add("streaming");
  const out = bubble.querySelector(".text");
  let pieces = 0;
  let content = "";
  const ctrl = new AbortController();
  S.chatAbort = ctrl;
  $("#chat-stop").disabled = false;
  $("#chat-send").disabled = true;
  const body = {messages: S.chat.slice(), stream: true};
  const maxTokens = parseInt($("#chat-max").value, 10);
  if (!Number.isNaN(maxTokens)) body.max_tokens = maxTokens;
  const temp = parseFloat($("#chat-temp").value);
  if (!Number.isNaN(temp)) body.temperature = temp;
  let info = "";
  try {
    const res = await request("POST", "/v1/chat/completions", body, {signal: ctrl.signal});
    if (!res.ok) throw await readError(res);
    for await (const e of sse(res)) {
      if (e.data === "[DONE]") break;
      let d;
      try { d = JSON.parse(e.data); } catch (err) { continue; }
      if (d.error) throw new ApiError(d.error.code || 500, d);
      const c = d.choices && d.choices[0];
      const piece = c && c.delta && c.delta.content;
      if (piece) {
        content += piece;
        out.textContent = content;
        pieces += 1;
        bubble.dataset.pieces = String(pieces);
        $("#chat-log").scrollTop = $("#chat-log").scrollHeight;
      }
      if (c && c.finish_reason) {
        const t = d.timings || {};
        info = `${t.predicted_n || pieces} tokens` +
          (t.predicted_per_second ? `, ${t.predicted_per_second.toFixed(1)} tokens/s` : "") +
          (c.finish_reason === "length" ? " · stopped at max tokens" : "");
      }
    }
  } catch (e) {
    if (e.name === "AbortError") info = "stopped";
    else showError("#chat-error", e);
  } finally {
    S.chatAbort = null;
    $("#chat-stop").disabled = true;
    $("#chat-send").disabled = false;
    bubble.classList.remove("streaming");
    bubble.dataset.done = "1";
    if (content) S.chat.push({role: "assistant", content});
    if (!content) out.textContent = info === "stopped" ? "" : "(no text)";
    if (info) bubble.append(el("div", {class: "info muted small"}, info));
  }
}

// ------------------------------------------------------------------------------------------------ train

function parseRecords(text, name) {
  const src = text.trim();
  if (!src) throw new Error(`${name}: empty, nothing to train on`);
  if (/\.(txt|md)$/i.test(name)) return [{text}];
  if (src.startsWith("[") || (src.startsWith("{") && !/\}\s*\n\s*\{/.test(src))) {
    try {
      const obj = JSON.parse(src);
      return Array.isArray(obj) ? obj : [obj];
    } catch (e) {
      if (src.startsWith("[")) throw new Error(`${name}: not valid JSON (${e.message})`);
    }
  }
  const records = [];
  src.split("\n").forEach((line, i) => {
    if (!line.trim()) return;
    try {
      records.push(JSON.parse(line));
    } catch (e) {
      throw new Error(`${name} line ${i + 1}: not valid JSON (${e.message}); expected one JSON record a line ` +
                      `({"text": ...}, {"messages": [...]} or {"prompt": ..., "completion": ...}), ` +
                      `or a .txt file of plain text`);
    }
  });
  return records;
}

async function trainRequest() {
  const req = {};
  const file = $("#t-file").files[0];
  const pasted = $("#t-data").value;
  if (file) req.data = parseRecords(await file.text(), file.name);
  else if (pasted.trim()) req.data = parseRecords(pasted, "pasted records");
  else throw new Error("no data: choose a file or paste records");
  const name = $("#t-name").value.trim();
  if (name) req.name = name;
  for (const [id, key] of [["#t-ctx", "ctx"], ["#t-epochs", "epochs"], ["#t-steps", "steps"]]) {
    const v = $(id).value.trim();
    if (v) req[key] = Number(v);
  }
  const lr = $("#t-lr").value.trim();
  if (lr) req.lr = Number(lr);
  const rank = $("#t-rank").value.trim();
  if (rank !== "") req.lora = Number(rank) === 0 ? false : {r: Number(rank)};
  req.recompute = $("#t-recompute").value;  // a policy: auto, budget, off, on, dots, every:K
  const device = $("#t-device").value.trim();
  if (device) req.device = device;  // auto, cpu, cuda, cuda:N, mps: the server's own when empty
  const dtype = $("#t-dtype").value;  // auto (not sent: the server's default), float32, bfloat16, float16
  if (dtype !== "auto") req.dtype = dtype;
  const budget = $("#t-budget-input").value.trim();
  if (budget) req.memory_budget = /^[0-9]+$/.test(budget) ? budget + "MiB" : budget;  // a bare number: MiB
  return req;
}

// Plan (POST /train/plan: nothing queued) or submit (POST /train): the same body, the same plan card.
// `extra`: fields set over the form's (the longest window: ctx "max").
async function trainCall(path, button, busy, extra) {
  showError("#train-error", null);
  let req;
  try {
    req = Object.assign(await trainRequest(), extra || {});
  } catch (e) {
    showError("#train-error", e);
    return null;
  }
  const label = button.textContent;
  const buttons = [$("#t-plan"), $("#t-longest"), $("#t-submit")];
  for (const b of buttons) b.disabled = true;
  button.textContent = busy;
  try {
    return await api("POST", path, req);
  } catch (e) {
    showError("#train-error", e);
    const err = e.body && e.body.error;
    if (err && err.code === "insufficient_memory") renderPlan($("#plan"), err, e);
    else $("#plan").hidden = true;
    return null;
  } finally {
    for (const b of buttons) b.disabled = false;
    button.textContent = label;
  }
}

async function planTrain() {
  const plan = await trainCall("/train/plan", $("#t-plan"), "Planning…");
  if (plan) { S.planned = plan; renderPlan($("#plan"), plan, null); }
}

// The longest window within the budget (POST /train/plan with ctx "max"), on each path, with the gate's plans.
async function planLongest() {
  const answer = await trainCall("/train/plan", $("#t-longest"), "Searching…", {ctx: "max"});
  if (answer) { S.planned = answer; renderLongest($("#plan"), answer); }
}

function renderLongest(box, answer) {
  box.replaceChildren(el("h2", {}, "Longest ctx", el("span", {class: "muted small"}, `within ${mib(answer.budget)}`)));
  for (const [path, a] of Object.entries(answer.paths)) {
    const row = el("div", {class: "longest", dataset: {path}});
    if (a.ctx === null) {
      row.append(el("p", {}, el("b", {}, `${path}: `), a.reason));
    } else {
      const limit = a.capped ? " (the model's maximum context)"
        : ` (${a.next.ctx.toLocaleString()} would plan ${mib(a.next.total)})`;
      row.append(el("p", {class: "choice"}, el("b", {}, `${path}: ${a.ctx.toLocaleString()} tokens`),
                    ` · policy ${a.policy} · ${mib(a.plan.total)}${limit}`),
                 el("p", {class: "reason"}, a.reason), planBars(a.plans, answer.budget, a.policy));
      if (path === "window") {
        row.append(el("button", {type: "button", class: "secondary use-ctx",
                                 onclick: () => { $("#t-ctx").value = a.ctx; }}, `Use ctx ${a.ctx}`));
      }
    }
    box.append(row);
  }
  box.hidden = false;
}

async function submitTrain(ev) {
  ev.preventDefault();
  const job = await trainCall("/train", $("#t-submit"), "Submitting…");
  if (!job) return;
  renderPlan($("#plan"), job, null);
  followJob(job.id);
  refreshJobs();
}

function policyLabel(k) {
  return k === "off" || k === "on" ? `recompute ${k}` : `policy ${k}`;
}

// Bars by category for recompute off and on (and the chosen policy when it is another one), against the
// budget; the chosen one marked.
function planBars(plans, budget, chosen) {
  const keys = ["off", "on"].filter((k) => plans && plans[k]);
  if (chosen && plans && plans[chosen] && !keys.includes(chosen)) keys.push(chosen);
  // The scale is the largest plan, or the budget when it is near (a budget far above the plans says so in words).
  const most = Math.max(...keys.map((k) => plans[k].total), 1);
  const budgetOnScale = budget && budget <= most * 4;
  const top = budgetOnScale ? Math.max(most, budget) * 1.04 : most * 1.04;
  const rows = keys.map((k) => {
    const p = plans[k];
    const bar = el("div", {class: "bar"});
    for (const c of CATEGORIES) {
      if (!p[c]) continue;
      bar.append(el("span", {class: "seg c-" + c, style: `width:${(100 * p[c] / top).toFixed(3)}%`,
                             title: `${CATEGORY_TEXT[c]}: ${mib(p[c])}`}));
    }
    if (budgetOnScale) {
      bar.append(el("span", {class: "budget-line", style: `left:${(100 * budget / top).toFixed(3)}%`,
                             title: `budget ${mib(budget)}`}));
    }
    const fits = budget ? p.total <= budget : null;
    return el("div", {class: "plan-row" + (chosen === k ? " chosen" : ""), dataset: {plan: k}},
      el("div", {class: "plan-label"}, policyLabel(k),
         chosen === k ? el("span", {class: "badge ok"}, "chosen") : null,
         fits === false ? el("span", {class: "badge bad"}, "over budget") : null),
      bar,
      el("div", {class: "plan-total"}, el("b", {}, mib(p.total)), el("div", {class: "muted small"}, `graph ${mib(p.graph)}`)));
  });
  const legend = el("div", {class: "legend"}, CATEGORIES.filter((c) => keys.some((k) => plans[k][c])).map(
    (c) => el("span", {}, el("i", {class: "c-" + c}), CATEGORY_TEXT[c])),
    budget ? el("span", {}, el("i", {class: "budget-key"}),
                `budget ${mib(budget)}${budgetOnScale ? "" : " (far right of this scale)"}`) : null);
  return el("div", {class: "plan-bars"}, rows, legend);
}

// The gate's answer: a plan (from /train/plan, or a queued job's from /train), or a 422 refusal's figures.
function renderPlan(box, answer, error) {
  box.replaceChildren();
  const budget = answer.budget ? `the budget ${mib(answer.budget)}` : "the budget";
  if (error) {
    box.append(el("h2", {}, "Refused: the job does not fit"));
    box.append(el("p", {class: "refused"}, answer.plans ? `No plan fits ${budget}: nothing was queued. ` +
      "Lower ctx, choose recompute on, or raise the budget (the server's --memory-budget caps it)."
      : `The adapter alone needs ${mib(answer.lora_bytes)} of ${budget}: nothing was queued. Lower the LoRA ` +
        "rank, or raise the budget."));
    if (answer.plans) box.append(planBars(answer.plans, answer.budget, null));
    box.hidden = false;
    return;
  }
  const queued = Boolean(answer.id);
  box.append(el("h2", {}, queued ? "Plan: queued" : "Plan", el("span", {class: "muted small"},
                queued ? "" : "not queued yet")));
  box.append(el("p", {class: "choice"}, el("b", {}, `Policy ${answer.policy}`),
                ` (recompute ${answer.recompute ? "on" : "off"}) · ${mib(answer.plan && answer.plan.total)} of ${budget}`,
                answer.steps ? ` · ${answer.steps} steps` : ""));
  box.append(el("p", {class: "reason"}, answer.recompute_reason || ""));
  box.append(planBars(answer.plans, answer.budget, answer.policy));
  box.append(queued
    ? el("p", {class: "muted"}, `Queued as ${answer.id} · `,
         el("a", {href: "#jobs", onclick: () => followJob(answer.id)}, "watch it in Jobs"))
    : el("p", {class: "muted"}, "Submit queues this job; the server plans it again then (memory may change)."));
  box.hidden = false;
}

// ------------------------------------------------------------------------------------------------- jobs

// One polling loop: a call while a poll is in flight asks for one more poll after it (its answer may predate
// what the caller changed) instead of starting a second loop; the timer is cleared right before it is set.
let jobsTimer = null;
let jobsPolling = false;
let jobsAgain = false;

async function refreshJobs() {
  if (jobsPolling) { jobsAgain = true; return; }
  jobsPolling = true;
  clearTimeout(jobsTimer);
  jobsTimer = null;
  try {
    const res = await api("GET", "/train");
    S.jobs = res.data || [];
    showError("#jobs-error", null);
    renderJobList();
    if (S.follow) {
      const j = S.jobs.find((x) => x.id === S.follow.id);
      if (j) { S.follow.job = j; renderJob(); }
    } else if (S.jobs.length && S.tab === "jobs") {
      followJob(S.jobs[S.jobs.length - 1].id);
    }
  } catch (e) {
    showError("#jobs-error", e);
  } finally {
    jobsPolling = false;
  }
  if (jobsAgain) { jobsAgain = false; refreshJobs(); return; }
  const active = S.jobs.filter((j) => !TERMINAL.includes(j.status)).length;
  clearTimeout(jobsTimer);
  jobsTimer = S.tab === "jobs" || active ? setTimeout(refreshJobs, active ? 1000 : 3000) : null;
}

function statusBadge(status) {
  return el("span", {class: "status s-" + status}, status);
}

function renderJobList() {
  const active = S.jobs.filter((j) => !TERMINAL.includes(j.status)).length;
  const count = $("#active-count");
  count.hidden = !active;
  count.textContent = active ? String(active) : "";
  const ul = $("#job-list");
  if (!S.jobs.length) { ul.replaceChildren(el("li", {class: "muted"}, "No jobs yet.")); return; }
  // Rows are kept by job id and updated in place, like the job view: a poll must not drop a click on one.
  const rows = new Map([...ul.children].filter((li) => li.dataset.job).map((li) => [li.dataset.job, li]));
  const order = S.jobs.slice().reverse().map((j) => {
    let li = rows.get(j.id);
    if (!li) {
      li = el("li", {dataset: {job: j.id}, onclick: () => followJob(j.id)},
              el("div", {class: "job-name"}, el("span", {class: "job-title"}), statusBadge(j.status)),
              el("div", {class: "muted small job-sub"}));
    }
    li.classList.toggle("selected", Boolean(S.follow && S.follow.id === j.id));
    setText(li.querySelector(".job-title"), j.name || j.id);
    const badge = li.querySelector(".status");
    setText(badge, j.status);
    badge.className = "status s-" + j.status;
    setText(li.querySelector(".job-sub"), `${j.id} · step ${j.step || 0}${j.steps ? "/" + j.steps : ""}`);
    return li;
  });
  const keep = new Set(order);
  for (const li of [...ul.children]) if (!keep.has(li)) li.remove();
  order.forEach((li, i) => { if (ul.children[i] !== li) ul.insertBefore(li, ul.children[i] || null); });
}

// Follow one job: its events so far, then the live stream, reconnecting with Last-Event-ID.
function followJob(id) {
  if (S.follow) S.follow.ctrl.abort();
  const f = {id, job: S.jobs.find((x) => x.id === id) || null, points: [], lastId: 0, ctrl: new AbortController(),
             state: "connecting", ended: false, reconnects: 0, seen: [], live: 0};
  S.follow = f;
  renderJobList();
  renderJob();
  streamJob(f);
}

function onJobEvent(f, ev, when) {
  const id = parseInt(ev.id, 10);
  if (!Number.isNaN(id)) {
    if (id <= f.lastId) return;
    f.lastId = id;
  }
  let d = {};
  try { d = typeof ev.data === "string" ? JSON.parse(ev.data) : (ev.data || {}); } catch (e) { /* keep {} */ }
  if (ev.event === "step" && typeof d.step === "number") {
    f.points = f.points.filter((p) => p.step < d.step);  // a resumed job replays from its checkpoint
    f.points.push({step: d.step, loss: d.loss, t: when});
    if (d.steps) f.steps = d.steps;
  } else if (TERMINAL.includes(ev.event)) {
    f.ended = true;
    if (Array.isArray(d.losses) && d.losses.length > f.points.length) {
      f.points = d.losses.map((loss, i) => (f.points[i] || {step: i + 1, loss, t: when}));
    }
  } else if (ev.event === "queued" || ev.event === "started") {
    f.ended = false;
  }
  f.lastEvent = ev.event;
}

async function streamJob(f) {
  const signal = f.ctrl.signal;
  try {  // the events so far, with their times (for steps/s)
    const past = await api("GET", `/train/${encodeURIComponent(f.id)}/events?stream=false`);
    for (const ev of past.data || []) onJobEvent(f, ev, ev.created);
    renderJob();
  } catch (e) {
    if (signal.aborted) return;
    showError("#jobs-error", e);
  }
  let scheduled = false;
  const redraw = () => {
    if (scheduled) return;
    scheduled = true;
    requestAnimationFrame(() => { scheduled = false; if (S.follow === f) renderJob(); });
  };
  while (!signal.aborted) {
    const job = f.job || S.jobs.find((x) => x.id === f.id);
    if (f.ended && job && TERMINAL.includes(job.status)) break;
    f.state = f.reconnects ? "reconnecting" : "connecting";
    const conn = new AbortController();  // this connection only: aborting it is a dropped connection
    f.conn = conn;
    const stop = () => conn.abort();
    signal.addEventListener("abort", stop);
    try {
      const res = await request("GET", `/train/${encodeURIComponent(f.id)}/events`, undefined,
                                {signal: conn.signal, headers: {"Last-Event-ID": String(f.lastId)}});
      if (!res.ok) throw await readError(res);
      f.state = "live";
      redraw();
      for await (const ev of sse(res)) {
        if (ev.event === "step") f.live += 1;
        onJobEvent(f, ev, Date.now() / 1000);
        redraw();
      }
      f.state = f.ended ? "ended" : "reconnecting";
    } catch (e) {
      if (signal.aborted) return;
      f.state = "reconnecting";
      if (e instanceof ApiError && e.status && e.status < 500) { showError("#jobs-error", e); return; }
    } finally {
      signal.removeEventListener("abort", stop);
    }
    if (f.ended) break;
    f.reconnects += 1;
    redraw();
    await sleep(1000);
  }
  f.state = "ended";
  try {
    f.job = await api("GET", `/train/${encodeURIComponent(f.id)}`);
    const i = S.jobs.findIndex((x) => x.id === f.id);
    if (i >= 0) S.jobs[i] = f.job;
  } catch (e) { /* the list polls */ }
  if (S.follow === f) { renderJob(); renderJobList(); }
  refreshAdaptersQuietly();
}

function lossChart(f) {
  const W = 640, H = 240, L = 60, R = 14, T = 14, B = 34;
  const pts = f.points.filter((p) => typeof p.loss === "number");
  const steps = Math.max(f.steps || (f.job && f.job.steps) || 0, pts.length ? pts[pts.length - 1].step : 0, 1);
  let lo = Math.min(...pts.map((p) => p.loss)), hi = Math.max(...pts.map((p) => p.loss));
  if (!pts.length) { lo = 0; hi = 1; }
  if (hi - lo < 1e-9) { hi += 0.5; lo -= 0.5; }
  const pad = (hi - lo) * 0.08;
  lo -= pad; hi += pad;
  const x = (s) => L + (W - L - R) * (steps <= 1 ? 1 : (s - 1) / (steps - 1));
  const y = (v) => T + (H - T - B) * (1 - (v - lo) / (hi - lo));
  const g = svg("svg", {viewBox: `0 0 ${W} ${H}`, class: "chart", role: "img",
                        "aria-label": "loss by step", "data-points": String(pts.length)});
  for (let i = 0; i <= 4; i++) {
    const v = lo + (hi - lo) * i / 4;
    g.append(svg("line", {x1: L, x2: W - R, y1: y(v), y2: y(v), class: "grid"}),
             svg("text", {x: L - 6, y: y(v) + 4, class: "tick", "text-anchor": "end"}, v.toFixed(3)));
  }
  const xt = [1, Math.round((steps + 1) / 2), steps].filter((v, i, a) => a.indexOf(v) === i);
  for (const s of xt) g.append(svg("text", {x: x(s), y: H - B + 16, class: "tick", "text-anchor": "middle"}, s));
  g.append(svg("text", {x: (L + W - R) / 2, y: H - 4, class: "axis", "text-anchor": "middle"}, "step"));
  g.append(svg("text", {x: 12, y: T + (H - T - B) / 2, class: "axis", "text-anchor": "middle",
                        transform: `rotate(-90 12 ${T + (H - T - B) / 2})`}, "loss"));
  g.append(svg("rect", {x: L, y: T, width: W - L - R, height: H - T - B, class: "frame"}));
  if (pts.length) {
    g.append(svg("polyline", {class: "loss", points: pts.map((p) => `${x(p.step).toFixed(1)},${y(p.loss).toFixed(1)}`).join(" ")}));
    const last = pts[pts.length - 1];
    g.append(svg("circle", {cx: x(last.step), cy: y(last.loss), r: 3.5, class: "last"}));
  } else {
    g.append(svg("text", {x: (L + W - R) / 2, y: T + (H - T - B) / 2, class: "axis", "text-anchor": "middle"},
                 "no steps yet"));
  }
  f.seen.push(pts.length);
  return g;
}

function stepsPerSecond(f) {
  const pts = f.points.filter((p) => typeof p.t === "number").slice(-20);
  if (pts.length < 2) return null;
  const dt = pts[pts.length - 1].t - pts[0].t;
  return dt > 0 ? (pts[pts.length - 1].step - pts[0].step) / dt : null;
}

function metric(label, value, title) {
  return el("div", {class: "metric", title: title || null}, el("div", {class: "m-label"}, label),
            el("div", {class: "m-value"}, value));
}

// The job view's nodes, made once per followed job and then updated in place. A redraw comes with every step
// event and poll; one that detached the header would drop a click whose press and release straddle it (a
// person's press lasts longer than a frame), and one that rebuilt the plan would close it while it is read.
function jobView(box, id) {
  if (box.__view && box.__view.id === id && box.__view.head.parentNode === box) return box.__view;
  const v = {id, actionsKey: null, planKey: null};
  v.title = document.createTextNode("");
  v.badge = el("span", {class: "status"});
  v.state = el("span", {class: "muted small stream-state"});
  v.actions = el("div", {class: "actions"});
  v.head = el("div", {class: "job-head"}, el("h2", {}, v.title, " ", v.badge), v.state, v.actions);
  v.reason = el("p", {hidden: true});
  v.chart = svg("svg", {class: "chart"});
  v.metrics = el("div", {class: "metrics"});
  v.planBars = el("div");
  v.plan = el("details", {class: "job-plan", hidden: true}, el("summary", {}, "plan"), v.planBars);
  v.adapterText = document.createTextNode("");
  v.adapter = el("p", {class: "muted small", hidden: true}, v.adapterText, el("a", {href: "#adapters"}, "set its scale"));
  v.output = el("p", {class: "muted small", hidden: true});
  box.replaceChildren(v.head, v.reason, v.chart, v.metrics, v.plan, v.adapter, v.output);
  box.__view = v;
  return v;
}

function setText(node, text) {
  if (node.textContent !== text) node.textContent = text;
}

function renderJob() {
  const box = $("#job-detail");
  const f = S.follow;
  if (!f) return;
  const j = f.job || {id: f.id, status: "…"};
  const v = jobView(box, j.id);
  const bound = S.props ? S.props.max_slowdown_ppm : null;
  const sps = stepsPerSecond(f);
  const lastLoss = f.points.length ? f.points[f.points.length - 1].loss : null;
  const active = !TERMINAL.includes(j.status) && j.status !== "…";

  setText(v.title, j.name || j.id);
  setText(v.badge, j.status);
  v.badge.className = "status s-" + j.status;
  v.state.dataset.state = f.state;
  setText(v.state, f.state === "live" ? "● live" : f.state === "reconnecting" ? "reconnecting…"
    : f.state === "ended" ? "" : "…");
  const actionsKey = `${j.id}|${active}|${Boolean(j.resumable)}`;  // the buttons change only with this
  if (v.actionsKey !== actionsKey) {
    v.actionsKey = actionsKey;
    v.actions.replaceChildren(...[
      active ? el("button", {class: "danger", id: "job-cancel", onclick: () => cancelJob(j.id)}, "Cancel") : null,
      j.resumable ? el("button", {id: "job-resume", onclick: () => resumeJob(j.id)}, "Resume") : null,
    ].filter(Boolean));
  }

  v.reason.hidden = !j.reason;
  v.reason.className = j.status === "failed" ? "refused" : "muted";
  setText(v.reason, j.reason || "");

  const chart = lossChart(f);
  v.chart.replaceWith(chart);
  v.chart = chart;

  const slow = j.slowdown_ppm;
  const slowBar = bound ? el("div", {class: "slow-bar", title: `measured ${pct(slow)} of the bound ${pct(bound)}`},
    el("span", {style: `width:${Math.min(100, 100 * (slow || 0) / bound).toFixed(1)}%`,
                class: slow > bound ? "over" : ""})) : null;
  const measured = j.measured && j.measured.graph;
  v.metrics.replaceChildren(
    metric("step", `${j.step || (f.points.length ? f.points[f.points.length - 1].step : 0)}` +
           (j.steps ? ` / ${j.steps}` : "")),
    metric("loss", fmt(lastLoss, 4)),
    metric("steps/s", sps === null ? "—" : fmt(sps, sps >= 10 ? 1 : 2), "over the last 20 steps"),
    metric("chunk window p50", ms(j.window_p50), "how long a decode could wait for a training chunk"),
    metric("chunk window p95", ms(j.window_p95)),
    metric("decode slowdown", el("span", {class: "slowdown"}, pct(slow), el("span", {class: "muted small"},
           bound !== null ? ` of ${pct(bound)} bound` : ""), slowBar),
           j.slowdown_source ? `measured from ${j.slowdown_source}` : null),
    metric("memory planned", mib(j.plan && j.plan.total), j.recompute_reason || ""),
    metric("graph planned / measured", `${mib(j.plan && j.plan.graph)} / ${measured ? mib(measured) : "—"}`),
    metric("recompute", j.recompute === undefined ? "—" : jobPolicy(j), j.recompute_reason));

  v.plan.hidden = !j.plans;
  const planKey = j.plans ? JSON.stringify([j.plans, j.budget, jobPolicy(j)]) : null;
  if (planKey !== v.planKey) {  // rebuilt only when the plan changes: an open <details> stays as it is
    v.planKey = planKey;
    v.planBars.replaceChildren(...(j.plans ? [planBars(j.plans, j.budget, jobPolicy(j))] : []));
  }

  v.adapter.hidden = !j.adapter;
  setText(v.adapterText, j.adapter ? `adapter #${j.adapter.id} "${j.adapter.name}" at scale ` +
          `${fmt(j.adapter.scale)} · ` : "");
  v.output.hidden = !(j.output && !j.adapter);
  setText(v.output, j.output && !j.adapter ? `output: ${j.output}` : "");

  box.dataset.job = j.id;
  box.dataset.status = j.status;
}

function jobPolicy(j) {
  return j.policy || (j.recompute ? "on" : "off");
}

async function cancelJob(id) {
  showError("#jobs-error", null);
  try {
    await api("POST", `/train/${encodeURIComponent(id)}/cancel`);
  } catch (e) { showError("#jobs-error", e); }
  refreshJobs();
}

async function resumeJob(id) {
  showError("#jobs-error", null);
  try {
    const j = await api("POST", `/train/${encodeURIComponent(id)}/resume`);
    const i = S.jobs.findIndex((x) => x.id === id);
    if (i >= 0) S.jobs[i] = j;
    followJob(id);
  } catch (e) { showError("#jobs-error", e); }
  refreshJobs();
}

// --------------------------------------------------------------------------------------------- adapters

async function refreshAdaptersQuietly() {
  try { S.adapters = await api("GET", "/lora-adapters"); } catch (e) { /* shown when the tab is open */ }
  if (S.tab === "adapters") renderAdapters();
}

async function refreshAdapters() {
  try {
    S.adapters = await api("GET", "/lora-adapters");
    showError("#adapters-error", null);
  } catch (e) {
    showError("#adapters-error", e);
  }
  renderAdapters();
}

function renderAdapters() {
  const tbody = $("#adapters tbody");
  tbody.replaceChildren();
  if (!S.adapters.length) {
    tbody.append(el("tr", {}, el("td", {colspan: 5, class: "muted"}, "No adapters yet: train one.")));
    return;
  }
  for (const a of S.adapters) {
    const out = el("output", {class: "scale-value"}, fmt(a.scale));
    const state = el("span", {class: "muted small save-state"});
    const slider = el("input", {type: "range", min: 0, max: 2, step: 0.05, value: a.scale,
                                "aria-label": `scale of adapter ${a.id}`, dataset: {adapter: a.id}});
    slider.addEventListener("input", () => { out.textContent = fmt(Number(slider.value)); });
    slider.addEventListener("change", () => setScale(a.id, Number(slider.value), state));
    tbody.append(el("tr", {dataset: {adapter: a.id}},
      el("td", {}, a.id), el("td", {}, a.name), el("td", {class: "muted small"}, a.job_id || ""),
      el("td", {}, el("div", {class: "scale"}, slider, out)), el("td", {}, state)));
  }
}

async function setScale(id, scale, state) {
  showError("#adapters-error", null);
  state.textContent = "saving…";
  // The server sets every adapter's scale at once (those not listed go to 0): send them all.
  const scales = S.adapters.map((a) => ({id: a.id, scale: a.id === id ? scale : a.scale}));
  try {
    S.adapters = await api("POST", "/lora-adapters", scales);
    renderAdapters();
    const row = document.querySelector(`#adapters tr[data-adapter="${id}"] .save-state`);
    if (row) row.textContent = "saved";
  } catch (e) {
    state.textContent = "";
    showError("#adapters-error", e);
    refreshAdapters();
  }
  refreshChatAdapters();
}

// ------------------------------------------------------------------------------------------------ start

function start() {
  $("#key").value = S.key;
  $("#key-form").addEventListener("submit", (e) => { e.preventDefault(); setKey($("#key").value); });
  $("#chat-form").addEventListener("submit", sendChat);
  $("#chat-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("#chat-form").requestSubmit(); }
  });
  $("#chat-stop").addEventListener("click", () => { if (S.chatAbort) S.chatAbort.abort(); });
  $("#chat-clear").addEventListener("click", () => {
    if (S.chatAbort) S.chatAbort.abort();
    S.chat = [];
    $("#chat-log").replaceChildren(el("p", {class: "empty muted"}, "New conversation."));
    showError("#chat-error", null);
  });
  $("#train-form").addEventListener("submit", submitTrain);
  $("#t-plan").addEventListener("click", planTrain);
  $("#t-longest").addEventListener("click", planLongest);
  $("#t-file").addEventListener("change", () => showError("#train-error", null));
  $("#ad-refresh").addEventListener("click", refreshAdapters);
  window.addEventListener("hashchange", () => selectTab(location.hash.slice(1)));
  refreshHeader().then(() => {
    selectTab(location.hash.slice(1) || "chat");
    refreshJobs();
  });
  setInterval(refreshHeader, 15000);
}

document.addEventListener("DOMContentLoaded", start);
