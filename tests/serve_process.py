"""`python -m remat serve --model tiny-llama` in a subprocess, and a small HTTP client for it: the one
harness the server's tests (`test_serve`, `test_server_*`, `test_page`) share."""

from __future__ import annotations

import contextlib
import http.client
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

MODEL = "tiny-llama"
TERMINAL = ("succeeded", "failed", "cancelled")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m remat serve` in a subprocess, and a small HTTP client for it."""

    def __init__(self, state_dir: Path, *args: str, key: str | None = None):
        self.state_dir, self.args, self.key = Path(state_dir), args, key
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.proc: subprocess.Popen | None = None
        self.log = self.state_dir.parent / f"{self.state_dir.name}-server.log"
        self.loading: list = []  # what /health said before it was ready

    def spawn(self) -> Server:
        cmd = [sys.executable, "-m", "remat", "serve", "--model", MODEL, "--port", str(self.port),
               "--state-dir", str(self.state_dir), "--threads", "1", *self.args]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        return self

    def wait_ready(self, timeout: float = 120) -> Server:
        assert self.proc is not None, "spawn() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log.read_text()}")
            with contextlib.suppress(OSError):
                status, body = self.request("GET", "/health", timeout=2)
                if status == 200:
                    return self
                self.loading.append((status, body))
            time.sleep(0.2)
        raise AssertionError(f"server not ready after {timeout} s:\n{self.log.read_text()}")

    def start(self, timeout: float = 120) -> Server:
        return self.spawn().wait_ready(timeout)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def headers(self, extra: dict | None = None) -> dict:
        h = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        return {**h, **(extra or {})}

    def request(self, method: str, path: str, body=None, *, raw: bytes | None = None, headers: dict | None = None,
                auth: bool = True, timeout: float = 120) -> tuple[int, object]:
        """(status, parsed JSON or text). `raw` sends bytes as they are."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
            h = {"Content-Type": "application/json"} if data is not None else {}
            h.update(self.headers() if auth else {})
            h.update(headers or {})
            conn.request(method, path, body=data, headers=h)
            resp = conn.getresponse()
            text = resp.read().decode()
            try:
                return resp.status, json.loads(text)
            except json.JSONDecodeError:
                return resp.status, text
        finally:
            conn.close()

    def ok(self, method: str, path: str, body=None, status: int = 200, **kw):
        got, out = self.request(method, path, body, **kw)
        assert got == status, (method, path, got, out)
        return out

    def sse(self, method: str, path: str, body=None, headers: dict | None = None, timeout: float = 120):
        """Yield server-sent events as dicts {"id", "event", "data"}; closing the generator hangs up."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = json.dumps(body).encode() if body is not None else None
            h = self.headers({"Content-Type": "application/json"} if data else {})
            conn.request(method, path, body=data, headers={**h, **(headers or {})})
            resp = conn.getresponse()
            assert resp.status == 200, (resp.status, resp.read())
            assert resp.getheader("Content-Type", "").startswith("text/event-stream")
            event: dict = {}
            while True:
                line = resp.readline()
                if not line:
                    return
                line = line.decode().rstrip("\r\n")
                if not line:
                    if "data" in event:
                        yield event
                    event = {}
                    continue
                if line.startswith(":"):
                    continue
                name, _, value = line.partition(":")
                event[name] = value.removeprefix(" ")
        finally:
            conn.close()

    # -- training helpers -------------------------------------------------------------------------------

    def submit(self, **job) -> dict:
        return self.ok("POST", "/train", job, status=202)

    def job(self, job_id: str) -> dict:
        return self.ok("GET", f"/train/{job_id}")

    def wait_job(self, job_id: str, until=lambda j: j["status"] in TERMINAL, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            j = self.job(job_id)
            if until(j):
                return j
            time.sleep(0.1)
        raise AssertionError(f"job {job_id} not there after {timeout} s: {self.job(job_id)}")

    def cancel(self, job_id: str) -> None:
        status, body = self.request("POST", f"/train/{job_id}/cancel")
        assert status in (200, 404, 409), body  # 404: deleted already
        if status != 404:
            self.wait_job(job_id)
