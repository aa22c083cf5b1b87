"""`remat plan --ctx max` (`training/longest.py`): the longest window within a budget, on each path. The oracle is
the gate itself: at the window named the gate admits the job (its plan within the budget), at the next allowed
window (the walk's: the next multiple of --ubatch) it refuses, unless the model's maximum context is the limit."""

from __future__ import annotations

import json
import random

import pytest

from remat import cli
from remat.base.settings import GateRefused, MiB, TrainSettings
from remat.models.load import load_config, max_ctx
from remat.training import gate
from remat.training.longest import longest, search

pytestmark = pytest.mark.usefixtures("one_thread")


def test_search_finds_the_last_window_within_the_budget():
    """Against every window tried in turn: plans that grow in a line, in a curve, in steps, or bend up where one
    part overtakes another (qwen2.5-coder-1.5b's window: the head's transient, then the layers'), or jump; any
    multiple. In few probes: a bend once took hundreds (the line and the curve through probes on both sides of it),
    a jump tens (the line held at the bracket's edge, one window a probe)."""
    rng = random.Random(0)
    for case in range(400):
        step, limit = rng.choice([1, 1, 64, 256]), rng.randrange(256, 40_000)
        base, slope, curve, jump = rng.randrange(1, 10**6), rng.randrange(1, 10**4), rng.random(), rng.randrange(50)
        bend, steeper = rng.randrange(limit), rng.randrange(2, 20) * (case % 3 == 1)  # a third of the plans bend
        hop = rng.randrange(100, 1000) * slope * (case % 3 == 2)  # a third jump at every 64 (qwen3.5's delta rule)

        def total(c: int, base=base, slope=slope, curve=curve, jump=jump, bend=bend, steeper=steeper, hop=hop) -> int:
            return int(base + slope * c + curve * c * c / 8 + jump * (c // 97) + steeper * slope * max(0, c - bend)
                       + hop * ((c + 63) // 64))

        budget = rng.randrange(base, total(limit) * 2)
        start = min(2048, limit) // step * step
        expected = max((c for c in range(step, limit // step * step + 1, step) if total(c) <= budget), default=None)
        for fixed in (0, base, rng.randrange(0, 2 * base)):  # the first guess's part that does not grow: any
            probes: list[int] = []
            got = search(lambda c, probes=probes: probes.append(c) or total(c), budget, step, limit // step * step,
                         start or step, fixed)
            assert got == expected and len(probes) <= 16, (case, got, expected, probes)



def test_a_plan_that_jumps_at_each_loss_piece_is_searched_piece_by_piece_first():
    """A window one token past a multiple of the loss chunk has one more piece, and its plan jumps there (qwen3.5
    near 82k tokens: 10.6 MiB, where a token adds 0.08): told the period, the search runs over its multiples
    first, then within the one stretch after the last that fits, where the plan is a line. The same answers as
    every window tried in turn, in fewer probes over the cases, and never more than 17; the same where a window
    known to fit is given (`floor`)."""
    rng = random.Random(1)
    probes = {0: 0, 1: 0}
    for case in range(300):
        period, limit = rng.choice([32, 64, 256]), rng.randrange(256, 6000)
        base, slope, curve = rng.randrange(1, 10**6), rng.randrange(1, 10**4), rng.random() * (case % 2)
        hop = rng.randrange(50, 200) * slope

        def total(c: int, base=base, slope=slope, curve=curve, hop=hop, period=period) -> int:
            return int(base + slope * c + curve * c * c / 8 + hop * -(-c // period))

        budget = rng.randrange(base, total(limit) * 2)
        expected = max((c for c in range(1, limit + 1) if total(c) <= budget), default=None)
        for told in (0, 1):
            tried: list[int] = []
            got = search(lambda c, tried=tried: tried.append(c) or total(c), budget, 1, limit, min(2048, limit),
                         period=period * told)
            assert got == expected and len(tried) <= 17, (case, told, got, expected, tried)
            probes[told] += len(tried)
        if expected is not None:  # a window known to fit (the search again, under the policy that fits there)
            floor = rng.randint(1, expected)
            assert search(total, budget, 1, limit, floor, period=period, floor=floor) == expected, (case, floor)
    assert probes[1] < probes[0] * 0.95, probes

def _check(s: TrainSettings, budget: gate.Budget) -> list:
    planners = gate.Planners(load_config(s.model))
    answers = longest(s, budget, planners)
    assert [a.path for a in answers] == ["window", "walk"]
    for a in answers:
        assert a.ctx is not None, a.reason
        at = s.model_copy(update={"ctx": a.ctx, "path": a.path})
        admitted = gate.admit(at, budget, planners=planners)
        assert admitted.plan.total <= budget.bytes
        assert a.admitted is not None and a.admitted.plan.total == admitted.plan.total
        if a.capped:
            assert a.ctx == max_ctx(planners.config) // a.step * a.step
            continue
        with pytest.raises(GateRefused):  # the next allowed window: a refusal, with every policy the gate has
            gate.admit(s.model_copy(update={"ctx": a.ctx + a.step, "path": a.path}), budget, planners=planners)
        planners.forget_graphs()
    return answers


def test_smollm2_lora_within_640_mib():
    """The embedded SmolLM2 (a GGUF, its weights held as Q4_1 blocks), LoRA, 640 MiB: neither path reaches the
    model's 8,192 tokens (in 1 GiB the window path does)."""
    window, walk = _check(TrainSettings(), gate.Budget(640 * MiB, "--memory-budget"))
    assert not window.capped and not walk.capped
    assert walk.ctx % 256 == 0


def test_the_models_maximum_context_caps_it():
    """tiny-llama (its 2,048 tokens) with far more memory than it needs there: both paths are capped."""
    window, walk = _check(TrainSettings(model="tiny-llama"), gate.Budget(1 << 30, "--memory-budget"))
    assert window.capped and walk.capped and window.ctx == walk.ctx == 2048


def test_where_the_weights_alone_are_over_the_budget_it_says_so_after_one_probe():
    """tiny-llama, full fine-tuning, 1 MiB: its weights and AdamW's states alone plan 1.2 MiB. Each path says so
    from its first probe, and the gate refuses the shortest window it allows (one token; one chunk on the walk)."""
    s, budget = TrainSettings(model="tiny-llama", lora=False), gate.Budget(1 * MiB, "--memory-budget")
    planners = gate.Planners(load_config(s.model))
    for a in longest(s, budget, planners):
        assert a.ctx is None and len(a.probes) == 1, (a.path, a.probes)
        assert "what every window holds (the weights, the optimizer's state) plans 1.2 MiB" in a.reason, a.reason
        with pytest.raises(GateRefused):
            gate.admit(s.model_copy(update={"ctx": a.step, "path": a.path}), budget, planners=planners)


def test_the_command_line_answers_with_both_paths(capsys):
    assert cli.main(["plan", "--model", "tiny-llama", "--ctx", "max", "--memory-budget", "4MiB", "--full",
                     "--ubatch", "64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ctx"] == "max" and out["budget"] == 4 * MiB and out["max_ctx"] == 2048
    window, walk = out["paths"]["window"], out["paths"]["walk"]
    assert 0 < window["ctx"] < 2048 and window["plan"]["total"] <= 4 * MiB < window["next"]["total"]
    assert walk["ctx"] % 64 == 0 and walk["next"]["ctx"] == walk["ctx"] + 64
    assert window["optimizer"].startswith("optimizer: in the backward")



@pytest.mark.parametrize("bad", ["0", "maximum", "-1"])
def test_a_bad_ctx_is_a_usage_error_that_names_max(capsys, bad):
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", "--ctx", bad])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --ctx" in err and err.rstrip().endswith("or max"), err



def test_the_document_says_plan_takes_max_and_train_does_not():
    from remat.serve.app import create_app

    doc = create_app(model="tiny-llama").openapi()
    schemas, plan = doc["components"]["schemas"], doc["paths"]["/train/plan"]["post"]
    assert {"const": "max", "type": "string"} in schemas["PlanRequest"]["properties"]["ctx"]["anyOf"]
    assert "max" not in json.dumps(schemas["TrainRequest"]["properties"]["ctx"])
    assert plan["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/PlanRequest")
    answers = plan["responses"]["200"]["content"]["application/json"]["schema"]["anyOf"]
    assert [a["$ref"].rsplit("/", 1)[1] for a in answers] == ["Plan", "Longest"]
    assert set(schemas["Longest"]["required"]) == {"ctx", "budget", "max_ctx", "paths"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from serve_process import Server

    s = Server(tmp_path_factory.mktemp("serve") / "state").start()  # tiny-llama
    yield s
    s.stop()


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_the_server_answers_as_the_command_line(server, capsys):
    """POST /train/plan with "ctx": "max" answers what `remat plan --ctx max --json` prints, path for path; a bad
    ctx is a 400 naming it, and POST /train takes no "max" (a job runs at one window)."""
    job = {"data": [{"text": "the cat sat on the mat. " * 6}] * 2, "ctx": "max", "lora": False, "ubatch": 64,
           "dtype": "float32",  # the server, another process, resolves auto for its CPU
           "memory_budget": "4MiB"}
    got = server.ok("POST", "/train/plan", job)
    assert cli.main(["plan", "--model", "tiny-llama", "--ctx", "max", "--memory-budget", "4MiB", "--full",
                     "--ubatch", "64", "--json"]) == 0
    expected = json.loads(capsys.readouterr().out)
    assert got["ctx"] == "max" and got["budget"] == 4 * MiB and got["max_ctx"] == expected["max_ctx"]
    assert got["paths"] == expected["paths"] and got["paths"]["window"]["ctx"] > 0
    for bad in ("maximum", 0, -1, 1.5, None, True):
        status, out = server.request("POST", "/train/plan", {**job, "ctx": bad})
        if bad is None:  # not sent: the server's default window
            assert status == 200 and "policy" in out, out
            continue
        assert status == 400 and "ctx" in out["error"]["message"], (bad, out)
    status, out = server.request("POST", "/train", job)
    assert status == 400 and "ctx" in out["error"]["message"], out


def test_the_command_line_says_when_the_models_maximum_is_the_limit(capsys):
    assert cli.main(["plan", "--model", "tiny-llama", "--ctx", "max", "--memory-budget", "1GiB", "--full"]) == 0
    out = capsys.readouterr().out
    for path in ("window", "walk"):
        assert f"  {path}: 2,048 tokens (recompute " in out and f"\n{path} at 2,048 tokens: recompute " in out, out
    assert out.count("the model's maximum context") == 2 and "would plan" not in out, out


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_jobs_plan_waits_for_one_probe_of_a_search_not_the_whole(tmp_path):
    """The server's search takes the planning lock a probe at a time: a job's plan asked while it runs (tiny-llama,
    real planners, one thread each) is answered before the search ends, and the search's answer is the one it
    gives alone."""
    import threading
    import time

    from remat.serve.jobs import JobManager
    from remat.serve.scheduler import Scheduler

    m = JobManager(model="tiny-llama", state_dir=tmp_path, scheduler=Scheduler())
    text = [{"text": "the cat sat on the mat. " * 6}] * 2
    search = {"data": text, "ctx": "max", "lora": False, "ubatch": 64, "memory_budget": "4MiB"}
    done: dict[str, float] = {}
    got: dict[str, dict] = {}

    def run() -> None:
        got["max"] = m.plan(search)
        done["max"] = time.monotonic()

    try:
        thread = threading.Thread(target=run)
        thread.start()
        while not m.torch._lock.locked() and thread.is_alive():  # the search's first probe has the lock
            time.sleep(0.001)
        job = m.plan({"data": text, "ctx": 32})
        done["job"] = time.monotonic()
        thread.join(120)
        assert job["plan"]["total"] > 0 and done["job"] < done["max"], done
        assert got["max"]["paths"] == m.plan(search)["paths"]
    finally:
        m.close()


def test_the_search_holds_one_probes_graphs_and_the_longest_fitting_windows():
    """Each probe's graphs are dropped once the next is planned, but the longest window that fits so far (the
    answer's, planned again under every policy at the end): at every probe the planners hold the graphs of at most
    three windows (that one, the last probe's, the one planned), and the answer still fits where the next window
    does not (SmolLM2 in 640 MiB: its window is a graph of ~15k nodes; every probe's kept, qwen3.5-0.8b's search
    near 80k tokens held 6.9 GB)."""
    import contextlib

    s, budget = TrainSettings(), gate.Budget(640 * MiB, "--memory-budget")
    planners = gate.Planners(load_config(s.model))
    held: list[int] = []

    @contextlib.contextmanager
    def turn():
        held.append(sum(bool(kept.graphs) for p in planners._planners.values() for kept in p._shapes.values()))
        yield

    window = longest(s, budget, planners, turn=turn, paths=("window",))[0]
    assert window.ctx is not None and len(window.probes) >= 3 and max(held) <= 3, held
    fresh = gate.Planners(load_config(s.model))
    assert gate.admit(s.model_copy(update={"ctx": window.ctx}), budget, planners=fresh).plan == window.admitted.plan
    with pytest.raises(GateRefused):
        gate.admit(s.model_copy(update={"ctx": window.ctx + 1}), budget, planners=fresh)
