"""Capture: trace one whole training step (forward, loss, backward) into a TrainGraph.

`make_fx` records the aten ops of a step that computes the loss and calls
`torch.autograd.grad`, so forward and backward land in one fx graph, in the order
they ran. The forward/backward boundary is the last node recorded before the
backward starts; it is read off the tracer at that moment, not guessed later.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

from remat.marks import mark_layer_outputs, mark_name

ROLES = ("trainable", "frozen", "buffer", "input")


@dataclass
class TrainGraph:
    """A traced train step: `gm(*trainable, *frozen, *buffers, *inputs) -> (loss, *grads)`."""

    gm: fx.GraphModule
    roles: list[str]  # one per placeholder, in order: see ROLES
    names: list[str]  # one per placeholder: parameter / buffer / input name
    boundary: fx.Node  # the last forward node
    info: dict = field(default_factory=dict)  # options the graph was traced with

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph

    def placeholders(self) -> list[fx.Node]:
        return [n for n in self.graph.nodes if n.op == "placeholder"]

    def forward_nodes(self) -> list[fx.Node]:
        nodes = []
        for n in self.graph.nodes:
            nodes.append(n)
            if n is self.boundary:
                return nodes
        raise AssertionError("boundary node is not in the graph")

    def forward_set(self) -> set[fx.Node]:
        return set(self.forward_nodes())

    def marks(self) -> dict[fx.Node, str]:
        return {n: name for n in self.graph.nodes if (name := mark_name(n)) is not None}

    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        loss, *grads = self.gm(*args)
        return loss, grads


def causal_lm_loss(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                   loss_chunk: int = 0) -> torch.Tensor:
    """Token-weighted mean cross-entropy over targets (labels == -100 are ignored).

    With `loss_chunk` = N > 0 the head runs on N tokens at a time: each chunk's logits
    and cross-entropy are separate nodes, summed and divided by the number of targets,
    so a recompute rewrite can keep one chunk's logits alive at a time.
    """
    prepare(model)
    hidden = model.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state
    head = model.get_output_embeddings()
    n = hidden.shape[1]
    if not 0 < loss_chunk < n:
        return F.cross_entropy(head(hidden).flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
    total = sum(
        F.cross_entropy(head(hidden[:, i:i + loss_chunk]).flatten(0, 1).float(),
                        labels[:, i:i + loss_chunk].flatten(), ignore_index=-100, reduction="sum")
        for i in range(0, n, loss_chunk)
    )
    return total / (labels != -100).sum()


@dataclass
class StepInputs:
    """The model's tensors split by role, in the placeholder order of the traced graph."""

    trainable: dict[str, torch.Tensor]
    frozen: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]

    @classmethod
    def of(cls, model: nn.Module) -> StepInputs:
        trainable, frozen = {}, {}
        for name, p in model.named_parameters():  # tied weights appear once
            (trainable if p.requires_grad else frozen)[name] = p
        return cls(trainable, frozen, dict(model.named_buffers()))

    def args(self, *batch: torch.Tensor) -> list[torch.Tensor]:
        return [*self.trainable.values(), *self.frozen.values(), *self.buffers.values(), *batch]


_trace_count = 0  # traces made in this process: an epoch must not trace more than once


def trace_count() -> int:
    return _trace_count


CAUSAL_ATTENTION = "remat_causal"


def _no_mask(*args, **kwargs) -> None:
    return None


def _causal_attention(module, query, key, value, attention_mask, **kwargs):
    return sdpa_attention_forward(module, query, key, value, None, **kwargs)


# Plain causal SDPA with no mask tensor. transformers' own "sdpa" decides between a mask
# and `is_causal` with data-dependent checks that answer differently under tracing than
# in eager mode, so a traced step would not match eager; this one has no such branch.
AttentionInterface.register(CAUSAL_ATTENTION, _causal_attention)
AttentionMaskInterface.register(CAUSAL_ATTENTION, _no_mask)


def prepare(model: nn.Module) -> None:
    """Mark the layer outputs and select causal attention, once per model."""
    if not getattr(model, "_remat_prepared", False):
        mark_layer_outputs(model)
        model.set_attn_implementation(CAUSAL_ATTENTION)
        model._remat_prepared = True


def capture(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, *, fake: bool = True,
            loss_chunk: int = 0) -> TrainGraph:
    """Trace the train step of `model` on a batch of this shape into a TrainGraph.

    With `fake=True` nothing of the step is computed: tensors are FakeTensors, and each
    node's `meta["val"]` carries shape, dtype and strides for the planner.
    """
    global _trace_count
    prepare(model)
    tensors = StepInputs.of(model)
    if not tensors.trainable:
        raise ValueError("the model has no trainable parameters")
    names = [*tensors.trainable, *tensors.frozen, *tensors.buffers, "input_ids", "labels"]
    roles = (
        ["trainable"] * len(tensors.trainable)
        + ["frozen"] * len(tensors.frozen)
        + ["buffer"] * len(tensors.buffers)
        + ["input", "input"]
    )
    n_train = len(tensors.trainable)
    state_names = names[:-2]
    boundary: list[fx.Node] = []

    def step(*args: torch.Tensor):
        state = {f"model.{k}": v for k, v in zip(state_names, args[:-2])}
        loss = torch.func.functional_call(_LossModule(model, loss_chunk), state, args[-2:])
        boundary.append(list(get_proxy_mode().tracer.graph.nodes)[-1])
        grads = torch.autograd.grad(loss, args[:n_train])
        return (loss, *grads)

    example = tensors.args(input_ids, labels)
    with torch.enable_grad():
        if fake:
            # a model built under a fake mode (planning without weights) brings its own
            mode = next((t.fake_mode for t in example if isinstance(t, FakeTensor)), None)
            mode = mode or EagerStridesFakeMode(allow_non_fake_inputs=True)
            example = [t if isinstance(t, FakeTensor) else mode.from_tensor(t) for t in example]
            with mode:
                gm = make_fx(step)(*example)
        else:
            gm = make_fx(step)(*example)
    _trace_count += 1
    return TrainGraph(gm=gm, roles=roles, names=names, boundary=boundary[0],
                      info={"shape": tuple(input_ids.shape), "loss_chunk": loss_chunk})


class EagerStridesFakeMode(FakeTensorMode):
    """Fake tensors laid out the way the real CPU kernels lay them out.

    A few of PyTorch's fake kernels are Python decompositions whose output strides
    differ from the eager kernel's (`softplus_backward` follows its second operand,
    eager follows the first). A traced `reshape` then becomes a `view` that fails at
    run time, or a copy eager never made. `tests/test_capture.py` checks every node's
    strides against a real run, so a new mismatch shows up there.
    """

    _same_layout_as: ClassVar[dict] = {
        # pointwise binary op on (grad_output, self): eager's TensorIterator layout
        torch.ops.aten.softplus_backward.default: torch.ops.aten.mul.Tensor,
    }

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self._same_layout_as:
            with self:
                return self._same_layout_as[func](args[0], args[1])
        return super().__torch_dispatch__(func, types, args, kwargs)


def refresh_meta(gm: fx.GraphModule) -> None:
    """Recompute every node's fake `meta["val"]` by running the graph on fake tensors."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = EagerStridesFakeMode(allow_non_fake_inputs=True)
    inputs = [mode.from_tensor(n.meta["val"]) for n in gm.graph.nodes if n.op == "placeholder"]
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)


class _LossModule(nn.Module):
    # functional_call swaps tensors on a module's whole tree; this makes the loss one call.
    def __init__(self, model: nn.Module, loss_chunk: int):
        super().__init__()
        self.model, self.loss_chunk = model, loss_chunk

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return causal_lm_loss(self.model, input_ids, labels, self.loss_chunk)


def interpret(gm: fx.GraphModule, args: list, *, on_node=None, on_free=None,
              keep: set[fx.Node] = frozenset()) -> list:
    """Run `gm` node by node, freeing each value after its last use (unless in `keep`).

    `on_node(node, value, env)` sees every value as it is made, `on_free(node, value)` as
    it is dropped. This is the slow path used to observe a run (measured memory, verify
    mode); training calls `gm` itself, which frees values at the same points.
    """
    def drop(n: fx.Node) -> None:
        value = env.pop(n)
        if on_free is not None:
            on_free(n, value)

    nodes = list(gm.graph.nodes)
    last_use: dict[fx.Node, int] = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last_use[a] = i
    dies_at: dict[int, list[fx.Node]] = {}
    for n, i in last_use.items():
        if n not in keep:
            dies_at.setdefault(i, []).append(n)
    env: dict[fx.Node, object] = {}
    it = iter(args)
    for i, n in enumerate(nodes):
        if n.op == "placeholder":
            env[n] = next(it)
        elif n.op == "output":
            return list(fx.node.map_arg(n.args[0], env.__getitem__))
        else:
            a, kw = fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
            target = getattr(gm, n.target) if n.op == "get_attr" else n.target
            env[n] = target(*a, **kw)
        if on_node is not None:
            on_node(n, env[n], env)
        if not n.users and n not in keep:
            drop(n)
        for dead in dies_at.get(i, ()):
            drop(dead)
    raise AssertionError("graph has no output")
