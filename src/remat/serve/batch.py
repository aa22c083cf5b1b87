"""The KV cache of a batch of sequences decoding together: rows join and leave between tokens.

A prompt is processed alone, in chunks, into a Hugging Face `DynamicCache` of one row (`prefill_cache`); when it
is done, `BatchCache.join` copies it into the batch as one or more rows (the `n` choices of one prompt share its
prefill). Each decode step then runs the model once over every row, one token each (`inputs`).

Rows hold different numbers of tokens, so the full-attention layers keep their keys and values left-padded to
one width: row b's tokens sit in the last `len_b` columns and the attention mask hides the columns before them.
Positions are each row's own (`len_b`). The layers write each step's keys and values in place into buffers
with room to grow (`_Attention`), so a step does not copy the past (`DynamicCache` concatenates every layer's
whole cache per token). Linear-attention layers (Gated DeltaNet, Mamba) hold a state per row: rows are
concatenated. A cache with any other layer type (sliding windows, quantized layers) is not merged: its row
decodes as a batch of its own (`mergeable`).

A row leaving is dropped from every layer and the columns that every remaining row pads are cut, so the width
stays the longest row's length, at most the context.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, LinearAttentionLayer

__all__ = ["BatchCache", "prefill_cache", "room_for_one"]

GROW = 256  # columns added when a full-attention layer's buffers fill up


def prefill_cache(model) -> Cache:
    """An empty one-row cache for a prompt's prefill, laid out as the model's own."""
    return DynamicCache(config=model.config)


def _mergeable(cache: Cache) -> bool:
    return all(type(layer) in (DynamicLayer, _Attention, LinearAttentionLayer) for layer in cache.layers)


class _Attention(DynamicLayer):
    """A full-attention layer's keys and values for the batch: [rows, heads, capacity, dim] buffers written in
    place; `keys`/`values` are the first `width` columns."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, width: int, limit: int):
        super().__init__()
        self.k, self.v, self.width, self.limit = k, v, width, limit
        self.device, self.is_initialized = k.device, True
        self._views()

    def _views(self) -> None:
        self.keys, self.values = self.k[:, :, :self.width], self.v[:, :, :self.width]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        t = key_states.shape[-2]
        if self.width + t > self.k.shape[2]:
            self.resize(self.width + t)
        self.k[:, :, self.width:self.width + t] = key_states
        self.v[:, :, self.width:self.width + t] = value_states
        self.width += t
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.width

    def resize(self, need: int, shift: int = 0, rows: torch.Tensor | None = None) -> None:
        """Room for `need` columns (and GROW more, within the limit): the rows `rows` (all when None), their
        columns [shift, width) moved to the front."""
        cap = max(need, min(need + GROW, self.limit))
        k, v = (self.k, self.v) if rows is None else (self.k[rows], self.v[rows])
        new_k = k.new_zeros(k.shape[0], k.shape[1], cap, k.shape[3])
        new_v = v.new_zeros(v.shape[0], v.shape[1], cap, v.shape[3])
        new_k[:, :, :self.width - shift] = k[:, :, shift:self.width]
        new_v[:, :, :self.width - shift] = v[:, :, shift:self.width]
        self.k, self.v, self.width = new_k, new_v, self.width - shift
        self._views()

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def _pad_left(x: torch.Tensor, cols: int, copies: int, cap: int) -> torch.Tensor:
    """x ([1, H, L, D]) as `copies` rows of a [copies, H, cap, D] buffer, its columns ending at `cols`."""
    out = x.new_zeros(copies, x.shape[1], cap, x.shape[3])
    out[:, :, cols - x.shape[2]:cols] = x
    return out


def _states(layer: LinearAttentionLayer) -> list[tuple[dict, int]]:
    return [(layer.conv_states, i) for i in range(layer.number_of_states)] + \
           [(layer.recurrent_states, i) for i in range(layer.number_of_states)]


class BatchCache:
    """The caches of the rows decoding together, and the inputs of their next step."""

    def __init__(self, limit: int):
        self.limit = limit  # the most columns a row may need: the context
        self.cache: Cache | None = None
        self.pad: list[int] = []  # columns each row pads on the left
        self.width = 0  # columns: every row's pad plus its tokens

    @property
    def rows(self) -> int:
        return len(self.pad)

    def accepts(self, one: Cache) -> bool:
        """Whether a one-row prefill cache may join this batch (an empty batch takes any)."""
        return self.cache is None or (_mergeable(one) and _mergeable(self.cache))

    def join(self, one: Cache, length: int, copies: int = 1) -> None:
        """Add `copies` rows holding the one-row prefill cache `one` of `length` tokens (which this batch
        `accepts`)."""
        if self.cache is None and not _mergeable(one):
            if copies != 1:
                raise ValueError("a cache that does not merge holds one row")
            self.cache, self.pad, self.width = one, [0], length
            return
        width = max(length, self.width)
        if self.cache is None:
            self.cache = Cache(layers=[self._first(layer, length, copies) for layer in one.layers])
        else:
            for mine, theirs in zip(self.cache.layers, one.layers):
                self._add(mine, theirs, width, copies)
        self.pad = [p + width - self.width for p in self.pad] + [width - length] * copies
        self.width = width

    def advance(self) -> None:
        """Each row took one token (the step's forward ran)."""
        self.width += 1

    def _first(self, layer, length: int, copies: int):
        if isinstance(layer, LinearAttentionLayer):
            for states, i in _states(layer):
                if states[i] is not None:
                    states[i] = states[i].expand(copies, *states[i].shape[1:]).clone()
            return layer
        cap = max(length, min(length + GROW, self.limit))
        return _Attention(_pad_left(layer.keys, length, copies, cap), _pad_left(layer.values, length, copies, cap),
                          length, self.limit)

    def _add(self, mine, theirs, width: int, copies: int) -> None:
        if isinstance(mine, LinearAttentionLayer):
            for (states, i), (new, j) in zip(_states(mine), _states(theirs)):
                if states[i] is not None:
                    states[i] = torch.cat([states[i], new[j].expand(copies, *new[j].shape[1:])])
            return
        if width > mine.width:  # the new row is longer: every row moves right
            old = mine.width
            mine.resize(width)
            for buf in (mine.k, mine.v):
                buf[:, :, width - old:width] = buf[:, :, :old].clone()
                buf[:, :, :width - old] = 0
            mine.width = width
        cap = mine.k.shape[2]
        mine.k = torch.cat([mine.k, _pad_left(theirs.keys, width, copies, cap)])
        mine.v = torch.cat([mine.v, _pad_left(theirs.values, width, copies, cap)])
        mine._views()

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows, in this order; cut the columns every remaining row pads."""
        if not rows:
            self.cache, self.pad, self.width = None, [], 0
            return
        index = torch.tensor(rows)
        pad = [self.pad[i] for i in rows]
        shift = min(pad)
        assert self.cache is not None
        for layer in self.cache.layers:
            if isinstance(layer, _Attention):
                layer.resize(layer.width - shift, shift, index)
            elif isinstance(layer, LinearAttentionLayer):
                for states, i in _states(layer):
                    if states[i] is not None:
                        states[i] = states[i].index_select(0, index.to(states[i].device))
            elif len(rows) != self.rows:  # a lone cache that does not merge: it goes whole or stays whole
                raise ValueError("cannot drop rows of a cache that does not merge")
        self.pad, self.width = [p - shift for p in pad], self.width - shift

    def inputs(self, tokens: list[int]) -> dict:
        """The model's inputs for one step: each row's next token at its own position."""
        width = self.width
        pad = torch.tensor(self.pad).unsqueeze(1)
        out = {"input_ids": torch.tensor(tokens).unsqueeze(1), "position_ids": width - pad}
        if any(self.pad):
            out["attention_mask"] = (torch.arange(width + 1).unsqueeze(0) >= pad).long()
        return out

    def nbytes(self) -> int:
        return cache_bytes(self.cache)


def room_for_one(cache: Cache | None) -> bool:
    """Whether `cache` is a batch's full-attention buffers only, each holding two columns or more, with room made
    for the next token and one column past it: the cache a compiled decode step was traced with
    (`Engine(compile=True)`). That step never grows a buffer itself (it was traced where the buffer had room), and
    a buffer that the token fills exactly has other shapes than it was traced for (a recompilation)."""
    layers = [layer for layer in cache.layers if type(layer) is _Attention] if cache is not None else []
    if cache is None or len(layers) < len(cache.layers) or any(layer.width < 2 for layer in layers):
        return False
    for layer in layers:
        if layer.width + 2 > layer.k.shape[2]:
            layer.resize(layer.width + 2)
    return True


def cache_bytes(cache: Cache | None) -> int:
    """Bytes a cache holds (its buffers' capacity)."""
    if cache is None:
        return 0
    total = 0
    for layer in cache.layers:
        if isinstance(layer, _Attention):
            total += layer.nbytes()
            continue
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            total += t.nbytes if isinstance(t, torch.Tensor) else 0
        if isinstance(layer, LinearAttentionLayer):
            total += sum(s[i].nbytes for s, i in _states(layer) if isinstance(s[i], torch.Tensor))
    return total
