"""Training jobs for `remat serve`: validate, plan and gate, queue, train one at a time, keep state in SQLite.

`submit` does everything that can refuse a job before it is queued: it checks each field, tokenizes the
data (when a tokenizer is at hand), and plans the graph that will run on fake tensors (the model built
from its config, LoRA attached), so a job that cannot fit is refused with both plans before anything is
allocated. One worker thread then runs the queued jobs in order through `train.finetune`, whose
`before_chunk` hook hands control to the scheduler (it yields to decoding) and stops a cancelled job.

State lives in `state_dir`:
    state.db            jobs, their events (the SSE stream, replayable by id) and the adapters
    jobs/<id>/          a job's checkpoints while it runs (resume continues from the latest)
    adapters/<id>/      a finished LoRA job's adapter (PEFT files + adapter.gguf), moved in whole
    models/<id>/        a finished full fine-tune's model folder
A server killed mid-job finds the job "running" at the next start and marks it failed ("interrupted");
`resume` requeues it from its last checkpoint. Finished adapters are files plus rows: they survive.
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import json
import logging
import math
import os
import re
import secrets
import shutil
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError
from torch import nn

from remat.base import collector
from remat.base.files import staged
from remat.base.settings import Cancelled, GateRefused, TrainSettings, UsageError, describe, one_line, percentile
from remat.core.plan import available_memory
from remat.models import adapters
from remat.models import load as models
from remat.serve import body
from remat.serve.errors import ApiError, invalid, parse
from remat.serve.scheduler import Scheduler, Totals
from remat.serve.schemas import MAX_SCALE, LoraScale, TrainRequest
from remat.training import checkpoints, data, step, train

log = logging.getLogger("remat.serve")

ACTIVE = ("queued", "running")
FINISHED = ("succeeded", "failed", "cancelled")
INTERRUPTED = "interrupted"
JOB_ID = re.compile(r"job-[0-9a-f]{16}")
MAX_EVENT_ID = 2**63 - 1  # SQLite's largest integer
KEEP_CHECKPOINTS = 1  # a running job keeps its latest checkpoint (plus the one being written)

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    name TEXT,
    status TEXT NOT NULL,
    reason TEXT,
    settings TEXT NOT NULL,
    data TEXT NOT NULL,
    plan TEXT NOT NULL,
    progress TEXT NOT NULL DEFAULT '{}',
    result TEXT,
    created REAL NOT NULL,
    finished REAL
);
CREATE TABLE IF NOT EXISTS adapters (
    id INTEGER PRIMARY KEY,
    job_id TEXT NOT NULL,
    name TEXT NOT NULL,
    path TEXT NOT NULL,
    scale REAL NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS events (
    job_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    event TEXT NOT NULL,
    data TEXT NOT NULL,
    created REAL NOT NULL,
    PRIMARY KEY (job_id, seq)
);
"""


def _invalid(name: str, message: str) -> ApiError:
    return invalid(name, message)


def _refused(message: str, extra: dict) -> ApiError:
    return ApiError(422, message, code="insufficient_memory", type="insufficient_memory", extra=extra)


def _dumps(value: object) -> str:
    """JSON with NaN and infinities (a diverging loss) as null, so every client can parse it."""
    def safe(x: object) -> object:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: safe(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [safe(v) for v in x]
        return x
    return json.dumps(safe(value))


def _dumps_list(values: list) -> str:
    """`_dumps` of a list, one item at a time: the training data can be tens of MiB, and one `json.dumps`
    call over all of it would hold the GIL (and stall the server's event loop) until it is done."""
    return "[" + ",".join(_dumps(v) for v in values) + "]"


def _prune_checkpoints(out: Path, keep: int = KEEP_CHECKPOINTS) -> None:
    """Delete all but the newest `keep` complete checkpoints of a running job."""
    found = sorted((int(m[1]), p) for p in out.glob("checkpoint-*") if (m := re.fullmatch(r"checkpoint-(\d+)", p.name)))
    for _, p in found[:-keep] if keep else found:
        shutil.rmtree(p, ignore_errors=True)


@dataclass
class _Run:
    """The running job's live state, shared by the worker's hooks and `cancel`."""

    job_id: str
    mark: Totals
    losses: list[float]
    windows: list[float] = field(default_factory=list)
    cancel: threading.Event = field(default_factory=threading.Event)
    yielding: bool = False  # waiting in the scheduler for decoding to allow the next chunk


@dataclass
class _Planned:
    """A job that passed every check: its settings, records, name, optimizer steps and the gate's answer."""

    settings: TrainSettings
    records: list[dict]
    name: str | None
    steps: int | None
    gate: dict  # plans, policy, recompute, recompute_reason, budget (stored with the job)

    def answer(self) -> dict:
        g = self.gate
        return {"plan": g["plans"][g["policy"]], "plans": g["plans"], "policy": g["policy"],
                "recompute": g["recompute"], "recompute_reason": g["recompute_reason"], "budget": g["budget"],
                "steps": self.steps}


class _Chunks:
    """The running job's hold on the device (the torch lock) and its chunk timings. A chunk lasts from one
    `before_chunk` to the next: all the trainer does in between holds the device."""

    def __init__(self, manager: JobManager, run: _Run):
        self.m, self.run = manager, run
        self.held = False
        self.opened: float | None = None

    def cancelled(self) -> bool:
        return self.run.cancel.is_set() or self.m._closing

    def acquire(self) -> None:
        # the lock is not fair: without this wait a submit could wait behind every chunk of a long job
        while self.m._planners and not self.cancelled():
            time.sleep(0.005)
        self.m._torch.acquire()
        self.held = True

    def release(self) -> None:
        if self.held:
            self.m._torch.release()
            self.held = False

    def close(self) -> None:
        if self.opened is not None:
            seconds = time.monotonic() - self.opened
            self.m.scheduler.chunk_done(seconds)
            self.run.windows.append(seconds)
            self.opened = None

    def before_chunk(self) -> None:
        self.close()
        self.release()
        while self.m._planners and not self.cancelled():  # planners first (see acquire)
            time.sleep(0.005)
        self.run.yielding = True
        try:
            self.m.scheduler.before_chunk(self.cancelled)
        finally:
            self.run.yielding = False
        self.m._torch.acquire()
        self.held = True
        self.opened = time.monotonic()


class JobManager:
    def __init__(self, *, model: str | None, state_dir: Path, scheduler: Scheduler,
                 memory_budget: int | None = None, save_every: int = 1, tokenizer=None):
        """`model`: the spec the server trains (None: the embedded default). `save_every`: steps between
        checkpoints of a job that does not say (they make a crashed job resumable). `tokenizer`: the served
        model's, to check at submit that the data gives windows (presets bring their own)."""
        self.model, self.scheduler, self.memory_budget = model, scheduler, memory_budget
        self.save_every = save_every
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._tokenizer = tokenizer
        self._config = None
        self._linears: builtins.list[tuple[str, int, int]] | None = None
        self._models: dict[tuple | None, nn.Module] = {}  # planning models (fake tensors) by LoRA; graphs cache on them
        self._lock = threading.RLock()  # the database and the fields below
        self._changed = threading.Condition(self._lock)  # a new event, a queued job, closing
        self._torch = threading.Lock()  # planning and training never trace or touch the RNG at once
        self._planners = 0  # submits waiting for self._torch: the trainer lets them go first
        self._queue: collections.deque[str] = collections.deque()
        self._run: _Run | None = None
        self._closing = False
        self._db = sqlite3.connect(self.state_dir / "state.db", check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")  # a step event per step: no fsync per commit
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        # scales outside the bounds (stored by an older server) overflow every sampled completion
        self._db.execute("UPDATE adapters SET scale = 0 WHERE NOT (abs(scale) <= ?)", (MAX_SCALE,))
        self._recover()
        self._worker = threading.Thread(target=self._work, name="remat-train", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------------------------------ API

    def plan(self, req: TrainRequest | dict) -> dict:
        """Validate, plan and gate a job without queueing it: the answer `submit` would give, less the id;
        raises ApiError (400, 422) when it cannot run."""
        p = self._planned(req)
        body.release(p.records)
        return p.answer()

    def submit(self, req: TrainRequest | dict) -> dict:
        """`plan`, then queue the job; raises ApiError (400, 422) when it cannot run."""
        p = self._planned(req)
        settings = p.settings.model_dump(exclude={"data", "out", "resume"})
        job_id = f"job-{secrets.token_hex(8)}"
        with self._lock:
            self._db.execute(
                "INSERT INTO jobs (id, name, status, settings, data, plan, progress, created) "
                "VALUES (?, ?, 'queued', ?, ?, ?, ?, ?)",
                (job_id, p.name, _dumps(settings), _dumps_list(p.records), _dumps(p.gate),
                 _dumps({"steps": p.steps} if p.steps else {}), time.time()))
            self._event(job_id, "queued", {"position": len(self._queue) + (self._run is not None)})
            self._queue.append(job_id)
            self._changed.notify_all()
        body.release(p.records)
        return {"id": job_id, "status": "queued", **p.answer()}

    def list(self) -> builtins.list[dict]:
        with self._lock:
            ids = [r["id"] for r in self._db.execute("SELECT id FROM jobs ORDER BY seq")]
            return [self.get(i) for i in ids]

    def get(self, job_id: str) -> dict:
        with self._lock:
            row = self._row(job_id)
            progress = json.loads(row["progress"])
            result = json.loads(row["result"]) if row["result"] else {}
            plan = json.loads(row["plan"])
            adapter = self._db.execute("SELECT id, name, path, scale FROM adapters WHERE job_id = ?",
                                       (job_id,)).fetchone()
            run = self._run if self._run and self._run.job_id == job_id else None
        return {
            "id": job_id,
            "object": "train.job",
            "name": row["name"],
            "status": row["status"],
            "reason": row["reason"],
            "epoch": progress.get("epoch"),
            "step": progress.get("step", 0),
            "steps": progress.get("steps"),
            "losses": progress.get("losses", []),
            "plan": plan["plans"][plan.get("policy", "on" if plan["recompute"] else "off")],
            "policy": plan.get("policy", "on" if plan["recompute"] else "off"),
            "plans": plan["plans"],
            "recompute": plan["recompute"],
            "recompute_reason": plan["recompute_reason"],
            "budget": plan["budget"],
            "measured": result.get("measured"),
            "chunks": progress.get("chunks", 0),
            "window_p50": progress.get("window_p50"),
            "window_p95": progress.get("window_p95"),
            "waited_seconds": progress.get("waited_seconds"),
            "slowdown_ppm": progress.get("slowdown_ppm"),
            "slowdown_source": progress.get("slowdown_source"),
            "adapter": dict(adapter) if adapter else None,
            "output": result.get("output"),
            "result": result or None,
            "cancel_requested": bool(run and run.cancel.is_set()),
            "yielding": bool(run and run.yielding),
            "resumable": row["status"] in ("failed", "cancelled"),
            "checkpoint_step": self._checkpoint_step(job_id),
            "created": row["created"],
            "finished": row["finished"],
            "settings": json.loads(row["settings"]),
        }

    def cancel(self, job_id: str, wait: float = 2.0) -> dict:
        """Cancel a queued job at once, a running one at its next chunk boundary (waiting up to `wait`
        seconds for it to stop); 409 when the job already finished."""
        with self._lock:
            status = self._row(job_id)["status"]
            if status in FINISHED:
                raise ApiError(409, code="job_finished", message=f"training job {job_id} already {status}")
            if job_id in self._queue:
                self._queue.remove(job_id)
                self._finish(job_id, "cancelled", "cancelled by request")
                return self.get(job_id)
            if self._run and self._run.job_id == job_id:
                self._run.cancel.set()
            deadline = time.monotonic() + wait
            while self._row(job_id)["status"] not in FINISHED and (left := deadline - time.monotonic()) > 0:
                self._changed.wait(left)
        return self.get(job_id)

    def events_since(self, job_id: str, after: int = 0) -> builtins.list[dict]:
        """The job's events with id > `after`, oldest first: {"id", "event", "data", "created"}."""
        after = max(-1, min(int(after), MAX_EVENT_ID))
        with self._lock:
            self._row(job_id)
            rows = self._db.execute("SELECT seq, event, data, created FROM events WHERE job_id = ? AND seq > ? "
                                    "ORDER BY seq", (job_id, after)).fetchall()
        return [{"id": r["seq"], "event": r["event"], "data": json.loads(r["data"]), "created": r["created"]}
                for r in rows]

    def wait_events(self, job_id: str, after: int = 0, timeout: float = 15.0) -> builtins.list[dict]:
        """Like events_since, but waits up to `timeout` seconds for one; returns [] at once when the job
        has finished and nothing newer is left (the stream can end)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                events = self.events_since(job_id, after)
                if events or self._row(job_id)["status"] in FINISHED:
                    return events
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self._changed.wait(left)

    def resume(self, job_id: str) -> dict:
        """Requeue a failed or cancelled job; it continues from its last checkpoint (or starts over)."""
        self._check_open()
        with self._lock:
            s = self._resumable(job_id)
        # memory may have changed since the job was submitted: the gate answers again. Not under self._lock:
        # planning waits for the trainer's chunk, and the trainer records its step under that lock first.
        plan = self._choose(s, self._budget(s))
        with self._lock:
            self._resumable(job_id)  # another resume may have queued it meanwhile
            self._db.execute("UPDATE jobs SET status = 'queued', reason = NULL, finished = NULL, plan = ? "
                             "WHERE id = ?", (_dumps(plan), job_id))
            self._event(job_id, "queued", {"resumed_from_step": self._checkpoint_step(job_id)})
            self._queue.append(job_id)
            self._changed.notify_all()
            return self.get(job_id)

    def _resumable(self, job_id: str) -> TrainSettings:
        """The settings a failed or cancelled job resumes with; 409 for any other (caller holds self._lock)."""
        row = self._row(job_id)
        if row["status"] not in ("failed", "cancelled"):
            raise ApiError(409, f"training job {job_id} is {row['status']}: only a failed or cancelled job "
                           "can be resumed", code="not_resumable")
        stored = json.loads(row["settings"]) | {"model": self.model, "out": str(self.state_dir / "jobs" / job_id)}
        return TrainSettings(**stored)

    def adapters(self) -> builtins.list[dict]:
        """Finished LoRA adapters in llama.cpp's /lora-adapters shape, plus name and job."""
        with self._lock:
            rows = self._db.execute("SELECT id, name, path, scale, job_id FROM adapters ORDER BY id").fetchall()
        return [dict(r) for r in rows]

    def set_scales(self, scales: builtins.list[dict]) -> builtins.list[dict]:
        """Set adapter scales from [{"id", "scale"}]; adapters not listed go to 0 (as llama.cpp does)."""
        scales = [parse(LoraScale, item).model_dump() for item in scales]
        with self._lock:
            known = {r["id"] for r in self._db.execute("SELECT id FROM adapters")}
            new = dict.fromkeys(known, 0.0)
            for item in scales:
                if item["id"] not in known:
                    raise ApiError(400, f"no adapter with id {item['id']}", code="invalid_adapter_id",
                                   extra={"param": "id"})
                new[item["id"]] = float(item["scale"])
            with self._transaction():
                self._db.executemany("UPDATE adapters SET scale = ? WHERE id = ?",
                                     [(v, k) for k, v in new.items()])
        return self.adapters()

    def close(self, timeout: float = 60.0) -> None:
        """Stop the worker: a running job stops at its next chunk boundary and is marked interrupted
        (resumable); queued jobs are marked interrupted at the next start."""
        with self._lock:
            self._closing = True
            self._changed.notify_all()
        self._worker.join(timeout)
        if not self._worker.is_alive():
            self._db.close()

    # ------------------------------------------------------------------------------------------ checks

    def _check_open(self) -> None:
        if self._closing:
            raise ApiError(503, code="shutting_down", message="the server is shutting down", type="unavailable_error")

    def _model_config(self):
        if self._config is None:
            try:
                self._config = models.load_config(self.model)
            except models.ModelError as e:
                raise ApiError(500, code="model_unavailable", message=str(e), type="server_error") from None
        return self._config

    def _planned(self, req: TrainRequest | dict) -> _Planned:
        """Everything that can refuse a job before it is queued: the fields, the data, the LoRA's own size
        and the gate on the planned graph, against the job's budget."""
        self._check_open()
        s, records, name = self._settings(req)
        try:
            steps = self._check_data(s, records)
            budget = self._budget(s)
            self._lora_gate(s, budget)  # from shapes, before PEFT allocates anything
            return _Planned(s, records, name, steps, self._choose(s, budget))
        except ApiError:
            body.release(records)  # a slice at a time, not with the error's traceback
            raise

    def _budget(self, s: TrainSettings) -> int:
        """The job's budget: its own `memory_budget` when it asks for one, at most the server's."""
        server = self.memory_budget or available_memory()
        return min(server, s.memory_budget) if s.memory_budget else server

    def _settings(self, req: TrainRequest | dict) -> tuple[TrainSettings, builtins.list[dict], str | None]:
        """The job's TrainSettings, records and name from a request (checked by `TrainRequest`)."""
        if not isinstance(req, TrainRequest):
            req = parse(TrainRequest, req)
        fields = body.dump(req, exclude_unset=True, exclude_none=True)  # the records a slice at a time
        dumped = fields.pop("data")
        try:
            records = data.parse_records(dumped)
        except data.DataError as e:
            raise _invalid("data", str(e)) from None
        finally:
            body.release(dumped)
        fields.pop("model", None)  # like llama.cpp's server: a server trains the model it serves
        name = fields.pop("name", None)
        return self._job_settings(fields), records, name

    def _job_settings(self, fields: dict) -> TrainSettings:
        """A job's TrainSettings from its request's fields (data, model and name aside), the server's
        defaults filled in."""
        max_ctx = int(self._model_config().max_position_embeddings)
        ctx = fields.setdefault("ctx", min(256, max_ctx))
        if ctx > max_ctx:
            raise _invalid("ctx", f"ctx {ctx} is above the model's maximum context {max_ctx}")
        fields.setdefault("ubatch", min(256, ctx))
        recompute = fields.pop("recompute", "auto")
        fields["recompute"] = ("on" if recompute else "off") if isinstance(recompute, bool) else recompute
        lora = fields.pop("lora", True)
        fields["lora"] = lora is not False
        if isinstance(lora, dict):
            fields.update({f"lora_{k}": v for k, v in lora.items()})
        fields.setdefault("save_every", self.save_every or None)
        try:
            return TrainSettings(model=self.model, out="<job folder>", **fields)
        except ValidationError as e:
            raise ApiError(400, describe(e, flags=False), code="invalid_request") from None

    def _lora_gate(self, s: TrainSettings, budget: int) -> None:
        """Refuse (422) a LoRA whose own weights, grads and AdamW states exceed the budget, from the base
        model's linear shapes alone, before PEFT allocates the adapter to plan it."""
        lora = step.lora_settings(s)
        if lora is None:
            return
        need = adapters.state_bytes(self._linear_shapes(), lora)
        why = adapters.over_budget(need, budget, lora, "lora.r")
        if why is not None:
            raise _refused(why, {"budget": budget, "lora_bytes": need})

    def _linear_shapes(self) -> builtins.list[tuple[str, int, int]]:
        """(name, in, out) of every linear layer of the served model, from a model built on fake tensors."""
        if self._linears is None:
            from remat.core.capture import EagerStridesFakeMode

            with self._planning(), EagerStridesFakeMode(allow_non_fake_inputs=True):
                model = models.build_from_config(self._model_config(), seed=0)
            self._linears = adapters.linear_shapes(model)
        return self._linears

    def _check_data(self, s: TrainSettings, records: builtins.list[dict]) -> int | None:
        """Tokenize and window the data as the trainer will; returns the job's optimizer steps."""
        tokenizer = self._tokenizer
        if tokenizer is None and self.model in models.TRAINABLE_PRESETS:
            tokenizer = self._tokenizer = models.tiny_tokenizer()
        if tokenizer is None:
            return None  # checked when the job runs
        try:
            windows = data.load_windows(records, tokenizer, s.ctx, s.batch, pack=s.pack)
        except data.DataError as e:
            raise _invalid("data", str(e)) from None
        try:
            return s.optimizer_steps(len(windows))[1]
        except UsageError as e:
            raise _invalid("accumulate", str(e).replace("--", "")) from None

    def _choose(self, s: TrainSettings, budget: int) -> dict:
        """The gate on the graph the job will run, traced on fake tensors (no weights): the policy that
        fits, why, and the plans; 422 with the plans when nothing fits."""
        with self._planning():
            try:
                choice = step.choose(self._planning_model(s), step.StepShape.of(s), s.recompute, budget)
            except GateRefused as e:
                raise _refused(str(e), {"plans": e.plans, "budget": budget}) from None
            except adapters.AdapterError as e:
                raise _invalid("lora", str(e)) from None
            except models.ModelError as e:
                raise ApiError(500, code="model_unavailable", message=str(e), type="server_error") from None
            except Exception as e:  # a model the planner cannot trace: say so, do not crash the server
                log.exception("planning failed")
                raise ApiError(500, code="plan_failed", message=f"cannot plan this job: {one_line(e)}",
                               type="server_error") from None
            finally:
                for model in self._models.values():  # the plans are kept: a server asked many shapes keeps no graphs
                    step.forget_graphs(model)
        return {"plans": {k: p.as_dict() for k, p in choice.plans.items()}, "policy": choice.policy,
                "recompute": choice.policy != "off", "recompute_reason": choice.reason, "budget": budget}

    def _planning_model(self, s: TrainSettings) -> nn.Module:
        """The served model on fake tensors with the LoRA `s` asks for, one per adapter shape (the plans of
        every shape planned cache on it); call with the torch lock held (`_planning`)."""
        lora = (s.lora_r, s.lora_alpha, s.lora_dropout, tuple(s.lora_targets or ())) if s.lora else None
        if lora not in self._models:
            self._models[lora] = step.planning_model(self._model_config(), s)
        return self._models[lora]

    def _warm(self) -> None:
        """Make what the first `POST /train` of a job of the server's defaults (the web page's) needs: the
        LoRA gate's linear shapes, the planning model and the plans of its shape (SmolLM2: 1.4 s of its
        answer). A failure is left for that request to report."""
        try:
            self._linear_shapes()
            s = self._job_settings({})
            with self._planning():
                step.plans(model := self._planning_model(s), step.StepShape.of(s))
                step.forget_graphs(model)
        except Exception:  # the request that needs it says why, as a 4xx or 500 of its own
            log.debug("warming the planner failed", exc_info=True)

    @contextlib.contextmanager
    def _planning(self) -> Iterator[None]:
        """Hold the torch lock for a plan; the trainer sees a waiting planner and lets it go first. The
        collector stays paused until the plan's graphs are dropped (`step.forget_graphs`), so its next
        collection frees them where they are, among the youngest objects, never walked again."""
        with self._lock:
            self._planners += 1
        try:
            self._torch.acquire()
        finally:
            with self._lock:
                self._planners -= 1
        try:
            with collector.paused:
                yield
        finally:
            self._torch.release()

    # ------------------------------------------------------------------------------------------ worker

    def _work(self) -> None:
        self._warm()
        while True:
            with self._lock:
                while not self._queue and not self._closing:
                    self._changed.wait()
                if self._closing:
                    return
                job_id = self._queue.popleft()
                run = self._run = _Run(job_id, self.scheduler.mark(),
                                       json.loads(self._row(job_id)["progress"]).get("losses", []))
            try:
                self._train(run)
            except Exception as e:  # bookkeeping broke, not training: record it and keep serving
                log.exception("training job %s", job_id)
                with self._lock:
                    if self._row(job_id)["status"] not in FINISHED:
                        self._finish(job_id, "failed", f"{type(e).__name__}: {one_line(e)}")
            finally:
                with self._lock:
                    self._run = None
                    self._changed.notify_all()

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
        with self._lock:
            row = self._row(job_id)
            stored = json.loads(row["settings"])
            records = body.loads(row["data"])  # in pieces: tens of MiB in one json.loads call stall the server
            budget = json.loads(row["plan"])["budget"]
            self._db.execute("UPDATE jobs SET status = 'running' WHERE id = ?", (job_id,))
        out = self.state_dir / "jobs" / job_id
        resume = self._checkpoint(job_id)
        if resume is None and out.exists():
            shutil.rmtree(out)  # leftovers of a run that saved no checkpoint: start over
        s = TrainSettings(**{**stored, "data": records, "out": str(out), "memory_budget": budget,
                             "resume": str(resume.path) if resume else None})
        with self._lock:
            self._event(job_id, "started", {"resumed_from_step": resume.step if resume else None})
        self.scheduler.new_job()
        return s, out

    def _on_step(self, run: _Run, out: Path, event: dict) -> None:
        _prune_checkpoints(out)  # the trainer saves this step's checkpoint next
        run.losses = run.losses[:event["step"] - 1] + [event["loss"]]
        progress = {"epoch": event["epoch"], "step": event["step"], "steps": event["steps"],
                    "losses": run.losses, **self._timings(run)}
        with self._lock:
            self._db.execute("UPDATE jobs SET progress = ? WHERE id = ?", (_dumps(progress), run.job_id))
            self._event(run.job_id, "step", {k: event[k] for k in ("epoch", "step", "steps", "loss")})

    def _succeed(self, run: _Run, s: TrainSettings, out: Path, receipt: dict, output: Path) -> None:
        result = {k: v for k, v in receipt.items() if k not in ("chunk_seconds", "checkpoints", "outputs")}
        result["output"] = str(output)
        shutil.rmtree(out, ignore_errors=True)  # its checkpoints are not needed any more
        with self._lock, self._transaction():  # the adapter and the job's success are recorded together
            if s.lora:
                next_id = self._db.execute("SELECT COALESCE(MAX(id), -1) + 1 FROM adapters").fetchone()[0]
                self._db.execute("INSERT INTO adapters (id, job_id, name, path, scale) VALUES (?, ?, ?, ?, 0)",
                                 (next_id, run.job_id, self._row(run.job_id)["name"] or run.job_id, str(output)))
            self._end(run, "succeeded", None, result)

    def _publish(self, job_id: str, s: TrainSettings, files: builtins.list[str]) -> Path:
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
        with self._lock:
            progress = {**json.loads(self._row(run.job_id)["progress"]), "losses": run.losses, **self._timings(run)}
            self._db.execute("UPDATE jobs SET progress = ? WHERE id = ?", (_dumps(progress), run.job_id))
            self._finish(run.job_id, status, reason, result)

    # ------------------------------------------------------------------------------------------ state

    def _recover(self) -> None:
        """Jobs a previous server left queued or running did not finish: mark them interrupted."""
        with self._lock:
            for r in self._db.execute("SELECT id FROM jobs WHERE status IN ('queued', 'running') "
                                      "ORDER BY seq").fetchall():
                self._finish(r["id"], "failed", INTERRUPTED)

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        # caller holds self._lock; the connection is in autocommit mode otherwise
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def _row(self, job_id: str) -> sqlite3.Row:
        row = None
        if isinstance(job_id, str) and JOB_ID.fullmatch(job_id):
            row = self._db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise ApiError(404, code="not_found", message=f"no training job {job_id!r}", type="not_found_error")
        return row

    def _checkpoint(self, job_id: str) -> checkpoints.Checkpoint | None:
        try:
            return checkpoints.latest(self.state_dir / "jobs" / job_id)
        except checkpoints.CheckpointError:
            return None

    def _checkpoint_step(self, job_id: str) -> int | None:
        ckpt = self._checkpoint(job_id)
        return ckpt.step if ckpt else None

    def _finish(self, job_id: str, status: str, reason: str | None, result: dict | None = None) -> None:
        # caller holds self._lock
        self._db.execute("UPDATE jobs SET status = ?, reason = ?, finished = ?, result = COALESCE(?, result) "
                         "WHERE id = ?", (status, reason, time.time(), _dumps(result) if result else None,
                                          job_id))
        data: dict[str, object] = {"reason": reason} if reason else {}
        if result:
            data |= {"steps": result.get("steps"), "losses": result.get("losses"), "output": result.get("output")}
        self._event(job_id, status, data)

    def _event(self, job_id: str, event: str, data: dict) -> None:
        # caller holds self._lock
        seq = self._db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM events WHERE job_id = ?",
                               (job_id,)).fetchone()[0]
        self._db.execute("INSERT INTO events (job_id, seq, event, data, created) VALUES (?, ?, ?, ?, ?)",
                         (job_id, seq, event, _dumps(data), time.time()))
        self._changed.notify_all()
