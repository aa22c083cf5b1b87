"""Training jobs for `remat serve`: the API the routes call. A job is checked, planned and gated here, then
stored (`store.JobStore`, SQLite) and trained by the worker thread (`worker.Worker`).

`submit` does everything that can refuse a job before it is queued: it checks each field, tokenizes the
data (when a tokenizer is at hand), and asks the gate (`training.gate.admit`) on the model built from its config
(fake weights, LoRA attached), so a job that cannot fit is refused with both plans before anything is allocated.

A server killed mid-job finds the job "running" at the next start and marks it failed ("interrupted");
`resume` requeues it from its last checkpoint. Finished adapters are files plus rows: they survive.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import logging
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from remat.base.settings import GateRefused, TrainSettings, UsageError, describe, one_line
from remat.core import devices
from remat.models import adapters
from remat.models import load as models
from remat.serve import body
from remat.serve.errors import ApiError, invalid, parse
from remat.serve.scheduler import Scheduler
from remat.serve.schemas import MAX_SCALE, LoraScale, PlanRequest, TrainRequest
from remat.serve.store import FINISHED, MAX_EVENT_ID, JobStore
from remat.serve.worker import TorchLock, Worker
from remat.training import data, gate, longest

__all__ = ["FINISHED", "MAX_EVENT_ID", "JobManager"]

log = logging.getLogger("remat.serve")


def _refused(message: str, extra: dict) -> ApiError:
    return ApiError(422, message, code="insufficient_memory", type="insufficient_memory", extra=extra)


@contextlib.contextmanager
def _planning_errors() -> Iterator[None]:
    """What planning raises, as the API's errors: a LoRA the model cannot take (400), a model that does not load
    or trace (500, said so; the server goes on)."""
    try:
        yield
    except ApiError:
        raise
    except adapters.AdapterError as e:
        raise invalid("lora", str(e)) from None
    except models.ModelError as e:
        raise ApiError(500, code="model_unavailable", message=str(e), type="server_error") from None
    except Exception as e:  # a model the planner cannot trace: say so, do not crash the server
        log.exception("planning failed")
        raise ApiError(500, code="plan_failed", message=f"cannot plan this job: {one_line(e)}",
                       type="server_error") from None


@dataclass
class _Planned:
    """A job that passed every check: its settings, records, name, optimizer steps and the gate's answer."""

    settings: TrainSettings
    records: list[dict]
    name: str | None
    steps: int | None
    gate: dict  # plans, policy, recompute, recompute_reason, budget, dtype and why (stored with the job)

    def answer(self) -> dict:
        g = self.gate
        return {"plan": g["plans"][g["policy"]], "plans": g["plans"], "policy": g["policy"],
                "recompute": g["recompute"], "recompute_reason": g["recompute_reason"], "budget": g["budget"],
                "steps": self.steps, "dtype": g["dtype"], "dtype_reason": g["dtype_reason"]}


class JobManager:
    def __init__(self, *, model: str | None, state_dir: Path, scheduler: Scheduler,
                 memory_budget: int | None = None, save_every: int = 1, tokenizer=None,
                 decode_reserve: Callable[[], int] = lambda: 0, device: str = "cpu", max_queued: int | None = None):
        """`model`: the spec the server trains (None: the embedded default). `save_every`: steps between
        checkpoints of a job that does not say (they make a crashed job resumable). `tokenizer`: the served
        model's, to check at submit that the data gives windows (presets bring their own). `decode_reserve`: what
        the decode slots' KV caches may still grow by (a job's budget read from free memory leaves it).
        `max_queued`: the jobs that may wait their turn (`--max-queued-jobs`; None: no limit); one more is refused
        (429)."""
        self.model, self.scheduler, self.memory_budget = model, scheduler, memory_budget
        self.decode_reserve = decode_reserve
        self.device = device  # where the server decodes (its KV caches), and where a job trains unless it says
        self.save_every = save_every
        self.max_queued = max_queued
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._tokenizer = tokenizer
        self._planners: gate.Planners | None = None  # the served model's, on fake weights, by LoRA shape
        self.torch = TorchLock()
        self.store = JobStore(self.state_dir / "state.db", MAX_SCALE)
        self.store.recover()
        self.worker = Worker(self.store, scheduler, self.state_dir, self.torch, warm=self._warm)

    # ------------------------------------------------------------------------------------------ jobs

    def plan(self, req: TrainRequest | dict) -> dict:
        """Validate, plan and gate a job without queueing it: the answer `submit` would give, less the id;
        raises ApiError (400, 422) when it cannot run. With ctx "max": the longest window on each path."""
        if (req.get("ctx") if isinstance(req, dict) else getattr(req, "ctx", None)) == "max":
            return self._longest(req)
        p = self._planned(req)
        body.release(p.records)
        return p.answer()

    def submit(self, req: TrainRequest | dict) -> dict:
        """`plan`, then queue the job; raises ApiError (400, 422) when it cannot run."""
        p = self._planned(req)
        settings = p.settings.model_dump(exclude={"data", "out", "resume"})
        job_id = f"job-{secrets.token_hex(8)}"
        try:
            with self.store.lock:
                self._room()
                self.store.insert(job_id, p.name, settings, p.records, p.gate, {"steps": p.steps} if p.steps else {})
                self.store.event(job_id, "queued", {"position": self.worker.enqueue(job_id)})
        finally:
            body.release(p.records)
        return {"id": job_id, "status": "queued", **p.answer()}

    def list(self) -> builtins.list[dict]:
        with self.store.lock:
            return [self.get(i) for i in self.store.ids()]

    def get(self, job_id: str) -> dict:
        with self.store.lock:
            row = self.store.row(job_id)
            progress = json.loads(row["progress"])
            result = json.loads(row["result"]) if row["result"] else {}
            plan = json.loads(row["plan"])
            adapter = self.store.adapter_of(job_id)
            run = self.worker.running(job_id)
        checkpoint = self.worker.checkpoint(job_id)
        policy = plan.get("policy", "on" if plan["recompute"] else "off")
        return {
            "id": job_id, "object": "train.job", "name": row["name"], "status": row["status"],
            "reason": row["reason"], "epoch": progress.get("epoch"), "step": progress.get("step", 0),
            "steps": progress.get("steps"), "losses": progress.get("losses", []),
            "plan": plan["plans"][policy], "policy": policy, "plans": plan["plans"], "recompute": plan["recompute"],
            "recompute_reason": plan["recompute_reason"], "budget": plan["budget"],
            "measured": result.get("measured"), "chunks": progress.get("chunks", 0),
            **{k: progress.get(k) for k in ("window_p50", "window_p95", "waited_seconds", "slowdown_ppm",
                                            "slowdown_source")},
            "adapter": adapter, "output": result.get("output"), "result": result or None,
            "cancel_requested": bool(run and run.cancel.is_set()), "yielding": bool(run and run.yielding),
            "resumable": row["status"] in ("failed", "cancelled"),
            "checkpoint_step": checkpoint.step if checkpoint else None,
            "created": row["created"], "finished": row["finished"], "settings": json.loads(row["settings"]),
        }

    def cancel(self, job_id: str, wait: float = 2.0) -> dict:
        """Cancel a queued job at once, a running one at its next chunk boundary (waiting up to `wait`
        seconds for it to stop); the job stays, `cancelled` (resumable). 409 when the job already finished."""
        with self.store.lock:
            status = self.store.row(job_id)["status"]
            if status in FINISHED:
                raise ApiError(409, code="job_finished", message=f"training job {job_id} already {status}")
            if job_id in self.worker.queue:
                self.worker.queue.remove(job_id)
                self.store.finish(job_id, "cancelled", "cancelled by request")
                return self.get(job_id)
            if (run := self.worker.running(job_id)) is not None:
                run.cancel.set()
            self.store.changed.wait_for(lambda: self.store.row(job_id)["status"] in FINISHED, wait)
        return self.get(job_id)

    def delete(self, job_id: str) -> dict:
        """Remove a finished job's record, events and checkpoints (its published adapter or model stays);
        409 while it is queued or running: cancel it first."""
        with self.store.lock:
            job = self.get(job_id)
            if job["status"] not in FINISHED:
                raise ApiError(409, code="job_active", message=f"training job {job_id} is {job['status']}: "
                               "cancel it first (POST /train/{id}/cancel)")
            self.store.delete(job_id)
        self.worker.forget(job_id)
        return {"id": job_id, "object": "train.job.deleted", "deleted": True}

    def events_since(self, job_id: str, after: int = 0) -> builtins.list[dict]:
        """The job's events with id > `after`, oldest first: {"id", "event", "data", "created"}."""
        return self.store.events_since(job_id, after)

    def wait_events(self, job_id: str, after: int = 0, timeout: float = 15.0) -> builtins.list[dict]:
        """Like events_since, but waits up to `timeout` seconds for one; [] at once when the job has
        finished and nothing newer is left (the stream can end)."""
        return self.store.wait_events(job_id, after, timeout)

    def resume(self, job_id: str) -> dict:
        """Requeue a failed or cancelled job; it continues from its last checkpoint (or starts over)."""
        self._check_open()
        with self.store.lock:
            s = self._resumable(job_id)
        # memory may have changed since the job was submitted: the gate answers again. Not under the store's
        # lock: planning waits for the trainer's chunk, and the trainer records its step under that lock first.
        plan = self._admit(s)
        with self.store.lock:
            self._resumable(job_id)  # another resume may have queued it meanwhile
            self._room()
            self.store.update(job_id, status="queued", reason=None, finished=None, plan=plan)
            checkpoint = self.worker.checkpoint(job_id)
            self.store.event(job_id, "queued", {"resumed_from_step": checkpoint.step if checkpoint else None})
            self.worker.enqueue(job_id)
            return self.get(job_id)

    def _room(self) -> None:
        """429 where `max_queued` jobs wait already (caller holds the store's lock). Checked after the job is
        planned: a request that is wrong in itself hears that first."""
        if self.max_queued is not None and len(self.worker.queue) >= self.max_queued:
            raise ApiError(429, code="queue_full",
                           message=f"{len(self.worker.queue)} training jobs are waiting, the most this server "
                           "queues (--max-queued-jobs): submit again once one has started, or cancel one")

    def _resumable(self, job_id: str) -> TrainSettings:
        """The settings a failed or cancelled job resumes with; 409 for any other (caller holds the lock)."""
        row = self.store.row(job_id)
        if row["status"] not in ("failed", "cancelled"):
            raise ApiError(409, f"training job {job_id} is {row['status']}: only a failed or cancelled job "
                           "can be resumed", code="not_resumable")
        stored = json.loads(row["settings"]) | {"model": self.model, "out": str(self.state_dir / "jobs" / job_id)}
        return TrainSettings(**stored)

    # ------------------------------------------------------------------------------------------ adapters

    def adapters(self) -> builtins.list[dict]:
        """Finished LoRA adapters in llama.cpp's /lora-adapters shape, plus name and job."""
        return self.store.adapters()

    def set_scales(self, scales: builtins.list[dict]) -> builtins.list[dict]:
        """Set adapter scales from [{"id", "scale"}]; adapters not listed go to 0 (as llama.cpp does)."""
        parsed = [parse(LoraScale, item) for item in scales]
        self.store.set_scales({item.id: float(item.scale) for item in parsed})
        return self.adapters()

    def close(self, timeout: float = 60.0) -> None:
        """Stop the worker: a running job stops at its next chunk boundary and is marked interrupted
        (resumable); queued jobs are marked interrupted at the next start."""
        if self.worker.close(timeout):
            self.store.close()

    # ------------------------------------------------------------------------------------------ checks

    def _check_open(self) -> None:
        if self.worker.closing:
            raise ApiError(503, code="shutting_down", message="the server is shutting down", type="unavailable_error")

    def _planners_of_model(self) -> gate.Planners:
        if self._planners is None:
            try:
                self._planners = gate.Planners(models.load_config(self.model))
            except models.ModelError as e:
                raise ApiError(500, code="model_unavailable", message=str(e), type="server_error") from None
        return self._planners

    def _planned(self, req: TrainRequest | dict) -> _Planned:
        """Everything that can refuse a job before it is queued: the fields, the data, and the gate (the
        LoRA's own size first, from shapes), against the job's budget."""
        self._check_open()
        s, records, name = self._settings(req)
        try:
            devices.resolve(s.device)  # a device this machine lacks: the job could only fail
        except UsageError as e:
            body.release(records)
            raise invalid("device", str(e).replace("--", "")) from None
        try:
            steps = self._check_data(s, records)
            return _Planned(s, records, name, steps, self._admit(s))
        except ApiError:
            body.release(records)  # a slice at a time, not with the error's traceback
            raise

    def _longest(self, req: TrainRequest | dict) -> dict:
        """The longest window within the job's budget, on each path, with the gate's plans there
        (`training.longest`; as `remat plan --ctx max --json`). The data is parsed, not windowed: the window is
        the answer."""
        self._check_open()
        s, records, _ = self._settings(req, PlanRequest)
        body.release(records)
        budget = self.budget(s)
        planners = self._planners_of_model()
        with _planning_errors():  # the planning lock per probe: a job's plan or chunk waits for one probe
            answers = longest.longest(s, budget, planners, turn=self.torch.turn)
        return longest.summary(s, budget, [a.as_dict() for a in answers], models.max_ctx(planners.config))

    def _settings(self, req: TrainRequest | dict,
                  model: type[TrainRequest] = TrainRequest) -> tuple[TrainSettings, builtins.list[dict], str | None]:
        """The job's TrainSettings, records and name from a request (checked by `model`)."""
        if not isinstance(req, TrainRequest):
            req = parse(model, req)
        fields = body.dump(req, exclude_unset=True, exclude_none=True)  # the records a slice at a time
        dumped = fields.pop("data")
        try:
            records = data.parse_records(dumped)
        except data.DataError as e:
            raise invalid("data", str(e)) from None
        finally:
            body.release(dumped)
        fields.pop("model", None)  # like llama.cpp's server: a server trains the model it serves
        name = fields.pop("name", None)
        return self._job_settings(fields), records, name

    def _job_settings(self, fields: dict) -> TrainSettings:
        """A job's TrainSettings from its request's fields (data, model and name aside), the server's
        defaults filled in."""
        max_ctx = models.max_ctx(self._planners_of_model().config)
        if fields.get("ctx") == "max":  # the longest window: each probe sets its own (`training.longest`)
            fields["ctx"] = fields.setdefault("ubatch", min(256, max_ctx))
        ctx = fields.setdefault("ctx", min(256, max_ctx))
        if ctx > max_ctx:
            raise invalid("ctx", f"ctx {ctx} is above the model's maximum context {max_ctx}")
        fields.setdefault("ubatch", min(256, ctx))
        recompute = fields.pop("recompute", "auto")
        fields["recompute"] = ("on" if recompute else "off") if isinstance(recompute, bool) else recompute
        lora = fields.pop("lora", True)
        fields["lora"] = lora is not False
        if isinstance(lora, dict):
            fields.update({f"lora_{k}": v for k, v in lora.items()})
        fields.setdefault("save_every", self.save_every or None)
        fields.setdefault("device", self.device)
        try:
            return TrainSettings(model=self.model, out="<job folder>", **fields)
        except ValidationError as e:
            raise ApiError(400, describe(e, flags=False), code="invalid_request") from None

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
            raise invalid("data", str(e)) from None
        try:
            return s.optimizer_steps(len(windows))[1]
        except UsageError as e:
            raise invalid("accumulate", str(e).replace("--", "")) from None

    def _admit(self, s: TrainSettings) -> dict:
        """The gate on the graph the job will run, planned on fake tensors (no weights) against the job's budget
        (its own `memory_budget` at most the server's): the policy that fits, why, and the plans; 422 with the
        figures when nothing fits."""
        budget = self.budget(s)
        planners = self._planners_of_model()
        with self.torch.planning(), _planning_errors():
            try:
                admitted = gate.admit(s, budget, planners=planners)
            except GateRefused as e:
                plans = {"plans": e.plans} if e.plans else {}  # none: the LoRA alone was refused, from shapes
                raise _refused(str(e), {**plans, "budget": budget.bytes, **e.extra}) from None
            finally:
                planners.forget_graphs()  # the plans are kept: a server asked many shapes keeps no graphs
        answer = admitted.answer()
        return {"plans": answer["plans"], "policy": admitted.policy, "recompute": admitted.policy != "off",
                "recompute_reason": answer["recompute_reason"], "budget": budget.bytes, "dtype": answer["dtype"],
                "dtype_reason": answer["dtype_reason"]}

    def budget(self, s: TrainSettings) -> gate.Budget:
        """A job's budget: its own `memory_budget` at most the server's (`--memory-budget`; else the free memory,
        less what the decode slots' KV caches may still take)."""
        device = devices.planned(s.device)
        # the decode slots' KV caches grow where the server decodes
        reserve = self.decode_reserve() if device == devices.planned(self.device) else 0
        if not devices.is_host(device):  # a device's: its memory, the host's beside it
            server = gate.Budget.of(self.memory_budget, device=device) if self.memory_budget else \
                gate.Budget.of(device=device).less("the decode slots' KV caches still to grow", reserve, on_device=True)
            return gate.Budget.of(s.memory_budget, cap=server, device=device)
        server = gate.Budget(self.memory_budget, "the server's --memory-budget") if self.memory_budget else \
            gate.Budget.of().less("the decode slots' KV caches still to grow", reserve)
        return gate.Budget.of(s.memory_budget, cap=server)

    def _warm(self) -> None:
        """Make what the first `POST /train` of a job of the server's defaults (the web page's) needs: the
        planning model of its LoRA and the plans of its shape. A failure is left for that request to report."""
        try:
            self._admit(self._job_settings({}).model_copy(update={"recompute": "on"}))
        except Exception:  # the request that needs it says why, as a 4xx or 500 of its own
            log.debug("warming the planner failed", exc_info=True)
