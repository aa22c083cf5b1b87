"""Shared fixtures: the tiny presets captured once per session, with a fixed random batch."""

from __future__ import annotations

import functools
import gc
import os
from dataclasses import dataclass

import pytest
import torch

from remat.core import precision
from remat.core.graph import StepInputs, TrainGraph
from remat.core.process import keep_for_good
from remat.core.recompute import rewrite
from remat.models.hf import causal_lm_loss
from remat.models.load import LoadedModel, load_model
from remat.models.steps import window_step

# Two workers on two cores (`make test`): one intra-op thread each, from the start. Collecting already runs torch:
# the conformance matrix builds and runs every family's tiny model (`conformance.matrix_families`), 39 s at two
# threads while the other worker collects too, 5 s at one (see `one_thread`).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

PRESETS = ("tiny-llama", "tiny-qwen35")
BATCH, CTX = 2, 64


@dataclass(eq=False)
class Case:
    """One preset model, one batch, its traced step (`tg`) and the rewritten step (`rt`).

    Shared across the session: tests must not change the model's parameters or flags; a test
    that needs to (freezing, reordering, training) builds its own with `make_case`.
    """

    lm: LoadedModel
    ids: torch.Tensor
    labels: torch.Tensor
    tg: TrainGraph

    @property
    def model(self) -> torch.nn.Module:
        return self.lm.model

    def args(self) -> list[torch.Tensor]:
        return StepInputs.of(self.model).args(self.ids, self.labels)

    def trainable(self) -> dict[str, torch.Tensor]:
        return StepInputs.of(self.model).trainable

    @functools.cached_property
    def rt(self) -> TrainGraph:
        return rewrite(self.tg)

    @functools.cached_property
    def eager(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Loss and grads of the trainable parameters by plain autograd, no graph involved."""
        loss = causal_lm_loss(self.model, self.ids, self.labels)
        grads = torch.autograd.grad(loss, list(self.trainable().values()))
        return loss.detach(), list(grads)

    def run(self, tg: TrainGraph, args: list[torch.Tensor] | None = None):
        with torch.no_grad():
            return tg(*(self.args() if args is None else args))


def random_batch(vocab: int = 259, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (BATCH, CTX), generator=g)
    labels = torch.randint(0, vocab, (BATCH, CTX), generator=g)
    labels[:, :3] = -100  # some ignored targets, as a chat mask would give
    return ids, labels


def new_case(name: str, *, num_layers: int | None = None, prepare=None) -> Case:
    lm = load_model(name, seed=0, num_layers=num_layers)
    if prepare is not None:
        prepare(lm.model)
    ids, labels = random_batch(len(lm.tokenizer))
    return Case(lm, ids, labels, window_step(lm.model, ids, labels))


# The modules that take longest, longest first (seconds on two idle cores, `--durations=0`, summed per module):
# `make test` hands whole modules to its two workers in this order (`--no-loadscope-reorder`), so a long one
# does not start last while the other worker idles. As measured before test_record's family matrix became
# test_stamp's and leftovers were frozen (both now shorter): conformance 630, stamp 470, cli 460, server_openapi 190,
# train_lora 95, precision 90, quant_cli 85, models 80, distributed 70, longest 70, shared_blocks 65, serve 60.
SLOWEST = ("test_conformance", "test_stamp", "test_cli", "test_server_openapi", "test_train_lora", "test_precision",
           "test_quant_cli", "test_models", "test_distributed", "test_longest", "test_shared_blocks", "test_serve")


def pytest_collection_finish(session):
    """What collecting imported (every family of transformers, for the conformance matrix) stays for the session:
    the collector's full collections (`process.trim_heap`, each in-process `finetune` makes three) walked it again,
    0.35 s each. Collected first: the families' tiny models built and run while collecting are garbage."""
    gc.collect()
    keep_for_good()


@pytest.fixture(scope="module", autouse=True)
def _leftovers_frozen():
    """Likewise at each module's start: what the modules before left is collected once and what lives on frozen,
    so a module's own full collections walk only what it makes (torch's fake-kernel cache alone grows by thousands
    of entries a traced model)."""
    gc.collect()
    keep_for_good()


def pytest_collection_modifyitems(config, items):
    """The slowest modules first (`SLOWEST`). Tests marked `cuda` run where a CUDA device is present, and are
    skipped with the reason elsewhere."""
    rank = {name: i for i, name in enumerate(SLOWEST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: each module keeps its order
    if torch.cuda.is_available():
        return
    why = "torch built without CUDA" if torch.version.cuda is None else "no CUDA device visible"
    skip = pytest.mark.skip(reason=f"needs a CUDA device: {why} ({torch.__version__})")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


# What `--dtype auto` resolves to in the suite's own process (see `auto_is_float32`).
PINNED_AUTO = precision.Precision(torch.float32, "auto: float32, pinned by the test suite")


@pytest.fixture(scope="session", autouse=True)
def auto_is_float32():
    """`--dtype auto` (the default) resolves per CPU: bfloat16 where the CPU computes it natively (AVX512-BF16,
    AMX), float32 elsewhere (`remat.core.precision.resolve`). The suite's oracles are transformers' float32 eager
    model, bitwise, and golden.json is float32, so no test may depend on the CPU it runs on: in this process `auto`
    means float32, for the whole session (module fixtures included). Tests of auto itself call the real `resolve`,
    taken at import (test_precision's `REAL_RESOLVE`); bfloat16 tests name `dtype="bfloat16"`; subprocesses (the
    CLI, torchrun, a server) see no patch, so their tests pass `--dtype float32` (or `"dtype": "float32"`) where
    they compare with this process or with float32 figures."""
    real = precision.resolve
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(precision, "resolve", lambda asked, device="cpu": PINNED_AUTO if asked == "auto"
                   else real(asked, device))
        yield


@pytest.fixture(scope="module")
def one_thread():
    """Use with `pytestmark = pytest.mark.usefixtures("one_thread")`. Tiny graphs run fastest on one
    thread, and with two intra-op threads on a busy 2-CPU machine every op waits on a descheduled
    thread: ~100x slower (3 s instead of 0.02 s per tiny-qwen35 step)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def case_cache() -> dict:
    return {}


@pytest.fixture(scope="session")
def get_case(case_cache):
    """`get_case(name, num_layers=None)`: the shared, session-cached Case of that preset and depth."""

    def get(name: str, num_layers: int | None = None) -> Case:
        key = (name, num_layers)
        if key not in case_cache:
            case_cache[key] = new_case(name, num_layers=num_layers)
        return case_cache[key]

    return get


@pytest.fixture(params=PRESETS)
def case(request, get_case) -> Case:
    """Each tiny preset at its own depth (shared: do not modify)."""
    return get_case(request.param)


@pytest.fixture(scope="session")
def make_case():
    """`make_case(name, num_layers=None, prepare=fn)`: a fresh model (prepare(model) runs before
    capture), for tests that change the model."""
    return new_case


@pytest.fixture
def traces(monkeypatch) -> list[int]:
    """One item per step traced while the test runs (`core.capture.trace`, as `models.steps` calls it)."""
    from remat.models import steps

    made: list[int] = []
    real = steps.trace
    monkeypatch.setattr(steps, "trace", lambda *a, **kw: made.append(1) or real(*a, **kw))
    return made
