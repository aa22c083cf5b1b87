"""A training job beside the served model holds the served model's GGUF blocks, not a second copy
(`remat.models.gguf_file._BLOCKS`): the same storage, its own modules, the same losses as a job that loads its own."""

from __future__ import annotations

import weakref

import pytest
import torch

from remat.core.process import trim_heap
from remat.models import gguf_file, stored
from remat.models import load as models

pytestmark = pytest.mark.usefixtures("one_thread")

CAT = "The cat sat on the mat. It looked at the dog, and the dog looked back at the cat. " * 12


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def _blocks(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: blocks for name, _, blocks in stored.stored(model)}


@pytest.fixture(scope="module")
def served():
    from remat.serve.engine import Engine

    engine = Engine(None)  # the default GGUF, served from its blocks
    engine.load()
    return engine


def test_a_second_model_of_the_file_holds_the_served_blocks(served, monkeypatch):
    """The oracle that could disagree: a load without the sharing grows the process by the blocks' bytes."""
    mine = _blocks(served.model)
    bytes_ = sum(b.nbytes for b in mine.values())
    assert len(mine) == 211 and bytes_ > 80 << 20  # SmolLM2's 210 Q4_1 layers and its tied Q8_0 embedding, 92 MiB
    sizes = {}
    for shared in (True, False):
        if not shared:
            monkeypatch.setattr(gguf_file, "_BLOCKS", weakref.WeakValueDictionary())
        trim_heap()  # what the load before freed goes back to the kernel: each load grows from what is live
        before = _rss_mib()
        lm = models.load_model(None, as_stored=True)
        sizes[shared] = _rss_mib() - before
        theirs = _blocks(lm.model)
        assert set(theirs) == set(mine)
        same = [theirs[n].data_ptr() == mine[n].data_ptr() for n in mine]
        assert all(same) if shared else not any(same)
        assert not any(a is b for a in lm.model.modules() for b in served.model.modules())  # its own modules
        del lm, theirs
    # the load's own modules, tokenizer and heap take ~10-20 MiB either way: sharing saves the blocks' bytes
    assert sizes[False] - sizes[True] > bytes_ / 2**20 - 16 and sizes[True] < 32, sizes


def _lora_job(tmp_path, name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    from remat.base.settings import TrainSettings
    from remat.training import train

    held = {}
    load = models.load_model

    def keep(*a, **kw):
        lm = load(*a, **kw)
        held.update(_blocks(lm.model))
        return lm

    s = TrainSettings(model=None, data=[{"text": CAT}], ctx=64, steps=2, lora=True, out=str(tmp_path / name),
                      memory_budget=4 << 30)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train.models, "load_model", keep)
        receipt = train.finetune(s, progress=False)
    return receipt.losses, {n: b.data_ptr() for n, b in held.items()}


def test_a_lora_job_beside_the_server_trains_on_its_blocks(served, tmp_path, monkeypatch):
    """The job's frozen blocks are the served model's, and it trains as a job that loaded its own copy."""
    losses, ptrs = _lora_job(tmp_path, "shared")
    mine = {n: b.data_ptr() for n, b in _blocks(served.model).items()}
    assert ptrs == mine
    monkeypatch.setattr(gguf_file, "_BLOCKS", weakref.WeakValueDictionary())  # a copy of its own
    alone, own = _lora_job(tmp_path, "alone")
    assert not set(own.values()) & set(mine.values())
    assert len(losses) == 2 and losses == alone
