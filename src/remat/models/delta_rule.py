"""The chunked gated delta rule (Gated DeltaNet layers: Qwen3-Next, Qwen3.5, OLMo Hybrid, ...) as two ops.

transformers' `torch_chunk_gated_delta_rule` loops over chunks of 64 tokens in Python, so a traced step
unrolls that loop: its graph, and the time to trace, rewrite and plan it, grew with the window
(qwen3.5-0.8b: 28k nodes at 512 tokens, 41k at 1,024; at 34,816 it did not plan in 4 minutes). While a step
is traced (`swapped`), the layer's module calls these ops instead, so each layer holds two nodes whatever
the window: `remat::gated_delta_rule` (the forward) and `remat::gated_delta_rule_backward`.

Follow the model: both run the model's own function. The forward runs it without grad; the backward runs
it again under autograd and takes its gradient: the same ops on the same values, returned in the layouts
eager gives them, so losses and grads are bitwise the model's own. The forward op saves only its inputs,
so the rule's intermediates are recomputed inside its backward under every policy, as
`torch.utils.checkpoint` would.

What an op holds inside (the backward: every chunk's intermediates) is its workspace, which the planner
adds at the op's node (`WORKSPACES`, handed to the tracer with the swap): run on the meta device at 3 and 4
chunks (every size in the rule is affine in the chunk count) and checked at 5, so planning costs the same at any
window; `plan.measure`
tracks the real one (`plan.held_inside`). Against the allocator's own events the plan over-counts by about
6% of the workspace (the tracker's weak references keep autograd from summing some gradients in place);
tests/test_delta_rule.py holds that bound.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Iterator

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from remat.core import plan
from remat.core.graph import Workspaces

NAME = "torch_chunk_gated_delta_rule"  # transformers' function, module-level in each Gated DeltaNet family
# Inside an op's kernel autograd is switched off (it runs below autograd); the backward turns it on again.
_EXCLUDED_WITH_AUTOGRAD = torch._C._dispatch_tls_local_exclude_set()


def _rule(module: str) -> Callable:
    """The model's own function, as its module holds it now (a test may have replaced it), unswapped."""
    return _own(getattr(sys.modules[module], NAME))


def _own(rule: Callable) -> Callable:
    if isinstance(rule, functools.partial) and rule.func is _traced_rule:  # swapped
        return rule.keywords["own"]
    return rule


# Which of each op's tensor arguments have the token dimension (dim 1; the states have none).
FORWARD_TOKENS = (True, True, True, True, True, False)  # query, key, value, g, beta, initial_state
BACKWARD_TOKENS = (True, False, *FORWARD_TOKENS)  # grad_out, grad_state, then the forward's


def _run(module: str, ts: list, chunk_size: int, l2norm: bool) -> tuple:
    query, key, value, g, beta, initial_state = ts
    return _rule(module)(query, key, value, g=g, beta=beta, chunk_size=chunk_size, initial_state=initial_state,
                         output_final_state=True, use_qk_l2norm_in_kernel=l2norm)


def _outputs(module: str, ts: list, chunk_size: int, l2norm: bool) -> list[torch.Tensor]:
    """The function's output and final state, without grad."""
    with torch.no_grad():
        return list(_run(module, ts, chunk_size, l2norm))


def _grads(module: str, ts: list, chunk_size: int, l2norm: bool) -> list[torch.Tensor | None]:
    """The function's own backward: run again under autograd, its gradient taken for each input (zeros where
    unused, None where absent). An unset `grad_state` seeds the output alone, as eager autograd does when
    nothing reads the final state: a zero seed is exact, but its path changes the order in which autograd
    sums the rest."""
    grad_out, grad_state, *given = ts
    leaves = [None if t is None else t.detach().requires_grad_() for t in given]
    wanted = [t for t in leaves if t is not None]
    with torch.enable_grad(), torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(),
                                                                _EXCLUDED_WITH_AUTOGRAD):
        out, state = _run(module, leaves, chunk_size, l2norm)
        outputs, seeds = ([out, state], [grad_out, grad_state]) if grad_state is not None else ([out], [grad_out])
        grads = iter(torch.autograd.grad(outputs, wanted, seeds, allow_unused=True))
    return [None if t is None else _or_zeros(next(grads), t) for t in leaves]


def _or_zeros(grad: torch.Tensor | None, t: torch.Tensor) -> torch.Tensor:
    return torch.zeros(t.shape, dtype=t.dtype, device=t.device) if grad is None else grad


def _in_eagers_layout(forward: bool, ts: list, module: str, chunk_size: int, l2norm: bool) -> list[torch.Tensor]:
    """An op's results, each dense in the dimension order eager gives it (`_layouts`)."""
    results = _outputs(module, ts, chunk_size, l2norm) if forward else _grads(module, ts, chunk_size, l2norm)
    layouts = _layouts(forward, _small(forward, ts, chunk_size), module, chunk_size, l2norm)
    return [_laid_out(r, layout[2]) for r, layout in zip(results, layouts) if r is not None]


def _forward(query, key, value, g, beta, initial_state, module: str, chunk_size: int, l2norm: bool) -> list:
    return _in_eagers_layout(True, [query, key, value, g, beta, initial_state], module, chunk_size, l2norm)


def _backward_of(grad_out, grad_state, query, key, value, g, beta, initial_state, module: str, chunk_size: int,
                 l2norm: bool) -> list[torch.Tensor]:
    grads = _in_eagers_layout(False, [grad_out, grad_state, query, key, value, g, beta, initial_state], module,
                              chunk_size, l2norm)
    return grads if initial_state is not None else grads[:5]


@torch.library.custom_op("remat::gated_delta_rule", mutates_args=())
def gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, initial_state: torch.Tensor | None, module: str, chunk_size: int,
                     l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    args = (query, key, value, g, beta, initial_state)
    return plan.held_inside(lambda: _forward(*args, module, chunk_size, l2norm), args)  # type: ignore[return-value]


@gated_delta_rule.register_fake
def _(query, key, value, g, beta, initial_state, module, chunk_size, l2norm):
    return tuple(_fake(True, [query, key, value, g, beta, initial_state], module, chunk_size, l2norm))


@torch.library.custom_op("remat::gated_delta_rule_backward", mutates_args=())
def gated_delta_rule_backward(grad_out: torch.Tensor, grad_state: torch.Tensor | None, query: torch.Tensor,
                              key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                              initial_state: torch.Tensor | None, module: str, chunk_size: int,
                              l2norm: bool) -> list[torch.Tensor]:
    args = (grad_out, grad_state, query, key, value, g, beta, initial_state)
    return plan.held_inside(lambda: _backward_of(*args, module, chunk_size, l2norm), args)  # type: ignore[return-value]


@gated_delta_rule_backward.register_fake
def _(grad_out, grad_state, query, key, value, g, beta, initial_state, module, chunk_size, l2norm):
    ts = [grad_out, grad_state, query, key, value, g, beta, initial_state]
    grads = _fake(False, ts, module, chunk_size, l2norm)
    return grads if initial_state is not None else grads[:5]


def _setup(ctx, inputs, output) -> None:
    query, key, value, g, beta, initial_state, ctx.module, ctx.chunk_size, ctx.l2norm = inputs
    ctx.save_for_backward(query, key, value, g, beta, initial_state)
    ctx.set_materialize_grads(False)  # an unread final state's grad stays None (see `_grads`)


def _backward(ctx, grad_out, grad_state):
    query, key, value, g, beta, initial_state = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(value)
    grads = gated_delta_rule_backward(grad_out, grad_state, query, key, value, g, beta, initial_state, ctx.module,
                                      ctx.chunk_size, ctx.l2norm)
    return (*grads[:5], grads[5] if initial_state is not None else None, None, None, None)


gated_delta_rule.register_autograd(_backward, setup_context=_setup)
FORWARD = torch.ops.remat.gated_delta_rule.default
BACKWARD = torch.ops.remat.gated_delta_rule_backward.default


def _traced_rule(query, key, value, g, beta, chunk_size: int = 64, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, *, module: str, own: Callable, **kwargs):
    """The model's function's signature, calling the op (what it does not know, the model's own function does)."""
    if kwargs.get("cu_seqlens") is not None or kwargs.get("seq_idx") is not None:  # packed: the model's own answer
        return own(query, key, value, g=g, beta=beta, chunk_size=chunk_size, initial_state=initial_state,
                   output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)
    out, state = gated_delta_rule(query, key, value, g, beta, initial_state, module, chunk_size,
                                  use_qk_l2norm_in_kernel)
    return out, state if output_final_state else None


def _modules(model: nn.Module) -> list:
    """The modules of the model's code that define the rule."""
    names = {type(m).__module__ for m in model.modules()}
    return [sys.modules[n] for n in sorted(names) if n in sys.modules and callable(getattr(sys.modules[n], NAME, None))]


def chunk_sizes(model: nn.Module) -> set[int]:
    """The chunks of tokens the model's rule cuts a window into (its function's default: the layers call it without
    one): a window's plan jumps one token past each multiple (one chunk more, its padding)."""
    rules = [_own(getattr(m, NAME)) for m in _modules(model)]
    # transformers wraps the function in a module (its hub kernels'), whose forward has the function's signature
    defaults = [inspect.signature(getattr(r, "forward", r)).parameters.get("chunk_size") for r in rules]
    return {p.default for p in defaults if p is not None and isinstance(p.default, int)}


@contextlib.contextmanager
def swapped(model: nn.Module) -> Iterator[None]:
    """While tracing: the model's Gated DeltaNet modules call the ops instead of their chunk loop."""
    before = {m: getattr(m, NAME) for m in _modules(model)}
    for m, rule in before.items():
        setattr(m, NAME, functools.partial(_traced_rule, module=m.__name__, own=_own(rule)))
    try:
        yield
    finally:
        for m, rule in before.items():
            setattr(m, NAME, rule)


# ------------------------------------------------------------------------------------ shapes and layouts
# Eager's layouts. The rule transposes and pads its inputs, so what it returns, and the grads autograd hands
# back, come in varied dimension orders (and, when the window is padded, as slices of bigger tensors). What
# the model does next rounds by layout (the conv's weight grad does), so each op returns its results dense in
# the order eager gives them. Shapes and orders are the same at any chunk count from 3 for a given padding,
# so they are asked of the function on the meta device at up to 3 chunks, where the fake kernels ask too.


def _small(forward: bool, ts: list, chunk_size: int) -> tuple:
    """The tensors' (shape, dtype) at up to 3 chunks, the padding kept: a key for `_layouts`."""
    tokens = ts[0].shape[1]
    chunks = -(-tokens // chunk_size)
    to = min(chunks, 3) * chunk_size - (chunks * chunk_size - tokens)
    flags = FORWARD_TOKENS if forward else BACKWARD_TOKENS
    return tuple(None if t is None else (_with_tokens(tuple(t.shape), to) if has else tuple(t.shape), t.dtype)
                 for t, has in zip(ts, flags))


@functools.lru_cache(maxsize=128)
def _layouts(forward: bool, specs: tuple, module: str, chunk_size: int, l2norm: bool) -> tuple:
    """Each result's (shape, dtype, dimension order outermost first) at these specs, on the meta device; None
    for the grad of an absent input."""
    with unset_fake_temporarily():  # asked from a fake kernel: plain meta tensors run several times faster
        ts = [None if s is None else torch.empty(s[0], dtype=s[1], device="meta") for s in specs]
        results = _outputs(module, ts, chunk_size, l2norm) if forward else _grads(module, ts, chunk_size, l2norm)
    return tuple(None if r is None else (tuple(r.shape), r.dtype, sorted(range(r.dim()), key=lambda i: -r.stride()[i]))
                 for r in results)


def _fake(forward: bool, ts: list, module: str, chunk_size: int, l2norm: bool) -> list[torch.Tensor]:
    """An op's results on fake tensors: the shapes and orders at up to 3 chunks, the window's length set."""
    tokens = ts[0].shape[1]
    layouts = _layouts(forward, _small(forward, ts, chunk_size), module, chunk_size, l2norm)
    flags = (True, False) if forward else BACKWARD_TOKENS[2:]
    results = []
    for layout, has in zip(layouts, flags):
        if layout is not None:
            shape, dtype, order = layout
            shape = _with_tokens(shape, tokens) if has else shape
            results.append(ts[0].new_empty_strided(shape, _strides(shape, order), dtype=dtype))
    return results


def _with_tokens(shape: tuple, tokens: int) -> tuple:
    return (shape[0], tokens, *shape[2:])


def _strides(shape: tuple | torch.Size, order: list[int]) -> tuple[int, ...]:
    strides, step = [0] * len(shape), 1
    for i in reversed(order):
        strides[i], step = step, step * shape[i]
    return tuple(strides)


def _laid_out(t: torch.Tensor, order: list[int]) -> torch.Tensor:
    """`t` dense in `order`: as it is where it is so, else copied (a slice of the padded window is not)."""
    strides = _strides(t.shape, order)
    if t.stride() == strides:
        return t
    return torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device).copy_(t)


# ---------------------------------------------------------------------------------------------- workspace


def _workspace(node: fx.Node) -> int:
    """The bytes the op holds at its peak beyond its outputs, at this node's shapes."""
    forward = node.target is FORWARD
    *tensors, module, chunk_size, l2norm = node.args
    values = [a.meta["val"] if isinstance(a, fx.Node) else None for a in tensors]
    specs = tuple(None if v is None else (tuple(v.shape), v.dtype) for v in values)
    tokens = node.args[0].meta["val"].shape[1]  # type: ignore[union-attr]
    peak = _peak_at(forward, specs, tokens, str(module), int(chunk_size), bool(l2norm))  # type: ignore[arg-type]
    return max(0, peak - plan.value_bytes(node.meta["val"]))


def _peak_at(forward: bool, specs: tuple, tokens: int, module: str, chunk_size: int, l2norm: bool) -> int:
    """The op's internal peak for `tokens` tokens. Every size in the rule is affine in the chunk count for a
    fixed padding, and so is the peak once it falls at the same point of the run (from 3 chunks on in
    transformers' rule): the peaks at 3 and 4 chunks (the same padding) give it; 5 checks that. Up to
    12 chunks one run at full size costs no more than those three."""
    chunks = -(-tokens // chunk_size)
    pad = chunks * chunk_size - tokens
    flags = FORWARD_TOKENS if forward else BACKWARD_TOKENS

    def run(to: int) -> int:  # kept by the shapes at `to` tokens: every window of this padding asks the same three
        resized = tuple(None if s is None else (_with_tokens(s[0], to) if has else s[0], s[1])
                        for s, has in zip(specs, flags))
        return _peak(forward, resized, module=module, chunk_size=chunk_size, l2norm=l2norm)

    if chunks <= 3 + 4 + 5:
        return run(tokens)
    at = {n: run(n * chunk_size - pad) for n in (3, 4, 5)}
    step = at[4] - at[3]
    if at[5] - at[4] != step:
        return run(tokens)  # not affine here: planned at its size
    return at[3] + step * (chunks - 3)


@functools.lru_cache(maxsize=256)
def _peak(forward: bool, specs: tuple, *, module: str, chunk_size: int, l2norm: bool) -> int:
    """The op's internal peak (bytes of the storages it makes, at most at once) on inputs of these (shape, dtype),
    run on the meta device (eager's own kernels' shapes and strides, several times faster than fake tensors)."""
    body: Callable[..., object] = _forward if forward else _backward_of
    ts = [None if s is None else torch.empty(s[0], dtype=s[1], device="meta") for s in specs]
    peak: list[int] = []
    with plan.watching(peak):
        plan.held_inside(lambda: body(*ts, module, chunk_size, l2norm), ts)
    return peak[0]


# the ops' memory held inside, for the planner: the tracer that swaps them in hands these to the graph
WORKSPACES: Workspaces = {FORWARD: _workspace, BACKWARD: _workspace}
