"""The compute dtype (`--dtype`, `remat.core.precision`): mixed precision with float32 master weights.

The suite pins `auto` to float32 in its own process (conftest.auto_is_float32); these tests ask for bfloat16 by
name, and test `auto`'s resolution with the real `resolve`, taken at import (before the session's pin).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch
from pydantic import ValidationError

from planning import plan_settings, planner_of
from remat.base.settings import TrainSettings, UsageError
from remat.core import alias, policies, precision
from remat.core.graph import StepInputs
from remat.core.plan import measure, plan
from remat.core.recompute import LAYER, Rewriter, rewrite
from remat.models.adapters import LoraSettings, apply_lora
from remat.models.hf import causal_lm_loss
from remat.models.load import load_model
from remat.models.steps import window_step
from remat.training.step import StepShape
from remat.training.train import finetune

REAL_RESOLVE = precision.resolve  # the module's own, not the suite's pin (conftest.auto_is_float32)
BF16 = torch.bfloat16

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def fresh_resolve():
    """`resolve` is cached per argument: each test of auto's resolution starts from an empty cache."""
    REAL_RESOLVE.cache_clear()
    yield REAL_RESOLVE
    REAL_RESOLVE.cache_clear()


# --------------------------------------------------------------------------------------------------
# resolve: what --dtype computes in, and why


@pytest.mark.parametrize("asked, dtype", [("float32", torch.float32), ("bfloat16", BF16), ("float16", torch.float16)])
def test_an_explicit_dtype_is_taken_as_asked(fresh_resolve, asked, dtype):
    p = fresh_resolve(asked)
    assert (p.dtype, p.name, p.reason) == (dtype, asked, f"--dtype {asked}")


@pytest.mark.parametrize("flags, named", [({"avx512_bf16", "avx512f"}, "AVX512-BF16"), ({"amx_bf16"}, "AMX-BF16")])
def test_auto_is_bfloat16_on_a_cpu_that_computes_it(fresh_resolve, monkeypatch, flags, named):
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset(flags))
    p = fresh_resolve("auto")
    assert p.dtype == BF16 and p.reason.startswith("auto:") and named in p.reason, p


def test_auto_is_float32_on_a_cpu_without_bfloat16(fresh_resolve, monkeypatch):
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    p = fresh_resolve("auto")
    assert p.dtype == torch.float32 and "no native bfloat16" in p.reason, p


def test_auto_on_this_machine_follows_its_cpu_flags(fresh_resolve):
    p = fresh_resolve("auto")
    native = bool(precision.cpu_flags() & set(precision.NATIVE_BF16))
    assert (p.dtype == BF16) == (native or "AMX" in torch.backends.cpu.get_cpu_capability()), p


@pytest.mark.parametrize("supported", [True, False])
def test_auto_on_cuda_asks_the_device(fresh_resolve, monkeypatch, supported):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **kw: supported)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **kw: "a test GPU")
    p = fresh_resolve("auto", "cuda")
    assert p.dtype == (BF16 if supported else torch.float32) and "a test GPU" in p.reason, p
    if not supported:
        with pytest.raises(UsageError, match="cannot compute bfloat16"):
            fresh_resolve("bfloat16", "cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="planning for CUDA without one: this machine has one")
def test_a_cuda_job_planned_without_a_gpu_computes_in_bfloat16(fresh_resolve, monkeypatch):
    """`remat plan --device cuda` on a machine without a GPU plans what auto would choose on any card since Ampere;
    the CPU's flags do not decide it (they did: a CPU without AVX512-BF16 planned a GPU job in float32)."""
    p = fresh_resolve("auto", "cuda:1")
    assert p.dtype == BF16 and "CUDA" in p.reason and "none here" in p.reason, p
    assert fresh_resolve("bfloat16", "cuda").dtype == BF16
    monkeypatch.setattr(precision, "resolve", fresh_resolve)  # the step's shape as a process without the pin has it
    assert StepShape.of(TrainSettings(dtype="auto", device="cuda")).dtype == "bfloat16"


def test_an_unknown_dtype_is_a_usage_error_of_one_line(fresh_resolve):
    with pytest.raises(UsageError) as e:
        fresh_resolve("float64")
    assert "\n" not in str(e.value) and "--dtype float64" in str(e.value), e.value
    with pytest.raises(ValidationError):
        TrainSettings(dtype="float64")


@pytest.mark.parametrize("command", ["finetune", "plan"])
def test_cli_dtype_float64_exits_2_with_one_line_and_writes_nothing(tmp_path, command):
    out = tmp_path / "out"
    argv = [command, "--model", "tiny-llama", "--ctx", "32", "--dtype", "float64"]
    argv += ["--out", str(out)] if command == "finetune" else []
    r = subprocess.run([sys.executable, "-m", "remat", *argv], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path, check=False)
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and r.stdout == "" and len(lines) == 1, r
    assert lines[0].startswith("remat: error:") and "dtype" in lines[0] and "float64" in lines[0], r
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == [], list(tmp_path.iterdir())


def test_the_cli_says_what_the_step_computes_in(tmp_path):
    """`remat plan --json` and `remat finetune`'s printed summary name the dtype and why (a subprocess: no pin)."""
    def remat(*argv: str) -> str:
        r = subprocess.run([sys.executable, "-m", "remat", *argv, "--model", "tiny-llama", "--ctx", "32"],
                           capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False)
        assert r.returncode == 0, r
        return r.stdout

    planned = json.loads(remat("plan", "--json", "--dtype", "bfloat16"))
    assert (planned["dtype"], planned["dtype_reason"]) == ("bfloat16", "--dtype bfloat16")
    assert "compute: float32 (--dtype float32)" in remat("finetune", "--steps", "1", "--dtype", "float32").splitlines()


def test_the_suite_pins_auto_to_float32():
    """conftest.auto_is_float32: the default settings compute in float32 in this process, on any CPU."""
    assert StepShape.of(TrainSettings()).dtype == "float32"
    assert StepShape.of(TrainSettings(dtype="bfloat16")).dtype == "bfloat16"


# --------------------------------------------------------------------------------------------------
# the oracle: the model's own forward and backward with its parameters in bfloat16


def batch(vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, 64), generator=g)
    labels = torch.randint(0, vocab, (2, 64), generator=g)
    labels[:, :3] = -100
    return ids, labels


def in_bf16(model: torch.nn.Module) -> torch.nn.Module:
    """The model as transformers runs it in bfloat16: every parameter cast (buffers as they are: the rotary
    tables are computed in float32 by the model itself, as `from_pretrained(dtype=torch.bfloat16)` leaves them)."""
    twin = copy.deepcopy(model)
    for p in twin.parameters():
        p.data = p.data.to(BF16)
    return twin


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen35"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_bf16_step_is_the_models_own_bf16_forward_and_backward(name, lora):
    """Loss and every grad bitwise: remat's step casts each float32 weight to bfloat16 where the forward reads
    it, so the model runs the same ops on the same values as its bfloat16 twin; a weight's grad is its bf16
    twin's grad upcast (the cast's backward), the loss float32 (the logits upcast, as transformers' loss does).
    Trainable weights stay float32 and so do their grads."""
    lm = load_model(name, seed=0)
    model = apply_lora(lm.model, LoraSettings(r=4), seed=0) if lora else lm.model
    ids, labels = batch(len(lm.tokenizer))
    tg = window_step(model, ids, labels, dtype=BF16)
    inputs = StepInputs.of(model)
    assert all(p.dtype == torch.float32 for p in inputs.trainable.values())
    with torch.no_grad():
        loss, *grads = tg.gm(*inputs.args(ids, labels))

    twin = in_bf16(model)
    reference = causal_lm_loss(twin, ids, labels)
    params = dict(twin.named_parameters())
    expected = torch.autograd.grad(reference, [params[n] for n in inputs.trainable])
    assert loss.dtype == reference.dtype == torch.float32
    assert torch.equal(loss, reference), (loss, reference)
    assert all(g.dtype == torch.float32 for g in grads)
    differ = [n for n, g, e in zip(inputs.trainable, grads, expected, strict=True) if not torch.equal(g, e.float())]
    assert not differ, differ
    # and not float32's: the step really computed in bfloat16
    with torch.no_grad():
        f32_loss = window_step(model, ids, labels).gm(*inputs.args(ids, labels))[0]
    assert not torch.equal(loss, f32_loss)


def test_a_bf16_step_recomputed_is_bitwise_the_same_and_planned_as_measured(get_case):
    case = get_case("tiny-qwen35")
    tg = window_step(case.model, case.ids, case.labels, dtype=BF16)
    rt = rewrite(tg)
    out, measured = measure(tg, case.args())
    out_rt, measured_rt = measure(rt, case.args())
    assert all(torch.equal(a, b) for a, b in zip(out, out_rt, strict=True))
    for graph, seen in ((tg, measured), (rt, measured_rt)):
        assert plan(graph).step == seen.step, (plan(graph).step, seen.step)
    assert plan(rt).graph < plan(tg).graph


def test_weights_are_cast_where_read_and_no_cast_is_saved(get_case):
    """Each weight's cast is made just before its first forward reader, and the backward makes its own: no cast of
    a weight lives from the forward into the backward (`precision.casts_where_read`)."""
    case = get_case("tiny-llama")
    tg = window_step(case.model, case.ids, case.labels, dtype=BF16)
    nodes = list(tg.gm.graph.nodes)
    pos, end = {n: i for i, n in enumerate(nodes)}, nodes.index(tg.boundary)
    casts = [n for n in nodes if n.target is precision.CAST and n.args[0].op == "placeholder"]
    forward = [n for n in casts if pos[n] <= end]
    assert forward and len(casts) > len(forward)
    for n in forward:
        assert all(pos[u] <= end for u in n.users), n
        assert min(n.users, key=pos.__getitem__) is n.next, n
    assert all(precision.never_saved(n) for n in casts)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen35"])
def test_the_heads_weight_is_cast_once_for_each_loss_pieces_backward(get_case, name):
    """The head's weight is read by every loss piece's forward; recomputed for the backward, its cast is made for
    each piece's logits and read again by that piece's own backward product (`Rewriter._same_cast`), not made
    once for all the pieces: that lived across every piece's backward beside each piece's own (qwen3.5-0.8b in
    bfloat16 at ctx 512: 485 MiB of its 1,013 MiB graph), and a cast for each reader cast twice as often (0.23 s
    a cast of qwen3.5's head). Outputs bitwise the trace's, and the plan the step's measured memory."""
    case = get_case(name)
    pieces = 4
    tg = window_step(case.model, case.ids, case.labels, loss_chunk=case.ids.shape[1] // pieces, dtype=BF16)
    rt = rewrite(tg)
    nodes = list(rt.gm.graph.nodes)
    end = nodes.index(rt.boundary)
    vocab = case.model.config.vocab_size
    heads = [n for n in nodes[end + 1:] if n.target is precision.CAST and n.args[0].op == "placeholder"
             and n.meta["val"].shape[0] == vocab]

    def readers(n):  # through views made of it alone (a weight's transpose)
        views = [u for u in n.users if alias.view_source(u) is n and u.all_input_nodes == [n]]
        return [u for u in n.users if u not in views] + [r for v in views for r in readers(v)]

    heads = [n for n in heads if torch.ops.aten.embedding.default not in {r.target for r in readers(n)}]
    assert len(heads) == pieces and all(len(readers(n)) == 2 for n in heads), [(n, readers(n)) for n in heads]
    out, _ = measure(tg, case.args())
    out_rt, measured_rt = measure(rt, case.args())
    assert all(torch.equal(a, b) for a, b in zip(out, out_rt, strict=True))
    assert plan(rt).step == measured_rt.step, (plan(rt).step, measured_rt.step)


# --------------------------------------------------------------------------------------------------
# training in bfloat16: recompute on == off, bitwise, on the window and the exact walk, LoRA and full


RUN = {"model": "tiny-llama", "ctx": 64, "batch": 2, "steps": 2, "dtype": "bfloat16"}
PATHS = {"window": {}, "exact walk": {"path": "walk", "walk": "exact", "ubatch": 16}}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_bf16_training_recompute_on_is_off_bitwise(path, lora):
    runs = [finetune(TrainSettings(**RUN, **PATHS[path], lora=lora, recompute=rc), progress=False).as_dict()
            for rc in ("off", "on")]
    off, on = runs
    assert off["losses"] == on["losses"], (off["losses"], on["losses"])
    assert len(off["losses"]) == 2 and off["losses"][1] != off["losses"][0]
    for r in runs:
        assert (r["dtype"], r["dtype_reason"]) == ("bfloat16", "--dtype bfloat16")
        assert r["plan"]["params"] == 4 * r["trainable_parameters"]  # float32 master weights
        assert r["plan"]["optimizer"] >= 8 * r["trainable_parameters"]  # AdamW's two float32 states
    assert on["plan"]["graph"] <= off["plan"]["graph"]  # a walk chunk of 16 tokens: a weight's grad may be the peak


def test_bf16_training_on_tiny_qwen35_exact_walk():
    """A hybrid model (gated delta rule, carried conv and recurrent states in the compute dtype) in bfloat16."""
    runs = [finetune(TrainSettings(**{**RUN, "model": "tiny-qwen35"}, **PATHS["exact walk"], recompute=rc),
                     progress=False).as_dict() for rc in ("off", "on")]
    assert runs[0]["losses"] == runs[1]["losses"]


def test_the_receipt_of_a_float32_run_says_so():
    r = finetune(TrainSettings(**{**RUN, "dtype": "float32", "steps": 1}), progress=False).as_dict()
    assert (r["dtype"], r["dtype_reason"]) == ("float32", "--dtype float32")


# --------------------------------------------------------------------------------------------------
# plans


def test_bf16_does_not_plan_more_than_float32_with_many_loss_pieces():
    """qwen3.5-0.8b at ctx 4,096 (128 loss pieces of 32 tokens), LoRA, recompute on: the bfloat16 step's graph is
    below float32's (1,135 MiB against 1,576; 1,204 while the recompute made the head's cast once for every piece).
    A loss that saved a value of the forward's cross-entropy for its backward had the rewrite make that node again
    there, keeping every piece's float32 log-probabilities until then (5,046 MiB). Not at short windows: there the
    bfloat16 cast of the tied 248,320 x 1,024 head (485 MiB) outweighs the activations (ctx 1,024: 635 MiB against
    float32's 396)."""
    graphs = {dtype: plan_settings(TrainSettings(model="qwen3.5-0.8b", ctx=4096, dtype=dtype), ("on",))["on"].graph
              for dtype in ("float32", "bfloat16")}
    assert graphs["bfloat16"] < 0.75 * graphs["float32"], {k: v / 2**20 for k, v in graphs.items()}


def test_bf16_halves_smollm2s_graph():
    """SmolLM2, full fine-tuning at ctx 2048, recompute off, planned from its config: the bfloat16 step's graph
    is at most 0.55 of float32's. Not 0.5: the loss's float32 log-probabilities (a piece at a time) are the same
    bytes in both, and a tied head's weight cast to bfloat16 and its bfloat16 grad are made in the step."""
    graphs = {}
    for dtype in ("float32", "bfloat16"):
        # the optimizer after the backward: the grads are a set, planned
        p = plan_settings(TrainSettings(ctx=2048, lora=False, dtype=dtype, optimizer_in_backward="off"),
                          ("off",))["off"]
        graphs[dtype] = p.graph
        assert p.params == p.grads == p.optimizer // 2  # float32 master weights, grads and AdamW state
    assert graphs["bfloat16"] <= 0.55 * graphs["float32"], {k: v / 2**20 for k, v in graphs.items()}


def test_a_bf16_plan_stamped_from_a_few_layers_is_the_whole_traces():
    """A planning model's bfloat16 step is stamped from a few layers (`remat.fastplan`), as float32's: each weight's
    grad made float32 where it is made (`precision.upcasts_where_made`), not all at the backward's end, keeps the
    backward layer by layer. Its plans are the whole trace's, per policy."""
    s = TrainSettings(ctx=128, lora=False, dtype="bfloat16", optimizer_in_backward="off", loss_chunk=256)
    planner, shape = planner_of(s), StepShape.of(s)
    stamped = planner.plans(shape, ("off", "on", "dots"))
    assert planner._at(shape).kept.stamper is not None  # stamped, not traced whole
    ids = torch.zeros(shape.batch, shape.ctx, dtype=torch.long)
    whole = window_step(planner.model, ids, ids.clone(), loss_chunk=shape.loss_chunk, dtype=BF16)
    rewriter = Rewriter(whole)
    for name, policy in (("off", policies.everything()), ("on", LAYER), ("dots", policies.parse("dots"))):
        assert stamped[name].as_dict() == rewriter.plan(policy).as_dict(), name


def test_each_weights_grad_is_made_float32_where_it_is_made(get_case):
    case = get_case("tiny-llama")
    tg = window_step(case.model, case.ids, case.labels, dtype=BF16)
    nodes = list(tg.gm.graph.nodes)
    end = nodes.index(tg.boundary)
    upcasts = [n for n in nodes[end + 1:] if n.target is precision.CAST and precision.never_saved(n)
               and n.args[0] in nodes[end + 1:]]
    assert upcasts and all(n.prev is n.args[0] for n in upcasts)



def test_a_bf16_lora_walk_chunk_is_stamped_and_planned_as_traced_whole():
    """The walk's LoRA grads go into their sums through a hook (`capture.into`) whose zero reads the grad made
    float32: moved with its upcast to where the grad is made, the backward stays layer by layer and the default
    model's walk chunk is stamped (it was traced whole at every probe of `remat plan --ctx max`). Its plans are the
    whole trace's, to the byte."""
    s = TrainSettings(ctx=512, path="walk", ubatch=256, dtype="bfloat16")  # the embedded SmolLM2 GGUF, LoRA
    planner, shape = planner_of(s), StepShape.of(s)
    stamped = planner.plans(shape, ("off", "on", "every:2"))
    assert planner._at(shape).kept.stamper is not None  # stamped, not traced whole
    whole = planner_of(s)
    whole.planning = False  # traced whole, every layer
    assert stamped == whole.plans(shape, ("off", "on", "every:2"))
