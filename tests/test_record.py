"""The recorder (`remat.fastplan.record`) keeps the graph make_fx keeps, node for node: the same ops on the same
arguments, the same layouts on the same storages, the same forward/backward boundary, on the walk's chunk steps
(the window's step, on every family of the conformance matrix, is `test_stamp`'s: the planner records its small
trace, and the stamped result is held to make_fx's whole trace). A plan-only step is recorded, the step that runs
is traced by make_fx: their graphs, and so their plans, must be one."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import conformance as C
from remat.core.capture import Recorder
from remat.core.graph import TrainGraph
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


def test_a_step_that_runs_is_traced_by_make_fx():
    """Real weights: the recorder is never asked (a step that runs keeps make_fx's graph)."""
    asked: list[int] = []

    def recorder(fn, args):
        asked.append(1)
        return record.record(fn, args)

    model = models.build_from_config(models.with_layers(C.tiny_config("llama"), LAYERS)).train()
    ids = torch.zeros(C.BATCH, C.SEQ, dtype=torch.long)
    window_step(model, ids, ids.clone(), recorder=recorder)
    assert not asked
    window_step(_planning_model("llama", LAYERS), ids, ids.clone(), recorder=recorder)  # fake weights: recorded
    assert asked == [1]
