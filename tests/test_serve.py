"""`remat serve` end to end, over real HTTP: a uvicorn server in a subprocess serving tiny-llama.

Covers serving (llama.cpp and OpenAI shapes, streaming, sampling, tokenize), bad input (each with its
status and error type, and the server still answers afterwards), API keys and the body limit, and the
training API: a job's whole life, its SSE events with Last-Event-ID, applying its adapter (checked
against the adapter loaded with PEFT in this process), cancel, queueing, decoding while a job trains,
a bounded load run, and a SIGKILL mid-job followed by a restart on the same state folder.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from serve_process import MODEL, Server, free_port

CAT = "the cat sat on the mat. "

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # PEFT's calls into deprecated transformers


def cat_job(epochs: int = 2, **extra) -> dict:
    """A small LoRA job that visibly teaches the random model to say 'cat' (19 steps per epoch)."""
    return {"data": [{"text": CAT * 6} for _ in range(8)], "ctx": 64, "epochs": epochs, "lr": 0.01, **extra}


def long_job(**extra) -> dict:
    return cat_job(epochs=200, **extra)  # ~3800 steps: minutes; cancelled or killed by the tests


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve") / "state", "--parallel", "4").start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """Two API keys and a 1000-byte body limit."""
    s = Server(tmp_path_factory.mktemp("guarded") / "state", "--api-key", "key-one", "--api-key", "key-two",
               "--max-body", "1000", key="key-two").start()
    yield s
    s.stop()


# ---------------------------------------------------------------------------------------------------------
# reference: the same model (and adapter) in this process, greedy by full forward passes


_REF: dict = {}


def reference_tokens(prompt: str, n: int, *adapters: tuple[str, float]) -> list[int]:
    """Greedy tokens of the served model in this process, with PEFT adapters (folder, scale) applied."""
    import torch

    from remat.models.load import load_model

    key = (prompt, n, adapters)
    if key in _REF:
        return _REF[key]
    lm = load_model(MODEL)
    model = lm.model.eval()
    if adapters:
        import peft
        from peft.tuners.lora import LoraLayer

        wrapped = peft.PeftModel.from_pretrained(model, adapters[0][0], adapter_name="a0")
        for i, (path, _) in enumerate(adapters[1:], 1):
            wrapped.load_adapter(path, adapter_name=f"a{i}")
        wrapped.base_model.set_adapter([f"a{i}" for i in range(len(adapters))])
        for module in model.modules():
            if isinstance(module, LoraLayer):
                for i, (_, scale) in enumerate(adapters):
                    module.set_scale(f"a{i}", scale)  # the adapter's delta times scale
    ids = lm.tokenizer.encode(prompt)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            token = int(model(input_ids=torch.tensor([ids + out])).logits[0, -1].argmax())
            if token == lm.tokenizer.eos_token_id:
                break
            out.append(token)
    _REF[key] = out
    return out


def greedy(server: Server, prompt: str, n: int, **extra) -> list[int]:
    out = server.ok("POST", "/completion", {"prompt": prompt, "n_predict": n, "temperature": 0,
                                            "return_tokens": True, **extra})
    return out["tokens"]


# ---------------------------------------------------------------------------------------------------------
# serving


def test_health_props_models(server):
    assert server.ok("GET", "/health") == {"status": "ok"}
    # while the model loads: 503 in llama.cpp's shape
    assert all(status == 503 and body == {"error": {"code": 503, "message": "Loading model",
                                                    "type": "unavailable_error"}}
               for status, body in server.loading), server.loading
    props = server.ok("GET", "/props")
    assert props["model"] == MODEL and props["n_ctx"] == 2048
    assert props["total_slots"] == props["parallel"] == 4
    assert props["max_slowdown_ppm"] == 50_000
    assert props["default_generation_settings"]["params"]["temperature"] == 0.8
    models = server.ok("GET", "/v1/models")
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    spec = server.ok("GET", "/openapi.json")
    assert {"/completion", "/v1/chat/completions", "/train", "/train/{job_id}/events"} <= set(spec["paths"])


def test_completion_greedy_and_seed(server):
    body = {"prompt": "Hello", "n_predict": 12, "temperature": 0}
    a, b = server.ok("POST", "/completion", body), server.ok("POST", "/completion", body)
    assert a["content"] == b["content"] and a["tokens_predicted"] == 12 and a["stop_type"] == "limit"
    assert a["stop"] is True and a["tokens_evaluated"] == len("Hello") and a["model"] == MODEL
    assert greedy(server, "Hello", 12) == reference_tokens("Hello", 12)  # KV-cached decoding = full passes

    sampled = {"prompt": "Hello", "n_predict": 16, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0}
    x = server.ok("POST", "/completion", {**sampled, "seed": 42})
    y = server.ok("POST", "/completion", {**sampled, "seed": 42})
    z = server.ok("POST", "/completion", {**sampled, "seed": 43})
    assert x["content"] == y["content"] and x["generation_settings"]["seed"] == 42
    assert x["content"] != z["content"]

    # a stop string ends the text before it (an ASCII one: the random model writes many broken UTF-8 bytes)
    body = {"prompt": "Hello", "n_predict": 40, "temperature": 0}
    text = server.ok("POST", "/completion", body)["content"]
    word = next(ch for ch in text[3:] if ch.isascii() and ch.isprintable())
    stopped = server.ok("POST", "/completion", {**body, "stop": [word, "never appears"]})
    assert stopped["stop_type"] == "word" and stopped["stopping_word"] == word
    assert stopped["content"] == text[:text.index(word)]


def test_openai_completions_and_chat(server):
    chat = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
            "max_tokens": 8, "temperature": 0}
    a, b = server.ok("POST", "/v1/chat/completions", chat), server.ok("POST", "/v1/chat/completions", chat)
    assert a["object"] == "chat.completion" and a["model"] == MODEL
    assert a["choices"][0]["message"]["role"] == "assistant"
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    assert a["choices"][0]["finish_reason"] == "length"
    usage = a["usage"]
    assert usage["completion_tokens"] == 8 and usage["total_tokens"] == usage["prompt_tokens"] + 8
    seeded = {**chat, "temperature": 1.0, "seed": 7}
    assert server.ok("POST", "/v1/chat/completions", seeded)["choices"] == \
        server.ok("POST", "/v1/chat/completions", seeded)["choices"]
    # content as a list of text parts is the same message
    parts = {**chat, "messages": [chat["messages"][0],
                                  {"role": "user", "content": [{"type": "text", "text": "h"},
                                                               {"type": "text", "text": "i"}]}]}
    assert server.ok("POST", "/v1/chat/completions", parts)["choices"] == a["choices"]

    c = server.ok("POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 5, "temperature": 0})
    assert c["object"] == "text_completion" and c["usage"] == {"prompt_tokens": 5, "completion_tokens": 5,
                                                              "total_tokens": 10}
    assert c["choices"][0]["text"] == server.ok("POST", "/completion", {"prompt": "Hello", "n_predict": 5,
                                                                       "temperature": 0})["content"]


def test_streaming(server):
    events = list(server.sse("POST", "/completion", {"prompt": "Hello", "n_predict": 10, "temperature": 0,
                                                     "stream": True}))
    chunks = [json.loads(e["data"]) for e in events]
    assert len(chunks) >= 3 and all(c["stop"] is False for c in chunks[:-1]) and chunks[-1]["stop"] is True
    assert chunks[-1]["tokens_predicted"] == 10
    whole = server.ok("POST", "/completion", {"prompt": "Hello", "n_predict": 10, "temperature": 0})["content"]
    assert "".join(c["content"] for c in chunks) == whole

    events = list(server.sse("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}}))
    assert events[-1]["data"] == "[DONE]"
    chunks = [json.loads(e["data"]) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6

    events = list(server.sse("POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0,
                                                         "stream": True}))
    assert events[-1]["data"] == "[DONE]"
    chunks = [json.loads(e["data"]) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in chunks) == \
        server.ok("POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0})[
            "choices"][0]["text"]

    # a client that hangs up frees its slot
    stream = server.sse("POST", "/completion", {"prompt": "Hi", "n_predict": 1500, "stream": True})
    next(stream), next(stream)
    stream.close()
    deadline = time.monotonic() + 20
    while "remat_requests_processing 0\n" not in server.ok("GET", "/metrics"):
        assert time.monotonic() < deadline, "the slot of a closed stream was not freed"
        time.sleep(0.1)


def test_tokenize_round_trip(server):
    text = "héllo, wörld <|im_end|>"
    tokens = server.ok("POST", "/tokenize", {"content": text})["tokens"]
    assert all(isinstance(t, int) for t in tokens) and tokens[-1] == 258  # special tokens parsed, as llama.cpp
    assert server.ok("POST", "/detokenize", {"tokens": tokens})["content"] == text
    special = server.ok("POST", "/tokenize", {"content": "<|im_end|>", "add_special": True})["tokens"]
    assert special == [258]
    pieces = server.ok("POST", "/tokenize", {"content": "ab", "with_pieces": True})["tokens"]
    assert pieces == [{"id": 97, "piece": "a"}, {"id": 98, "piece": "b"}]


def test_exceed_context(server):
    status, body = server.request("POST", "/completion", {"prompt": "a" * 3000, "n_predict": 1})
    assert status == 400
    err = body["error"]
    assert err["type"] == "exceed_context_size_error" and err["n_prompt_tokens"] == 3000 and err["n_ctx"] == 2048
    status, body = server.request("POST", "/v1/chat/completions",
                                  {"messages": [{"role": "user", "content": "a" * 3000}], "stream": True})
    assert status == 400 and body["error"]["type"] == "exceed_context_size_error"


def _jobs_payload(**overrides) -> dict:
    return {**cat_job(), **overrides}


BAD_INPUTS = [
    # (name, method, path, body (dict/list, or bytes sent raw), status, type, message part)
    ("malformed json", "POST", "/completion", b'{"prompt": "x",', 400, "invalid_request_error", "malformed JSON"),
    ("malformed json chat", "POST", "/v1/chat/completions", b"{nope", 400, "invalid_request_error", "malformed"),
    ("malformed json train", "POST", "/train", b"[1, 2", 400, "invalid_request_error", "malformed JSON"),
    ("not an object", "POST", "/completion", [1, 2], 400, "invalid_request_error", "JSON object"),
    ("wrong type", "POST", "/completion", {"prompt": "x", "n_predict": "5"}, 400, "invalid_request_error",
     "n_predict"),
    ("wrong type prompt", "POST", "/completion", {"prompt": 5}, 400, "invalid_request_error", "prompt"),
    ("bool for int", "POST", "/v1/completions", {"prompt": "x", "max_tokens": True}, 400, "invalid_request_error",
     "max_tokens"),
    ("unknown field", "POST", "/completion", {"prompt": "x", "n_predcit": 5}, 400, "invalid_request_error",
     "n_predcit"),
    ("unknown field chat", "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                            "temprature": 1}, 400, "invalid_request_error",
     "temprature"),
    ("missing field", "POST", "/v1/chat/completions", {"max_tokens": 3}, 400, "invalid_request_error",
     "messages"),
    ("bad role", "POST", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400,
     "invalid_request_error", "role"),
    ("negative n_predict", "POST", "/completion", {"prompt": "x", "n_predict": -2}, 400, "invalid_request_error",
     "n_predict"),
    ("top_p above 1", "POST", "/completion", {"prompt": "x", "top_p": 1.5}, 400, "invalid_request_error", "top_p"),
    ("empty prompt", "POST", "/completion", {"prompt": ""}, 400, "invalid_request_error", "prompt"),
    # token ids are bounded by the vocabulary in the schema (259 ids): the message names the id's place
    ("token out of vocabulary", "POST", "/completion", {"prompt": [1, 100000]}, 400, "invalid_request_error",
     "'prompt.1': input should be less than or equal to 258"),
    ("detokenize out of vocabulary", "POST", "/detokenize", {"tokens": [5, 9999]}, 400, "invalid_request_error",
     "'tokens.1': input should be less than or equal to 258"),
    ("unknown adapter in request", "POST", "/completion", {"prompt": "x", "lora": [{"id": 99, "scale": 1}]}, 400,
     "invalid_request_error", "99"),
    ("unknown adapter scale", "POST", "/lora-adapters", [{"id": 99, "scale": 1}], 400, "invalid_request_error",
     "99"),
    ("adapters not a list", "POST", "/lora-adapters", {"id": 0}, 400, "invalid_request_error", "array"),
    ("train without data", "POST", "/train", {"epochs": 1}, 400, "invalid_request_error", "data"),
    ("empty training data", "POST", "/train", _jobs_payload(data=[]), 400, "invalid_request_error", "data"),
    ("record without text", "POST", "/train", _jobs_payload(data=[{"txt": "hello"}]), 400,
     "invalid_request_error", "data.0"),
    ("ctx above the model's", "POST", "/train", _jobs_payload(ctx=4096), 400, "invalid_request_error", "ctx"),
    ("negative epochs", "POST", "/train", _jobs_payload(epochs=-1), 400, "invalid_request_error", "epochs"),
    ("epochs not a number", "POST", "/train", _jobs_payload(epochs="many"), 400, "invalid_request_error",
     "epochs"),
    ("unknown train field", "POST", "/train", _jobs_payload(epochz=3), 400, "invalid_request_error", "epochz"),
    ("integer of 5000 digits", "POST", "/train", b'{"data": [{"text": "x"}], "ctx": 1' + b"0" * 5000 + b"}", 400,
     "invalid_request_error", "malformed JSON"),
    ("integer of 5000 digits completion", "POST", "/completion", b'{"prompt": "x", "seed": 1' + b"0" * 5000 + b"}",
     400, "invalid_request_error", "body"),
    ("arrays nested 100,000 deep", "POST", "/train", b"[" * 100_000 + b"]" * 100_000, 400, "invalid_request_error",
     "malformed JSON"),
    ("arrays nested 100,000 deep completion", "POST", "/completion", b'{"prompt": ' + b"[" * 100_000, 400,
     "invalid_request_error", "body"),
    ("unknown job", "GET", "/train/job-nope", None, 404, "not_found_error", "job-nope"),
    ("cancel unknown job", "POST", "/train/job-nope/cancel", None, 404, "not_found_error", "job-nope"),
    ("delete unknown job", "DELETE", "/train/job-nope", None, 404, "not_found_error", "job-nope"),
    ("resume unknown job", "POST", "/train/job-nope/resume", None, 404, "not_found_error", "job-nope"),
    ("events of unknown job", "GET", "/train/job-nope/events", None, 404, "not_found_error", "job-nope"),
    ("unknown route", "GET", "/nowhere", None, 404, "not_found_error", "/nowhere"),
    ("wrong method", "DELETE", "/completion", None, 405, "invalid_request_error", ""),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input(server, case):
    _, method, path, body, status, type_, part = case
    if isinstance(body, bytes):
        got, out = server.request(method, path, raw=body)
    else:
        got, out = server.request(method, path, body)
    assert got == status, out
    assert isinstance(out, dict) and set(out) == {"error"}, out
    err = out["error"]
    assert err["type"] == type_ and part in err["message"], err
    assert "Traceback" not in err["message"]
    # and the server answers the next good request (one token or two: the second may be the end of text, as
    # the adapter scales other tests of this module set change what the model samples)
    assert server.ok("POST", "/completion", {"prompt": "ok", "n_predict": 2})["tokens_predicted"] in (1, 2)


def test_bad_last_event_id(server):
    job = server.submit(**cat_job(epochs=1))
    status, out = server.request("GET", f"/train/{job['id']}/events", headers={"Last-Event-ID": "abc"})
    assert status == 400 and out["error"]["type"] == "invalid_request_error"
    server.cancel(job["id"])


def test_body_limit(guarded):
    status, out = guarded.request("POST", "/completion", {"prompt": "x" * 2000, "n_predict": 1})
    assert status == 413 and out["error"]["code"] == 413 and "1000" in out["error"]["message"]
    # a chunked body (no Content-Length) is counted as it arrives
    conn = http.client.HTTPConnection("127.0.0.1", guarded.port, timeout=30)
    body = json.dumps({"prompt": "x" * 3000}).encode()
    conn.request("POST", "/completion", body=iter([body[:500], body[500:]]), encode_chunked=True,
                 headers={**guarded.headers(), "Content-Type": "application/json", "Transfer-Encoding": "chunked"})
    resp = conn.getresponse()
    assert resp.status == 413 and json.loads(resp.read())["error"]["code"] == 413
    conn.close()
    assert guarded.ok("POST", "/completion", {"prompt": "x", "n_predict": 1})["tokens_predicted"] == 1


def test_api_key(guarded):
    spec = guarded.ok("GET", "/openapi.json")
    routes = [(m.upper(), p.replace("{job_id}", "job-x")) for p, ops in spec["paths"].items() for m in ops]
    routes += [("GET", "/openapi.json"), ("GET", "/docs")]
    public = {("GET", "/health"), ("GET", "/v1/models")}
    assert public <= set(routes) and len(routes) > 15
    for method, path in routes:
        body = {} if method == "POST" else None
        if (method, path) in public:
            assert guarded.request(method, path, auth=False)[0] == 200
            continue
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-Api-Key": "wrong"},
                        {"Authorization": "key-one"}):
            status, out = guarded.request(method, path, body, auth=False, headers=headers)
            assert status == 401, (method, path, headers, status, out)
            assert out["error"]["type"] == "authentication_error"
    # either key, either header
    assert guarded.request("GET", "/props", auth=False, headers={"Authorization": "Bearer key-one"})[0] == 200
    assert guarded.request("GET", "/props", auth=False, headers={"X-Api-Key": "key-two"})[0] == 200
    assert guarded.ok("POST", "/completion", {"prompt": "x", "n_predict": 1})["tokens_predicted"] == 1


def test_metrics(server):
    server.ok("POST", "/completion", {"prompt": "x", "n_predict": 3})
    text = server.ok("GET", "/metrics")
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values["remat_requests_total"] >= 1 and values["remat_tokens_predicted_total"] >= 3
    assert values["remat_decode_tokens_per_second"] > 0 and values["remat_slots_total"] == 4
    assert "remat_requests_processing" in values and values["remat_max_slowdown_ppm"] == 50_000


# ---------------------------------------------------------------------------------------------------------
# training


def test_train_lifecycle(server):
    job = server.submit(**cat_job(name="cats"))
    assert job["status"] == "queued" and job["id"].startswith("job-") and job["plan"]["total"] > 0
    job_id = job["id"]

    # events: read a few, hang up, reconnect with Last-Event-ID and get exactly the rest
    stream = server.sse("GET", f"/train/{job_id}/events")
    first = [next(stream) for _ in range(3)]
    stream.close()
    ids = [int(e["id"]) for e in first]
    assert ids == list(range(ids[0], ids[0] + 3)) and first[0]["event"] == "queued"
    rest = list(server.sse("GET", f"/train/{job_id}/events", headers={"Last-Event-ID": str(ids[-1])}))
    assert [int(e["id"]) for e in rest] == list(range(ids[-1] + 1, ids[-1] + 1 + len(rest)))
    assert rest[-1]["event"] == "succeeded"  # the stream ends after the terminal event
    steps = [json.loads(e["data"]) for e in first + rest if e["event"] == "step"]
    assert [s["step"] for s in steps] == list(range(1, len(steps) + 1)) and len(steps) == job["steps"] > 1
    replay = server.ok("GET", f"/train/{job_id}/events?stream=false")["data"]
    assert [e["id"] for e in replay] == ids + [int(e["id"]) for e in rest]

    done = server.job(job_id)
    assert done["status"] == "succeeded" and done["step"] == job["steps"] == len(done["losses"])
    assert done["losses"][-1] < done["losses"][0]
    assert job_id in [j["id"] for j in server.ok("GET", "/train")["data"]]

    adapter = next(a for a in server.ok("GET", "/lora-adapters") if a["job_id"] == job_id)
    assert adapter["scale"] == 0 and adapter["name"] == "cats" and Path(adapter["path"]).is_dir()

    prompts = ["the cat", "Hello"]
    base = {p: reference_tokens(p, 20) for p in prompts}
    tuned = {p: reference_tokens(p, 20, (adapter["path"], 1.0)) for p in prompts}
    assert base != tuned, "the adapter should change greedy decoding"
    for p in prompts:
        assert greedy(server, p, 20) == base[p]  # listed at scale 0: not applied
        assert greedy(server, p, 20, lora=[{"id": adapter["id"], "scale": 1.0}]) == tuned[p]
    scales = server.ok("POST", "/lora-adapters", [{"id": adapter["id"], "scale": 1.0}])
    assert next(a for a in scales if a["id"] == adapter["id"])["scale"] == 1.0
    try:
        for p in prompts:
            assert greedy(server, p, 20) == tuned[p]
            assert greedy(server, p, 20, lora=[]) == base[p]  # a request's own list overrides
    finally:
        server.ok("POST", "/lora-adapters", [{"id": adapter["id"], "scale": 0.0}])
    assert greedy(server, "the cat", 20) == base["the cat"]

    metrics = server.ok("GET", "/metrics")
    assert "remat_training_steps_total" in metrics and "remat_training_last_loss" in metrics
    assert 'remat_training_planned_bytes{kind="total"}' in metrics
    assert "remat_training_window_p95_seconds" in metrics and "remat_slowdown_ppm" in metrics


def test_plan_first_queues_nothing(server):
    """POST /train/plan answers what POST /train would (the plans, the gate's choice and why), queues nothing;
    a job's own memory_budget (bytes or "64KiB") caps the server's and can make it 422 with the plans."""
    before = [j["id"] for j in server.ok("GET", "/train")["data"]]
    plan = server.ok("POST", "/train/plan", cat_job(name="planned"))
    assert set(plan) == {"plan", "plans", "policy", "recompute", "recompute_reason", "budget", "steps", "dtype",
                         "dtype_reason"}
    assert plan["dtype"] in ("float32", "bfloat16") and plan["dtype_reason"].startswith("auto:"), plan  # per CPU
    named = server.ok("POST", "/train/plan", cat_job(dtype="bfloat16"))
    assert (named["dtype"], named["dtype_reason"]) == ("bfloat16", "--dtype bfloat16"), named
    assert plan["policy"] == "off" and plan["recompute"] is False and plan["plan"] == plan["plans"]["off"]
    assert {"off", "on"} <= set(plan["plans"]) and "not needed" in plan["recompute_reason"] and plan["steps"] > 1
    assert [j["id"] for j in server.ok("GET", "/train")["data"]] == before  # nothing queued

    for policy in ("on", "dots", "every:2", "budget"):
        got = server.ok("POST", "/train/plan", cat_job(recompute=policy))
        assert got["policy"] == policy or policy == "budget", got
        assert got["plan"] == got["plans"][got["policy"]] and got["recompute"] is True
    on = plan["plans"]["on"]["total"]
    fits_on = server.ok("POST", "/train/plan", cat_job(memory_budget=on + 1))  # off is over this budget
    assert fits_on["budget"] == on + 1 and fits_on["policy"] != "off" and fits_on["plan"]["total"] <= on + 1
    capped = server.ok("POST", "/train/plan", cat_job(memory_budget="1000000GiB"))  # above the server's
    assert capped["budget"] < 1_000_000 << 30 and capped["budget"] > plan["budget"] // 2  # the server's: free memory

    lora = sum(plan["plans"]["on"][k] for k in ("params", "grads", "optimizer"))  # the adapter's own bytes
    for path in ("/train/plan", "/train"):  # above the adapter, below the smallest plan: 422 with the plans
        got, out = server.request("POST", path, cat_job(memory_budget=lora + 1))
        assert got == 422 and out["error"]["code"] == "insufficient_memory", out
        assert out["error"]["budget"] == lora + 1 and {"off", "on"} <= set(out["error"]["plans"])
        assert all(p["total"] > lora + 1 for p in out["error"]["plans"].values())
    got, out = server.request("POST", "/train/plan", cat_job(memory_budget="4KiB"))  # below the adapter itself
    assert got == 422 and out["error"]["budget"] == 4096 and out["error"]["lora_bytes"] == lora, out
    for bad in ("lots", "0", 0, -1, "1e9", True):
        got, out = server.request("POST", "/train/plan", cat_job(memory_budget=bad))
        assert got == 400 and "memory_budget" in out["error"]["message"], (bad, out)
    got, out = server.request("POST", "/train/plan", cat_job(recompute="sometimes"))
    assert got == 400 and "recompute" in out["error"]["message"]
    assert [j["id"] for j in server.ok("GET", "/train")["data"]] == before

    job = server.submit(**cat_job(epochs=1, memory_budget=on + 1))  # the job runs within its own budget
    assert job["budget"] == on + 1 and job["policy"] == fits_on["policy"]
    assert server.wait_job(job["id"])["status"] == "succeeded"


def test_cancel_running_job_then_delete_its_record(server):
    """OpenAI's fine-tuning conventions: `POST .../cancel` stops a job and keeps it (cancelled, resumable);
    DELETE refuses a job still running, and removes a finished one's record and events."""
    job_id = server.submit(**long_job())["id"]
    try:
        server.wait_job(job_id, lambda j: j["status"] == "running" and j["step"] >= 2)
        status, out = server.request("DELETE", f"/train/{job_id}")
        assert status == 409 and out["error"]["code"] == "job_active"  # running: cancel it first
        out = server.ok("POST", f"/train/{job_id}/cancel")
        assert out["id"] == job_id
        done = server.wait_job(job_id)
        assert done["status"] == "cancelled" and 2 <= done["step"] < 3800 and done["resumable"]
        events = server.ok("GET", f"/train/{job_id}/events?stream=false")["data"]
        assert events[-1]["event"] == "cancelled"
        status, out = server.request("POST", f"/train/{job_id}/cancel")
        assert status == 409 and out["error"]["code"] == "job_finished"
        assert server.ok("DELETE", f"/train/{job_id}") == {"id": job_id, "object": "train.job.deleted",
                                                             "deleted": True}
        for path in (f"/train/{job_id}", f"/train/{job_id}/events?stream=false"):
            status, out = server.request("GET", path)
            assert status == 404 and out["error"]["code"] == "not_found", path
        assert job_id not in [j["id"] for j in server.ok("GET", "/train")["data"]]
    finally:
        server.cancel(job_id)


def test_jobs_run_in_order(server):
    first = server.submit(**cat_job(epochs=1))["id"]
    second = server.submit(**cat_job(epochs=1, name="second"))["id"]
    assert server.job(second)["status"] == "queued"
    a, b = server.wait_job(first), server.wait_job(second)
    assert a["status"] == b["status"] == "succeeded"
    started = next(e for e in server.ok("GET", f"/train/{second}/events?stream=false")["data"]
                   if e["event"] == "started")
    assert a["finished"] <= started["created"]
    listed = [j["id"] for j in server.ok("GET", "/train")["data"]]
    assert listed.index(first) < listed.index(second)

    # both adapters at once, at their own scales
    adapters = {a["job_id"]: a for a in server.ok("GET", "/lora-adapters")}
    one, two = adapters[first], adapters[second]
    lora = [{"id": one["id"], "scale": 0.5}, {"id": two["id"], "scale": -1.0}]
    both = reference_tokens("the cat", 16, (one["path"], 0.5), (two["path"], -1.0))
    assert both != reference_tokens("the cat", 16)
    assert greedy(server, "the cat", 16, lora=lora) == both


def test_decoding_while_training(server):
    job_id = server.submit(**long_job())["id"]
    try:
        server.wait_job(job_id, lambda j: j["status"] == "running" and j["step"] >= 1)
        # greedy, so the streamed answer is the same as the whole one (a sampled EOS can't end it early)
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0}
        chat = server.ok("POST", "/v1/chat/completions", body)
        n = chat["usage"]["completion_tokens"]
        assert 1 <= n <= 8
        events = list(server.sse("POST", "/v1/chat/completions", {**body, "stream": True}))
        assert events[-1]["data"] == "[DONE]" and len(events) >= 3
        pieces = [json.loads(e["data"])["choices"] for e in events[:-1]]
        text = "".join(c[0]["delta"].get("content") or "" for c in pieces if c)
        assert text == chat["choices"][0]["message"]["content"]
        assert server.job(job_id)["status"] == "running"
    finally:
        server.cancel(job_id)


def test_load_during_training(server):
    """200 short requests, 8 at a time, while a job trains: all answered, no 5xx, and the job finishes."""
    job = server.submit(**cat_job(epochs=3))
    job_id = job["id"]
    server.wait_job(job_id, lambda j: j["status"] != "queued")

    def one(i: int) -> int:
        if i % 3 == 0:
            body = {"messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 4}
            return server.request("POST", "/v1/chat/completions", body, timeout=120)[0]
        return server.request("POST", "/completion", {"prompt": f"p{i}", "n_predict": 4}, timeout=120)[0]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(one, range(200)))
    assert statuses == [200] * 200
    done = server.wait_job(job_id)
    assert done["status"] == "succeeded" and done["step"] == job["steps"] > 1
    assert done["window_p95"] is not None


# ---------------------------------------------------------------------------------------------------------
# crash and restart


def test_kill_and_restart(tmp_path):
    state = tmp_path / "state"
    srv = Server(state).start()
    try:
        finished = srv.submit(**cat_job(epochs=1, name="kept"))["id"]
        assert srv.wait_job(finished)["status"] == "succeeded"
        running = srv.submit(**long_job())["id"]
        srv.wait_job(running, lambda j: j["status"] == "running" and (j["checkpoint_step"] or 0) >= 2)
    finally:
        srv.stop(signal.SIGKILL)
    assert srv.proc.returncode == -signal.SIGKILL

    again = Server(state).start()
    try:
        adapters = again.ok("GET", "/lora-adapters")
        kept = next(a for a in adapters if a["job_id"] == finished)
        assert kept["name"] == "kept" and kept["scale"] == 0
        assert greedy(again, "the cat", 16, lora=[{"id": kept["id"], "scale": 1}]) == \
            reference_tokens("the cat", 16, (kept["path"], 1.0))

        job = again.job(running)
        assert job["status"] == "failed" and job["reason"] == "interrupted" and job["resumable"]
        step = job["checkpoint_step"]
        assert step >= 2
        resumed = again.ok("POST", f"/train/{running}/resume", status=202)
        assert resumed["status"] in ("queued", "running")
        again.wait_job(running, lambda j: j["status"] == "running" and j["step"] > step)
        started = [e for e in again.ok("GET", f"/train/{running}/events?stream=false")["data"]
                   if e["event"] == "started"]
        assert started[-1]["data"]["resumed_from_step"] == step
        again.cancel(running)
        assert again.job(running)["status"] == "cancelled"
        status, out = again.request("POST", f"/train/{finished}/resume")
        assert status == 409 and out["error"]["type"] == "invalid_request_error"
    finally:
        again.stop()
    # uvicorn ends a SIGTERM'd server by re-raising the signal, after the clean shutdown
    log = again.log.read_text()
    assert again.proc.returncode in (0, -signal.SIGTERM) and log.endswith("stopped\n"), log[-2000:]
    assert "Traceback" not in log


def test_bad_model_exits(tmp_path):
    out = subprocess.run([sys.executable, "-m", "remat", "serve", "--model", "no-such-model", "--port",
                          str(free_port()), "--state-dir", str(tmp_path)], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 2 and "no-such-model" in out.stderr and "Traceback" not in out.stderr
