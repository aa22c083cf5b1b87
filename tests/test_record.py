"""The recorder (`remat.fastplan.record`) keeps the graph make_fx keeps, node for node: the same ops on the same
arguments, the same layouts on the same storages, the same forward/backward boundary, on the walk's chunk steps
(the window's step, on every family of the conformance matrix, is `test_stamp`'s: the planner records its small
trace, and the stamped result is held to make_fx's whole trace). The planner records every step, the one that
runs as well as one only planned: its graph, and so its plan and what it computes, must be make_fx's."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

import conformance as C
from remat.core.capture import Recorder
from remat.core.graph import StepInputs, TrainGraph
from remat.fastplan import record
from remat.models import load as models
from remat.models.steps import chunk_step, window_step
from test_stamp import _assert_same, _planning_model

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = 2


def _both(step: Callable[[Recorder | None], TrainGraph]) -> tuple[TrainGraph, TrainGraph]:
    """`step(recorder)` recorded, then traced by make_fx (no recorder)."""
    return step(record.record), step(None)


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "truncated"])
# plain; recurrent state; sliding window; Mamba's scan from the carried state; an indexer's cache; GPT-Neo's masks
@pytest.mark.parametrize("name", ["llama", "qwen3_5_text", "gemma2", "mamba", "deepseek_v32", "gpt_neo"])
def test_recorded_walk_chunk_is_make_fx_trace(name, exact):
    """The walk's chunk step: state inputs, gradient sums filled by hooks, seeded cotangents (exact)."""
    model = _planning_model(name, LAYERS)
    recorded, traced = _both(lambda r: chunk_step(model, C.BATCH, C.SEQ, C.UBATCH, exact=exact, recorder=r))
    _assert_same(recorded, traced)


@pytest.mark.parametrize("name", ["llama", "qwen3_5_text", "gemma2"])  # plain; recurrent state; softcapped logits
def test_a_step_that_runs_is_recorded_and_runs_as_make_fxs(name):
    """Real weights: the step is recorded too (the planner's, for the step that trains), and it is make_fx's graph,
    node for node, computing the same loss and grads, bit for bit."""
    model = models.build_from_config(models.with_layers(C.tiny_config(name), LAYERS)).train()
    ids, labels = C.batch()
    recorded, traced = _both(lambda r: window_step(model, ids, labels, recorder=r))
    assert _fake_values(traced) and not _fake_values(recorded)  # recorded: meta tensors, make_fx's are fake
    _assert_same(recorded, traced)
    args = StepInputs.of(model).args(ids, labels)
    (loss, grads), (loss_fx, grads_fx) = recorded(*args), traced(*args)
    assert torch.equal(loss, loss_fx) and len(grads) == len(grads_fx) > 0
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_fx))


def _fake_values(tg: TrainGraph) -> int:
    return sum(isinstance(n.meta.get("val"), FakeTensor) for n in tg.graph.nodes if n.op == "call_function")
