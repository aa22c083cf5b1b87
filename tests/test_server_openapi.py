"""The OpenAPI document describes the server: every route's request, answers and errors; schemathesis
(`--checks all`, every phase: examples, coverage, fuzzing and stateful) against a real server finds no failure
of any kind."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from remat.serve.app import create_app
from serve_process import Server

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

# A request the schema allows gets 2xx, except where the refusal is about what the server holds or what the
# request's text turns into, which no schema can say; each operation lists only its own:
# - 404: a job id no job has (schemathesis makes them up);
# - 409: a job's state: cancelling a finished job, deleting one that has not finished, resuming one that did
#   not fail or was not cancelled;
# - 422: a job (or a resumed one) over the memory budget;
# - 429: a job (or a resumed one) while the queue is full: this server queues one (`--max-queued-jobs 1`), so
#   that the ~400 jobs the fuzzer submits do not train one after another beside it (POST /train and /train/plan
#   took 173 s of its 195 while they did; /train/plan's requests 15 s with no job training);
# - 400 on generation and /lora-adapters: an adapter id no adapter has (the server holds none here); on
#   generation also a text prompt that tokenizes to the whole context or more (the schema bounds its
#   characters, 32 per token of context, and prompts of token ids by the context), and for chat a template
#   that refuses the messages (their roles and order) or renders nothing;
# - 400 on training: what the data tokenizes to (too short for one window; fewer windows than one optimizer
#   step takes) and LoRA targets that name no layer of the model.
# Token ids are bounded by the vocabulary and texts by the context in the schema itself (`schemas.bounded`),
# so /tokenize and /detokenize take every request the schema allows.
# Planning traces the step on fake tensors: a job with `loss_chunk: 1` (a loss head in 256 pieces) takes ~15 s
# on a shared 2-core machine, over the response time check's default of 10 s.
CONFIG = """
[checks]
max_response_time = 60

[checks.positive_data_acceptance]
expected-statuses = ["2xx"]

[[operations]]
include-name = ["GET /train/{job_id}", "GET /train/{job_id}/events"]
checks.positive_data_acceptance.expected-statuses = ["2xx", "404"]

[[operations]]
include-name = ["DELETE /train/{job_id}", "POST /train/{job_id}/cancel"]
checks.positive_data_acceptance.expected-statuses = ["2xx", "404", "409"]

[[operations]]
include-name = "POST /train/{job_id}/resume"
checks.positive_data_acceptance.expected-statuses = ["2xx", "404", "409", "422", "429"]

[[operations]]
include-name = ["POST /completion", "POST /v1/completions", "POST /v1/chat/completions", "POST /lora-adapters"]
checks.positive_data_acceptance.expected-statuses = ["2xx", "400"]

[[operations]]
include-name = "POST /train/plan"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "422"]

[[operations]]
include-name = "POST /train"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "422", "429"]
"""


def test_every_route_documents_its_answers_and_errors():
    doc = create_app(model="tiny-llama", api_keys=["k"]).openapi()
    assert "HTTPValidationError" not in str(doc) and "ErrorResponse" in doc["components"]["schemas"]
    error = doc["components"]["schemas"]["ErrorDetail"]
    assert set(error["required"]) == {"code", "message", "type"}
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            answers = op["responses"]
            ok = [s for s in answers if s.startswith("2")]
            assert len(ok) == 1 and answers[ok[0]]["content"], (method, path)
            for status, answer in answers.items():
                if status[0] in "45":
                    ref = answer["content"]["application/json"]["schema"]["$ref"]
                    assert ref.endswith("/ErrorResponse"), (method, path, status)
            if "requestBody" in op:
                assert {"400", "408", "413"} <= set(answers), (method, path)
                assert op["requestBody"]["content"]["application/json"]["schema"], (method, path)
            if path not in ("/health", "/v1/models"):
                assert "401" in answers, (method, path)
    streams = ["/completion", "/v1/completions", "/v1/chat/completions", "/train/{job_id}/events"]
    for path in streams:
        op = next(iter(doc["paths"][path].values()))
        assert "text/event-stream" in op["responses"]["200"]["content"], path
    train = doc["components"]["schemas"]["TrainRequest"]["properties"]
    assert train["data"]["type"] == "array" and "anyOf" in train["data"]["items"]  # typed records
    assert train["seed"]["anyOf"][0]["maximum"] == 2**63 - 1
    # the served model's bounds (tiny-llama: a context of 2048 tokens, 259 token ids), as the server checks them
    schemas = doc["components"]["schemas"]
    text, ids = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    token, item_text, mixed, _ = ids["items"]["anyOf"]  # a token id, a text, a prompt of both, llama.cpp's object
    assert text["maxLength"] == item_text["maxLength"] == 32 * 2048 and ids["maxItems"] == 2047
    assert token["maximum"] == mixed["items"]["anyOf"][0]["maximum"] == 258
    # a field remat does not implement is documented with the only values it takes; n with --parallel (1 here)
    chat = schemas["ChatRequest"]["properties"]
    assert chat["mirostat"]["enum"] == [0, None] and "not supported" in chat["mirostat"]["description"]
    assert chat["n"]["anyOf"][0]["maximum"] == 1 and chat["tools"]["enum"] == [[], None]
    assert schemas["TokenizeRequest"]["properties"]["content"]["maxLength"] == 32 * 2048
    assert schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] == 258
    events = {p["name"]: p for p in doc["paths"]["/train/{job_id}/events"]["get"]["parameters"]}
    assert events["last-event-id"]["schema"] == {"type": "string", "pattern": "^[0-9]{1,18}$",
                                                 "description": "resume after this event id", "title": "Last-Event-Id"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # a valid completion decodes at most 4 tokens (--n-predict), in a context of 64, and one job waits at most
    # (--max-queued-jobs), so the run stays short
    s = Server(tmp_path_factory.mktemp("openapi") / "state", "--ctx", "64", "--n-predict", "4",
               "--max-queued-jobs", "1").start()
    yield s
    s.stop()


def test_n_predict_is_the_default_and_the_most_a_request_gets(server):
    """`--n-predict 4`, as llama.cpp's server: a request naming no count gets 4 tokens, one asking more gets 4,
    one asking fewer gets what it asks, under each of the three names."""
    def generated(**count) -> int:
        status, body = server.request("POST", "/completion", {"prompt": "hi", "ignore_eos": True, **count})
        assert status == 200, body
        return body["tokens_predicted"]

    assert [generated(), generated(n_predict=-1), generated(n_predict=9), generated(n_predict=2)] == [4, 4, 4, 2]
    status, body = server.request("POST", "/v1/completions", {"prompt": "hi", "ignore_eos": True, "max_tokens": 50})
    assert status == 200 and body["usage"]["completion_tokens"] == 4, body
    status, body = server.request("GET", "/props")
    assert status == 200 and body["default_generation_settings"]["params"]["n_predict"] == 4, body


def schemathesis_cli() -> str:
    pytest.importorskip("schemathesis")
    found = shutil.which("schemathesis", path=str(Path(sys.executable).parent)) or shutil.which("schemathesis")
    if found is None:
        pytest.skip("no schemathesis command")
    return found


def test_schemathesis_finds_no_failure(server, tmp_path):
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG)
    cmd = [schemathesis_cli(), "--config-file", str(config), "run", f"http://127.0.0.1:{server.port}/openapi.json",
           "--checks", "all", "--phases", "examples,coverage,fuzzing,stateful", "--max-examples", "2", "--seed", "19",
           "--no-shrink", "--workers", "1", "--request-timeout", "30"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False, cwd=tmp_path)
    finally:
        for job in server.ok("GET", "/train")["data"]:  # the jobs it submitted: stop them
            if job["status"] in ("queued", "running"):
                server.request("POST", f"/train/{job['id']}/cancel")
    summary = out.stdout[-6000:]
    assert out.returncode == 0, summary + out.stderr[-2000:]
    assert "passed" in summary and "failure" not in summary.split("SUMMARY")[-1].lower(), summary
    assert server.ok("GET", "/health") == {"status": "ok"}
