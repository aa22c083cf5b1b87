"""The training worker: one thread that runs the queued jobs in order through `train.finetune`.

Before each chunk the trainer's `before_chunk` hook hands control to the scheduler (it yields to decoding) and
stops a cancelled job. Planning (a `/train` submit traces on fake tensors) and training share the process's torch
state, so they take turns on one lock (`TorchLock`), planners first. The worker records each step in the store
while it holds the torch lock, so nothing waits for the torch lock while holding the store's.

Files, under the server's `state_dir`:
    jobs/<id>/          a job's checkpoints while it runs (resume continues from the latest)
    adapters/<id>/      a finished LoRA job's adapter (PEFT files + adapter.gguf), moved in whole
    models/<id>/        a finished full fine-tune's model folder
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from remat.base import collector
from remat.base.files import remove_stale, staged
from remat.base.settings import Cancelled, GateRefused, TrainSettings, one_line, percentile
from remat.serve import body
from remat.serve.scheduler import Scheduler, Totals
from remat.serve.store import FINISHED, INTERRUPTED, JobStore
from remat.training import checkpoints, train

log = logging.getLogger("remat.serve")

KEEP_CHECKPOINTS = 1  # a running job keeps its latest checkpoint (plus the one being written)


class TorchLock:
    """Planning and training never trace or touch the RNG at once. The lock is not fair: without a turn for
    waiting planners, a submit could wait behind every chunk of a long job; so the trainer lets them go first."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = threading.Lock()
        self.waiting = 0  # planners waiting for the lock

    @contextlib.contextmanager
    def planning(self) -> Iterator[None]:
        """Hold the lock for a plan. The collector stays paused until the plan's graphs are dropped
        (`Planner.forget_graphs`), so its next collection frees them among the youngest objects."""
        with self._count:
            self.waiting += 1
        try:
            self._lock.acquire()
        finally:
            with self._count:
                self.waiting -= 1
        try:
            with collector.paused:
                yield
        finally:
            self._lock.release()

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """`planning`, for one of many plans in a row (a `--ctx max` search: a probe each): after any planner
        waiting (the lock is not fair: one that releases and takes it again would mostly win it back). The
        trainer's chunk may come in between."""
        while self.waiting:
            time.sleep(0.005)
        with self.planning():
            yield

    def train(self, stop: Callable[[], bool]) -> None:
        """Take the lock for the trainer, after any waiting planner (or until `stop()`)."""
        while self.waiting and not stop():
            time.sleep(0.005)
        self._lock.acquire()

    def release(self) -> None:
        self._lock.release()


@dataclass
class _Run:
    """The running job's live state, shared by the worker's hooks and `cancel`."""

    job_id: str
    mark: Totals
    losses: list[float]
    windows: list[float] = field(default_factory=list)
    cancel: threading.Event = field(default_factory=threading.Event)
    yielding: bool = False  # waiting in the scheduler for decoding to allow the next chunk


class _Chunks:
    """The running job's hold on the torch lock and its chunk timings. A chunk lasts from one `before_chunk` to
    the next: all the trainer does in between holds the lock."""

    def __init__(self, worker: Worker, run: _Run):
        self.w, self.run = worker, run
        self.held = False
        self.opened: float | None = None

    def cancelled(self) -> bool:
        return self.run.cancel.is_set() or self.w.closing

    def acquire(self) -> None:
        self.w.torch.train(self.cancelled)
        self.held = True

    def release(self) -> None:
        if self.held:
            self.w.torch.release()
            self.held = False

    def close(self) -> None:
        if self.opened is not None:
            seconds = time.monotonic() - self.opened
            self.w.scheduler.chunk_done(seconds)
            self.run.windows.append(seconds)
            self.opened = None

    def before_chunk(self) -> None:
        self.close()
        self.release()
        self.run.yielding = True
        try:
            self.w.scheduler.before_chunk(self.cancelled)
        finally:
            self.run.yielding = False
        self.acquire()
        self.opened = time.monotonic()


class Worker:
    """The thread that trains queued jobs one at a time; `warm` runs first, before it waits for jobs."""

    def __init__(self, store: JobStore, scheduler: Scheduler, state_dir: Path, torch: TorchLock,
                 warm: Callable[[], None] = lambda: None):
        self.store, self.scheduler, self.state_dir, self.torch = store, scheduler, state_dir, torch
        self.queue: collections.deque[str] = collections.deque()
        self.run: _Run | None = None
        self.closing = False
        for folder in (state_dir, state_dir / "adapters", state_dir / "models", *state_dir.glob("jobs/*")):
            remove_stale(folder)  # what a server killed mid-write left: nothing writes there yet
        self._warm = warm
        self._thread = threading.Thread(target=self._work, name="remat-train", daemon=True)
        self._thread.start()

    def enqueue(self, job_id: str) -> int:
        """Queue the job (caller holds the store's lock); its place in line (0: it runs next)."""
        place = len(self.queue) + (self.run is not None)
        self.queue.append(job_id)
        self.store.changed.notify_all()
        return place

    def running(self, job_id: str) -> _Run | None:
        return self.run if self.run is not None and self.run.job_id == job_id else None

    def checkpoint(self, job_id: str) -> checkpoints.Checkpoint | None:
        try:
            return checkpoints.latest(self.state_dir / "jobs" / job_id)
        except checkpoints.CheckpointError:
            return None

    def forget(self, job_id: str) -> None:
        """A deleted job's checkpoints go with it."""
        shutil.rmtree(self.state_dir / "jobs" / job_id, ignore_errors=True)

    def close(self, timeout: float) -> bool:
        """Stop: a running job stops at its next chunk boundary (interrupted, resumable); True once stopped."""
        with self.store.lock:
            self.closing = True
            self.store.changed.notify_all()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _work(self) -> None:
        self._warm()
        while True:
            with self.store.lock:
                while not self.queue and not self.closing:
                    self.store.changed.wait()
                if self.closing:
                    return
                job_id = self.queue.popleft()
                progress = json.loads(self.store.row(job_id)["progress"])
                run = self.run = _Run(job_id, self.scheduler.mark(), progress.get("losses", []))
            try:
                self._train(run)
            except Exception as e:  # bookkeeping broke, not training: record it and keep serving
                log.exception("training job %s", job_id)
                with self.store.lock:
                    if self.store.row(job_id)["status"] not in FINISHED:
                        self.store.finish(job_id, "failed", f"{type(e).__name__}: {one_line(e)}")
            finally:
                with self.store.lock:
                    self.run = None
                    self.store.changed.notify_all()

    def _train(self, run: _Run) -> None:
        s, out = self._start(run)
        chunks = _Chunks(self, run)
        chunks.acquire()
        try:
            hooks = train.Hooks(before_chunk=chunks.before_chunk, on_step=lambda event: self._on_step(run, out, event))
            receipt = train.finetune(s, progress=False, hooks=hooks).as_dict()
            chunks.close()
            output = self._publish(run.job_id, s, receipt["outputs"])
        except Cancelled:
            chunks.close()
            self._end(run, *(("cancelled", "cancelled by request") if run.cancel.is_set() else ("failed", INTERRUPTED)))
            return
        except Exception as e:
            chunks.close()
            known = (ValueError, GateRefused, MemoryError)  # the project's errors are ValueErrors with one line
            if not isinstance(e, known):
                log.exception("training job %s failed", run.job_id)
            self._end(run, "failed", one_line(e) if isinstance(e, known) else f"{type(e).__name__}: {one_line(e)}")
            return
        finally:
            chunks.release()
        self._succeed(run, s, out, receipt, output)

    def _start(self, run: _Run) -> tuple[TrainSettings, Path]:
        """Mark the job running; its settings, resuming from its latest checkpoint if it has one."""
        job_id = run.job_id
        with self.store.lock:
            row = self.store.row(job_id)
            stored = json.loads(row["settings"])
            records = body.loads(row["data"])  # in pieces: tens of MiB in one json.loads call stall the server
            budget = json.loads(row["plan"])["budget"]
            self.store.update(job_id, status="running")
        out = self.state_dir / "jobs" / job_id
        remove_stale(out)  # a checkpoint half written when the last run was killed
        resume = self.checkpoint(job_id)
        if resume is None and out.exists():
            shutil.rmtree(out)  # leftovers of a run that saved no checkpoint: start over
        s = TrainSettings(**{**stored, "data": records, "out": str(out), "memory_budget": budget,
                             "resume": str(resume.path) if resume else None})
        self.store.event(job_id, "started", {"resumed_from_step": resume.step if resume else None})
        self.scheduler.new_job()
        return s, out

    def _on_step(self, run: _Run, out: Path, event: dict) -> None:
        _prune_checkpoints(out)  # the trainer saves this step's checkpoint next
        run.losses = run.losses[:event["step"] - 1] + [event["loss"]]
        progress = {"epoch": event["epoch"], "step": event["step"], "steps": event["steps"],
                    "losses": run.losses, **self._timings(run)}
        with self.store.lock:
            self.store.update(run.job_id, progress=progress)
            self.store.event(run.job_id, "step", {k: event[k] for k in ("epoch", "step", "steps", "loss")})

    def _succeed(self, run: _Run, s: TrainSettings, out: Path, receipt: dict, output: Path) -> None:
        result = {k: v for k, v in receipt.items() if k not in ("chunk_seconds", "checkpoints", "outputs")}
        result["output"] = str(output)
        shutil.rmtree(out, ignore_errors=True)  # its checkpoints are not needed any more
        with self.store.transaction():  # the adapter and the job's success are recorded together
            if s.lora:
                self.store.add_adapter(run.job_id, self.store.row(run.job_id)["name"] or run.job_id, str(output))
            self._end(run, "succeeded", None, result)

    def _publish(self, job_id: str, s: TrainSettings, files: list[str]) -> Path:
        """Move the trained files into adapters/<id> (or models/<id>) in one rename: whole or absent."""
        final = self.state_dir / ("adapters" if s.lora else "models") / job_id
        # "replace": a folder left by a crash after the rename, before it was recorded, gives way
        with staged(final, mode="replace") as tmp:
            for f in files:
                os.replace(f, tmp / Path(f).name)
        return final

    def _timings(self, run: _Run) -> dict:
        stats = self.scheduler.stats(since=run.mark)
        windows = run.windows
        return {"chunks": len(windows),
                "window_p50": percentile(windows, 0.5) if windows else None,
                "window_p95": percentile(windows, 0.95) if windows else None,
                "waited_seconds": stats["waited_seconds"], "slowdown_ppm": stats["slowdown_ppm"],
                "slowdown_source": stats["slowdown_source"]}

    def _end(self, run: _Run, status: str, reason: str | None, result: dict | None = None) -> None:
        with self.store.lock:
            progress = {**json.loads(self.store.row(run.job_id)["progress"]), "losses": run.losses,
                        **self._timings(run)}
            self.store.update(run.job_id, progress=progress)
            self.store.finish(run.job_id, status, reason, result)


def _prune_checkpoints(out: Path, keep: int = KEEP_CHECKPOINTS) -> None:
    """Delete all but the newest `keep` complete checkpoints of a running job."""
    found = sorted((int(m[1]), p) for p in out.glob("checkpoint-*") if (m := re.fullmatch(r"checkpoint-(\d+)", p.name)))
    for _, p in found[:-keep] if keep else found:
        shutil.rmtree(p, ignore_errors=True)
