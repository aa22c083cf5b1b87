"""On a CUDA device: what the CPU's tests plan, run. Every test here is marked `cuda`: it runs where a GPU is
present and is skipped with the reason elsewhere (tests/conftest.py). `python -m remat.bench.gpu_receipts` makes
the receipts at the reference's configurations."""

from __future__ import annotations

import pytest
import torch

from planning import planner_of
from remat.base.settings import TrainSettings
from remat.core import attention, devices
from remat.models.load import load_config, load_model
from remat.serve.batch import prefill_cache
from remat.serve.engine import Engine
from remat.training.step import Planner, StepShape
from remat.training.train import finetune

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("one_thread")]
MEASURED_ONLY = ("runtime", "trace", "total", "host")  # the process's, measured by the trainer alone


def test_the_plan_made_without_the_gpu_is_the_plan_made_on_it():
    """Planned from the config on fake tensors of the CPU, traced for CUDA (what `remat plan --device cuda` does
    on a laptop), and planned from the model on the GPU, traced from its real weights: the same figures."""
    s = TrainSettings(model="tiny-llama", ctx=64, lora=False, device="cuda")
    which = ("off", "on", "offload")
    ahead = planner_of(s, load_config("tiny-llama")).plans(StepShape.of(s), which)
    devices.prepare(torch.device("cuda"))
    model = torch.nn.Module.to(load_model("tiny-llama").model, "cuda")
    here = Planner(model).plans(StepShape.of(s), which)
    for name in which:
        a, b = ahead[name].as_dict(), here[name].as_dict()
        assert {k: v for k, v in a.items() if k not in MEASURED_ONLY} == \
            {k: v for k, v in b.items() if k not in MEASURED_ONLY}, name


def test_a_cuda_run_is_bitwise_the_same_with_recompute_off_on_and_offload():
    receipts = {p: finetune(TrainSettings(model="tiny-llama", ctx=64, steps=3, lora=False, device="cuda",
                                          recompute=p), progress=False) for p in ("off", "on", "offload")}
    losses = {p: r.losses for p, r in receipts.items()}
    assert losses["off"] == losses["on"] == losses["offload"]
    for r in receipts.values():
        assert r.device.startswith("cuda:0 (") and r.measured is not None
        assert r.measured["graph"] == r.plan["graph"]  # remat's own tracking of the run, as planned
        assert {"cuda_max_allocated", "cuda_max_reserved"} <= set(r.measured)
    assert receipts["offload"].plan["offload"] > 0


def test_the_kernel_remat_chooses_is_one_torch_allows():
    cuda = torch.device("cuda")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for kv_heads in (2, 8):
            for masked in (False, True):
                q = torch.randn(1, 8, 128, 64, dtype=dtype, device=cuda)
                k = torch.randn(1, kv_heads, 128, 64, dtype=dtype, device=cuda)
                mask = torch.ones(128, 128, dtype=torch.bool, device=cuda).tril()[None, None] if masked else None
                chosen = attention.kernel(cuda, q, k, k, mask, not masked)
                grouped = kv_heads != 8
                params = torch.backends.cuda.SDPAParams(q, k, k, mask, 0.0, not masked, grouped)
                if chosen == attention.FLASH:
                    assert torch.backends.cuda.can_use_flash_attention(params, True)
                elif chosen == attention.EFFICIENT and not grouped:  # grouped: remat repeats the keys first
                    assert torch.backends.cuda.can_use_efficient_attention(params, True)


def test_the_served_model_decodes_on_the_gpu():
    engine = Engine("tiny-llama", device="cuda")
    engine.load()
    assert next(engine.model.parameters()).is_cuda
    out = engine.forward(torch.zeros(1, 3, dtype=torch.long), prefill_cache(engine.model))
    assert out.logits.device.type == "cpu" and out.logits.shape[-1] == engine.model.config.vocab_size
