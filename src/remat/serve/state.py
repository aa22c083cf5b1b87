"""The server's state (the engine, the job manager, the scheduler) on `app.state.server`, and the FastAPI
dependencies that hand the routes what they need once the model is loaded."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request

from remat.base.settings import one_line
from remat.serve.engine import Engine
from remat.serve.errors import ApiError
from remat.serve.jobs import JobManager
from remat.serve.scheduler import Scheduler

log = logging.getLogger("remat.serve")


class Server:
    def __init__(self, *, model: str | None, parallel: int, max_slowdown_ppm: int, memory_budget: int | None,
                 state_dir: Path, n_ctx: int | None, on_load_error=None, device: str = "cpu",
                 weights: str = "blocks", compile: bool = False, n_predict: int = -1,
                 max_queued_jobs: int | None = None):
        self.model_spec, self.parallel, self.max_slowdown_ppm = model, parallel, max_slowdown_ppm
        self.device = device  # where the model decodes, and jobs train unless they say
        self.weights, self.compile = weights, compile  # what the model decodes from, and how (`Engine`)
        self.n_predict = n_predict  # the most tokens a request generates (`Engine`)
        self.max_queued_jobs = max_queued_jobs  # training jobs that may wait (`JobManager`)
        self.memory_budget, self.state_dir, self.n_ctx = memory_budget, Path(state_dir), n_ctx
        self.on_load_error = on_load_error
        self.scheduler: Scheduler | None = None
        self.jobs: JobManager | None = None
        self.engine: Engine | None = None
        self.started = time.time()
        self.ready = threading.Event()  # the model is loaded and the job state is open
        self.load_error: str | None = None

    def start(self) -> None:
        self.scheduler = scheduler = Scheduler(max_slowdown_ppm=self.max_slowdown_ppm)
        self.engine = engine = Engine(self.model_spec, parallel=self.parallel, n_ctx=self.n_ctx,
                                      scheduler=scheduler, adapters=self.adapters, device=self.device,
                                      weights=self.weights, compile=self.compile, n_predict=self.n_predict)
        threading.Thread(target=self._load, args=(engine, scheduler), name="remat-load", daemon=True).start()

    def adapters(self) -> list[dict]:
        return self.jobs.adapters() if self.jobs is not None else []

    def _load(self, engine: Engine, scheduler: Scheduler) -> None:
        """Load the model, then open the job state (its checks use the served model's tokenizer)."""
        try:
            engine.load()
            self.state_dir.mkdir(parents=True, exist_ok=True)

            def reserve() -> int:  # what the decode slots' KV caches may still take
                return max(0, engine.kv_cache_reserve() - engine.kv_cache_bytes())

            self.jobs = JobManager(model=self.model_spec, state_dir=self.state_dir, scheduler=scheduler,
                                   decode_reserve=reserve, device=self.device, max_queued=self.max_queued_jobs,
                                   memory_budget=self.memory_budget, tokenizer=engine.tokenizer)
            self.ready.set()
            log.info("model %s loaded (n_ctx %d)", engine.name, engine.n_ctx)
        except Exception as e:  # noqa: BLE001 - reported by /health; the command line stops the server
            self.load_error = engine.load_error or f"{type(e).__name__}: {one_line(e)}"
            log.error("cannot start: %s", self.load_error)
            if self.on_load_error is not None:
                self.on_load_error(self.load_error)

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.close()
        if self.jobs is not None:
            self.jobs.close()

    def check_ready(self) -> None:
        if not self.ready.is_set():
            if self.load_error:
                raise ApiError(500, f"the server failed to start: {self.load_error}", type="server_error")
            raise ApiError(503, "Loading model", type="unavailable_error")

    def loaded(self) -> tuple[Engine, JobManager]:
        """The engine and the job manager once the model is loaded; 503 (500 if loading failed) before."""
        self.check_ready()
        if self.engine is None or self.jobs is None:  # ready is set only after both exist
            raise ApiError(503, "Loading model", type="unavailable_error")
        return self.engine, self.jobs


# ---------------------------------------------------------------------------------------------------------
# dependencies


def get_server(request: Request) -> Server:
    return request.app.state.server


def get_engine(request: Request) -> Engine:
    return get_server(request).loaded()[0]


def get_jobs(request: Request) -> JobManager:
    return get_server(request).loaded()[1]


ServerDep = Annotated[Server, Depends(get_server)]
EngineDep = Annotated[Engine, Depends(get_engine)]
JobsDep = Annotated[JobManager, Depends(get_jobs)]
