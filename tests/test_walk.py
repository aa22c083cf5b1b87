"""The walk path (docs/architecture.md, "The walk"): a window trained in chunks over a KV cache and carried state.

Each chunk is one traced step whose placeholders are the model's tensors, then the walk's
states (`walk.new_state`; the exact walk adds their gradient buffers), the chunk's offset, the
window's target count and the chunk's ids and labels. It returns the chunk's summed cross-entropy
over the window's target count and the grads, so a window's loss and grads are the sums over its
chunks (`train.BatchRunner.run`). The truncated walk's chunks run in order, writing the cache in
place; the exact walk's run in reverse after a forward sweep, and their grads are the window's.
"""

from __future__ import annotations

import functools

import pytest
import torch

import conformance
from planning import plan_settings
from remat.base.settings import TrainSettings
from remat.core import alias
from remat.core.capture import EagerStridesFakeMode
from remat.core.graph import StepInputs, TrainGraph
from remat.core.plan import Plan, measure, plan
from remat.core.recompute import explain, keep_reasons, rewrite, saved_nodes
from remat.models import steps
from remat.models.load import build_from_config, load_config, load_model
from remat.models.steps import window_step
from remat.training import walk
from remat.training.train import finetune

TINY = ("tiny-llama", "tiny-qwen35")
BATCH, CTX, UBATCH = 2, 64, 16


pytestmark = pytest.mark.usefixtures("one_thread")


def random_window(vocab: int, batch: int, ctx: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, ctx), generator=g)
    labels = torch.randint(0, vocab, (batch, ctx), generator=g)
    labels[:, :3] = -100  # ignored targets, as a chat mask gives; the first chunk has fewer targets
    labels[-1, -5:] = -100
    return ids, labels


def run_window(graph: TrainGraph, model: torch.nn.Module, state: dict[str, torch.Tensor], ids: torch.Tensor,
               labels: torch.Tensor, ubatch: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One window through the truncated walk's chunk graph: -> (chunk losses, the window's grads).

    Each chunk adds its grads into the window's sums (the graph's last inputs) and returns those very
    tensors: one set of grads, never a second beside it."""
    for t in state.values():
        t.zero_()  # a new window starts from an empty cache and zero recurrent state
    n_targets = (labels != -100).sum().to(torch.float32)
    tensors = StepInputs.of(model)
    sums = [torch.zeros_like(p) for p in tensors.trainable.values()]
    losses = []
    with torch.no_grad():
        for start in range(0, ids.shape[1], ubatch):
            piece = [t[:, start:start + ubatch].contiguous() for t in (ids, labels)]
            loss, *grads = graph.gm(*tensors.args(*state.values(), torch.tensor(start), n_targets, *piece, *sums))
            assert all(g is s for g, s in zip(grads, sums)) and len(grads) == len(sums)
            losses.append(loss)
    return losses, sums


def window_loss(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    tg = window_step(model, ids, labels)
    with torch.no_grad():
        return tg(*StepInputs.of(model).args(ids, labels))[0]


@functools.cache
def tiny(name: str) -> tuple[torch.nn.Module, TrainGraph]:
    """A tiny preset's model and its traced walk chunk (batch 2, ctx 64, ubatch 16), once per module."""
    model = load_model(name, seed=0).model
    return model, steps.chunk_step(model, BATCH, CTX, UBATCH)


@functools.cache
def tiny_rewritten(name: str) -> TrainGraph:
    return rewrite(tiny(name)[1])


@pytest.fixture(scope="module", autouse=True)
def _drop_cached_graphs():
    yield
    tiny.cache_clear()
    tiny_rewritten.cache_clear()
    walk_plans.cache_clear()


def roles_by_node(tg: TrainGraph) -> dict[torch.fx.Node, tuple[str, str]]:
    return {n: (role, name) for n, role, name in zip(tg.placeholders(), tg.roles, tg.names)}


def state_writes(tg: TrainGraph) -> list[tuple[torch.fx.Node, str]]:
    """In-place writes whose root is a "state" placeholder: (node, state name)."""
    root, roles = alias.roots(tg.graph), roles_by_node(tg)
    out = []
    for n in tg.graph.nodes:
        for w in alias.written(n):
            role, name = roles.get(root[w], (None, None))
            if role == "state":
                out.append((n, name))
    return out


# ------------------------------------------------------------------------------------ walk == window


@pytest.fixture(scope="module")
def smollm2():
    """The real SmolLM2-135M weights (the embedded GGUF). Loaded through the default cache, which
    converts the GGUF on first use when it is missing (~25 s), so the test does not rely on it."""
    return load_model(None).model


@pytest.mark.parametrize("name", [*TINY, "smollm2"])
def test_walk_forward_loss_equals_the_windows(name, request):
    """The walk's window loss (sum of chunk losses) equals the one-graph window loss within 1e-5
    relative. Not bitwise: each chunk attends over the full-length cache with a mask (masked
    keys included in the softmax's reductions) where the window path runs causal SDPA over the
    window, and the loss is a sum of per-chunk sums, each divided by the window's target count,
    where the window path takes one mean: both change the order of floating-point sums."""
    if name == "smollm2":
        model, batch, ubatch = request.getfixturevalue("smollm2"), 1, 32
        tg = steps.chunk_step(model, batch, CTX, ubatch)
    else:
        (model, tg), batch, ubatch = tiny(name), BATCH, UBATCH
    ids, labels = random_window(model.config.vocab_size, batch, CTX, seed=1)
    losses, _ = run_window(tg, model, steps.new_state(model, batch, CTX), ids, labels, ubatch)
    assert len(losses) == CTX // ubatch
    walked, reference = torch.stack(losses).sum(), window_loss(model, ids, labels)
    assert torch.isfinite(reference)
    assert abs(walked.item() - reference.item()) <= 1e-5 * abs(reference.item()), (walked, reference)
    # every chunk contributes: no chunk's loss is the whole window's
    assert all(0 < loss.item() < reference.item() for loss in losses)


# ------------------------------------------------------------------------------ recompute on == off


@pytest.mark.parametrize("name", TINY)
def test_walk_recompute_on_off_bitwise_over_windows(name):
    """Three windows with AdamW steps in between: chunk losses, grads, the carried state after
    each window and the updated weights are bitwise equal with recompute on and off."""
    off_graph, on_graph = tiny(name)[1], tiny_rewritten(name)
    runs = {}
    for key, graph in (("off", off_graph), ("on", on_graph)):
        model = load_model(name, seed=0).model
        params = list(StepInputs.of(model).trainable.values())
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
        state = steps.new_state(model, BATCH, CTX)
        record = []
        for window in range(3):
            ids, labels = random_window(model.config.vocab_size, BATCH, CTX, seed=10 + window)
            losses, grads = run_window(graph, model, state, ids, labels, UBATCH)
            record.append((losses, [g.clone() for g in grads], {k: v.clone() for k, v in state.items()}))
            for p, g in zip(params, grads):
                p.grad = g
            opt.step()
            opt.zero_grad(set_to_none=True)
        runs[key] = (record, [p.detach().clone() for p in params])
    (off, off_params), (on, on_params) = runs["off"], runs["on"]
    for w, ((l0, g0, s0), (l1, g1, s1)) in enumerate(zip(off, on)):
        assert all(torch.equal(a, b) for a, b in zip(l0, l1)), f"window {w}: losses differ"
        assert len(g0) == len(g1) == len(off_params)
        for i, (a, b) in enumerate(zip(g0, g1)):
            assert torch.equal(a, b), f"window {w}: grad {i} differs by {(a - b).abs().max()}"
        assert s0.keys() == s1.keys()
        assert all(torch.equal(s0[k], s1[k]) for k in s0), f"window {w}: carried state differs"
        assert any(s.abs().sum() > 0 for s in s0.values())  # the state really was written
    assert all(torch.equal(a, b) for a, b in zip(off_params, on_params))


@pytest.mark.parametrize("name", TINY)
def test_finetune_walk_recompute_on_off(name):
    steps = 3
    receipts = {rc: finetune(TrainSettings(model=name, path="walk", ctx=CTX, ubatch=UBATCH, batch=BATCH,
                                           steps=steps, recompute=rc), progress=False).as_dict()
                for rc in ("on", "off")}
    on, off = receipts["on"], receipts["off"]
    assert on["recompute"] is True and off["recompute"] is False
    assert len(on["losses"]) == steps
    assert on["losses"] == off["losses"]
    for r in (on, off):
        assert r["chunks"] == steps * CTX // UBATCH
        assert len(r["chunk_seconds"]) == r["chunks"]
        assert 0 < r["window_p50"] <= r["window_p95"]


# ---------------------------------------------------------------------------- in-place cache writes


def test_llama_chunk_writes_kv_cache_in_place():
    model, tg = tiny("tiny-llama")
    fwd = tg.forward_set()
    writes = state_writes(tg)
    layers = model.config.num_hidden_layers
    assert sorted(name for _, name in writes) == sorted(f"{kv}.{i}" for kv in "kv" for i in range(layers))
    for n, _ in writes:
        assert n.target is torch.ops.aten.index_copy_.default
        assert n in fwd


def test_qwen35_chunk_writes_conv_recurrent_state_in_place():
    model, tg = tiny("tiny-qwen35")
    fwd = tg.forward_set()
    writes = state_writes(tg)
    assert all(n in fwd for n, _ in writes)
    by_name = {name: n.target for n, name in writes}
    assert len(by_name) == len(writes)  # each state written once per chunk
    linear = [i for i, t in enumerate(model.config.layer_types) if t == "linear_attention"]
    full = [i for i, t in enumerate(model.config.layer_types) if t == "full_attention"]
    assert linear and full
    for i in linear:
        assert by_name.pop(f"conv.{i}") is torch.ops.aten.copy_.default
        assert by_name.pop(f"recurrent.{i}") is torch.ops.aten.copy_.default
    for i in full:
        assert by_name.pop(f"k.{i}") is torch.ops.aten.index_copy_.default
        assert by_name.pop(f"v.{i}") is torch.ops.aten.index_copy_.default
    assert not by_name


# ------------------------------------------------------------------------------- what the rewrite keeps


def test_qwen35_state_reads_before_the_write_are_kept():
    """The recurrent state's clone and the conv's cat read their buffer before this chunk writes
    it: recomputed in backward they would read the new state, so they are kept."""
    _, tg = tiny("tiny-qwen35")
    reasons, roles = keep_reasons(tg), roles_by_node(tg)

    def readers(prefix: str, op) -> list[torch.fx.Node]:
        return [n for n in tg.forward_nodes() if n.target is op
                and any(roles.get(a, ("", ""))[1].startswith(prefix) for a in n.all_input_nodes)]

    clones = readers("recurrent.", torch.ops.aten.clone.default)
    cats = readers("conv.", torch.ops.aten.cat.default)
    n_linear = sum(t == "linear_attention" for t in tiny("tiny-qwen35")[0].config.layer_types)
    assert len(clones) == len(cats) == n_linear > 0
    for n in clones + cats:
        assert reasons.get(n) == "reads-mutated-root", (n.name, reasons.get(n))
    # the cats are saved for backward, and explain() reports them kept for that reason
    kept = explain(tg).kept
    assert all(kept.get(n.name) == "reads-mutated-root" for n in cats)


def test_llama_attention_over_the_written_cache_is_recomputed():
    """A K/V row written before attention reads the cache does not pin attention's intermediates."""
    _, tg = tiny("tiny-llama")
    reasons = keep_reasons(tg)
    root = alias.roots(tg.graph)
    kv = {n for n, (role, name) in roles_by_node(tg).items() if role == "state" and name[:2] in ("k.", "v.")}
    writes = {n for n, _ in state_writes(tg)}

    # nodes reading the cache (directly or through views) after its write, and everything downstream
    after: set[torch.fx.Node] = set()
    for n in tg.forward_nodes():
        reads_cache = any(r in kv for r in alias.reads(n, root)) and n not in writes
        if reads_cache or any(a in after or a in writes for a in n.all_input_nodes):
            after.add(n)
    sdpa = [n for n in tg.forward_nodes() if "_scaled_dot_product" in str(n.target)]
    assert sdpa and all(n in after for n in sdpa)
    bad = {n.name: reasons[n] for n in after if reasons.get(n) == "reads-mutated-root"}
    assert not bad
    assert not any(n in reasons for n in sdpa)
    # the full-length K/V that attention reads (GQA-expanded copies of the cache) are saved for
    # backward without recompute; the rewrite recomputes them rather than keeping them
    full_kv = [n for n in saved_nodes(tg) if n in after and isinstance(v := n.meta.get("val"), torch.Tensor)
               and v.dim() == 4 and v.shape[-2] == CTX]
    assert len(full_kv) == len(writes)  # one K and one V per layer
    kept = explain(tg).kept
    assert not any(n in reasons or n.name in kept for n in full_kv)


# ------------------------------------------------------------------------------------------- memory


@functools.cache
def walk_plans(num_layers: int, ctx: int) -> dict[str, Plan]:
    """tiny-llama's walk plans at ubatch 64: `plan_settings` at the preset's depth (2 layers); at another
    depth built the way plan_settings builds it, on fake tensors."""
    if num_layers == load_config("tiny-llama").num_hidden_layers:
        return plan_settings(TrainSettings(model="tiny-llama", ctx=ctx, path="walk", ubatch=64, lora=False))
    with EagerStridesFakeMode(allow_non_fake_inputs=True):
        model = build_from_config(load_config("tiny-llama", num_layers=num_layers))
    tg = steps.chunk_step(model, 1, ctx, 64, exact=True)  # as plan_settings: the default walk
    return {"off": plan(tg), "on": plan(rewrite(tg))}


def test_a_planning_model_walks_again_the_same():
    """A fake model's parameters are its chunk step's inputs themselves: the gradient hooks a trace puts on them
    go with it. A second trace on the same model (the server plans every new shape on one) once also ran the
    first one's hooks, adding each gradient into an old sum (a constant and an add_ more per trainable)."""
    with EagerStridesFakeMode(allow_non_fake_inputs=True):
        model = build_from_config(load_config("tiny-llama"))
    first, second = (steps.chunk_step(model, 1, 128, 64) for _ in range(2))
    assert len(second.graph.nodes) == len(first.graph.nodes)
    assert not [n for n in second.graph.nodes if n.op == "get_attr"]
    assert plan(second).as_dict() == plan(first).as_dict()


def test_walk_graph_plan_does_not_grow_with_ctx():
    """The issue's check on the default model's config: at fixed ubatch, with recompute the walk's
    graph peak is the same at ctx 256 and 1024; only the cache grows (x4). The peak there is the
    loss head and the weight gradients, which depend on the chunk. (Each chunk also attends over the
    whole cache, so one layer's attention backward does grow with ctx: the next test pins that.)"""
    short = plan_settings(TrainSettings(model="smollm2-135m", ctx=256, path="walk", ubatch=128, lora=False))
    long = plan_settings(TrainSettings(model="smollm2-135m", ctx=1024, path="walk", ubatch=128, lora=False))
    assert long["on"].cache == 4 * short["on"].cache > 0
    assert abs(long["on"].graph - short["on"].graph) <= 0.01 * short["on"].graph
    assert long["off"].graph > short["off"].graph  # without recompute every layer's attention grows


def test_walk_graph_growth_with_ctx_is_one_layer_with_recompute():
    """What holds instead: at fixed ubatch, with recompute the walk's graph grows with ctx by one
    layer's attention over the cache (the same growth at 2 and 4 layers); without, by every
    layer's. The cache grows in proportion to ctx and depth."""
    def growth(layers: int, key: str) -> int:
        return walk_plans(layers, 1024)[key].graph - walk_plans(layers, 256)[key].graph

    assert growth(2, "on") == growth(4, "on") > 0
    assert growth(4, "off") > 1.5 * growth(2, "off") > 0
    assert walk_plans(4, 1024)["on"].cache == 4 * walk_plans(4, 256)["on"].cache == 2 * walk_plans(2, 1024)["on"].cache
    assert walk_plans(4, 1024)["on"].graph < walk_plans(4, 1024)["off"].graph / 2


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("recompute", ["off", "on"])
def test_walk_planned_graph_matches_measured(name, recompute):
    model, tg = tiny(name)
    if recompute == "on":
        tg = tiny_rewritten(name)
    state = steps.new_state(model, BATCH, CTX)
    for t in state.values():
        t.normal_(generator=torch.Generator().manual_seed(2))  # earlier chunks' rows and state
    ids, labels = random_window(model.config.vocab_size, BATCH, UBATCH, seed=3)
    sums = [torch.randn_like(p) for p in StepInputs.of(model).trainable.values()]  # earlier chunks' grads
    args = StepInputs.of(model).args(*state.values(), torch.tensor(UBATCH), torch.tensor(100.0), ids, labels, *sums)
    planned = plan(tg).graph
    with torch.no_grad():
        _, measured = measure(tg, args)
    assert planned > 0
    assert abs(measured.graph - planned) <= 0.05 * planned, (planned, measured.graph)


# ------------------------------------------------------------------------------------ the exact walk


def exact_window(model: torch.nn.Module, tg: TrainGraph, ids: torch.Tensor, labels: torch.Tensor,
                 ubatch: int) -> tuple[float, list[torch.Tensor]]:
    """One window through the exact walk, as `train.BatchRunner.run` runs it: -> (loss, summed grads)."""
    tensors, loss, grads = StepInputs.of(model), 0.0, []
    chunks = walk.Walk(model, ids.shape[0], ids.shape[1], ubatch, exact=True).chunks(ids, labels, lambda: None)
    with torch.no_grad():
        for inputs in chunks:
            chunk_loss, *grads = tg.gm(*tensors.args(*inputs))  # the window's sums, added into in place
            loss += chunk_loss.item()
    return loss, grads


def window_and_exact_walk(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, ubatch: int):
    """-> ((loss, grads) of the one-graph window, (loss, grads) of the exact walk in chunks of `ubatch`)."""
    tensors = StepInputs.of(model)
    with torch.no_grad():
        reference_loss, *reference = window_step(model, ids, labels).gm(*tensors.args(ids, labels))
    tg = steps.chunk_step(model, ids.shape[0], ids.shape[1], ubatch, exact=True)
    return (reference_loss, reference), exact_window(model, tg, ids, labels, ubatch)


def family(name: str) -> torch.nn.Module:
    """A tiny preset, or a family of the conformance matrix (its tiny config keeps the family's features)."""
    if name.startswith("tiny-"):
        return load_model(name, seed=0).model
    model = build_from_config(conformance.tiny_config(name))
    return model.train()


@pytest.mark.parametrize("chunks", [4, 8])
@pytest.mark.parametrize("name", ["tiny-llama", "mistral", "bamba"])
def test_exact_walk_gives_the_windows_loss_and_grads(name, chunks):
    """Attention (tiny-llama), sliding-window attention (mistral, window 4) and Mamba-2 + attention (bamba):
    the exact walk's loss and every grad equal the one-graph window's within 1e-5 (fp32, per tensor, not
    bitwise: the chunks sum in another order). The truncated walk, on the same window, is far off."""
    model = family(name)
    ids, labels = random_window(model.config.vocab_size, BATCH, CTX, seed=4)
    (reference_loss, reference), (loss, grads) = window_and_exact_walk(model, ids, labels, CTX // chunks)
    ubatch = CTX // chunks
    assert abs(loss - reference_loss.item()) <= 1e-5 * reference_loss.item()
    assert conformance.grads_rel(grads, reference) <= 1e-5
    truncated = run_window(steps.chunk_step(model, BATCH, CTX, ubatch), model, steps.new_state(model, BATCH, CTX),
                           ids, labels, ubatch)
    assert abs(torch.stack(truncated[0]).sum().item() - reference_loss.item()) <= 1e-5 * reference_loss.item()
    assert conformance.grads_rel(truncated[1], reference) > 1e-2  # the truncated walk's gradient is another one


@pytest.fixture
def delta_rule_in_fp64(monkeypatch):
    """qwen3.5's chunked delta rule computes in fp32 whatever the model's dtype: here it keeps fp64."""
    import ast
    import inspect

    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen35

    # Its source from the module's: the module-level name may be a kernel wrapper (transformers >= 5.25).
    source = inspect.getsource(qwen35)
    rule = next(n for n in ast.parse(source).body
                if isinstance(n, ast.FunctionDef) and n.name == "torch_chunk_gated_delta_rule")
    namespace = dict(vars(qwen35))
    exec(ast.get_source_segment(source, rule).replace("torch.float32", "torch.float64"), namespace)  # no decorators
    monkeypatch.setattr(qwen35, "torch_chunk_gated_delta_rule", namespace["torch_chunk_gated_delta_rule"])


@pytest.mark.parametrize("chunks", [4, 8])
def test_exact_walk_through_the_delta_rule_is_the_windows(chunks, delta_rule_in_fp64):
    """Gated delta-net + attention (tiny-qwen35): conv and recurrent state carried, their gradient handed
    back chunk by chunk. In fp64: in fp32 the decay parameters' grads (A_log, dt_bias) are sums that
    cancel, and the window path itself is 1.5e-3 from its fp64 value there (the exact walk: 3.3e-4), so
    fp32 could not tell a wrong walk from rounding. In fp64 the two agree to 1e-7."""
    model = load_model("tiny-qwen35", seed=0).model.double()
    ids, labels = random_window(model.config.vocab_size, BATCH, CTX, seed=5)
    (reference_loss, reference), (loss, grads) = window_and_exact_walk(model, ids, labels, CTX // chunks)
    assert abs(loss - reference_loss.item()) <= 1e-9 * reference_loss.item()
    assert conformance.grads_rel(grads, reference) <= 1e-6


@pytest.mark.parametrize("name", TINY)
def test_exact_walk_recompute_on_off_bitwise(name):
    model = load_model(name, seed=0).model
    ids, labels = random_window(model.config.vocab_size, BATCH, CTX, seed=6)
    off = steps.chunk_step(model, BATCH, CTX, UBATCH, exact=True)
    (loss_off, grads_off), (loss_on, grads_on) = (exact_window(model, tg, ids, labels, UBATCH)
                                                  for tg in (off, rewrite(off)))
    assert loss_off == loss_on
    assert all(torch.equal(a, b) for a, b in zip(grads_off, grads_on))


@pytest.mark.parametrize("name", TINY)
def test_exact_walk_plans_its_buffers_and_graph(name):
    """The plan's cache is the bytes the walk really holds (cache, its gradient buffers, every chunk's start
    state from the forward sweep), and the chunk graph's planned peak is the measured one."""
    model = load_model(name, seed=0).model
    tg = rewrite(steps.chunk_step(model, BATCH, CTX, UBATCH, exact=True))
    ids, labels = random_window(model.config.vocab_size, BATCH, CTX, seed=7)
    w = walk.Walk(model, BATCH, CTX, UBATCH, exact=True)
    chunks = w.chunks(ids, labels, lambda: None)
    inputs = next(chunks)  # after the forward sweep: the cache, its gradient buffers, the start states
    held = [*w.state.values(), *w.grad.values(), *w.grad_start.values(), *(t for s in w.starts for t in s.values())]
    assert plan(tg).cache == sum(t.untyped_storage().nbytes() for t in held) > 0
    assert len(w.starts) == CTX // UBATCH
    with torch.no_grad():
        _, measured = measure(tg, StepInputs.of(model).args(*inputs))
    assert measured.graph == plan(tg).graph > 0
    chunks.close()  # the window is over (here, early): its buffers go before the optimizer's update
    assert (w.state, w.grad, w.grad_start, w.starts) == ({}, {}, {}, [])


def test_finetune_says_which_walk_ran():
    """Both walks train; the receipt names the one that ran; their losses are the window's loss (the first
    step's, before their gradients part ways) and the later steps differ."""
    receipts = {kind: finetune(TrainSettings(model="tiny-llama", path="walk", walk=kind, ctx=CTX, ubatch=UBATCH,
                                             batch=BATCH, steps=2, lora=False), progress=False).as_dict()
                for kind in ("exact", "truncated")}
    window = finetune(TrainSettings(model="tiny-llama", ctx=CTX, batch=BATCH, steps=2, lora=False), progress=False)
    for kind, r in receipts.items():
        assert r["settings"]["walk"] == kind and r["settings"]["path"] == "walk"
        assert abs(r["losses"][0] - window.losses[0]) <= 1e-5 * window.losses[0]
    exact, truncated = receipts["exact"]["losses"], receipts["truncated"]["losses"]
    assert abs(exact[1] - window.losses[1]) <= 1e-5 * window.losses[1]
    assert abs(truncated[1] - window.losses[1]) > abs(exact[1] - window.losses[1])
