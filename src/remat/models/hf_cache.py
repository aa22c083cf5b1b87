"""transformers' cache interface for the walk: the shapes of every state a model's layers keep, and the cache
that attention and recurrent layers call over the walk's persistent buffers (beside `hf`, whose functions it uses)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_leaves
from transformers import Cache

from remat.base.settings import one_line
from remat.models import masks, scan
from remat.models.hf import UnsupportedModel, causal_lm, decoder_layers, decoder_of, only_layers, prepare
from remat.models.stored import compute_dtype


@contextlib.contextmanager
def walking(model: nn.Module) -> Iterator[None]:
    """What the walk changes while it runs a model (its probes, a chunk's trace, the forward sweep): Mamba's scans
    start from the carried state (`scan`), causal masks cut by the cache's length are cut by positions (`masks`)."""
    lm = causal_lm(model)
    with scan.carried(lm), masks.by_positions(lm):
        yield


K = TypeVar("K")  # a cache class
R = TypeVar("R")


# The caches that hold a row per token of the window, and the dimension of their rows: attention's keys and values
# (batch, heads, tokens, dim), a sparse-attention indexer's keys (batch, tokens, dim). The other states are carried.
ROWS = {"k": 2, "v": 2, "index": 1}


def _over_window(name: str, shape: tuple[int, ...], ctx: int) -> tuple[int, ...]:
    """A state's shape for the whole window: a cache's rows for every token of it, a carried state as probed."""
    dim = ROWS.get(name.split(".")[0])
    return tuple(shape) if dim is None else (*shape[:dim], ctx, *shape[dim + 1:])


def _name(kind: str, layer_idx: int, state_idx: int = 0) -> str:
    """A carried state's name: `conv.3`, or `conv.3.1` for a layer's second one (Inkling's layers keep four
    short-convolution states, told apart by `state_idx`)."""
    return f"{kind}.{layer_idx}" + (f".{state_idx}" if state_idx else "")


class _ProbeCache:
    """The walk's cache interface on an empty cache, recording the shape of every state a layer writes."""

    is_compileable = False
    is_initialized = True  # the walk's buffers are made before the window (HRM asks, for its prefix masks)

    def __init__(self):
        self.shapes: dict[str, tuple[int, ...]] = {}

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        self.shapes[f"k.{layer_idx}"], self.shapes[f"v.{layer_idx}"] = key_states.shape, value_states.shape
        return key_states, value_states

    def update_indexer(self, key_states, layer_idx: int):
        self.shapes[f"index.{layer_idx}"] = key_states.shape
        return key_states

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return query_length, 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        return None

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        return None

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        return 0  # per-token states are kept only while recording the past, which the walk never does

    def update_conv_state(self, conv_input, layer_idx: int, conv_kernel_size: int, state_idx: int = 0, **kwargs):
        self.shapes[_name("conv", layer_idx, state_idx)] = (*conv_input.shape[:-1], conv_kernel_size)
        return torch.cat([conv_input.new_zeros(*conv_input.shape[:-1], conv_kernel_size), conv_input], dim=-1)

    def update_recurrent_state(self, recurrent, layer_idx: int, state_idx: int = 0, **kwargs):
        self.shapes[_name("recurrent", layer_idx, state_idx)] = recurrent.shape
        return recurrent

    # MiniMax's lightning attention keeps its recurrent state (K^T V) as a "linear cache"
    def get_linear_cache(self, layer_idx: int):
        return self.get_recurrent_state(layer_idx)

    def set_linear_cache(self, layer_idx: int, linear_cache):
        self.update_recurrent_state(linear_cache, layer_idx)


class _CarriedStateProbe(_ProbeCache):
    """The probe cache handing each layer a carried recurrent state (zeros), recording which layers' states
    reach an op: a scan that never reads the state it is handed starts every chunk from zero."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype):
        super().__init__()
        self.carried = {k: torch.zeros(v, dtype=dtype) for k, v in shapes.items() if k.startswith("recurrent.")}
        self.read: set[str] = set()

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        return self.carried.get(_name("recurrent", layer_idx, state_idx))


class _StateReads(torch.overrides.TorchFunctionMode):
    """Which of the probe's carried states an op takes as an argument (reading a size is not using it)."""

    def __init__(self, probe: _CarriedStateProbe):
        super().__init__()
        self.probe = probe
        self.names = {id(t): k for k, t in probe.carried.items()}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") != "__get__":
            for t in tree_leaves((args, kwargs)):
                if id(t) in self.names:
                    self.probe.read.add(self.names[id(t)])
        return func(*args, **kwargs)


def _scans_from_zero(lm: Any, batch: int, shapes: dict[str, tuple[int, ...]], family: type | None) -> list[int]:
    """The layers whose sequence scan ignores the recurrent state carried in (Mamba's selective scan takes no
    initial state): the walk would start each chunk of theirs from zero."""
    fake = next((p for p in lm.parameters() if isinstance(p, FakeTensor)), None)
    with fake.fake_mode if fake is not None else contextlib.nullcontext():
        probe = _CarriedStateProbe(shapes, compute_dtype(lm))
    with _StateReads(probe):
        _run_probe(lm, batch, probe, family)
    return sorted({state_layer(k) for k in probe.carried.keys() - probe.read})


class _PaddedProbeCache(_ProbeCache):
    """The probe cache laid out as the walk's: after the chunk's K/V rows, `pad` rows of later positions
    (zeros), which the mask hides."""

    def __init__(self, pad: int):
        super().__init__()
        self.pad = pad

    def _padded(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(*t.shape[:dim], self.pad, *t.shape[dim + 1:])], dim=dim)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        return self._padded(key_states, ROWS["k"]), self._padded(value_states, ROWS["v"])

    def update_indexer(self, key_states, layer_idx: int):
        return self._padded(key_states, ROWS["index"])

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return query_length + self.pad, 0


def own_cache(lm: Any) -> type | None:
    """The cache class the model's family defines (MiniMax's `MiniMaxCache`), if it defines one."""
    module = sys.modules[type(decoder_of(lm)).__module__]
    own = [c for c in vars(module).values()
           if isinstance(c, type) and issubclass(c, Cache) and c.__module__ == module.__name__]
    return own[0] if len(own) == 1 else None


_MIXED: dict[tuple[type, type], type] = {}


def of_family(kind: type[K], family: type | None) -> type[K]:
    """`kind` (a walk or probe cache), also an instance of the family's own cache class where the decoder takes
    no other (MiniMax checks `isinstance(cache, MiniMaxCache)`): `kind`'s methods first, the family's never run."""
    if family is None:
        return kind
    return _MIXED.setdefault((kind, family), type(kind.__name__, (kind, family), {}))


def _run_probe(lm: Any, batch: int, cache: _ProbeCache, family: type | None = None) -> Any:
    """The decoder on two tokens over a probe cache (in the fake mode of a model built without weights), the
    cache made an instance of the family's own cache class where the decoder takes no other."""
    cache.__class__ = of_family(type(cache), family)
    params = [p for p in lm.parameters()]
    mode = next((p.fake_mode for p in params if isinstance(p, FakeTensor)), None)
    device = params[0].device
    ids = torch.zeros(batch, 2, dtype=torch.long, device=device)
    positions = torch.arange(2, device=device)[None].expand(batch, -1)
    with torch.no_grad(), mode if mode is not None else contextlib.nullcontext(), walking(lm):
        return decoder_of(lm)(input_ids=ids, position_ids=positions, cache=cache, use_cache=True)


def _probe(lm: Any, batch: int, family: type | None) -> dict[str, tuple[int, ...]]:
    """Run the decoder on two tokens over a probe cache: the shape of every state its layers keep."""
    cache = _ProbeCache()
    _run_probe(lm, batch, cache, family)
    return cache.shapes


def _reads_cache_length(lm: Any, batch: int, ctx: int, family: type | None) -> bool:
    """Whether the decoder's output changes when its cache holds rows past the chunk's, as the walk's does.

    Attention that follows the mask ignores those rows; attention that cuts its own causal or local
    mask by the cache's length (assuming the cache ends at the queries: GPT-Neo) attends elsewhere.
    A model without weights (fake) has no values to compare.
    """
    if ctx <= 2 or any(isinstance(p, FakeTensor) for p in lm.parameters()):
        return False
    training = {m: m.training for m in lm.modules()}
    lm.eval()  # dropout and sampled routing off: the two runs must draw nothing
    try:
        plain, padded = (_run_probe(lm, batch, c, family)[0] for c in (_ProbeCache(), _PaddedProbeCache(ctx - 2)))
    finally:
        for m, mode in training.items():
            m.training = mode
    return not torch.allclose(plain, padded, rtol=1e-4, atol=1e-5)


class Probes:
    """What the walk learns of a model by running it, asked once each: its states' shapes (per batch), whether its
    attention masks by the cache's length (per window), whether its scans start from the carried state. One per
    model, held by whoever plans or walks it (a `Planner`, a `Walk`): nothing is kept on the model."""

    def __init__(self, model: nn.Module, stand_ins: Sequence[int] | None = None):
        self.lm = causal_lm(model)
        # stand_ins[i]: the layer whose states are layer i's (a planning model's alike layers, `fastplan`'s pick):
        # the probes run those layers alone (qwen3.5-0.8b's two: 1.1 s with its 24 layers, 0.14 s with five)
        self.stand_ins = None if stand_ins is None else tuple(stand_ins)
        self.shapes: dict[int, dict[str, tuple[int, ...]]] = {}
        self.reads_length: dict[int, bool] = {}
        self.from_zero: dict[int, list[int]] = {}
        self.family: type | None = None  # the family's own cache class, where its decoder takes no other

    def cache(self, kind: type[K]) -> type[K]:
        """The walk's cache class for this model: `kind`, an instance of the family's own cache where it must be."""
        return of_family(kind, self.family)

    def state_shapes(self, batch: int, ctx: int) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every cache and state tensor the walk keeps for a window of `ctx` tokens.

        Read off the model itself: its decoder runs on two tokens over a probe cache, and each
        attention layer's K/V (full window: sliding-window layers keep every row and apply their
        window in the mask), conv state and recurrent state is recorded as the layer writes it.
        Refuses, naming the feature, what a chunk cannot carry over to the next.
        """
        lm = self.lm
        prepare(lm)
        if getattr(lm.config, "output_router_logits", False):
            raise UnsupportedModel("the walk path does not support a router aux loss (output_router_logits): "
                                   "it is a function of the whole window's routing")
        shapes = self._shapes(batch)
        if ctx not in self.reads_length:
            self.reads_length[ctx] = (any(k.startswith("k.") for k in shapes)
                                      and _reads_cache_length(lm, 1, ctx, self.family))
        if self.reads_length[ctx]:
            raise UnsupportedModel(f"the walk path does not support {lm.config.model_type}: its attention masks by "
                                   "the cache's length, not by positions (the walk's cache holds the whole window)")
        if any(k.startswith("recurrent.") for k in shapes):
            if batch not in self.from_zero:
                self.from_zero[batch] = self._from_zero(batch, shapes)
            if self.from_zero[batch]:
                layer = decoder_layers(lm)[self.from_zero[batch][0]]
                raise UnsupportedModel(f"the walk path does not support {type(layer).__name__} layers: their "
                                       "sequence scan does not start from the state carried in from the previous chunk")
        if not shapes:
            raise UnsupportedModel(f"the walk path does not support {lm.config.model_type}: its layers keep no cache")
        return {k: _over_window(k, v, ctx) for k, v in shapes.items()}

    def _shapes(self, batch: int) -> dict[str, tuple[int, ...]]:
        if batch not in self.shapes:
            try:
                try:
                    self.shapes[batch] = self._probed(batch, self.family)
                except ValueError:  # a decoder that takes its family's own cache alone (MiniMax)
                    if self.family is not None or (family := own_cache(self.lm)) is None:
                        raise
                    self.shapes[batch], self.family = self._probed(batch, family), family
            except (AttributeError, TypeError, NotImplementedError, ValueError, RuntimeError) as e:
                raise UnsupportedModel(f"the walk path does not support {self.lm.config.model_type}: its layers "
                                       f"call the cache in a way the walk does not know ({type(e).__name__}: "
                                       f"{one_line(e, 160)})") from None
        return self.shapes[batch]

    def _probed(self, batch: int, family: type | None) -> dict[str, tuple[int, ...]]:
        """`_probe`, of the stand-ins alone where there are some: each layer's states named after it, in order."""
        cut = self._alike(lambda: _probe(self.lm, batch, family))
        if cut is None or self.stand_ins is None or not {state_layer(k) for k in cut} <= set(self.stand_ins):
            self.stand_ins = None  # a decoder that numbers its layers by their place in the list: whole from now
            return _probe(self.lm, batch, family)
        return {_renamed(k, i): v for i, s in enumerate(self.stand_ins) for k, v in cut.items() if state_layer(k) == s}

    def _from_zero(self, batch: int, shapes: dict[str, tuple[int, ...]]) -> list[int]:
        """`_scans_from_zero`, of the stand-ins alone where there are some (a layer scans as its stand-in does)."""
        stand_ins = self.stand_ins
        if stand_ins is not None:
            cut = {k: v for k, v in shapes.items() if state_layer(k) in stand_ins}
            zero = self._alike(lambda: _scans_from_zero(self.lm, batch, cut, self.family))
            if zero is not None:
                return [i for i, s in enumerate(stand_ins) if s in zero]
        return _scans_from_zero(self.lm, batch, shapes, self.family)

    def _alike(self, run: Callable[[], R]) -> R | None:
        """`run()` while the decoder runs only the stand-in layers; None where there are none, or it cannot run so
        (a model that keeps tables by layer): the probe runs the whole model."""
        if self.stand_ins is None:
            return None
        try:
            with only_layers(self.lm, decoder_layers(self.lm), tuple(sorted(set(self.stand_ins)))):
                return run()
        except Exception:  # noqa: BLE001 - any error: the whole model's run answers (or raises) as it would
            self.stand_ins = None
            return None


def state_layer(name: str) -> int:
    """The layer a walk state belongs to, by its name (`_name`: `k.3`, `recurrent.3`, `conv.3.1`; a gradient's:
    `grad.k.3`, `grad_start.recurrent.3`)."""
    return int(name.removeprefix("grad_start.").removeprefix("grad.").split(".")[1])


def _renamed(name: str, layer: int) -> str:
    kind, _, *rest = name.split(".")
    return ".".join([kind, str(layer), *rest])


class WalkCache:
    """The cache interface transformers' attention and recurrent layers call, over placeholder tensors."""

    is_compileable = False
    is_initialized = True

    def __init__(self, state: dict[str, torch.Tensor], offset: torch.Tensor, chunk: int):
        self.state, self.offset = state, offset
        self.ctx = next((t.shape[2] for k, t in state.items() if k.startswith("k.")), 0)
        self.positions = offset + torch.arange(chunk, device=offset.device)

    # attention layers
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = self.state[f"k.{layer_idx}"], self.state[f"v.{layer_idx}"]
        rows = self.rows()
        keys.index_copy_(2, rows, key_states)
        values.index_copy_(2, rows, value_states)
        return keys, values

    def update_indexer(self, key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        keys = self.state[f"index.{layer_idx}"]
        keys.index_copy_(1, self.rows(), key_states)
        return keys

    def rows(self) -> torch.Tensor:
        """The chunk's positions, as a value of the calling layer's own (a view): the layer's backward reads the
        index it wrote at, and a stamped plan (`fastplan.stamp`) places each backward node by the layers it reads."""
        return self.positions.view(-1)

    def get_query_offset(self, layer_idx: int = 0) -> torch.Tensor:
        return self.offset

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.ctx, 0  # every attention layer, sliding ones too, attends over the whole window's cache

    def get_seq_length(self, layer_idx: int = 0) -> torch.Tensor:
        return self.offset

    # gated delta-net layers
    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self.state[_name("conv", layer_idx, state_idx)]

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        # A copy: the delta rule's backward needs the state as it was at the chunk's start,
        # and this chunk overwrites the buffer in place (autograd refuses a saved tensor that
        # changed). The copy reads the buffer before that write, so the rewrite keeps it.
        return self.state[_name("recurrent", layer_idx, state_idx)].clone()

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        return 0

    def update_conv_state(self, conv_input: torch.Tensor, layer_idx: int, conv_kernel_size: int, state_idx: int = 0,
                          **kwargs):
        conv = self.state[_name("conv", layer_idx, state_idx)]
        full = torch.cat([conv, conv_input], dim=-1)  # the previous chunk's last columns, then this chunk
        conv.copy_(full[..., -conv_kernel_size:].detach())
        return full

    def update_recurrent_state(self, recurrent: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        state = self.state[_name("recurrent", layer_idx, state_idx)]
        state.copy_(recurrent.detach())
        return state

    def get_linear_cache(self, layer_idx: int) -> torch.Tensor:
        return self.get_recurrent_state(layer_idx)

    def set_linear_cache(self, layer_idx: int, linear_cache: torch.Tensor) -> None:
        self.update_recurrent_state(linear_cache, layer_idx)


class ExactWalkCache(WalkCache):
    """The exact walk's cache for one chunk's step in the reverse sweep (`remat.training.walk`).

    It writes nothing: the window's K/V rows are in the cache already (the forward sweep wrote them)
    and the chunk starts from the state recorded for it. This chunk's own K/V rows are put in place
    out of place, so that its queries' gradient reaches them; `made` holds what the chunk adds (its
    K/V rows, its end state), where later chunks' gradient arrives.
    """

    def __init__(self, state: dict[str, torch.Tensor], offset: torch.Tensor, chunk: int):
        super().__init__(state, offset, chunk)
        self.made: dict[str, torch.Tensor] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        k, v = f"k.{layer_idx}", f"v.{layer_idx}"
        self.made[k], self.made[v] = key_states, value_states
        rows = self.rows()
        return self.state[k].index_copy(2, rows, key_states), self.state[v].index_copy(2, rows, value_states)

    def update_indexer(self, key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        # the indexer scores keys without grad: no gradient leaves through its rows
        return self.state[f"index.{layer_idx}"].index_copy(1, self.positions, key_states)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self.state[_name("recurrent", layer_idx, state_idx)]  # nothing overwrites it in this step

    def update_conv_state(self, conv_input: torch.Tensor, layer_idx: int, conv_kernel_size: int, state_idx: int = 0,
                          **kwargs):
        full = torch.cat([self.state[_name("conv", layer_idx, state_idx)], conv_input], dim=-1)
        self.made[_name("conv", layer_idx, state_idx)] = full[..., -conv_kernel_size:]
        return full

    def update_recurrent_state(self, recurrent: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        self.made[_name("recurrent", layer_idx, state_idx)] = recurrent
        return recurrent
