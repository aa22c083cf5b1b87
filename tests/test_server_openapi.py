"""The OpenAPI document describes the server: every route's request, answers and errors; schemathesis
(`--checks all`) against a real server finds no failure of any kind."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from remat.serve.app import create_app
from serve_process import Server

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

# A request the schema allows may still be refused for what it asks of the model, not for its shape:
# a prompt longer than the context (400), an unknown adapter id (400), training data too short for one
# window (400) or a job over the memory budget (422). Everything else a valid request gets is 2xx.
# Planning traces the step on fake tensors: a job with `loss_chunk: 1` (a loss head in 256 pieces) takes ~15 s
# on a shared 2-core machine, over the response time check's default of 10 s.
CONFIG = """
[checks]
max_response_time = 60

[checks.positive_data_acceptance]
expected-statuses = ["2xx", "400", "404", "409", "422"]
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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # --ctx 64: a valid completion decodes at most 64 tokens, so the run stays short
    s = Server(tmp_path_factory.mktemp("openapi") / "state", "--ctx", "64").start()
    yield s
    s.stop()


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
           "--checks", "all", "--phases", "coverage,fuzzing", "--max-examples", "2", "--seed", "19",
           "--no-shrink", "--workers", "1", "--request-timeout", "30"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False, cwd=tmp_path)
    finally:
        for job in server.ok("GET", "/train")["data"]:  # the jobs it submitted: stop them
            if job["status"] in ("queued", "running"):
                server.request("DELETE", f"/train/{job['id']}")
    summary = out.stdout[-6000:]
    assert out.returncode == 0, summary + out.stderr[-2000:]
    assert "passed" in summary and "failure" not in summary.split("SUMMARY")[-1].lower(), summary
    assert server.ok("GET", "/health") == {"status": "ok"}
