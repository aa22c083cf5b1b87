"""The web page of `remat serve`, driven in a real headless Chromium against a real server.

Two servers (subprocesses on free ports, tiny-llama, one thread each): an open one, and one with
`--api-key` and a memory budget too small for any job. The browser is Debian's `chromium` driven by
Playwright (no browser download): `make setup` installs it; without it these tests skip.

`REMAT_SCREENSHOTS=docs/screenshots pytest tests/test_page.py` also writes a screenshot of each tab.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from urllib.parse import urlparse

import pytest

from serve_process import Server

KEY = "page-key"
CAT = "the cat sat on the mat. "
SCREENSHOTS = os.environ.get("REMAT_SCREENSHOTS")


playwright_api = pytest.importorskip("playwright.sync_api", reason="the test extra's playwright is not installed")
CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None)
pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH: `make setup` installs Debian's chromium"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(open server, keyed server with a 64 KiB memory budget), spawned side by side; each test waits for
    the one it uses."""
    both = (Server(tmp_path_factory.mktemp("page-open") / "state"),
            Server(tmp_path_factory.mktemp("page-keyed") / "state", "--api-key", KEY, "--memory-budget", "64KiB",
                   key=KEY))
    try:
        for s in both:
            s.spawn()
        yield both
    finally:
        for s in both:
            s.stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers[0].wait_ready()


@pytest.fixture(scope="module")
def keyed(servers):
    return servers[1].wait_ready()


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--disable-gpu", "--disable-dev-shm-usage"])
        yield b
        b.close()


class Page:
    """A browser tab on a server's page; records every request it makes and every script error."""

    def __init__(self, browser, server: Server):
        self.context = browser.new_context(viewport={"width": 1280, "height": 820})
        self.page = self.context.new_page()
        self.page.set_default_timeout(30_000)
        self.requests: list[str] = []
        self.errors: list[str] = []
        self.headers: list[tuple[str, dict]] = []
        self.page.on("request", lambda r: (self.requests.append(r.url), self.headers.append((r.url, r.headers))))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.goto(server.url)

    def tab(self, name: str) -> None:
        self.page.click(f"#tabs a[data-tab={name}]")
        self.page.wait_for_selector(f"#tab-{name}:not([hidden])")

    def shot(self, name: str) -> None:
        if SCREENSHOTS:
            Path(SCREENSHOTS).mkdir(parents=True, exist_ok=True)
            self.page.screenshot(path=str(Path(SCREENSHOTS) / f"{name}.png"))

    def error_text(self, selector: str) -> str:
        self.page.wait_for_selector(f"{selector}:not([hidden])")
        return self.page.inner_text(selector)

    def close(self) -> None:
        assert not self.errors, self.errors
        self.context.close()


@pytest.fixture(scope="module")
def page(browser, server):
    p = Page(browser, server)
    yield p
    p.close()


def records_jsonl(n: int = 4) -> str:
    return "\n".join(json.dumps({"text": CAT * 6}) for _ in range(n))


def pct(ppm: int | None) -> str:
    """The page's pct(): parts per million as a percentage (JS toFixed rounds the exact value half up)."""
    if ppm is None:
        return "—"
    return f"{Decimal(ppm / 10000).quantize(Decimal('0.01' if ppm < 10000 else '0.1'), ROUND_HALF_UP)}%"


@contextlib.contextmanager
def delivered(p, method: str, path: str, what: str, timeout: float = 10_000):
    """The click inside sends `method path`, or the test fails at once saying the click was lost."""
    try:
        with p.expect_request(lambda r: r.method == method and urlparse(r.url).path == path, timeout=timeout):
            yield
    except playwright_api.TimeoutError as e:
        raise AssertionError(f"{what}: no {method} {path} within {timeout / 1000:.0f} s; the click was lost") from e


# ---------------------------------------------------------------------------------------------------------


def test_page_is_served_from_the_package_only(page, server):
    p = page.page
    p.wait_for_function("() => document.querySelector('#model').textContent.includes('tiny-llama')")
    assert p.title() == "remat serve"
    hosts = {urlparse(u).netloc for u in page.requests}
    assert hosts == {f"127.0.0.1:{server.port}"}, page.requests  # nothing from outside the server
    status, body = server.request("GET", "/ui/../page.py")
    assert status == 404 and body["error"]["type"] == "not_found_error"


def test_chat_streams(page):
    page.tab("chat")
    p = page.page
    p.fill("#chat-max", "96")  # long enough that a loaded machine cannot deliver it in one read
    p.fill("#chat-temp", "0")  # greedy: sampled, the model may end its answer at once ("(no text)")
    p.fill("#chat-input", "What is remat?")
    p.click("#chat-send")
    p.wait_for_selector(".msg.assistant[data-done]", timeout=60_000)
    answer = p.locator(".msg.assistant .text").inner_text()
    assert answer and answer != "(no text)"
    assert int(p.get_attribute(".msg.assistant", "data-pieces")) >= 2  # pieces, not one answer
    assert p.locator("#chat-error").is_hidden()
    assert p.evaluate("window.__remat.chat.length") == 2  # the answer joins the conversation


def test_train_plan_then_live_loss_curve(page, server):
    page.tab("train")
    p = page.page
    p.fill("#t-name", "cat")
    p.fill("#t-data", records_jsonl())
    p.fill("#t-ctx", "32")
    p.fill("#t-epochs", "3")
    p.fill("#t-lr", "0.01")
    jobs_before = len(server.request("GET", "/train")[1]["data"])

    # Plan first: the server's plans and the gate's choice, nothing queued
    p.click("#t-plan")
    plan = p.wait_for_selector("#plan:not([hidden])", timeout=60_000)
    text = plan.inner_text()
    assert "recompute off" in text and "recompute on" in text and "not queued" in text, text
    assert p.locator("#plan .plan-row.chosen").count() == 1
    planned = p.evaluate("window.__remat.planned")
    assert planned["recompute_reason"] in text and f"Policy {planned['policy']}" in text  # the gate's choice, why
    assert len(server.request("GET", "/train")[1]["data"]) == jobs_before

    # a policy other than off and on: its own bar beside them, chosen
    p.select_option("#t-recompute", "dots")
    p.click("#t-plan")
    p.wait_for_selector("#plan .plan-row.chosen[data-plan=dots]", timeout=60_000)
    assert p.locator("#plan .plan-row").count() == 3 and "policy dots" in p.inner_text("#plan")
    p.select_option("#t-recompute", "auto")
    p.click("#t-plan")
    p.wait_for_selector("#plan .plan-row.chosen[data-plan=off]", timeout=60_000)
    page.shot("train")

    # then Submit queues it
    p.click("#t-submit")
    p.wait_for_function("() => window.__remat.follow && document.querySelector('#plan').textContent.includes("
                        "'Queued as ' + window.__remat.follow.id)", timeout=60_000)
    job_id = p.evaluate("window.__remat.follow.id")
    assert server.request("GET", f"/train/{job_id}")[1]["recompute_reason"] in p.inner_text("#plan")
    assert len(server.request("GET", "/train")[1]["data"]) == jobs_before + 1

    page.tab("jobs")
    p.wait_for_selector(f"#job-list li[data-job='{job_id}']")
    p.wait_for_selector(f"#job-detail[data-job='{job_id}'][data-status=succeeded]", timeout=120_000)
    p.wait_for_function("() => window.__remat.follow.state === 'ended'")
    job = server.request("GET", f"/train/{job_id}")[1]
    assert job["status"] == "succeeded"
    steps = job["steps"]
    assert steps > 10
    assert int(p.get_attribute("#job-detail svg.chart", "data-points")) == steps
    # The curve gained points while the job ran: drawn with fewer points first, steps arriving on the stream.
    seen, live = p.evaluate("[window.__remat.follow.seen, window.__remat.follow.live]")
    assert len(set(seen)) >= 2 and seen == sorted(seen) and seen[-1] == steps, seen
    assert live > 0
    p.wait_for_selector(f"#job-list li[data-job='{job_id}'] .status:text('succeeded')")
    metrics = p.inner_text("#job-detail .metrics")
    assert f"{steps} / {steps}" in metrics
    assert "STEPS/S\n—" not in metrics.upper() and "ms" in metrics  # steps/s and the chunk windows
    # the measured decode slowdown against the bound: the job's own figures and the server's bound
    bound = server.request("GET", "/props")[1]["max_slowdown_ppm"]
    slow = job["slowdown_ppm"]
    assert bound > 0
    shown = p.inner_text("#job-detail .metrics .slowdown")
    assert shown.startswith(pct(slow)) and f" of {pct(bound)} bound" in shown, (shown, slow, bound)
    assert p.get_attribute("#job-detail .slow-bar", "title") == f"measured {pct(slow)} of the bound {pct(bound)}"
    width = p.evaluate("parseFloat(document.querySelector('#job-detail .slow-bar span').style.width)")
    assert width == pytest.approx(min(100.0, 100 * (slow or 0) / bound), abs=0.051)
    if job["slowdown_source"]:
        assert p.locator("#job-detail .metric", has=p.locator(".slowdown")).get_attribute("title") == \
            f"measured from {job['slowdown_source']}"
    page.shot("jobs")


def test_adapter_scale_slider(page, server):
    adapters = server.request("GET", "/lora-adapters")[1]
    assert adapters and adapters[-1]["scale"] == 0
    ad = adapters[-1]["id"]
    page.tab("adapters")
    p = page.page
    slider = p.wait_for_selector(f"#adapters input[data-adapter='{ad}']")
    slider.fill("1.5")  # a range input: sets the value and fires input and change
    p.wait_for_selector(f"#adapters tr[data-adapter='{ad}'] .save-state:text('saved')")
    assert server.request("GET", "/lora-adapters")[1][ad]["scale"] == 1.5
    assert p.inner_text(f"#adapters tr[data-adapter='{ad}'] .scale-value") == "1.50"
    page.shot("adapters")
    page.tab("chat")
    p.wait_for_function("() => document.querySelector('#chat-adapters').textContent.includes('×1.50')")
    p.click("#chat-clear")
    p.fill("#chat-temp", "0")
    p.fill("#chat-input", "Where did the cat sit?")
    p.click("#chat-send")
    p.wait_for_selector(".msg.assistant[data-done]", timeout=60_000)
    page.shot("chat")  # the adapter applied: it learnt the cat

    p.fill("#chat-max", "1500")  # a long answer (greedy "cat ..." with no end), stopped while it streams
    p.fill("#chat-input", "And then?")
    p.click("#chat-send")
    p.wait_for_selector(".msg.assistant.streaming[data-pieces]")
    p.click("#chat-stop")
    p.wait_for_selector(".msg.assistant:last-child .info:text('stopped')")
    assert p.is_enabled("#chat-send") and p.locator("#chat-error").is_hidden()
    server.request("POST", "/lora-adapters", [{"id": ad, "scale": 0.0}])


def test_bad_file_and_refused_records_show_their_messages(page, server):
    page.tab("train")
    p = page.page
    p.fill("#t-data", "")
    p.set_input_files("#t-file", files=[{"name": "bad.jsonl", "mimeType": "application/json",
                                         "buffer": b'{"text": "fine"}\n{"text": oops\n'}])
    p.click("#t-submit")
    assert "bad.jsonl line 2: not valid JSON" in page.error_text("#train-error")

    bad = [{"role": "user"}]  # JSON, but no record the server can use: its message is shown
    status, body = server.request("POST", "/train", {"data": bad, "ctx": 32})
    assert status == 400
    p.set_input_files("#t-file", files=[{"name": "records.json", "mimeType": "application/json",
                                         "buffer": json.dumps(bad).encode()}])
    p.click("#t-submit")
    p.wait_for_function("() => document.querySelector('#train-error').textContent.startsWith('400')")
    assert body["error"]["message"] in page.error_text("#train-error")

    # a good file: planned, then queued, with the form's LoRA rank and steps
    p.set_input_files("#t-file", files=[{"name": "cat.jsonl", "mimeType": "application/json",
                                         "buffer": records_jsonl(3).encode()}])
    p.fill("#t-name", "from-file")
    p.fill("#t-ctx", "32")
    p.fill("#t-epochs", "1")
    p.fill("#t-steps", "2")
    p.fill("#t-rank", "4")
    p.click("#t-plan")
    p.wait_for_function("() => document.querySelector('#plan').textContent.includes('not queued')", timeout=60_000)
    assert p.locator("#train-error").is_hidden()
    assert "· 2 steps" in p.inner_text("#plan")
    with delivered(p, "POST", "/train", "Submit"):
        p.click("#t-submit")
    p.wait_for_function("() => window.__remat.follow && document.querySelector('#plan').textContent.includes("
                        "'Queued as ' + window.__remat.follow.id)", timeout=60_000)
    job_id = p.evaluate("window.__remat.follow.id")
    job = server.request("GET", f"/train/{job_id}")[1]
    assert job["name"] == "from-file" and job["steps"] == 2, job
    assert job["settings"]["lora"] is True and job["settings"]["lora_r"] == 4, job["settings"]  # the rank field
    assert server.wait_job(job_id)["status"] == "succeeded"  # done before the next tests queue theirs
    for field in ("#t-steps", "#t-rank", "#t-name"):
        p.fill(field, "")
    p.set_input_files("#t-file", files=[])


def test_budget_field_refusal_shows_its_figures(page, server):
    page.tab("train")
    p = page.page
    p.set_input_files("#t-file", files=[])
    p.fill("#t-data", records_jsonl(2))
    p.fill("#t-ctx", "32")
    jobs_before = len(server.request("GET", "/train")[1]["data"])
    plans = server.request("POST", "/train/plan", {"data": [{"text": CAT * 6}] * 2, "ctx": 32})[1]["plans"]
    lora = sum(plans["on"][k] for k in ("params", "grads", "optimizer"))  # above the adapter, below every plan
    budget = f"{(lora + 2048) / 1024:.0f}KiB"
    p.fill("#t-budget-input", budget)
    for button in ("#t-plan", "#t-submit"):
        p.click(button)
        p.wait_for_selector(f"{button}:not([disabled])")
        p.wait_for_function("() => document.querySelector('#train-error').textContent.startsWith('422')")
        status, body = server.request("POST", "/train/plan", {"data": [{"text": CAT * 6}] * 2, "ctx": 32,
                                                              "memory_budget": budget})
        assert status == 422 and body["error"]["message"] in page.error_text("#train-error")
        text = p.wait_for_selector("#plan:not([hidden])").inner_text()
        assert "Refused" in text and "over budget" in text and "recompute on" in text, text
        assert f"budget {body['error']['budget'] / 1024:.1f} KiB" in text  # the job's own budget, its figures
        assert p.locator("#plan .plan-row .badge.bad").count() == p.locator("#plan .plan-row").count() >= 2
    assert len(server.request("GET", "/train")[1]["data"]) == jobs_before  # nothing queued
    p.fill("#t-budget-input", "lots")
    p.click("#t-plan")
    p.wait_for_function("() => document.querySelector('#train-error').textContent.startsWith('400')")
    assert "memory_budget" in page.error_text("#train-error")
    p.fill("#t-budget-input", "")


def test_longest_ctx_shows_each_paths_window(page, server):
    """"Longest ctx" asks POST /train/plan with ctx "max" for the form's job and shows each path's window, policy
    and plans as the server answers them; "Use ctx" puts the window's into the form."""
    page.tab("train")
    p = page.page
    p.set_input_files("#t-file", files=[])
    p.fill("#t-data", records_jsonl(2))
    p.fill("#t-ctx", "32")
    p.fill("#t-rank", "0")
    p.fill("#t-budget-input", "4MiB")
    p.click("#t-longest")
    p.wait_for_selector("#t-longest:not([disabled])", timeout=120_000)
    text = p.wait_for_selector("#plan .longest[data-path=walk]", timeout=120_000) and p.inner_text("#plan")
    answer = p.evaluate("window.__remat.planned")
    expected = server.ok("POST", "/train/plan", {"data": [{"text": CAT * 6}] * 2, "ctx": "max", "lora": False,
                                                 "memory_budget": "4MiB", "recompute": "auto"})
    assert answer == expected
    window = answer["paths"]["window"]
    assert 0 < window["ctx"] < answer["max_ctx"] and f"window: {window['ctx']:,} tokens" in text, text
    assert f"policy {window['policy']}" in text and "Longest ctx" in text
    assert p.locator("#plan .longest[data-path=window] .plan-row.chosen").count() == 1
    p.click("#plan .use-ctx")
    assert p.input_value("#t-ctx") == str(window["ctx"])
    for field in ("#t-rank", "#t-budget-input"):
        p.fill(field, "")


def test_reconnect_cancel_and_resume(page, server):
    # sized by steps (epochs only high enough not to cap them): it cannot end before the test cancels it
    job = server.request("POST", "/train", {"data": [{"text": CAT * 6}], "ctx": 32, "epochs": 100_000,
                                            "steps": 100_000, "name": "long"})[1]
    assert job["steps"] == 100_000, job
    job_id = job["id"]
    detail = f"#job-detail[data-job='{job_id}']"
    page.tab("jobs")
    p = page.page
    p.click(f"#job-list li[data-job='{job_id}']")
    p.wait_for_function(f"() => window.__remat.follow.id === '{job_id}' && window.__remat.follow.live >= 3")

    # The stream drops: the page reconnects with Last-Event-ID and the curve goes on without a gap or a repeat.
    last = p.evaluate("() => { const f = window.__remat.follow; const id = f.lastId; f.conn.abort(); return id; }")
    p.wait_for_function(f"() => window.__remat.follow.reconnects >= 1 && window.__remat.follow.lastId > {last}")
    resent = [h["last-event-id"] for url, h in page.headers if f"/train/{job_id}/events" in url
              and "stream=false" not in url]
    assert len(resent) >= 2 and int(resent[-1]) >= last, resent
    steps = p.evaluate("window.__remat.follow.points.map((x) => x.step)")
    assert steps == list(range(1, len(steps) + 1)), steps

    # A press held across redraws (a step event redraws the view) is still a click: the button stays put.
    cancel = p.locator(f"{detail} #job-cancel")
    cancel.wait_for()
    p.evaluate("() => { window.__cancel = document.querySelector('#job-cancel');"
               " window.__redraws = window.__remat.follow.seen.length; }")
    box = cancel.bounding_box()
    with delivered(p, "POST", f"/train/{job_id}/cancel", "Cancel pressed across redraws"):
        p.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        p.mouse.down()
        p.wait_for_function("() => window.__remat.follow.seen.length >= window.__redraws + 2")
        assert p.evaluate("() => window.__cancel.isConnected && document.querySelector('#job-cancel') === "
                          "window.__cancel")
        p.mouse.up()
    p.wait_for_selector(f"{detail}[data-status=cancelled]", timeout=60_000)
    with delivered(p, "POST", f"/train/{job_id}/resume", "Resume"):
        p.locator(f"{detail} #job-resume").click()
    p.wait_for_selector(f"{detail}[data-status=running]", timeout=60_000)
    assert server.request("GET", f"/train/{job_id}")[1]["status"] in ("queued", "running")
    with delivered(p, "POST", f"/train/{job_id}/cancel", "Cancel after resume"):
        p.locator(f"{detail} #job-cancel").click()
    p.wait_for_selector(f"{detail}[data-status=cancelled]", timeout=60_000)
    assert server.request("GET", f"/train/{job_id}")[1]["status"] == "cancelled"


def test_api_key_and_memory_refusal(browser, keyed):
    page = Page(browser, keyed)
    try:
        p = page.page
        banner = page.error_text("#banner")
        assert "needs an API key" in banner
        p.wait_for_function("() => document.querySelector('#model').textContent.includes('tiny-llama')")  # public
        page.tab("jobs")
        assert "401" in page.error_text("#jobs-error")  # the server's refusal, shown

        p.fill("#key", "wrong")
        p.click("#key-save")
        p.wait_for_function("() => document.querySelector('#banner').textContent.includes('refused the API key')")
        p.fill("#key", KEY)
        p.click("#key-save")
        p.wait_for_selector("#banner", state="hidden")
        assert p.evaluate("sessionStorage.getItem('remat.apiKey')") == KEY
        p.reload()  # the key stays for the tab's session
        p.wait_for_function("() => window.__remat.props !== null")
        assert p.input_value("#key") == KEY

        page.tab("chat")
        p.fill("#chat-max", "6")
        p.fill("#chat-input", "hi")
        p.click("#chat-send")
        p.wait_for_selector(".msg.assistant[data-done]", timeout=60_000)
        assert p.locator("#chat-error").is_hidden()

        page.tab("train")
        p.fill("#t-data", records_jsonl(2))
        p.fill("#t-ctx", "32")
        p.click("#t-submit")
        status, body = keyed.request("POST", "/train", {"data": [{"text": CAT * 6}] * 2, "ctx": 32})
        assert status == 422
        message = page.error_text("#train-error")
        assert message.startswith("422") and body["error"]["message"] in message  # the server's own words
        plan = p.wait_for_selector("#plan:not([hidden])").inner_text()
        # 64 KiB is below the adapter's own weights, grads and optimizer states: refused before planning
        need = body["error"]["lora_bytes"] / 1024
        assert "Refused" in plan and f"adapter alone needs {need:.1f} KiB of the budget 64.0 KiB" in plan, plan
        page.shot("train-refused")
    finally:
        page.close()
