"""Capture: trace one whole training step (forward, loss, backward) into a TrainGraph.

`make_fx` records the aten ops of a step that computes the loss and calls
`torch.autograd.grad`, so forward and backward land in one fx graph, in the order
they ran. The forward/backward boundary is the last node recorded before the
backward starts; it is read off the tracer at that moment, not guessed later.
"""

from __future__ import annotations

import functools
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

# With recompute, only one chunk's logits live at a time. SmolLM2 at ctx 2048 plans a
# 1,296 MiB graph unchunked, 545 MiB at 512 and 473 MiB at 256 (`remat plan --loss-chunk`).
DEFAULT_LOSS_CHUNK = 256

ROLES = ("trainable", "frozen", "buffer", "input")


def tensors_in(value: object) -> list[torch.Tensor]:
    """The tensors in a node's value: a tensor, or a (nested) tuple or list holding some."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_in(v)]
    return []


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
        with torch.no_grad():  # the backward is in the graph: autograd must not record it again
            loss, *grads = self.gm(*args)
        return loss, grads


def causal_lm_loss(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                   loss_chunk: int = 0) -> torch.Tensor:
    """Token-weighted mean cross-entropy over targets (labels == -100 are ignored)."""
    prepare(model)
    hidden = model.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state
    return head_loss(model, hidden, labels, loss_chunk)


def head_loss(model: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, loss_chunk: int = 0,
              n_targets: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy of the LM head over `hidden`: the mean over targets, or the sum over `n_targets`.

    With `loss_chunk` = N > 0 the head runs on N tokens at a time: each chunk's logits
    and cross-entropy are separate nodes, summed and divided by the number of targets,
    so a recompute rewrite can keep one chunk's logits alive at a time.
    """
    head = model.get_output_embeddings()
    n = hidden.shape[1]
    if n_targets is None and not 0 < loss_chunk < n:
        return F.cross_entropy(head(hidden).flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
    step = loss_chunk if 0 < loss_chunk < n else n
    total = sum(
        F.cross_entropy(head(hidden[:, i:i + step]).flatten(0, 1).float(),
                        labels[:, i:i + step].flatten(), ignore_index=-100, reduction="sum")
        for i in range(0, n, step)
    )
    return total / (n_targets if n_targets is not None else (labels != -100).sum())


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


ATTENTION = "remat"


def _mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0, device=None, **kwargs):
    """No mask for a plain causal window; for a chunk attending over a cache, keys up to each query."""
    if isinstance(q_offset, int) and q_offset == 0 and kv_offset == 0 and kv_length == q_length:
        return None
    q = q_offset + torch.arange(q_length, device=device)
    kv = kv_offset + torch.arange(kv_length, device=device)
    return (kv[None, :] <= q[:, None])[None, None]


def _attention(module, query, key, value, attention_mask, **kwargs):
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


# SDPA with masks remat builds. transformers' own "sdpa" decides between a mask and
# `is_causal` with data-dependent checks that answer differently under tracing than in
# eager mode, so a traced step would not match eager; these have no such branch.
AttentionInterface.register(ATTENTION, _attention)
AttentionMaskInterface.register(ATTENTION, _mask)


def prepare(model: nn.Module) -> None:
    """Mark the layer outputs and select remat's attention masks, once per model."""
    if not getattr(model, "_remat_prepared", False):
        mark_layer_outputs(model)
        model.set_attn_implementation(ATTENTION)
        model._remat_prepared = True


def capture(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, *,
            loss_chunk: int = 0) -> TrainGraph:
    """Trace the train step of `model` on a batch of this shape into a TrainGraph.

    Nothing of the step is computed: tracing runs on FakeTensors, and each node's
    `meta["val"]` carries shape, dtype, strides and storage for the planner.
    """
    return trace(model, functools.partial(causal_lm_loss, loss_chunk=loss_chunk),
                 {"input_ids": ("input", input_ids), "labels": ("input", labels)},
                 info={"shape": tuple(input_ids.shape), "loss_chunk": loss_chunk})


def trace(model: nn.Module, loss_fn, inputs: dict[str, tuple[str, torch.Tensor]], *,
          info: dict | None = None) -> TrainGraph:
    """Trace `loss_fn(model, *inputs)` and the grads of the trainable parameters into a TrainGraph.

    `inputs` maps a name to (role, example tensor): "input" for batch data, "state" for
    buffers the step reads and writes in place (the walk's caches). Placeholders are the
    model's trainable, frozen and buffer tensors, then the inputs in order.
    """
    global _trace_count
    prepare(model)
    tensors = StepInputs.of(model)
    if not tensors.trainable:
        raise ValueError("the model has no trainable parameters")
    model_names = [*tensors.trainable, *tensors.frozen, *tensors.buffers]
    roles = (["trainable"] * len(tensors.trainable) + ["frozen"] * len(tensors.frozen)
             + ["buffer"] * len(tensors.buffers) + [role for role, _ in inputs.values()])
    n_train, n_model = len(tensors.trainable), len(model_names)
    boundary: list[fx.Node] = []

    def step(*args: torch.Tensor):
        state = {f"model.{k}": v for k, v in zip(model_names, args[:n_model])}
        loss = torch.func.functional_call(_LossModule(model, loss_fn), state, args[n_model:])
        boundary.append(list(get_proxy_mode().tracer.graph.nodes)[-1])
        grads = torch.autograd.grad(loss, args[:n_train])
        return (loss, *grads)

    example = tensors.args(*(t for _, t in inputs.values()))
    if len({id(t) for t in example}) != len(example):
        raise ValueError("each input must be its own tensor (make_fx merges repeated inputs)")
    # a model built under a fake mode (planning without weights) brings its own
    mode = next((t.fake_mode for t in example if isinstance(t, FakeTensor)), None)
    mode = mode or EagerStridesFakeMode(allow_non_fake_inputs=True)
    example = [t if isinstance(t, FakeTensor) else mode.from_tensor(t) for t in example]
    with torch.enable_grad(), mode:
        gm = make_fx(step)(*example)
    _trace_count += 1
    return TrainGraph(gm=gm, roles=roles, names=[*model_names, *inputs], boundary=boundary[0], info=info or {})


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
    def __init__(self, model: nn.Module, loss_fn):
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.model, *inputs)


@torch.no_grad()  # the backward is in the graph: autograd must not record it again
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
            env[n] = getattr(gm, n.target) if n.op == "get_attr" else n.target(*a, **kw)
        if on_node is not None:
            on_node(n, env[n], env)
        if not n.users and n not in keep:
            drop(n)
        for dead in dies_at.get(i, ()):
            drop(dead)
    raise AssertionError("graph has no output")
