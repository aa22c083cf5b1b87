"""Preflight: an op with no kernel on the target device refuses the job, by name."""

import pytest
import torch

from remat.base.settings import GateRefused
from remat.core.devices import preflight
from remat.core.graph import StepInputs
from remat.models.load import load_model
from remat.models.steps import window_step

lib = torch.library.Library("remat_test", "DEF")
lib.define("cuda_only(Tensor x) -> Tensor")
lib.impl("cuda_only", lambda x: x.clone(), "CUDA")
lib.impl("cuda_only", torch.empty_like, "Meta")


@pytest.fixture(scope="module")
def graph():
    model = load_model("tiny-llama").model
    ids = torch.randint(0, 259, (1, 16))
    return window_step(model, ids, ids.clone()), model


def test_every_op_of_a_real_step_has_a_cpu_kernel(graph):
    tg, _ = graph
    preflight(tg, "cpu")  # does not raise


def test_an_op_without_a_kernel_on_the_device_is_named(graph):
    tg, _ = graph
    # plant a CUDA-only op on the loss; on CPU nothing can run it
    out = next(n for n in tg.graph.nodes if n.op == "output")
    loss = out.args[0][0]
    with tg.graph.inserting_after(loss):
        planted = tg.graph.call_function(torch.ops.remat_test.cuda_only.default, (loss,))
    with pytest.raises(GateRefused, match=r"no kernel on cpu for remat_test::cuda_only"):
        preflight(tg, "cpu")
    # a CUDA target would run it, but the CPU-traced attention has no CUDA kernel
    if not torch.cuda.is_available():
        with pytest.raises(GateRefused, match="_scaled_dot_product_flash_attention_for_cpu"):
            preflight(tg, "cuda")
    tg.graph.erase_node(planted)
    preflight(tg, "cpu")


def test_cpu_fallback_lets_a_cpu_op_run_on_another_device(graph):
    tg, _ = graph
    preflight(tg, "cuda", cpu_fallback=True)  # every op has a CPU kernel
    assert StepInputs.of(graph[1]).trainable
