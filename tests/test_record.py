"""The recorder (`remat.fastplan.record`) keeps the graph make_fx keeps, node for node: the same ops on the same
arguments, the same layouts on the same storages, the same forward/backward boundary, on every family of
the conformance matrix and on the walk's chunk steps. A plan-only step is recorded, the step that runs is
traced by make_fx: their graphs, and so their plans, must be one."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import conformance as C
from remat.core.capture import EagerStridesFakeMode, Recorder
from remat.core.graph import TrainGraph
from remat.core.plan import plan
from remat.fastplan import record
from remat.models import load as models
from remat.models.hf import UnsupportedModel
from remat.models.steps import chunk_step, window_step
from test_stamp import _described

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = 2
LOSS_CHUNK = 4  # the loss in pieces: its checkpointed pieces recorded too


def _planning_model(name: str, layers: int | None) -> torch.nn.Module:
    config = C.tiny_config(name)
    with EagerStridesFakeMode(allow_non_fake_inputs=True):
        model = models.build_from_config(config if layers is None else models.with_layers(config, layers))
    model.config.use_cache = False
    return model.train()


def _both(step: Callable[[Recorder | None], TrainGraph]) -> tuple[TrainGraph, TrainGraph]:
    """`step(recorder)` recorded, then traced by make_fx (no recorder)."""
    return step(record.record), step(None)


def _assert_same(recorded: TrainGraph, traced: TrainGraph) -> None:
    assert _described(recorded) == _described(traced)
    assert recorded.boundary.name == traced.boundary.name
    assert recorded.names == traced.names and recorded.roles == traced.roles
    assert plan(recorded).as_dict() == plan(traced).as_dict()


@pytest.mark.parametrize("name", C.matrix_families())
def test_recorded_step_is_make_fx_trace(name):
    try:
        model = _planning_model(name, LAYERS)
    except Exception:  # noqa: BLE001 - a family that needs its own depth (its table of hybrid layers)
        try:
            model = _planning_model(name, None)
        except Exception as e:  # noqa: BLE001 - the family's own config or init, on fake weights
            pytest.skip(f"no model on fake weights: {C._one_line(e)}")
    ids = torch.zeros(C.BATCH, C.SEQ, dtype=torch.long)
    try:
        recorded, traced = _both(lambda r: window_step(model, ids, ids.clone(), loss_chunk=LOSS_CHUNK, recorder=r))
    except UnsupportedModel as e:
        pytest.skip(str(e))
    except torch._subclasses.fake_tensor.DataDependentOutputException as e:
        pytest.skip(f"its trace reads tensor values: {e}")
    _assert_same(recorded, traced)


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
