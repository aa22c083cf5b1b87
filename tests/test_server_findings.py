"""Issue #19's findings, one test each, against one real server (tiny-llama, one slot, a 64 MiB training
budget): every bad input answers 4xx with the error shape, quickly, and /health keeps answering."""

from __future__ import annotations

import json
import math
import socket
import sqlite3
import stat
import threading
import time
from pathlib import Path

import pytest
import torch

from remat.serve.sampling import Row, Sampling, pick
from serve_process import Server
from test_serve import BAD_INPUTS, CAT, cat_job

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

# /health answers in a few ms when the loop is free; parsing and validating a 57 MiB body on the loop would
# hold it for well over a second, and even in a worker thread one C call over all of it (json.loads,
# pydantic, freeing the records) held the GIL 25-450 ms. No C call over a body part holds it ~1 ms now.
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("findings") / "state", "--memory-budget", "64MiB").start()
    yield s
    s.stop()


def raw(server: Server, method: str, path: str, text: str, **kw) -> tuple[int, object]:
    """Send `text` as the body as it is (JSON Python would not write: lone surrogates, NaN, 1e999)."""
    return server.request(method, path, raw=text.encode(), **kw)


def refused(out: object, status: int, got: int, part: str = "") -> None:
    assert got == status, out
    assert isinstance(out, dict) and set(out) == {"error"} and {"code", "message", "type"} <= set(out["error"])
    assert part in out["error"]["message"], out


def health_while(server: Server, send) -> int:
    """How many /health answers (each 200) came back while `send()`, in another thread, still waited for its
    own: at least one means the server answered others meanwhile, whatever this machine's speed."""
    done = threading.Event()
    worker = threading.Thread(target=lambda: (send(), done.set()))
    answered = 0
    worker.start()
    while not done.is_set():
        assert server.ok("GET", "/health") == {"status": "ok"}
        answered += not done.is_set()
    worker.join()
    return answered


# ---------------------------------------------------------------------------------------------------------
# 1. adapter scales


@pytest.mark.parametrize("text", ['[{"id": 0, "scale": 1e38}]', '[{"id": 0, "scale": NaN}]',
                                  '[{"id": 0, "scale": -Infinity}]', '[{"id": 0, "scale": 1e308}]'])
def test_adapter_scale_is_bounded(server, text):
    got, out = raw(server, "POST", "/lora-adapters", text)
    refused(out, 400, got, "scale")


@pytest.mark.parametrize("scale", ["1e38", "NaN", "Infinity", "1e308"])
def test_request_lora_scale_is_bounded(server, scale):
    got, out = raw(server, "POST", "/completion", f'{{"prompt": "x", "lora": [{{"id": 0, "scale": {scale}}}]}}')
    refused(out, 400, got, "scale")


def test_out_of_bounds_scale_in_an_old_state_db_is_reset(tmp_path):
    from remat.serve.jobs import JobManager
    from remat.serve.scheduler import Scheduler

    JobManager(model="tiny-llama", state_dir=tmp_path, scheduler=Scheduler()).close()
    with sqlite3.connect(tmp_path / "state.db") as db:
        db.execute("INSERT INTO adapters (id, job_id, name, path, scale) VALUES (0, 'j', 'n', 'p', 1e38)")
    m = JobManager(model="tiny-llama", state_dir=tmp_path, scheduler=Scheduler())
    try:
        assert m.adapters()[0]["scale"] == 0.0
    finally:
        m.close()


def test_sampling_survives_inf_and_nan_logits():
    row = Row(Sampling(temperature=0.8), torch.Generator().manual_seed(0))
    logits = torch.randn(259)
    for bad in (math.inf, -math.inf, math.nan):
        x = logits.clone()
        x[3] = bad
        assert 0 <= pick(x.unsqueeze(0), [row]).tokens[0] < 259
    assert 0 <= pick(torch.full((1, 259), math.nan), [row]).tokens[0] < 259
    assert pick(torch.full((1, 259), math.inf), [row]).tokens[0] in range(259)
    banned = Row(Sampling(temperature=0.8, logit_bias=tuple((t, -math.inf) for t in range(259))), row.generator)
    assert pick(logits.unsqueeze(0), [banned]).tokens[0] in range(259)  # every token banned: still one


# ---------------------------------------------------------------------------------------------------------
# 2. temperature


def test_temperature_extremes(server):
    body = {"prompt": "Hello", "n_predict": 4, "seed": 1}
    for t in (1e-300, 5e-324, 100.0):
        out = server.ok("POST", "/completion", {**body, "temperature": t})
        assert out["tokens_predicted"] == 4
        events = list(server.sse("POST", "/completion", {**body, "temperature": t, "stream": True}))
        assert "error" not in json.loads(events[-1]["data"]) and json.loads(events[-1]["data"])["stop"] is True
    # greedy: a tiny temperature picks the most likely token, as temperature 0 does
    greedy = server.ok("POST", "/completion", {**body, "temperature": 0})["content"]
    assert server.ok("POST", "/completion", {**body, "temperature": 1e-300})["content"] == greedy
    for t in ("Infinity", "NaN", "1e300", "-1"):
        got, out = raw(server, "POST", "/completion", f'{{"prompt": "x", "temperature": {t}}}')
        refused(out, 400, got, "temperature")
        got, out = raw(server, "POST", "/v1/chat/completions",
                       f'{{"messages": [{{"role": "user", "content": "x"}}], "temperature": {t}}}')
        refused(out, 400, got, "temperature")


# ---------------------------------------------------------------------------------------------------------
# 3. lone surrogates


SURROGATES = [
    ("POST", "/tokenize", '{"content": "a\\ud800"}'),
    ("POST", "/completion", '{"prompt": "a\\udc00b", "n_predict": 1}'),
    ("POST", "/completion", '{"prompt": "x", "stop": ["\\ud800"], "n_predict": 1}'),
    ("POST", "/v1/completions", '{"prompt": "a\\ud800", "max_tokens": 1}'),
    ("POST", "/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800"}]}'),
    ("POST", "/v1/chat/completions",
     '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}'),
    ("POST", "/train", '{"data": [{"text": "hello \\ud800 world"}]}'),
    ("POST", "/train", '{"data": [{"messages": [{"role": "user", "content": "\\ud800"}, '
                       '{"role": "assistant", "content": "x"}]}]}'),
    ("POST", "/train", '{"data": [{"text": "hello world"}], "name": "job \\ud800"}'),
    ("POST", "/train", '{"data": [{"text": "hello world"}], "\\ud800": 1}'),
]


@pytest.mark.parametrize("case", SURROGATES, ids=[f"{m} {p} {i}" for i, (m, p, _) in enumerate(SURROGATES)])
def test_lone_surrogates_are_400(server, case):
    method, path, text = case
    got, out = raw(server, method, path, text)
    refused(out, 400, got)
    # a surrogate pair is one character, and fine
    assert server.ok("POST", "/tokenize", {"content": "\U0001f600"})["tokens"]


# ---------------------------------------------------------------------------------------------------------
# 4. size before tokenizing, off the event loop


def test_huge_texts_are_refused_before_tokenizing_and_health_answers(server):
    cases = [("/tokenize", {"content": "word " * 400_000}, 400),  # 2 MB: over 32 characters per token of context
             ("/tokenize", {"content": "x" * (5 << 20)}, 400),  # over the longest text field
             ("/detokenize", {"tokens": [7] * 2_000_000}, 400),  # more ids than the longest text has characters
             ("/completion", {"prompt": "a" * 200_000, "n_predict": 1}, 400),
             ("/completion", {"prompt": "x", "stop": ["y"] * 2_000_000, "lora": [{"id": 99}]}, 400),  # no adapter 99
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "b" * 200_000}]}, 400)]
    for path, body, status in cases:
        data = json.dumps(body).encode()  # once: json.dumps of 2M items would hold this process's GIL, not the server's
        t = time.perf_counter()
        got, out = server.request("POST", path, raw=data)
        assert time.perf_counter() - t < 5, path
        refused(out, status, got)
        assert server.ok("GET", "/health") == {"status": "ok"}, path
    got, out = server.request("POST", "/completion", {"prompt": "a" * 3000, "n_predict": 1})
    refused(out, 400, got, "context")
    assert out["error"]["type"] == "exceed_context_size_error"


def test_huge_train_body_is_validated_off_the_event_loop(server):
    """A 57 MiB training job is parsed, validated and freed in a worker thread, a bounded part per C call,
    with the collector paused: /health answers meanwhile (it waited ~600 ms when FastAPI parsed and
    validated it on the event loop)."""
    turn = [{"role": "user", "content": "What is remat? " * 20},
            {"role": "assistant", "content": "A fine-tuner that recomputes. " * 20}]
    records = [{"messages": turn}] * 60_000 + [{"txt": "no text"}]  # the last one is bad: a 400 once all is read
    raw = json.dumps({"data": records, "ctx": 32}).encode()
    assert len(raw) > 50 << 20

    def post(path: str) -> tuple[int, dict]:  # header and body sent apart: http.client would join them, here
        with socket.create_connection(("127.0.0.1", server.port), timeout=120) as sock:
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(raw)}\r\nConnection: close\r\n\r\n".encode())
            sock.sendall(raw)
            reply = b"".join(iter(lambda: sock.recv(1 << 16), b""))
        head, _, text = reply.partition(b"\r\n\r\n")
        return int(head.split()[1]), json.loads(text)

    for path in ("/train", "/train/plan"):
        got, out = post(path)
        refused(out, 400, got, "data.60000")
        assert health_while(server, lambda p=path: post(p)) >= 1, path


def test_bad_inputs_are_4xx_and_health_stays_up(server):
    for _, method, path, body, status, _, _ in BAD_INPUTS:
        got, out = server.request(method, path, raw=body) if isinstance(body, bytes) else \
            server.request(method, path, body)
        assert got == status and set(out) == {"error"}, (method, path, got, out)
        assert server.ok("GET", "/health") == {"status": "ok"}, (method, path)


def test_health_answers_while_a_job_is_planned(server):
    """Planning a job runs off the event loop: /health is answered while a plan of a new shape (2048 tokens,
    the loss head in 128 pieces, traced on fake tensors) is in progress."""
    job = {"data": [{"text": CAT * 400}], "ctx": 2048, "loss_chunk": 16, "lora": False, "memory_budget": "1GiB"}
    answers: list = []
    assert health_while(server, lambda: answers.append(server.request("POST", "/train/plan", job))) >= 1
    assert answers[0][0] in (200, 422), answers


def test_head_answers_where_get_does(server):
    """HEAD: the GET's status and headers, no body; a stream's headers alone; 405 where GET is not allowed."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        for path, status in (("/health", b"200"), ("/v1/models", b"200"), ("/train/job-0123456789abcdef/events",
                                                                          b"404"), ("/completion", b"405")):
            sock.sendall(f"HEAD {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            head = b""
            while b"\r\n\r\n" not in head:
                head += sock.recv(1 << 16)
            assert head.split()[1] == status, (path, head)
            rest = head.partition(b"\r\n\r\n")[2]
            assert rest == b"", (path, rest)  # no body follows the headers (the next answer's would)


# ---------------------------------------------------------------------------------------------------------
# 5. a non-streaming completion stops when its client leaves


def test_non_streaming_completion_is_cancelled_on_disconnect(server):
    body = json.dumps({"prompt": "Hi", "n_predict": 2000, "temperature": 0}).encode()  # ~4 s of decoding
    logged = server.log.stat().st_size
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 10
        while "remat_requests_processing 1\n" not in server.ok("GET", "/metrics"):
            assert time.monotonic() < deadline
            time.sleep(0.02)
    hung_up = time.monotonic()
    out = server.ok("POST", "/completion", {"prompt": "next", "n_predict": 2})  # the only slot, freed
    # one token when it samples the end of text first (it did, once in many runs)
    assert out["tokens_predicted"] in (1, 2) and time.monotonic() - hung_up < 1.5
    with server.log.open("rb") as log:  # the request that was left ended cleanly (closing its stream once failed)
        log.seek(logged)
        assert b"Traceback" not in log.read()


# ---------------------------------------------------------------------------------------------------------
# 6. lora.r: bounded, and a rank that cannot fit is refused from shapes, before anything is allocated


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmHWM")


def test_lora_rank_is_bounded_and_gated_before_allocating(server):
    job = {"data": [{"text": CAT * 6}], "ctx": 64, "steps": 1}
    got, out = server.request("POST", "/train", {**job, "lora": {"r": 65536}})
    refused(out, 400, got, "lora.r")
    # The worker plans a default job as it starts (`JobManager._warm`, 13-21 MiB kept: a planning model, its
    # plans); a request waits for that under the planning lock, so a plan first keeps it out of what is measured
    # (measured: 13-21 MiB in the window when the server had just started, 1.5 after).
    assert server.request("POST", "/train/plan", job)[0] == 200
    pid = server.proc.pid
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak RSS starts again from the RSS now
    before = peak_rss(pid)
    got, out = server.request("POST", "/train", {**job, "lora": {"r": 4096}})  # 128 MiB of LoRA state
    grew = peak_rss(pid) - before
    assert grew < 16 << 20, f"the server's peak RSS grew by {grew / 2**20:.1f} MiB"  # PEFT allocates ~70
    refused(out, 422, got, "rank 4096")
    assert out["error"]["code"] == "insufficient_memory" and out["error"]["lora_bytes"] > out["error"]["budget"]


# ---------------------------------------------------------------------------------------------------------
# 7, 8. event ids and seeds in range


def test_event_ids_and_seeds_out_of_range_are_400(server):
    job = server.submit(**cat_job(epochs=1))
    try:
        for query in ("after=1000000000000000000000000000000", "after=-1", "after=9223372036854775808"):
            got, out = server.request("GET", f"/train/{job['id']}/events?{query}")
            refused(out, 400, got, "after")
        for header in ("1000000000000000000000000000000", "-5", "9223372036854775808"):
            got, out = server.request("GET", f"/train/{job['id']}/events", headers={"Last-Event-ID": header})
            refused(out, 400, got, "Last-Event-ID")
        assert server.ok("GET", f"/train/{job['id']}/events?stream=false&after=9223372036854775807")["data"] == []
    finally:
        server.cancel(job["id"])
    for seed in (2**64, 2**63, -1):
        got, out = server.request("POST", "/train", {**cat_job(), "seed": seed})
        refused(out, 400, got, "seed")
    got, out = server.request("POST", "/completion", {"prompt": "x", "seed": 2**64})
    refused(out, 400, got, "seed")


def test_unknown_job_ids_of_any_shape_are_404(server):
    for job_id in ("job-nope", "%ED%A0%80", "job-" + "f" * 16, "x" * 300):
        got, out = server.request("GET", f"/train/{job_id}")
        refused(out, 404, got)


# ---------------------------------------------------------------------------------------------------------
# 9, 11. a running job keeps its last checkpoint; published files are readable by everyone


def test_checkpoints_pruned_and_files_readable(server):
    job_id = server.submit(**cat_job(epochs=1))["id"]
    folder = server.state_dir / "jobs" / job_id
    most, seen = 0, set()
    while server.job(job_id)["status"] not in ("succeeded", "failed", "cancelled"):
        try:  # the job's folder goes when it ends
            found = {p.name for p in folder.glob("checkpoint-*")}
        except FileNotFoundError:
            found = set()
        most, seen = max(most, len(found)), seen | found
        time.sleep(0.005)
    done = server.job(job_id)
    assert done["status"] == "succeeded" and done["step"] > 5
    assert len(seen) >= 3 and most <= 2, (most, sorted(seen))  # one kept, the next being written
    adapter = Path(done["output"])
    assert stat.S_IMODE(adapter.stat().st_mode) == 0o755
    files = list(adapter.rglob("*"))
    assert {"adapter.gguf", "adapter_model.safetensors", "adapter_config.json"} <= {p.name for p in files}
    for p in files:
        assert stat.S_IMODE(p.stat().st_mode) == (0o755 if p.is_dir() else 0o644), p


# ---------------------------------------------------------------------------------------------------------
# 10. a body that stops arriving


def test_body_read_timeout():
    import uvicorn

    from remat.serve.middleware import BodyLimitMiddleware

    async def app(scope, receive, send):  # never reached: the middleware answers first
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(BodyLimitMiddleware(app, limit=1 << 20, timeout=0.5), host="127.0.0.1",
                                        port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        while not srv.started:
            time.sleep(0.01)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
            t = time.monotonic()
            received = b""
            while chunk := s.recv(65536):  # the answer closes the connection; its body may come in a packet of its own
                received += chunk
        reply = received.decode()
        assert reply.startswith("HTTP/1.1 408") and '"code":408' in reply.replace(" ", "")
        assert time.monotonic() - t < 3
    finally:
        srv.should_exit = True
        thread.join(10)
