"""`--device` on this machine: the setting everywhere it is taken, plans for a CUDA job made without a GPU (fake
tensors, CUDA's kernels), the gate on a device's memory and the host's beside it, offload planned (and its graph
run, on the CPU, bitwise as `on`), and a run on a device this machine lacks refused in one line. What needs a
GPU is in test_cuda.py."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers
from pydantic import ValidationError
from torch.multiprocessing.reductions import StorageWeakRef

from planning import planner_of, sweep
from remat import cli
from remat.base.settings import GateRefused, ServeSettings, TrainSettings
from remat.core import attention, devices, offload, policies
from remat.core import plan as plan_module
from remat.core.capture import EagerStridesFakeMode
from remat.core.graph import tensors_in
from remat.core.plan import HOST, Plan, mib, plan
from remat.models.load import load_config
from remat.serve.schemas import TrainRequest
from remat.training import gate
from remat.training.step import DEVICE_LADDER, LADDER, Planner, StepShape

CUDA = torch.device("cuda", 0)
no_cuda_here = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
pytestmark = pytest.mark.usefixtures("one_thread")


def planning_model(config: transformers.PretrainedConfig, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A model of `config` on fake weights in `dtype` (what `gate.Planners` makes, in another dtype)."""
    with EagerStridesFakeMode(allow_non_fake_inputs=True):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)


def deep_llama(layers: int = 8) -> transformers.PretrainedConfig:
    """tiny-llama deeper: its marks are a large part of what `on` keeps across the backward."""
    return load_config("tiny-llama", num_layers=layers)


# ---------------------------------------------------------------------------------------------- the setting


def test_the_device_is_one_setting_that_the_cli_the_server_and_train_take():
    assert TrainSettings().device == "auto" and ServeSettings().device == "auto"
    assert TrainSettings(device=" CUDA:1 ").device == "cuda:1"
    for bad in ("gpu", "cuda:", "cuda:x", "tpu", "cpu:0"):
        with pytest.raises(ValidationError):
            TrainSettings(device=bad)
    p = cli.parser()
    for command in (["finetune"], ["plan"], ["serve"]):
        assert p.parse_args([*command, "--device", "cuda:0"]).device == "cuda:0"
    assert "--device" in p._subparsers._group_actions[0].choices["plan"].format_help()  # type: ignore[union-attr]
    request = TrainRequest.model_validate({"data": [{"text": "x"}], "device": "cuda:0"})
    assert request.device == "cuda:0"  # type: ignore[attr-defined]
    with pytest.raises(ValidationError):
        TrainRequest.model_validate({"data": [{"text": "x"}], "device": "gpu"})


def test_auto_is_cuda_where_present_else_mps_else_the_cpu():
    expected = ("cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu")
    assert devices.resolve("auto").type == expected
    assert devices.resolve("cpu") == torch.device("cpu")
    assert devices.planned("cuda") == CUDA and devices.planned("cuda:3") == torch.device("cuda", 3)


@no_cuda_here
def test_a_run_on_a_device_this_machine_lacks_fails_in_one_line_and_writes_nothing(tmp_path, capsys):
    out, state = tmp_path / "out", tmp_path / "state"
    code = cli.main(["finetune", "--model", "tiny-llama", "--device", "cuda", "--ctx", "16", "--steps", "1",
                     "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("remat: error: --device cuda: ")
    assert "remat plan --device cuda" in err  # what to do instead: plan it
    assert not out.exists()
    assert cli.main(["serve", "--model", "tiny-llama", "--device", "cuda:1", "--state-dir", str(state)]) == 2
    assert capsys.readouterr().err.count("\n") == 1 and not state.exists()


# ---------------------------------------------------------------------------------------------- plans


def test_remat_plan_plans_a_cuda_job_without_a_gpu(capsys):
    assert cli.main(["plan", "--model", "tiny-llama", "--ctx", "64", "--full", "--device", "cuda", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["device"] == "cuda:0" and set(answer["plans"]) == {"off", "on"}
    for p in answer["plans"].values():
        assert p["device"] == "cuda:0" and p["workspace"] == 0  # fused AdamW updates in place
        assert p["total"] == p["params"] + p["frozen"] + p["optimizer"] + p["cache"] + max(p["step"], p["grads"])
        assert p["host"] == p["runtime"] + p["trace"] + p["offload"] == 0
    assert cli.main(["plan", "--model", "tiny-llama", "--ctx", "64", "--full", "--device", "cuda"]) == 0
    table = capsys.readouterr().out
    assert "host" in table and "total: cuda:0's memory" in table


def test_a_cpu_plan_keeps_its_figures():
    """A CPU plan reads as it always did (tests/test_golden.py holds the figures): no device, offload or host."""
    p = Plan(params=1, frozen=2, grads=1, optimizer=8, graph=5, step=6, workspace=3, trace=7, runtime=11)
    assert set(p.as_dict()) == {"params", "frozen", "grads", "optimizer", "graph", "cache", "step", "workspace",
                                "trace", "runtime", "total"}
    assert p.total == 1 + 2 + 8 + 7 + 11 + 6 and p.host == 0
    on_device = dataclasses.replace(p, device="cuda:0", offload=13)
    assert on_device.total == 1 + 2 + 8 + 6 and on_device.host == 7 + 11 + 13
    assert on_device.as_dict()["host"] == on_device.host and on_device.as_dict()["device"] == "cuda:0"


def _peak_without_rng_state(tg) -> int:
    """The graph's peak without the storages of the random-number state CUDA's kernels return (their results
    after the output and the logsumexp; the CPU's return none)."""
    nodes, life, outputs = plan_module._lifetimes(tg)
    rng = {StorageWeakRef(t.untyped_storage()) for n in nodes if n.target in attention.KERNEL_OPS.values()
           for t in tensors_in(n.meta["val"][2:])}
    return sweep(len(nodes), {s: v for s, v in life.items() if s not in rng}, outputs)[0]


@pytest.mark.parametrize("dtype, kernel", [(torch.float32, attention.EFFICIENT), (torch.bfloat16, attention.FLASH)])
def test_a_cuda_plans_graph_is_the_cpus_but_for_its_kernels_rng_state_and_workspace(dtype, kernel):
    """Without grouped heads the same tensors go into attention on both devices (the CPU's flash kernel, CUDA's
    flash or efficient one): the step's graph is the CPU's to the byte, but for the random-number state CUDA's
    kernels return (live at the peak), and at most the largest of their backwards' workspaces above it."""
    config = load_config("tiny-llama")
    config.num_key_value_heads = config.num_attention_heads
    shape = StepShape("window", 2, 64, None, 0)
    cpu, cuda = (Planner(planning_model(config, dtype), device) for device in (torch.device("cpu"), CUDA))
    for policy in ("off", "on"):
        here, there = cpu.build(shape, policy), cuda.build(shape, policy)
        kernels = {n.target for n in there.graph.nodes if n.target in attention.KERNEL_OPS.values()}
        assert kernels == {attention.KERNEL_OPS[kernel]}
        bare = dataclasses.replace(there, workspaces={})
        assert _peak_without_rng_state(bare) == plan(here).graph
        assert 0 <= plan(bare).graph - plan(here).graph <= 64 * 2  # a few scalars of RNG state per kernel call
        held = max(there.workspace(n) for n in there.graph.nodes)
        assert held > 0 and plan(bare).graph <= plan(there).graph <= plan(bare).graph + held
        if kernel == attention.FLASH:  # its deterministic backward's dQ accumulators are the step's peak
            assert plan(there).graph > plan(bare).graph


def test_the_attention_kernel_is_chosen_by_what_the_step_allows():
    def qkv(dtype, heads=8, kv_heads=8, size=64, n=32):
        return (torch.empty(1, heads, n, size, dtype=dtype, device="meta"),
                torch.empty(1, kv_heads, n, size, dtype=dtype, device="meta"))

    def chosen(dtype, mask=None, causal=True, device=CUDA, **kw):
        q, k = qkv(dtype, **kw)
        return attention.kernel(device, q, k, k, mask, causal)

    mask = torch.empty(1, 1, 32, 32, dtype=torch.bool, device="meta")
    assert chosen(torch.bfloat16) == chosen(torch.float16) == chosen(torch.bfloat16, kv_heads=2) == attention.FLASH
    assert chosen(torch.float32) == chosen(torch.bfloat16, mask=mask) == attention.EFFICIENT
    assert chosen(torch.bfloat16, size=320) == chosen(torch.float32, kv_heads=2) == attention.EFFICIENT
    assert chosen(torch.float64) == chosen(torch.float16, size=20) == attention.MATH
    assert chosen(torch.bfloat16, device=torch.device("mps")) == attention.MATH


# ---------------------------------------------------------------------------------------------- the gate


def test_a_device_budget_names_its_memory_and_the_hosts():
    host = gate.Budget(1 << 30, "free memory", read=True)
    budget = gate.Budget(2 << 30, "free memory of cuda:0", read=True, device="cuda:0", host=host)
    assert str(budget) == "2,048.0 MiB of cuda:0 (free memory of cuda:0); host 1,024.0 MiB (free memory)"
    grown = budget.less("the trace", 1 << 20)  # the process grows in host memory
    assert (grown.bytes, grown.host.bytes) == (2 << 30, (1 << 30) - (1 << 20))  # type: ignore[union-attr]
    decoding = budget.less("the decode slots' KV caches", 1 << 20, on_device=True)
    assert (decoding.bytes, decoding.host) == ((2 << 30) - (1 << 20), host)
    assert gate.Budget.of(5 << 30, device="cuda").device == "cuda:0"
    assert str(gate.Budget.of(1 << 30)) == "1,024.0 MiB (--memory-budget)"  # a CPU budget as it always was


def test_the_gate_refuses_a_job_over_the_device_budget_with_figures():
    # the optimizer after the backward: with auto, a budget under these plans would put it inside instead
    s = TrainSettings(model="tiny-llama", ctx=64, lora=False, device="cuda", recompute="budget",
                      optimizer_in_backward="off")
    plans = planner_of(s).plans(StepShape.of(s), DEVICE_LADDER)
    smallest = min(p.total for p in plans.values())
    with pytest.raises(GateRefused) as refused:
        gate.admit(s, gate.Budget.of(smallest - 1, device="cuda"))
    message = str(refused.value)
    assert f"the memory budget of cuda:0 {mib(smallest - 1)}" in message and mib(smallest) in message
    assert set(refused.value.plans) == set(DEVICE_LADDER)
    assert all(p["device"] == "cuda:0" for p in refused.value.plans.values())


def test_offload_moves_the_checkpoints_bytes_from_the_device_to_the_host():
    s = TrainSettings(model="tiny-llama", ctx=256, batch=2, device="cuda")  # LoRA: few grads at the end
    config = deep_llama()
    cuda = planner_of(s, config).plans(StepShape.of(s), ("on", "offload"))
    marks = config.num_hidden_layers * s.batch * s.ctx * config.hidden_size * 4  # every layer's mark, fp32
    on, moved = cuda["on"], cuda["offload"]
    assert moved.offload == moved.host == marks and on.host == 0
    assert moved.graph < on.graph and on.graph - moved.graph <= marks and moved.total < on.total
    same = ("params", "frozen", "grads", "optimizer", "cache", "workspace")
    assert [getattr(moved, c) for c in same] == [getattr(on, c) for c in same]
    cpu = planner_of(s.model_copy(update={"device": "cpu"}), config).plans(StepShape.of(s), ("on", "offload"))
    assert cpu["offload"] == cpu["on"]  # no memory of its own to spare: offload is on


def test_offload_is_a_rung_on_a_device_where_the_host_holds_its_checkpoints():
    s = TrainSettings(model="tiny-llama", ctx=256, batch=2, device="cuda", recompute="budget")
    config = deep_llama()
    planners = gate.Planners(config)
    plans = planners.planner(s, gate.Budget.unlimited()).plans(StepShape.of(s), DEVICE_LADDER)
    on, moved = plans["on"], plans["offload"]
    between = (on.total + moved.total) // 2
    assert gate.admit(s, gate.Budget.of(between, device="cuda"), planners=planners).policy == "offload"
    short = gate.Budget(moved.host - 1, "--memory-budget")  # the host cannot hold the checkpoints
    budget = dataclasses.replace(gate.Budget.of(between, device="cuda"), host=short)
    chosen = gate.admit(s, budget, planners=planners).choice
    assert chosen.policy.startswith("every:") and "offload plans" in chosen.reason
    assert f"(host {mib(moved.host)}, over the host's {mib(moved.host - 1)})" in chosen.reason
    cpu = Planner(planners.base(), torch.device("cpu"))
    assert cpu.ladder == LADDER and "offload" not in LADDER


def test_the_offload_pass_runs_bitwise_as_on_and_moves_every_mark(get_case):
    """The pass on the CPU (its copies are plain copies there: the streams are CUDA's): the same losses and grads
    as `on`, to the bit; each kept mark copied out once and back once, the backward reading only the copy back."""
    case = get_case("tiny-llama")
    on = case.rt
    moved = offload.apply(on, policies.offload(), torch.device("cpu"))
    marks = [n for n in moved.forward_nodes() if n.target is offload.OFFLOAD]
    kept = [n for n in on.forward_nodes() if policies.layer_index(n) is not None]
    assert len(marks) == len(kept) == case.model.config.num_hidden_layers
    nodes = list(moved.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    end = pos[moved.boundary]
    for h in marks:
        (mark,) = h.all_input_nodes
        assert all(pos[u] <= end for u in mark.users)  # the device's copy: read by the forward alone
        (back,) = h.users
        assert back.target is offload.RELOAD and pos[back] > end and back.args[1] == torch.device("cpu")
        ready = next(u for u in back.users if u.target is offload.READY)
        assert pos[ready] < min(pos[u] for u in back.users if u is not ready)  # waited for before it is read
        assert h.meta[HOST]
    loss, grads = case.run(moved)
    loss_on, grads_on = case.run(on)
    assert torch.equal(loss, loss_on) and all(torch.equal(a, b) for a, b in zip(grads, grads_on))
    assert plan(moved).offload == sum(t.nbytes for t in (n.meta["val"] for n in kept))
