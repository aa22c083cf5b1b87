"""The loss head in chunks (`window_step(..., loss_chunk=N)`): each N-token piece's logits and
cross-entropy are separate nodes, so with recompute only one piece's logits live at a time."""

from __future__ import annotations

import functools

import pytest
import torch

from planning import live_at_peak, plan_settings
from remat.base.settings import TrainSettings
from remat.core.capture import EagerStridesFakeMode
from remat.core.graph import StepInputs, TrainGraph
from remat.core.plan import measure, plan
from remat.core.recompute import rewrite
from remat.models.hf import causal_lm_loss
from remat.models.load import build_from_config, load_config, load_model
from remat.models.steps import window_step

TINY = ("tiny-llama", "tiny-qwen35")
BATCH, CTX, CHUNK = 2, 64, 16


pytestmark = pytest.mark.usefixtures("one_thread")


def random_batch(vocab: int, batch: int = BATCH, ctx: int = CTX, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, ctx), generator=g)
    labels = torch.randint(0, vocab, (batch, ctx), generator=g)
    labels[:, :3] = -100  # ignored targets, as a chat mask gives: pieces have different target counts
    labels[-1, 20:30] = -100
    return ids, labels


class Case:
    """A model, a batch, and its step traced with the loss in chunks of 16 and in one piece."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.ids, self.labels = random_batch(model.config.vocab_size)
        self.chunked = window_step(model, self.ids, self.labels, loss_chunk=CHUNK)
        self.rewritten = rewrite(self.chunked)

    @functools.cached_property
    def whole(self) -> TrainGraph:
        return window_step(self.model, self.ids, self.labels, loss_chunk=0)

    def run(self, tg: TrainGraph) -> tuple[torch.Tensor, list[torch.Tensor]]:
        with torch.no_grad():
            return tg(*StepInputs.of(self.model).args(self.ids, self.labels))


@functools.cache
def case(name: str) -> Case:
    return Case(load_model(name, seed=0).model)


@pytest.fixture(scope="module", autouse=True)
def _drop_cases():
    yield
    case.cache_clear()


def head_pieces(tg: TrainGraph) -> int:
    return sum(n.target is torch.ops.aten._log_softmax.default for n in tg.forward_nodes())


@pytest.mark.parametrize("name", TINY)
def test_chunked_loss_recompute_on_off_bitwise(name):
    c = case(name)
    assert head_pieces(c.chunked) == head_pieces(c.rewritten) == CTX // CHUNK
    loss_off, grads_off = c.run(c.chunked)
    loss_on, grads_on = c.run(c.rewritten)
    assert torch.equal(loss_off, loss_on)
    assert len(grads_off) == len(grads_on) == len(StepInputs.of(c.model).trainable)
    for i, (a, b) in enumerate(zip(grads_off, grads_on)):
        assert torch.equal(a, b), f"grad {i} differs by {(a - b).abs().max()}"


@pytest.mark.parametrize("name", TINY)
def test_chunked_loss_matches_unchunked(name):
    """Within 1e-6 (loss) and 1e-5 (grads) relative, not bitwise: the chunked head sums each piece's
    cross-entropy and divides once by the target count, where the unchunked head takes one mean,
    so the floating-point sums run in a different order."""
    c = case(name)
    assert head_pieces(c.whole) == 1
    loss, grads = c.run(c.chunked)
    ref_loss, ref_grads = c.run(c.whole)
    assert abs(loss.item() - ref_loss.item()) <= 1e-6 * abs(ref_loss.item())
    assert len(grads) == len(ref_grads)
    for i, (a, b) in enumerate(zip(grads, ref_grads)):
        scale = b.abs().max().item()
        assert scale > 0
        assert (a - b).abs().max().item() <= 1e-5 * scale, f"grad {i}"


# ------------------------------------------------------------------------------------ tied embeddings


def fake_model(spec: str) -> torch.nn.Module:
    """The model `plan_settings` plans: built from the config on fake tensors, no weights."""
    with EagerStridesFakeMode(allow_non_fake_inputs=True):
        return build_from_config(load_config(spec))


def test_smollm2_plan_with_loss_chunks_counts_the_tied_head_once():
    assert load_config("smollm2-135m").tie_word_embeddings
    plans = plan_settings(TrainSettings(model="smollm2-135m", ctx=512, loss_chunk=128, lora=False,
                                        optimizer_in_backward="off"))
    unique = sum(p.numel() for p in fake_model("smollm2-135m").parameters())  # tied weights appear once
    for p in plans.values():
        assert p.params == p.grads == 4 * unique
    assert 0 < plans["on"].graph < plans["off"].graph


def test_tied_head_chunked_step():
    """tiny-llama with its head tied to the embedding: one trainable tensor and one grad for both
    uses (embedding and each loss piece), bitwise equal with recompute on and off."""
    cfg = load_config("tiny-llama")
    cfg.tie_word_embeddings = True
    model = build_from_config(cfg)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    trainable = StepInputs.of(model).trainable
    assert len(trainable) == len(list(model.parameters()))
    tied = [i for i, t in enumerate(trainable.values()) if t is model.get_input_embeddings().weight]
    assert len(tied) == 1
    c = Case(model)
    loss_off, grads_off = c.run(c.chunked)
    loss_on, grads_on = c.run(c.rewritten)
    assert len(grads_off) == len(grads_on) == len(trainable)
    assert torch.equal(loss_off, loss_on)
    assert all(torch.equal(a, b) for a, b in zip(grads_off, grads_on))
    # the one grad carries both uses: it matches plain autograd through the tied module
    eager = torch.autograd.grad(causal_lm_loss(model, c.ids, c.labels, loss_chunk=CHUNK), list(trainable.values()))
    torch.testing.assert_close(grads_on[tied[0]], eager[tied[0]], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(loss_on, loss_off)


# -------------------------------------------------------------------------------------------- memory


def test_loss_chunk_lowers_smollm2_peak_by_the_logits():
    """SmolLM2-135M at ctx 2048 with recompute: shrinking the loss chunk from 2048 to 256 lowers the
    planned graph peak by k logits-sized tensors' difference, k counted at the 2048 peak. The tied
    head (and so the embedding) is frozen: trained, the 256 peak moves to the head's weight-grad
    accumulation and hides the loss head's share."""
    ctx = 2048
    model = fake_model("smollm2-135m")
    model.get_output_embeddings().weight.requires_grad_(False)
    assert not model.get_input_embeddings().weight.requires_grad  # tied: the same tensor
    vocab = model.config.vocab_size
    ids = torch.zeros(1, ctx, dtype=torch.long)
    peaks = {}
    for chunk in (2048, 256):
        peaks[chunk] = live_at_peak(rewrite(window_step(model, ids, ids.clone(), loss_chunk=chunk)))
    logits = ctx * vocab * 4
    k = sum(size == logits for _, size in peaks[2048][2])
    assert k >= 2
    expected = k * (2048 - 256) * vocab * 4
    drop = peaks[2048][0] - peaks[256][0]
    assert abs(drop - expected) <= 0.10 * expected, (drop, expected, k)


@pytest.mark.parametrize("recompute", ["off", "on"])
def test_loss_chunk_planned_matches_measured(recompute):
    model = load_model("tiny-llama", seed=0).model
    ids, labels = random_batch(model.config.vocab_size, batch=1, ctx=256, seed=4)
    tg = window_step(model, ids, labels, loss_chunk=32)
    if recompute == "on":
        tg = rewrite(tg)
    assert head_pieces(tg) == 256 // 32
    planned = plan(tg).graph
    with torch.no_grad():
        _, measured = measure(tg, StepInputs.of(model).args(ids, labels))
    assert planned > 0
    assert abs(measured.graph - planned) <= 0.05 * planned, (planned, measured.graph)


def test_tied_head_sums_its_weight_gradient_in_place():
    """The tied weight's gradient, summed over the loss's pieces and the embedding, is summed in place into
    one tensor (`capture.sum_in_place`, as eager autograd does), which is the step's grad. The real run
    holds it: measured, the step allocates what its plan says, and with the sums put back out of place
    it allocates at least one weight-sized tensor more, for the same grads bit for bit."""
    cfg = load_config("tiny-llama")
    cfg.tie_word_embeddings = True
    c = Case(build_from_config(cfg))
    weight = c.model.get_input_embeddings().weight
    sums = [n for n in c.chunked.graph.nodes if n.target is torch.ops.aten.add_.Tensor
            and tuple(n.meta["val"].shape) == tuple(weight.shape)]
    assert len(sums) == CTX // CHUNK  # the pieces after the first, then the embedding's
    out = next(n for n in c.chunked.graph.nodes if n.op == "output")
    assert sums[-1] in out.all_input_nodes
    args = StepInputs.of(c.model).args(c.ids, c.labels)
    with torch.no_grad():
        grads, in_place = measure(c.chunked, args)
    assert in_place.graph == plan(c.chunked).graph
    for n in c.chunked.graph.nodes:
        if n.target is torch.ops.aten.add_.Tensor:
            n.target = torch.ops.aten.add.Tensor
    c.chunked.gm.recompile()
    with torch.no_grad():
        grads_out, out_of_place = measure(c.chunked, args)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_out))
    assert out_of_place.graph - in_place.graph >= weight.numel() * weight.element_size()
