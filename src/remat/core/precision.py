"""The compute dtype of a step: mixed precision with float32 master weights.

The step's forward reads every float parameter in the compute dtype (`--dtype`): a trainable float32 weight is cast
where the forward reads it, and its gradient flows back through the cast into float32; a stored weight is
dequantized into the compute dtype at once (`remat.models.stored`). So the model computes as it would loaded in that
dtype (its activations, the residual stream, its own float32 islands: norms, softmax, rotary tables), while its
trainable weights, their grads and AdamW's state stay float32, and the loss is float32 (`hf.causal_lm_loss`
upcasts the logits, as transformers' own loss does). The oracle (tests/test_precision.py): the model's own forward
and backward with its parameters in that dtype, bitwise.

`auto` takes bfloat16 where the hardware computes it natively (a CPU with AVX512-BF16 or AMX, a CUDA device that
supports it), else float32; `resolve` says which and why.

Casts cost one pass over their values to remake, and a weight's copy in the compute dtype is a weight's worth of
memory: a cast of a placeholder (a weight read in the compute dtype), an upcast (a norm's float32 island: its input
is the smaller value, and saved anyway) and the loss's float32 log-probabilities (remade from the logits in the
compute dtype, half their bytes) are never saved for the backward (`never_saved`, `policies.always_recomputed`), and
a weight's cast is made where the forward first reads it, and again by each backward reader (`casts_where_read`),
not at the step's start; its grad is made float32 where the grad is made (`upcasts_where_made`), not at the end.
float16 runs without loss scaling (a gradient below float16's range flushes to zero): prefer bfloat16.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import fx

from remat.base.settings import UsageError
from remat.core import alias, devices
from remat.core.capture import copied_value
from remat.core.graph import TrainGraph

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# CPU flags of instructions that compute bfloat16 products natively (Linux's names in /proc/cpuinfo)
NATIVE_BF16 = ("avx512_bf16", "amx_bf16")
CAST = torch.ops.aten._to_copy.default
SOFTMAX = frozenset({torch.ops.aten._log_softmax.default, torch.ops.aten._softmax.default})

__all__ = ["CAST", "DTYPES", "Precision", "backward_reads", "casts_where_read", "never_saved", "resolve"]


@dataclass(frozen=True)
class Precision:
    """The dtype a step computes in, and why it was chosen."""

    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's features as /proc/cpuinfo names them (x86; empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def _native_bf16_cpu() -> str | None:
    """The CPU's instructions that compute bfloat16 natively, or None."""
    found = [f.upper().replace("_", "-") for f in NATIVE_BF16 if f in cpu_flags()]
    if not found and "AMX" in torch.backends.cpu.get_cpu_capability():  # no /proc/cpuinfo: torch's own dispatch
        found = ["AMX"]
    return ", ".join(found) or None


@functools.cache
def resolve(asked: str, device: str = "cpu") -> Precision:
    """The dtype `--dtype asked` computes in on `--device device` (auto, cpu, cuda, cuda:N, mps: planned for it, here
    or not), and why; UsageError for a dtype the device cannot run."""
    device = str(devices.planned(device))
    kind = torch.device(device).type
    here = kind != "cuda" or torch.cuda.is_available()  # a CUDA job can be planned on a machine without one
    if asked != "auto":
        if asked not in DTYPES:
            raise UsageError(f"--dtype {asked}: not one of auto, {', '.join(DTYPES)}")
        if kind == "cuda" and here and asked == "bfloat16" and not torch.cuda.is_bf16_supported():
            raise UsageError(f"--dtype bfloat16: {torch.cuda.get_device_name(device)} cannot compute bfloat16")
        return Precision(DTYPES[asked], f"--dtype {asked}")
    if not here:
        return Precision(torch.bfloat16, "auto: planned for a CUDA device (none here) as bfloat16, which every one "
                                         "since Ampere computes")
    if kind == "mps":
        return Precision(torch.float32, "auto: float32 on MPS (bfloat16 there is untested)")
    if kind == "cuda":
        name = torch.cuda.get_device_name(device)
        if torch.cuda.is_bf16_supported():
            return Precision(torch.bfloat16, f"auto: {name} computes bfloat16")
        return Precision(torch.float32, f"auto: {name} has no bfloat16")
    native = _native_bf16_cpu()
    if native is not None:
        return Precision(torch.bfloat16, f"auto: this CPU computes bfloat16 natively ({native})")
    return Precision(torch.float32, "auto: this CPU has no native bfloat16 (no AVX512-BF16 or AMX)")


def _upcast(n: fx.Node) -> bool:
    made, read = n.meta.get("val"), n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else None
    return (n.target is CAST and isinstance(made, torch.Tensor) and isinstance(read, torch.Tensor)
            and made.is_floating_point() and read.is_floating_point() and made.element_size() > read.element_size())


def never_saved(n: fx.Node) -> bool:
    """A value of mixed precision that no policy saves, cheaper remade from its input: a cast of a placeholder (a
    weight read in the compute dtype); an upcast (its input is the smaller value: a norm's float32 island); a
    softmax of an upcast (the loss's float32 log-probabilities, twice the bytes of the logits they are made from)."""
    if n.target in SOFTMAX:
        return isinstance(n.args[0], fx.Node) and _upcast(n.args[0])
    if n.target is not CAST or not isinstance(n.args[0], fx.Node):
        return False
    return n.args[0].op == "placeholder" or _upcast(n)


def casts_where_read(tg: TrainGraph) -> int:
    """Make each cast of a placeholder (a weight read in the compute dtype) where it is read: the forward's just
    before its first forward reader (`functional_call` casts them all at the step's start, and each would live
    from there), and, for each backward reader of it or of a view made of it alone (a transpose), a cast of its
    own (and the views) just before that reader: the same ops on the same weight, the same values. So no cast
    lives from the forward into the backward, nor from one backward reader to the next (a tied head's weight,
    read by every loss piece's backward: 54 MiB of SmolLM2's in bfloat16, alive through each piece's float32
    log-softmax backward). Returns how many casts moved or were made."""
    graph = tg.gm.graph
    pos = {n: i for i, n in enumerate(graph.nodes)}
    end = pos[tg.boundary]
    changed = 0
    casts = [n for n in graph.nodes
             if n.target is CAST and isinstance(n.args[0], fx.Node) and n.args[0].op == "placeholder" and n.users]
    for n in casts:
        for made, reader in backward_reads(n, pos, end):
            with graph.inserting_before(reader):
                own = _made_again(graph, made)
            reader.replace_input_with(made[-1], own)
            changed += 1
            for old in reversed(made[1:]):  # the views the backward no longer reads
                if not old.users:
                    graph.erase_node(old)
        if not n.users:
            graph.erase_node(n)
            continue
        first = min(n.users, key=lambda u: pos.get(u, -1))
        if first is not n.next:
            first.prepend(n)
            changed += 1
    if changed:
        graph.lint()
        tg.gm.recompile()
    return changed


def backward_reads(cast: fx.Node, pos: dict[fx.Node, int], end: int) -> list[tuple[list[fx.Node], fx.Node]]:
    """Each backward node reading `cast` or a view made of it alone (a transpose, the forward's or the
    backward's own), with the chain that makes what it reads: the cast, then the views. A view's value shares
    its input's storage, so the backward's views are made again with the cast, not kept reading the old one."""
    found, stack = [], [[cast]]
    while stack:
        chain = stack.pop()
        for u in list(chain[-1].users):
            if alias.view_source(u) is chain[-1] and u.all_input_nodes == [chain[-1]]:
                stack.append([*chain, u])
            elif pos[u] > end:
                found.append((chain, u))
    return sorted(found, key=lambda x: pos[x[1]])


def _made_again(graph: fx.Graph, chain: list[fx.Node]) -> fx.Node:
    """The chain's nodes copied in order (each reading the copy before), with values of their own."""
    made: dict[fx.Node, fx.Node] = {}
    for n in chain:
        copy = graph.node_copy(n, lambda a: made.get(a, a))
        copy.meta = {**n.meta, "val": copied_value(n, copy)}
        made[n] = copy
    return made[chain[-1]]


def upcasts_where_made(tg: TrainGraph) -> int:
    """Move each upcast of a backward value (a weight's grad in the compute dtype made float32: its cast's
    backward), and an in-place sum of it into a buffer of the step's (the walk's gradient sums), to just after
    the value is made. Autograd runs a cast's backward once its grad is whole, and the forward made every weight's
    cast at its start (`functional_call`), so each came at the very end of the backward, and every layer's grad
    in the compute dtype lived until then. The same ops on the same values, earlier. Returns how many moved."""
    graph = tg.gm.graph
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    end = pos[tg.boundary]
    moved = 0
    for n in nodes[end + 1:]:
        made = n.args[0] if n.target is CAST and n.args else None
        if not isinstance(made, fx.Node) or pos[made] <= end or not _upcast(n) or made.next is n:
            continue
        between = nodes[pos[made] + 1:pos[n]]
        if any(alias.is_mutating(x) and made in x.all_input_nodes for x in between):
            continue  # written after it is made: the upcast reads the value as it is at its place
        after = made
        for x in [n, *(u for u in n.users if alias.is_mutating(u) and _reads_only(u, n)), *_hook_zero(n)]:
            after.append(x)
            after = x
            moved += 1
    if moved:
        graph.lint()
        tg.gm.recompile()
    return moved


def _hook_zero(grad: fx.Node) -> list[fx.Node]:
    """The zero a gradient hook passes on in place of `grad` (`capture.into`: a scalar of its kind, expanded to its
    shape), made as the hook runs: just after the grad, with it."""
    zeros = [u for u in grad.users if u.target is torch.ops.aten.new_zeros.default and u.all_input_nodes == [grad]]
    return [*zeros, *(e for z in zeros for e in z.users if e.target is torch.ops.aten.expand.default
                      and e.all_input_nodes == [z])]


def _reads_only(node: fx.Node, value: fx.Node) -> bool:
    """Whether `node` reads `value` and otherwise placeholders alone (an in-place sum into a step's buffer)."""
    return all(a is value or a.op == "placeholder" for a in node.all_input_nodes)

