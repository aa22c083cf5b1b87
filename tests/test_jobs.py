"""Training jobs end to end: real worker thread, real SQLite file, real training of tiny-llama."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from remat.base.settings import Renamed
from remat.serve.errors import ApiError
from remat.serve.jobs import JobManager
from remat.serve.scheduler import Scheduler

pytestmark = pytest.mark.usefixtures("one_thread")

RECORDS = [{"text": f"Record {i}: the quick brown fox jumps over the lazy dog. " * 3} for i in range(4)]
SMALL = {"data": RECORDS, "ctx": 32, "batch": 1}  # ~22 windows of 32 tokens: 22 steps per epoch
LONG = {**SMALL, "epochs": 50, "steps": 1000}
TERMINAL = ("succeeded", "failed", "cancelled")


def new_manager(state_dir: Path, **kw) -> JobManager:
    return JobManager(model="tiny-llama", state_dir=state_dir, scheduler=kw.pop("scheduler", Scheduler()), **kw)


def wait_for(m: JobManager, job_id: str, event: str, timeout: float = 60, after: int = 0) -> list[dict]:
    """The events after `after` up to and including the first `event` (or a terminal one), in order."""
    seen: list[dict] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in m.wait_events(job_id, seen[-1]["id"] if seen else after, timeout=1.0):
            seen.append(e)
            if e["event"] in (event, *TERMINAL):
                return seen
    raise AssertionError(f"no {event!r} event for {job_id} in {timeout} s: {[e['event'] for e in seen]}")


@pytest.fixture
def manager(tmp_path):
    m = new_manager(tmp_path)
    yield m
    m.close()


def test_job_trains_and_publishes_its_adapter(manager, tmp_path):
    r = manager.submit({**SMALL, "steps": 3, "name": "fox"})
    assert r["status"] == "queued" and r["steps"] == 3
    assert r["recompute"] is False and "not needed" in r["recompute_reason"]
    assert r["plan"] == r["plans"]["off"] and r["plans"]["on"]["graph"] < r["plans"]["off"]["graph"]

    events = wait_for(manager, r["id"], "succeeded")
    assert [e["event"] for e in events] == ["queued", "started", "step", "step", "step", "succeeded"]
    assert [e["id"] for e in events] == [1, 2, 3, 4, 5, 6]
    assert [e["data"]["step"] for e in events if e["event"] == "step"] == [1, 2, 3]
    assert manager.events_since(r["id"], after=4) == events[4:]  # replay after Last-Event-ID 4
    assert manager.wait_events(r["id"], after=6, timeout=30) == []  # finished: returns at once

    job = manager.get(r["id"])
    assert (job["status"], job["reason"], job["name"], job["step"], job["steps"]) == ("succeeded", None, "fox", 3, 3)
    assert len(job["losses"]) == 3 and job["finished"] >= job["created"]
    ran = dict(job["result"]["plan"])  # the receipt adds the process's own memory (`runtime`, `trace`) to its total
    ran["total"] -= ran.pop("runtime") + ran.pop("trace")
    assert {k: v for k, v in job["plan"].items() if k not in ("runtime", "trace")} == ran  # the plan at submit ran
    assert job["chunks"] == 3 and 0 < job["window_p50"] <= job["window_p95"]
    assert job["slowdown_ppm"] == 0 and job["measured"]["graph"] > 0
    assert job["settings"]["ctx"] == 32 and job["settings"]["lora"] is True

    [adapter] = manager.adapters()
    assert adapter == {"id": 0, "name": "fox", "path": job["adapter"]["path"], "scale": 0.0, "job_id": r["id"]}
    files = {p.name for p in Path(adapter["path"]).iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "adapter.gguf"} <= files
    assert not (tmp_path / "jobs" / r["id"]).exists()  # checkpoints are cleaned up
    assert [p.name for p in (tmp_path / "adapters").iterdir()] == [r["id"]]  # no temp folder left

    assert manager.set_scales([{"id": 0, "scale": 0.5}])[0]["scale"] == 0.5
    assert manager.set_scales([])[0]["scale"] == 0.0  # not listed: back to 0, as llama.cpp does
    with pytest.raises(ApiError) as e:
        manager.set_scales([{"id": 7, "scale": 1.0}])
    assert e.value.status == 400 and e.value.code == "invalid_adapter_id"
    assert [j["id"] for j in manager.list()] == [r["id"]]


def test_jobs_run_one_at_a_time_in_order(manager):
    a = manager.submit({**SMALL, "steps": 3})
    b = manager.submit({**SMALL, "steps": 2, "path": "walk", "ubatch": 16})
    b_events = wait_for(manager, b["id"], "succeeded")
    a_events = manager.events_since(a["id"])
    assert a_events[-1]["event"] == "succeeded" and b_events[-1]["event"] == "succeeded"
    b_started = next(e for e in b_events if e["event"] == "started")
    assert b_started["created"] >= a_events[-1]["created"]  # b waited for a to finish
    assert b_events[0]["data"]["position"] == 1
    assert [j["id"] for j in manager.list()] == [a["id"], b["id"]]
    # the exact walk: per step, two chunks of 16 tokens in the forward sweep and two in the reverse one
    assert manager.get(b["id"])["chunks"] == 8
    assert [x["id"] for x in manager.adapters()] == [0, 1]


def test_cancel_running_job_then_409(manager):
    r = manager.submit(LONG)
    wait_for(manager, r["id"], "step")
    job = manager.cancel(r["id"])
    assert job["status"] == "cancelled" and job["reason"] == "cancelled by request"
    assert 1 <= job["step"] < 1000
    assert manager.events_since(r["id"])[-1]["event"] == "cancelled"
    with pytest.raises(ApiError) as e:
        manager.cancel(r["id"])
    assert (e.value.status, e.value.code) == (409, "job_finished")
    assert manager.adapters() == []


def test_cancel_while_yielding_and_while_queued(tmp_path):
    scheduler = Scheduler(0)  # training never overlaps decoding
    m = new_manager(tmp_path, scheduler=scheduler)
    try:
        scheduler.decode_begin()  # a request is decoding for as long as this test runs
        a = m.submit({**SMALL, "steps": 3})
        b = m.submit({**SMALL, "steps": 3})
        wait_for(m, a["id"], "started")
        assert m.cancel(b["id"], wait=0)["status"] == "cancelled"  # queued: cancelled at once
        deadline = time.monotonic() + 30
        while not m.get(a["id"])["yielding"]:  # loaded, traced, and now held back by the scheduler
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.1)
        assert m.get(a["id"])["yielding"] and m.get(a["id"])["step"] == 0
        assert m.cancel(a["id"], wait=5)["status"] == "cancelled"  # out of the scheduler's wait, not after a step
        assert m.get(a["id"])["step"] == 0 and [e["event"] for e in m.events_since(a["id"])][-1] == "cancelled"
        assert [e["event"] for e in m.events_since(b["id"])] == ["queued", "cancelled"]
    finally:
        scheduler.decode_end()
        m.close()


def test_a_full_queue_refuses_one_more_job_with_429_and_stores_nothing(tmp_path):
    """`--max-queued-jobs 1`: with one job training (held back by a decoding request) and one waiting, a new job
    and a resumed one are refused, after their own checks (a bad field is still 400), and nothing is stored;
    once the waiting one is cancelled, both are taken."""
    scheduler = Scheduler(0)  # training never overlaps decoding
    m = new_manager(tmp_path, scheduler=scheduler, max_queued=1)
    try:
        scheduler.decode_begin()
        a = m.submit({**SMALL, "steps": 3})
        wait_for(m, a["id"], "started")
        b = m.submit({**SMALL, "steps": 3})
        assert b["status"] == "queued"
        with pytest.raises(ApiError) as e:
            m.submit({**SMALL, "steps": 2})
        assert (e.value.status, e.value.code) == (429, "queue_full") and "--max-queued-jobs" in e.value.message
        with pytest.raises(ApiError) as e:
            m.submit({**SMALL, "steps": 0})
        assert e.value.status == 400  # what is wrong with the request itself comes first
        assert [j["id"] for j in m.list()] == [a["id"], b["id"]]
        assert m.cancel(b["id"], wait=0)["status"] == "cancelled"
        c = m.submit({**SMALL, "steps": 1, "name": "c"})
        assert c["status"] == "queued"
        with pytest.raises(ApiError) as e:
            m.resume(b["id"])  # cancelled, resumable: but the queue is full again
        assert (e.value.status, e.value.code) == (429, "queue_full")
        assert m.get(b["id"])["status"] == "cancelled"
        assert [j["id"] for j in m.list()] == [a["id"], b["id"], c["id"]]
    finally:
        scheduler.decode_end()
        m.close()


def test_resuming_a_job_while_another_trains(tmp_path, monkeypatch):
    """The gate plans a resumed job again while another job trains: the planner waits for the trainer's
    chunk, and the trainer records its step meanwhile. Here the trainer, holding the device, records a step
    once a planner waits: the resume held the job lock as it planned, so both stopped (the planner for the
    device, the trainer for the lock). A manager stopped so is left to its daemon threads, not closed."""
    import threading

    m = new_manager(tmp_path)
    running = m.submit(LONG)
    stopped = m.submit({**SMALL, "steps": 3})
    assert m.cancel(stopped["id"], wait=0)["status"] == "cancelled"
    wait_for(m, running["id"], "step")
    record, in_step = m.worker._on_step, threading.Event()

    def once_a_planner_waits(*args) -> None:
        in_step.set()
        deadline = time.monotonic() + 5
        while not m.torch.waiting and time.monotonic() < deadline:
            time.sleep(0.001)
        record(*args)

    monkeypatch.setattr(m.worker, "_on_step", once_a_planner_waits)
    assert in_step.wait(30)
    answer: list[dict] = []
    resume = threading.Thread(target=lambda: answer.append(m.resume(stopped["id"])), daemon=True)
    resume.start()
    resume.join(60)
    assert answer and answer[0]["status"] == "queued", "the resume and the trainer wait for each other"
    monkeypatch.setattr(m.worker, "_on_step", record)
    step = m.get(running["id"])["step"]
    wait_for(m, running["id"], "step", after=m.events_since(running["id"])[-1]["id"])
    assert m.get(running["id"])["step"] > step  # the trainer goes on
    with pytest.raises(ApiError) as e:
        m.resume(stopped["id"])  # queued now: not resumable twice
    assert (e.value.status, e.value.code) == (409, "not_resumable")
    queued = m.events_since(stopped["id"])[-1]
    assert queued["event"] == "queued"
    m.cancel(running["id"])
    assert wait_for(m, stopped["id"], "succeeded", after=queued["id"])[-1]["event"] == "succeeded"
    m.close()


def test_unknown_job_is_404(manager):
    for call in (manager.get, manager.cancel, manager.events_since, manager.resume):
        with pytest.raises(ApiError) as e:
            call("job-nope")
        assert (e.value.status, e.value.code, e.value.type) == (404, "not_found", "not_found_error")


@pytest.mark.parametrize("change, code", [
    ({"data": []}, "invalid_data"),
    ({"data": [{"txt": "hello"}]}, "invalid_data"),
    ({"data": "hello"}, "invalid_data"),
    ({"data": None}, "invalid_data"),
    ({"data": [{"text": "too short for four windows"}], "batch": 4}, "invalid_data"),
    ({"ctx": 4096}, "invalid_ctx"),
    ({"ctx": 0}, "invalid_ctx"),
    ({"epochs": -1}, "invalid_epochs"),
    ({"epochs": "2"}, "invalid_epochs"),
    ({"batch": True}, "invalid_batch"),
    ({"lr": 0}, "invalid_lr"),
    ({"recompute": "sometimes"}, "invalid_recompute"),
    ({"path": "zigzag"}, "invalid_path"),
    ({"path": "walk", "ubatch": 12}, "invalid_request"),
    ({"steps": 0}, "invalid_steps"),
    ({"name": "x" * 65}, "invalid_name"),
    ({"lora": {"r": 0}}, "invalid_lora"),
    ({"lora": {"rank": 8}}, "invalid_lora"),
    ({"lora": {"targets": ["no_such_layer"]}}, "invalid_lora"),
    ({"accumulate": 100}, "invalid_accumulate"),
    ({"epoch": 2}, "unknown_field"),
])
def test_bad_input_is_400_naming_the_field(manager, change, code):
    with pytest.raises(ApiError) as e:
        manager.submit({**SMALL, **change})
    assert (e.value.status, e.value.code) == (400, code)
    assert e.value.body()["error"]["code"] == code and "\n" not in e.value.message
    if code == "invalid_ctx" and change["ctx"] > 2048:
        assert "2048" in e.value.message
    assert manager.list() == []  # nothing was queued


def test_insufficient_memory_is_422_with_both_plans(tmp_path):
    m = new_manager(tmp_path, memory_budget=300_000)  # the LoRA alone fits (262,144 bytes), the step not
    try:
        with pytest.raises(ApiError) as e:
            m.submit(SMALL)
        err = e.value
        assert (err.status, err.code, err.type) == (422, "insufficient_memory", "insufficient_memory")
        assert err.extra["budget"] == 300_000
        assert {"off", "on"} <= set(err.extra["plans"])
        assert all(p["total"] > 300_000 for p in err.extra["plans"].values())
        assert m.list() == []

        plans = err.extra["plans"]
        m.memory_budget = (plans["on"]["total"] + plans["off"]["total"]) // 2  # fits with recompute only
        r = m.submit({**SMALL, "steps": 1})
        assert r["recompute"] is True and "over the budget" in r["recompute_reason"]
        assert r["plan"] == r["plans"][r["policy"]] and r["plan"]["total"] <= m.memory_budget
        assert r["plans"]["on"] == plans["on"]
        with pytest.raises(ApiError) as e:
            m.submit({**SMALL, "recompute": False})
        assert e.value.status == 422
        assert wait_for(m, r["id"], "succeeded")[-1]["event"] == "succeeded", m.get(r["id"])["reason"]
        assert m.get(r["id"])["result"]["recompute"] is True  # what ran is what was planned
    finally:
        m.close()


def test_plan_is_submit_without_the_queue(tmp_path):
    """`plan` answers what `submit` would (less the id) and queues nothing; a job's own budget caps the
    server's, and below the smallest plan it is refused with the plans, as `submit` refuses it."""
    m = new_manager(tmp_path, memory_budget=64 << 20)
    try:
        p = m.plan(SMALL)
        assert set(p) == {"plan", "plans", "policy", "recompute", "recompute_reason", "budget", "steps", "dtype",
                          "dtype_reason"}
        assert p["policy"] == "off" and p["budget"] == 64 << 20 and p["plan"] == p["plans"]["off"]
        assert p["dtype"] == "float32" and p["dtype_reason"].startswith("auto:")  # auto: pinned in this process
        assert m.list() == []
        with pytest.warns(Renamed, match="'ubatch' is now called 'window'"):  # the old spelling still plans
            assert m.plan({**SMALL, "path": "ubatch"}) == p
        assert m.plan({**SMALL, "memory_budget": "1GiB"})["budget"] == 64 << 20  # capped by the server's
        on = p["plans"]["on"]["total"]
        q = m.plan({**SMALL, "memory_budget": on})
        assert q["budget"] == on and q["recompute"] is True and q["plan"]["total"] <= on
        small = 300_000  # the LoRA alone fits (262,144 bytes), no plan does
        for call in (m.plan, m.submit):
            with pytest.raises(ApiError) as e:
                call({**SMALL, "memory_budget": small})
            assert (e.value.status, e.value.code, e.value.extra["budget"]) == (422, "insufficient_memory", small)
            assert {"off", "on"} <= set(e.value.extra["plans"])
        assert m.list() == []
        r = m.submit({**SMALL, "steps": 1, "memory_budget": on})
        assert {k: r[k] for k in q if k != "steps"} == {k: v for k, v in q.items() if k != "steps"}
        assert r["steps"] == 1 and m.get(r["id"])["budget"] == on
        assert wait_for(m, r["id"], "succeeded")[-1]["event"] == "succeeded", m.get(r["id"])["reason"]
    finally:
        m.close()


def test_a_default_job_is_planned_as_the_manager_starts(tmp_path, monkeypatch, traces):
    """What the first `POST /train` of a job of the server's defaults (the web page's) needs is made as the
    manager starts: its planning model (fake weights, the default LoRA) and the plans of its shape. That
    request traces nothing; a job of another shape traces once, and one with another LoRA gets its own model."""
    from remat.training import gate

    built: list[bool] = []
    make = gate.Planner
    monkeypatch.setattr(gate, "Planner", lambda model, *device: built.append(hasattr(model, "peft_config"))
                        or make(model, *device))
    m = new_manager(tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not built and time.monotonic() < deadline:
            time.sleep(0.05)
        with m.torch.planning():  # the start's planning done
            made = len(traces)
        assert built == [True]
        defaults = m.plan({"data": RECORDS})
        assert defaults["policy"] == "off" and len(traces) == made and built == [True]
        m.plan(SMALL)
        assert len(traces) == made + 1 and built == [True]
        m.plan({**SMALL, "lora": {"r": 4}})
        assert built == [True, True]
    finally:
        m.close()


def test_a_lora_made_while_the_server_loads_an_adapter_keeps_its_weights(tmp_path, monkeypatch):
    """PEFT's low_cpu_mem_usage loading (how the engine loads an adapter to decode with) patches
    nn.Module.register_parameter for the whole process while it runs: a LoRA attached meanwhile in another
    thread (a planner's, a training job's) got empty meta weights, and its plan failed ("cpu and meta").
    Making modules holds `models.module_lock`: with an adapter load held open for up to 2 s, a planning model
    made meanwhile has real LoRA weights."""
    import threading

    import peft
    from peft.utils.integrations import init_empty_weights

    from planning import planner_of
    from remat.base.settings import TrainSettings
    from remat.serve.engine import Engine

    engine = Engine("tiny-llama", n_ctx=64, scheduler=Scheduler())
    engine.load()
    (tmp_path / "adapter_config.json").write_text("{}")
    loading, made, refused = threading.Event(), threading.Event(), []

    def held_open(*args, **kwargs):  # PEFT's empty-weights window, held until the other model is made
        with init_empty_weights():
            loading.set()
            made.wait(2)
        raise ValueError("this test only holds the window open")

    def load() -> None:
        try:
            engine._load_adapter(0, str(tmp_path))
        except ApiError as e:
            refused.append(e.status)

    monkeypatch.setattr(peft.PeftModel, "from_pretrained", held_open)
    loader = threading.Thread(target=load)
    loader.start()
    assert loading.wait(30)
    model = planner_of(TrainSettings(model="tiny-llama", out="x")).model
    made.set()
    loader.join()
    assert refused == [400]
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    assert lora and all(p.device.type == "cpu" for p in lora), {p.device for p in lora}


def test_close_interrupts_the_running_job(tmp_path):
    m = new_manager(tmp_path)
    r = m.submit(LONG)
    wait_for(m, r["id"], "step")
    m.close()
    m = new_manager(tmp_path)
    try:
        job = m.get(r["id"])
        assert (job["status"], job["reason"]) == ("failed", "interrupted") and job["resumable"]
    finally:
        m.close()


CRASHING_SERVER = textwrap.dedent("""
    import json, sys, time, torch
    from pathlib import Path
    from remat.serve.jobs import JobManager
    from remat.serve.scheduler import Scheduler
    torch.set_num_threads(1)
    m = JobManager(model="tiny-llama", state_dir=Path(sys.argv[1]), scheduler=Scheduler())
    records = json.loads(sys.argv[2])
    done = m.submit({"data": records, "ctx": 32, "steps": 2, "name": "before-crash"})
    while m.get(done["id"])["status"] != "succeeded":
        time.sleep(0.01)
    long = m.submit({"data": records, "ctx": 32, "epochs": 3, "steps": 30})
    queued = m.submit({"data": records, "ctx": 32, "steps": 2})
    print(json.dumps({"done": done["id"], "long": long["id"], "queued": queued["id"]}), flush=True)
    time.sleep(600)
""")


def test_restart_after_a_crash_keeps_adapters_and_resumes(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", CRASHING_SERVER, str(tmp_path), json.dumps(RECORDS)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        ids = json.loads(proc.stdout.readline())
        ckpts = tmp_path / "jobs" / ids["long"]
        deadline = time.monotonic() + 60
        while not (ckpts.is_dir() and any(p.name.startswith("checkpoint-") for p in ckpts.iterdir())):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.005)
    finally:
        proc.kill()  # the crash: no chance to clean up or record anything
        proc.wait()

    m = new_manager(tmp_path)
    try:
        long = m.get(ids["long"])
        assert (long["status"], long["reason"]) == ("failed", "interrupted")
        assert 1 <= long["checkpoint_step"] < 30
        assert (m.get(ids["queued"])["status"], m.get(ids["queued"])["reason"]) == ("failed", "interrupted")
        [adapter] = m.adapters()
        assert adapter["name"] == "before-crash" and (Path(adapter["path"]) / "adapter.gguf").is_file()

        step = long["checkpoint_step"]
        last = m.events_since(ids["long"])[-1]
        assert (last["event"], last["data"]) == ("failed", {"reason": "interrupted"})
        assert m.resume(ids["long"])["status"] == "queued"
        events = wait_for(m, ids["long"], "succeeded", after=last["id"])
        assert events[0]["event"] == "queued" and events[0]["data"]["resumed_from_step"] >= step
        assert events[-1]["event"] == "succeeded", events[-1]
        started = [e for e in events if e["event"] == "started"][-1]
        assert started["data"]["resumed_from_step"] >= step
        job = m.get(ids["long"])
        assert job["step"] == 30 and len(job["losses"]) == 30
        assert job["result"]["resumed_from"].endswith(f"checkpoint-{started['data']['resumed_from_step']}")
        assert [a["name"] for a in m.adapters()] == ["before-crash", ids["long"]]
        with pytest.raises(ApiError) as e:
            m.resume(ids["long"])
        assert (e.value.status, e.value.code) == (409, "not_resumable")
    finally:
        m.close()
    assert os.path.exists(tmp_path / "state.db")


def test_a_server_keeps_the_plans_of_the_shapes_it_planned_not_their_graphs(tmp_path, monkeypatch, traces):
    """Each new shape a client asks for is traced and planned; its plans are kept, so the same shape is
    answered again without a trace, but its graphs are not: a server asked shape after shape would hold
    every one's (SmolLM2 with LoRA: 25 MiB and 150,000 objects each) and walk them all in each collection."""
    import gc

    from torch import fx


    def live_nodes() -> int:
        gc.collect()
        return sum(isinstance(o, fx.Node) for o in gc.get_objects())

    # the start's planning of the default job runs in the worker thread, whenever it gets there: not counted here
    monkeypatch.setattr(JobManager, "_warm", lambda self: None)
    m = new_manager(tmp_path)
    try:
        first = m.plan(SMALL)
        before = live_nodes()
        made = len(traces)
        for ctx in (40, 48, 56):
            m.plan({**SMALL, "ctx": ctx})
        assert len(traces) == made + 3
        assert live_nodes() == before
        again = m.plan(SMALL)  # from its plans (the budget is the memory free at the time)
        assert again["plans"] == first["plans"] and len(traces) == made + 3
    finally:
        m.close()


def test_a_jobs_budget_leaves_room_for_the_decode_slots(tmp_path):
    """Read from free memory, a job's budget is less what the decode slots' KV caches may still take; a budget
    set (the server's, or the job's own below it) is what the job may allocate."""
    from remat.base.settings import TrainSettings

    s = TrainSettings(model="tiny-llama", out="x")
    m = new_manager(tmp_path, decode_reserve=lambda: 123 << 20)
    try:
        free = m.budget(s)
        assert free.read and free.deducted == (("the decode slots' KV caches still to grow", 123 << 20),)
        own = m.budget(s.model_copy(update={"memory_budget": 1 << 20}))
        assert (own.bytes, own.deducted) == (1 << 20, ())
    finally:
        m.close()
    m = new_manager(tmp_path / "capped", decode_reserve=lambda: 123 << 20, memory_budget=64 << 20)
    try:
        assert (m.budget(s).bytes, m.budget(s).deducted) == (64 << 20, ())
    finally:
        m.close()


def test_half_written_folders_of_a_killed_server_are_removed(tmp_path):
    """`kill -9` during a checkpoint or a publish leaves `.<name>.tmp-*` folders (`files.staged`): the next server
    removes them as it starts, and a job removes its own as it starts again; complete checkpoints stay."""
    m = new_manager(tmp_path)
    r = m.submit(LONG)
    wait_for(m, r["id"], "step")
    m.cancel(r["id"])
    m.close()
    job = tmp_path / "jobs" / r["id"]
    complete = sorted(p.name for p in job.iterdir())
    assert complete and all(p.startswith("checkpoint-") for p in complete)
    stale = [job / ".checkpoint-9.tmp-x1", tmp_path / "adapters" / ".job-0.tmp-x2", tmp_path / "models" / ".m.tmp-x3"]
    for p in stale:
        (p / "half").mkdir(parents=True)
    m = new_manager(tmp_path)
    try:
        assert not any(p.exists() for p in stale)
        assert sorted(p.name for p in job.iterdir()) == complete
        (job / ".checkpoint-10.tmp-x4").mkdir()  # as if the job had been killed again
        m.resume(r["id"])
        wait_for(m, r["id"], "step", after=m.events_since(r["id"])[-1]["id"])
        assert not (job / ".checkpoint-10.tmp-x4").exists()
        m.cancel(r["id"])
    finally:
        m.close()
