"""The walk for families with a state of their own to carry (the conformance matrix holds each family's exact walk
to the model's own backward; these hold what the matrix cannot see): sampled routing replayed chunk by chunk,
a cache no gradient reaches, and the refusals that stay."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

import conformance as C
from remat.core.graph import StepInputs
from remat.models import load as models
from remat.models import steps
from remat.models.hf import UnsupportedModel
from remat.training import walk

pytestmark = pytest.mark.usefixtures("one_thread")


def exact_walk(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor,
               seed: int) -> tuple[float, list[torch.Tensor]]:
    """One window through the exact walk in chunks of `C.UBATCH`, as the trainer runs it, its forward sweep
    drawing from `seed` (the probes that size the walk's buffers run the model too): -> (loss, grads)."""
    tg = steps.chunk_step(model, C.BATCH, C.SEQ, C.UBATCH, exact=True)
    tensors, loss, grads = StepInputs.of(model), 0.0, []
    w = walk.Walk(model, C.BATCH, C.SEQ, C.UBATCH, exact=True)
    w.probes.state_shapes(C.BATCH, C.SEQ)  # sized before the seed (kept): the states are made as the window starts
    chunks = w.chunks(ids, labels, lambda: None)
    torch.manual_seed(seed)
    with torch.no_grad():
        for inputs in chunks:
            chunk_loss, grads = tg(*tensors.args(*inputs))
            loss += chunk_loss.item()
    return loss, grads


def own_chunks(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    """The model's own forward over the window's chunks in order (its own cache, keys and values kept with their
    gradient), the chunks' summed cross-entropy over the window's targets, one backward."""
    model.zero_grad(set_to_none=True)
    cache, total = DynamicCache(config=model.config), 0
    for start in range(0, C.SEQ, C.UBATCH):
        chunk = slice(start, start + C.UBATCH)
        positions = torch.arange(start, start + C.UBATCH)[None].expand(C.BATCH, -1)
        logits = model(input_ids=ids[:, chunk], position_ids=positions, past_key_values=cache, use_cache=True).logits
        total = total + F.cross_entropy(logits.flatten(0, 1), labels[:, chunk].flatten(), ignore_index=-100,
                                        reduction="sum")
    loss = total / (labels != -100).sum()
    loss.backward()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in StepInputs.of(model).trainable.values()]
    return loss.item(), grads


def test_the_exact_walk_replays_sampled_routing(monkeypatch):
    """PhiMoE samples its experts while training (Gumbel draws; with jitter, more than one expert can be drawn).
    The forward sweep records the generators' state at each chunk's start and each chunk's step replays it, so
    the sweep and the steps compute one function: the model's own forward over the chunks from the same
    generator state, whose gradient the walk's equals. Without the replay, the steps draw other experts."""
    model = models.build_from_config(C.tiny_config("phimoe", router_jitter_noise=0.5)).train()
    ids, labels = C.batch()
    torch.manual_seed(7)
    own_loss, own_grads = own_chunks(model, ids, labels)
    loss, grads = exact_walk(model, ids, labels, seed=7)
    assert abs(loss - own_loss) <= C.TOL * own_loss, (loss, own_loss)
    assert C.grads_rel(grads, own_grads) <= C.TOL
    monkeypatch.setattr(walk.Draws, "replay", lambda self: None)
    assert abs(exact_walk(model, ids, labels, seed=7)[0] - own_loss) > 10 * C.TOL * own_loss  # the test can tell


def test_an_indexer_cache_gets_no_gradient_buffer():
    """DeepSeek-V3.2's sparse-attention indexer scores its cached keys without grad: the exact walk keeps the
    indexer's keys as a cache of the window (`index.{i}`), with no gradient buffer beside it."""
    model = models.build_from_config(C.tiny_config("deepseek_v32")).train()
    w = walk.Walk(model, C.BATCH, C.SEQ, C.UBATCH, exact=True)
    ids, labels = C.batch()
    chunks = w.chunks(ids, labels, lambda: None)  # held: the window's states are given back when it closes
    next(chunks)  # the states and their buffers are made for the window
    indexed = [k for k in w.state if k.startswith("index.")]
    assert indexed and all(w.state[k].shape[1] == C.SEQ for k in indexed)  # every row of the window
    assert not set(indexed) & set(w.grad) and {k for k in w.state if k.startswith("k.")} <= set(w.grad)


@pytest.mark.parametrize(("name", "why"), [
    ("xlstm", "rnn_state"),  # writes its states in place into a cache of its own
    ("opt", "data-dependent"),  # sizes its position mask by the cache's length
    ("rwkv", "keep no cache"),
])
def test_what_cannot_walk_is_refused_in_one_line(name, why):
    model = models.build_from_config(C.tiny_config(name)).train()
    with pytest.raises(UnsupportedModel, match=why) as refused:
        steps.chunk_step(model, C.BATCH, C.SEQ, C.UBATCH, exact=True)
    assert "\n" not in str(refused.value) and str(refused.value).startswith("the walk path does not support")
