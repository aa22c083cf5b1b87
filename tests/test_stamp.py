"""The stamped step (`remat.fastplan.stamp`: the first layer and two of each type traced, the second, or the last layer
where it is of the type, copied for the others; `remat.fastplan.pieces`: six of the loss's pieces traced, the middle
one copied) is the whole trace, node for node, on every family of the conformance matrix whose layers repeat
(one type, or several for hybrids); the others are traced whole."""

from __future__ import annotations

import pytest
import torch
from torch import fx

import conformance as C
from planning import planner_of
from remat.base.settings import TrainSettings
from remat.core import plan as plan_module
from remat.core import policies
from remat.core.capture import EagerStridesFakeMode
from remat.core.graph import TrainGraph, tensors_in
from remat.core.plan import plan
from remat.core.recompute import LAYER, Rewriter
from remat.fastplan import picking, pieces, record, stamp
from remat.models import load as models
from remat.models.hf import UnsupportedModel, decoder_layers, only_layers
from remat.models.hf_cache import Probes
from remat.models.steps import window_step
from remat.training import step

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = 6  # three traced (the first layer, the second and the last), three copied
LOSS_CHUNK = 2  # eight pieces of the 16 tokens: the fewest `pieces` stamps (six traced, pieces 2-4 copied)
# Hybrids (layers of several types: sliding and full attention, MoE and dense MLP, attention and recurrent
# mixers) deep enough that their pattern repeats at least four times (1 + 4 groups + the rest), so that every
# type has layers copied besides its two traced ones.
DEPTHS: dict[str, int] = {
    **dict.fromkeys(["afmoe", "axk1", "axk2", "bailing_hybrid", "cohere2", "cohere2_moe", "cwm", "deepseek_v32",
                     "exaone4", "exaone_moe", "gemma2", "gemma3_text", "glm4_moe_lite", "gpt_neo", "gpt_oss",
                     "granite_swa", "granitemoe_swa", "hy_v3", "jamba", "kimi_linear", "kolibri1", "laguna",
                     "mimo_v2_flash", "minicpm5_moe", "minimax", "olmo3", "olmo_hybrid", "qwen3_5_moe_text",
                     "qwen3_5_text", "qwen3_next", "vaultgemma"], 10),
    **dict.fromkeys(["bamba", "ernie4_5_moe", "llama4_text"], 7),  # dense first layers, then alike ones
    "flint": 11,
    **dict.fromkeys(["lara_mini", "lfm3", "recurrent_gemma"], 14),
}

# Families traced whole, with why (what `stamp` says at their depth): the test asserts they still are, so a
# family that starts to stamp shows up.
TRACED_WHOLE: dict[str, str] = {
    "axk2": "a copied layer's parameter",
    "beam": "the layer attn_residual_add_idx, mlp_residual_add_idx",
    "deepseek_v32": "a copied layer's parameter",
    "diffllama": "self_attn lambda_init",
    "ernie4_5_moe": "differ in length",
    "gpt_neo": "differ at _tensor_constant",
    "hrm_text": "2 layers: too few to copy one",
    "mimo_v2_flash": "the backward does not run layer by layer",
    "mpt": "the backward does not run layer by layer",
    "nemotron_h": "4 layers: too few to copy one",
    "xlstm": "2 layers: too few to copy one",
    "zamba2": "6 layers: too few to copy one",  # deeper, its table of hybrid layers (`layer_dic`) no longer builds
}

# Stamped families whose last layer stands for itself: it is of no type between (its signature differs), or it
# differs from its type's copied layer beyond what the signature shows (the check fails: picked again).
LAST_ITSELF = {"axk1", "gpt_neox_japanese", "jamba", "laguna", "olmo_hybrid"}


def _planning_model(name: str, layers: int | None = None) -> torch.nn.Module:
    """The family's tiny model on fake weights, `layers` deep (None: its config's own depth)."""
    config = C.tiny_config(name)
    with EagerStridesFakeMode(allow_non_fake_inputs=True):
        model = models.build_from_config(config if layers is None else models.with_layers(config, layers))
    model.config.use_cache = False
    return model.train()


def _layout(t: object) -> object:
    return (tuple(t.shape), t.stride(), t.dtype, t.storage_offset()) if isinstance(t, torch.Tensor) else t


def _described(tg: TrainGraph) -> list[tuple]:
    """Each node as what it computes: op, target, arguments (graph values by position, placeholders by name),
    its value's layout, and which earlier node first held its storage."""
    nodes = list(tg.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    names = dict(zip(tg.placeholders(), tg.names))
    owner: dict[object, int] = {}
    out = []
    for n in nodes:
        args = fx.node.map_aggregate((n.args, n.kwargs), lambda a: names.get(a, index.get(a)) if isinstance(
            a, fx.Node) else a)
        vals = tensors_in(n.meta.get("val"))
        storages = [owner.setdefault(t.untyped_storage()._cdata, index[n]) for t in vals]
        out.append((n.op, str(n.target), args, [_layout(t) for t in vals], storages))
    return out


def _index(tg: TrainGraph, node: fx.Node) -> int:
    return list(tg.graph.nodes).index(node)


def _assert_same(ours: TrainGraph, full: TrainGraph) -> None:
    """`ours` is make_fx's whole trace `full`: node for node, the same forward/backward boundary, names, roles and
    plan (the same graph and layouts: every policy's plan too)."""
    assert _described(ours) == _described(full)
    assert _index(ours, ours.boundary) == _index(full, full.boundary)
    assert ours.names == full.names and ours.roles == full.roles
    assert plan(ours).as_dict() == plan(full).as_dict()


def _recorded_whole(name: str, why: str) -> None:
    """A family this test cannot stamp at its depth (`why`) is held to make_fx all the same where the planner
    would trace it whole: its step recorded (two layers, else its config's depth) is make_fx's."""
    try:
        model = _planning_model(name, 2)
    except Exception:  # noqa: BLE001 - a family that needs its own depth (its table of hybrid layers)
        try:
            model = _planning_model(name)
        except Exception as e:  # noqa: BLE001 - the family's own config or init, on fake weights
            pytest.skip(f"{why}; no model on fake weights: {C._one_line(e)}")
    ids = torch.zeros(C.BATCH, C.SEQ, dtype=torch.long)
    try:
        recorded = window_step(model, ids, ids.clone(), loss_chunk=LOSS_CHUNK, recorder=record.record)
        _assert_same(recorded, window_step(model, ids, ids.clone(), loss_chunk=LOSS_CHUNK))
    except UnsupportedModel as e:
        pytest.skip(str(e))
    except torch._subclasses.fake_tensor.DataDependentOutputException as e:
        pytest.skip(f"its trace reads tensor values: {e}")


@pytest.mark.parametrize("name", C.matrix_families())
def test_stamped_recorded_step_is_the_whole_trace(name):
    """As the planner plans a model on fake weights: its few layers' step recorded (`fastplan.record`, not make_fx),
    the loss's pieces and the layers stamped; the result is make_fx's trace of the whole step. This holds the
    recorder to make_fx on every family as well (a family that does not stamp compares its recorded step whole)."""
    depth = DEPTHS.get(name, LAYERS)
    try:
        model = _planning_model(name, depth)
    except Exception as e:  # noqa: BLE001 - the family's own config or init, at this depth or on fake weights
        return _recorded_whole(name, f"no {depth}-layer model on fake weights: {C._one_line(e)}")
    ids = torch.zeros(C.BATCH, C.SEQ, dtype=torch.long)
    pieces_refused: list[str] = []

    def whole(recorder=None) -> TrainGraph:
        return window_step(model, ids, ids.clone(), loss_chunk=LOSS_CHUNK, recorder=recorder)

    def small() -> TrainGraph:  # as `step` plans: recorded, the loss's pieces stamped where they can be
        try:
            return pieces.stamp(lambda: whole(record.record), C.SEQ, LOSS_CHUNK)
        except stamp.NotStampable as e:
            pieces_refused.append(str(e))
            return whole(record.record)

    stamper = None
    try:
        stamper = stamp.stamp(model, lambda _layers: small())
        stamped = stamper.graph()
    except UnsupportedModel as e:  # no layers to stamp (the planner traces it whole), or refused as a whole
        return _recorded_whole(name, str(e))
    except torch._subclasses.fake_tensor.DataDependentOutputException as e:  # fake weights: traced whole too
        pytest.skip(f"its trace reads tensor values: {e}")
    except stamp.NotStampable as e:
        assert name in TRACED_WHOLE, f"{name} is traced whole: {e}"
        assert TRACED_WHOLE[name] in str(e).replace("the layer: ", ""), e
        pieces_refused.clear()
        stamped = small()  # its layers traced whole, its loss's pieces still stamped
    else:
        assert name not in TRACED_WHOLE, f"{name} stamps now: drop it from TRACED_WHOLE"
        copied = stamper.picked.last_copied
        assert copied == (name not in LAST_ITSELF), f"{name}'s last layer is {'copied' if copied else 'itself'}"
    assert not pieces_refused, pieces_refused
    full = whole()
    _assert_same(stamped, full)
    if stamper is not None:  # and the plans stamped without the whole graph: its own, and its rewrites'
        assert stamper.plan().as_dict() == plan(full).as_dict()
        rewriter = Rewriter(full)
        for policy in (LAYER, policies.parse("dots")):
            assert stamper.plan(policy).as_dict() == rewriter.plan(policy).as_dict(), policy.name


@pytest.mark.parametrize("name", ["llama", "gemma2", "qwen3_5_text"])  # plain; softcapped logits; hybrid
def test_stamped_pieces_with_a_short_last_piece(name):
    """17 tokens in pieces of 2: nine pieces, the last of one token (its slices and layouts differ)."""
    model = _planning_model(name, DEPTHS.get(name, LAYERS))
    ids = torch.zeros(C.BATCH, C.SEQ + 1, dtype=torch.long)
    traced: list[int] = []

    def whole() -> TrainGraph:
        tg = window_step(model, ids, ids.clone(), loss_chunk=LOSS_CHUNK)
        traced.append(len(tg.graph.nodes))
        return tg

    stamped, full = pieces.stamp(whole, C.SEQ + 1, LOSS_CHUNK), whole()
    assert traced[0] < traced[1] == len(stamped.graph.nodes)  # six pieces traced, nine in the graph
    assert _described(stamped) == _described(full)
    assert plan(stamped).as_dict() == plan(full).as_dict()


def test_stamped_pieces_in_bfloat16():
    """In bfloat16 each piece's backward casts the head's weight (qwen2.5's, tied to the embedding) where it reads
    it (`precision.casts_where_read`): nodes that read no piece's, stamped with their piece (the step was traced with
    all its pieces at every window of `remat plan --ctx max`). The whole trace's graph, node for node; lumped (as a
    plan stamps it: each copy's backward casts the weight again), its plans, rewritten or not, to the byte."""
    s = TrainSettings(model="qwen2.5-coder-1.5b", ctx=1024, dtype="bfloat16")
    planner = planner_of(s)
    layers = decoder_layers(planner.model)
    ids = torch.zeros(1, s.ctx, dtype=torch.long)

    def whole() -> TrainGraph:
        return window_step(planner.model, ids, ids.clone(), loss_chunk=64, dtype=torch.bfloat16)

    with only_layers(planner.model, layers, (0, 1, len(layers) - 1)):
        stamped, full = pieces.stamp(whole, s.ctx, 64), whole()
        lumped = pieces.stamp(whole, s.ctx, 64, lumped=True)
    assert _described(stamped) == _described(full)
    assert plan(stamped).as_dict() == plan(full).as_dict()
    assert plan(lumped) == plan(full)
    mine, theirs = Rewriter(lumped), Rewriter(full)
    for policy in (LAYER, policies.parse("dots"), policies.everything()):  # everything: off where casts are recomputed
        assert mine.plan(policy) == theirs.plan(policy), policy.name


@pytest.mark.parametrize(("model", "traced"), [
    ("qwen3.5-0.8b", (0, 1, 2, 3, 23)),  # 18 linear-attention layers and 6 full, the last one full
    ("qwen2.5-coder-1.5b", (0, 1, 27)),
])
def test_a_plan_traces_the_first_layer_and_two_of_each_type(model, traced):
    with EagerStridesFakeMode(allow_non_fake_inputs=True):
        built = models.build_from_config(models.load_config(model))
    layers = [picking.signature(m) for m in stamp.decoder_layers(built)]
    picked = picking.pick(layers)
    assert picked.traced == traced
    assert [layers[picked.traced[picked.source[i]]] for i in range(len(layers))] == layers  # each from its type


def test_the_last_layer_is_its_types_copied_one_unless_no_layer_between_is_of_its_type():
    """Two dense layers, then MoE ones, the last dense again: the second dense layer's twin is the last layer,
    the one copied for it; every MoE layer is layer 3, copied. A last layer of a type of its own stands for
    itself, and so it does where its check failed (picked again, `last_copied=False`)."""
    picked = picking.pick(["dense"] * 2 + ["moe"] * 7 + ["dense"])
    assert picked.traced == (0, 1, 2, 3, 9)
    assert picked.source == (0, 4, 3, 3, 3, 3, 3, 3, 3, 4)
    assert picked.alike == ((1, 4), (2, 3))
    picked = picking.pick(["dense"] + ["moe"] * 8 + ["last"])
    assert (picked.traced, picked.alike, picked.source[-1]) == ((0, 1, 2, 9), ((1, 2),), 3)
    assert picked.itself(3)
    picked = picking.pick(["moe"] * 10, last_copied=False)
    assert (picked.traced, picked.alike, picked.source[-1]) == ((0, 1, 2, 9), ((1, 2),), 3)


@pytest.mark.parametrize("lora", [True, False])
def test_a_planning_models_plans_are_stamped_without_its_graph(monkeypatch, lora):
    """The gate's plans of a model on fake weights (off, dots, on) make no graph of the whole step: stamped
    from the small trace and its rewrites, they are the plans of the graphs `Planner.build` makes. every:2 keeps
    marks by their layer's number, so the layer copied does not stand for the others: it is planned from the
    whole stamped graph."""
    s = TrainSettings(model="tiny-llama", ctx=32, batch=1, lora=lora, optimizer_in_backward="off" if lora else "on")
    planner = planner_of(s, models.with_layers(models.load_config("tiny-llama"), LAYERS))
    shape = step.StepShape.of(s)
    graphs = []
    whole_graph = stamp.Stamper.graph

    def counted(self: stamp.Stamper) -> TrainGraph:
        graphs.append(whole_graph(self))
        return graphs[-1]

    monkeypatch.setattr(stamp.Stamper, "graph", counted)
    stamped = planner.plans(shape, step.LAYERS_ALIKE)
    assert graphs == []
    every = planner.plans(shape, ("every:2",))
    assert len(graphs) == 1
    monkeypatch.undo()
    # full fine-tuning: the optimizer in the backward (`shape.updates`), planned so on both sides
    assert stamped == {k: plan(planner.build(shape, k), updates=shape.updates) for k in stamped}
    assert every["every:2"] == plan(planner.build(shape, "every:2"), updates=shape.updates)
    assert stamped["on"].graph < stamped["off"].graph  # the rewrite was planned, not the step again


WALKERS = ("llama", "mistral", "qwen3_5_text", "bamba", "lfm2")  # attention, sliding, delta-net, Mamba-2, conv


@pytest.mark.parametrize("name", [*WALKERS, "jamba", "lfm3", "olmo_hybrid"])
def test_a_planning_models_probes_run_the_stand_ins_alone_and_find_every_layers_states(name):
    """The walk's probes of a planning model run only the layers a stamp traces, each layer's states its stand-in's
    renamed (`Probes`' `stand_ins`, `stamp.stand_ins`): the same states, in the same order, and the same layers
    scanning from zero, as the probes that run every layer."""
    model = _planning_model(name, DEPTHS.get(name, LAYERS))
    stand_ins = stamp.stand_ins(model)
    assert stand_ins is not None and len(set(stand_ins)) < len(stand_ins)
    cut, whole = Probes(model, stand_ins), Probes(model)
    try:
        states = whole.state_shapes(C.BATCH, 2 * C.SEQ)
    except UnsupportedModel as e:
        with pytest.raises(UnsupportedModel) as refused:
            cut.state_shapes(C.BATCH, 2 * C.SEQ)
        assert str(refused.value) == str(e)
        return
    assert list(cut.state_shapes(C.BATCH, 2 * C.SEQ).items()) == list(states.items())
    assert cut.stand_ins is not None and cut.from_zero == whole.from_zero


@pytest.mark.parametrize("walk", ["exact", "truncated"])
@pytest.mark.parametrize("name", WALKERS)
def test_a_stamped_walk_chunk_is_the_whole_trace(name, walk):
    """A walk chunk's step stamped from a few layers (their states alone the small trace's inputs; every layer's
    the whole step's, each layer's renumbered to its own) is the chunk traced whole, node for node, with the same
    inputs; its plans off and on too, to the byte."""
    model = _planning_model(name, DEPTHS.get(name, LAYERS))
    try:
        planner = step.Planner(model)
        shape = step.StepShape("walk", C.BATCH, 2 * C.SEQ, C.SEQ // 2, LOSS_CHUNK, walk)
        stamped = planner.build(shape, "off")
    except UnsupportedModel as e:  # the walk refuses the family (the matrix asserts it)
        pytest.skip(str(e))
    assert planner._at(shape).kept.stamper is not None, f"{name}'s walk is traced whole"
    whole = step.Planner(model)
    whole.planning = False  # traced whole, every layer
    whole.probes = Probes(model)  # the states probed running every layer (the planner's run the stand-ins alone)
    full = whole.build(shape, "off")
    assert _described(stamped) == _described(full)
    assert stamped.names == full.names and stamped.roles == full.roles
    assert planner.plans(shape) == whole.plans(shape)


@pytest.mark.parametrize("name", ["llama", "gemma2", "qwen3_5_text"])  # plain; softcapped logits; hybrid
@pytest.mark.parametrize("tokens", [C.SEQ + 1, 3 * C.SEQ])  # nine pieces, the last of one token; 24 pieces
def test_a_plans_lumped_pieces_plan_as_all_of_them(monkeypatch, name, tokens):
    """Stamped for plans (`lumped`: pieces 2, 3 and N-4 copied, the one for piece 3 standing for those left out),
    the step plans as make_fx's whole trace with all its pieces, to the byte: every policy, the optimizer after the
    backward or in it, the graph's own plan and one made without it (the rewriter's, the layers' stamper's)."""
    model = _planning_model(name, DEPTHS.get(name, LAYERS))
    ids = torch.zeros(C.BATCH, tokens, dtype=torch.long)

    def whole(recorder=None) -> TrainGraph:
        return window_step(model, ids, ids.clone(), loss_chunk=LOSS_CHUNK, recorder=recorder)

    def lumped() -> TrainGraph:
        return pieces.stamp(lambda: whole(record.record), tokens, LOSS_CHUNK, lumped=True)

    ours, full = lumped(), whole()
    assert len(ours.graph.nodes) < len(full.graph.nodes)
    stamper = stamp.stamp(model, lambda _layers: lumped())
    mine, theirs = Rewriter(ours), Rewriter(full)
    for updates in (False, True):
        assert plan(ours, updates=updates) == plan(full, updates=updates)
        assert stamper.plan(None, updates) == plan(full, updates=updates)
        for policy in (LAYER, policies.parse("dots"), policies.parse("every:2")):
            expected = theirs.plan(policy, updates=updates)
            assert mine.plan(policy, updates=updates) == expected, policy.name
            assert plan(mine(policy), updates=updates) == expected, policy.name
        for policy in (LAYER, policies.parse("dots")):
            assert stamper.plan(policy, updates) == theirs.plan(policy, updates=updates), policy.name
    added: list[int] = []

    def counted(life: dict, at: list) -> dict:
        lumped_life = lump(life, at)
        added.append(sum(size for key, (_, size, _) in lumped_life.items() if key not in life))
        return lumped_life

    lump = plan_module.lumped
    monkeypatch.setattr(plan_module, "lumped", counted)
    assert plan(ours) == plan(full) and added[0] > 0  # what the pieces left out saved for their backward
    monkeypatch.setattr(plan_module, "lumped", lambda life, _at: life)
    if tokens > 2 * C.SEQ and name != "qwen3_5_text":  # sixteen left out: without them, the head's peak is short
        assert plan(ours) != plan(full)


def test_a_save_back_among_the_loss_pieces_values_chooses_as_with_every_piece(monkeypatch):
    """A planning model's window step is lumped (the copy of piece 3 stands for pieces 4 to N-5), so a save-back
    choosing among the pieces' own values (between dots and off: each piece's log-softmax) makes every piece a
    graph of its own first: the gate chooses as a planner whose step has all its pieces, and plans the same. (At
    this size the values it takes come before the pieces' in cost per byte: the lumped step would have chosen
    the same; the flag says the step was made whole.)"""
    s = TrainSettings(model="tiny-llama", ctx=512, batch=1, loss_chunk=32, lora=False, dtype="float32")
    config = models.with_layers(models.load_config("tiny-llama"), LAYERS)
    shape = step.StepShape.of(s)
    planner = planner_of(s, config)
    plans = planner.plans(shape, ("dots", "off"))
    budget = plans["off"].total - 1  # as many as fit of what off saves besides: the pieces' among them
    choice = planner.choose(shape, "auto", budget)
    assert choice.policy.startswith("dots+") and planner._at(shape).kept.all_pieces, choice.policy
    chosen = choice.plans[choice.policy]
    assert plan(planner.build(shape, choice.policy), updates=shape.updates) == chosen  # its graph has every piece
    whole = pieces.stamp
    monkeypatch.setattr(pieces, "stamp", lambda trace, tokens, chunk, lumped=False: whole(trace, tokens, chunk))
    every = planner_of(s, config).choose(shape, "auto", budget)
    assert (every.policy, every.plans[every.policy]) == (choice.policy, chosen)
