"""Sampling for batched decoding: llama.cpp's sampler chain, vectorized over the rows of a batch.

Each row has its own settings (`Sampling`) and random generator. The chain runs in llama.cpp's default order
(`SAMPLERS`): logit bias, penalties, top-n-sigma, top-k, typical, top-p, min-p, XTC, temperature, then a draw.
Penalties and top-n-sigma see the whole vocabulary; the rest runs over the top-k survivors, as llama.cpp's
does (sorting a 49,152-token vocabulary costs ~3 ms a row; `topk(40)` a fraction of that). A row that turns
top-k off gets the whole vocabulary as candidates. A stage a row does not use leaves it as it is: every stage
is masked by the rows that use it, so neutral settings are exact no-ops.

Candidates are `(values, ids)` of shape [rows, K], sorted by logit, largest first; a removed candidate has the
value -inf. Log-probabilities for the answer (`logprobs`) are those of the model's own logits (log_softmax of
the forward, before bias and penalties), as OpenAI and llama.cpp report them; with `post_sampling_probs`, the
probabilities the draw used instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

__all__ = ["SAMPLERS", "Picked", "Row", "Sampling", "TokenProbs", "pick", "sampler_names"]

# llama.cpp's default chain; a request may leave samplers out (they are then off) but not reorder them.
SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
_ALIASES = {"nucleus": "top_p", "temp": "temperature", "typ": "typ_p", "typical_p": "typ_p"}
for _name in SAMPLERS:
    _ALIASES[_name.replace("_", "-")] = _ALIASES[_name.replace("_", "")] = _name
_CHARS = {"d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "s": "top_n_sigma", "m": "min_p", "x": "xtc",
          "t": "temperature"}  # llama.cpp's one-letter names ("samplers": "kypmt")
NEG = -math.inf


def sampler_names(names: Sequence[str] | str) -> tuple[str, ...]:
    """llama.cpp's sampler names (any of its spellings, or one letter each in a string) as canonical names, in
    order. ValueError for a name llama.cpp does not know, one remat does not run, or an order not llama.cpp's."""
    if isinstance(names, str):
        unknown = [c for c in names if c not in _CHARS]
        if unknown:
            raise ValueError(f"unknown sampler letter '{unknown[0]}' (known: {''.join(_CHARS)})")
        names = [_CHARS[c] for c in names]
    out = []
    for name in names:
        key = name.lower()
        canonical = key if key in SAMPLERS else _ALIASES.get(key)
        if canonical is None:
            if key in ("infill", "adaptive_p", "adaptive-p", "adaptivep"):
                raise ValueError(f"the '{name}' sampler is not supported")
            raise ValueError(f"unknown sampler '{name}' (known: {', '.join(SAMPLERS)})")
        out.append(canonical)
    order = [SAMPLERS.index(n) for n in out]
    if order != sorted(set(order)):
        raise ValueError("samplers in an order other than llama.cpp's default (" + ", ".join(SAMPLERS)
                         + ") are not supported; leaving some out is")
    return tuple(out)


@dataclass(frozen=True)
class Sampling:
    """One request's sampling settings, llama.cpp's names and defaults. temperature <= 0 is greedy."""

    temperature: float = 0.8
    dynatemp_range: float = 0.0  # 0: off
    dynatemp_exponent: float = 1.0
    top_k: int = 40  # <= 0: off
    top_p: float = 0.95  # >= 1: off
    min_p: float = 0.05  # <= 0: off
    typical_p: float = 1.0  # >= 1: off
    top_n_sigma: float = -1.0  # <= 0: off
    xtc_probability: float = 0.0  # 0: off
    xtc_threshold: float = 0.1  # > 0.5: off
    repeat_penalty: float = 1.0  # 1: off
    repeat_last_n: int = 64  # tokens (prompt and generated) the penalties look at; 0: off, -1: all
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_keep: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); -inf bans the token
    samplers: tuple[str, ...] = SAMPLERS
    logprobs: int | None = None  # report the token's log-probability and the top `logprobs` others
    post_sampling_probs: bool = False  # report the draw's probabilities instead

    def as_dict(self) -> dict:
        d = asdict(self)
        d["logit_bias"] = [[t, b if math.isfinite(b) else False] for t, b in self.logit_bias]
        d["samplers"], d["n_probs"] = list(self.samplers), self.logprobs or 0
        del d["logprobs"]
        return d


@dataclass
class Row:
    """What the chain needs of one row: its settings, its generator, its tokens so far (prompt included)."""

    sampling: Sampling
    generator: torch.Generator
    history: list[int] = field(default_factory=list)


@dataclass
class TokenProbs:
    """The chosen token's log-probability (or probability) and the top others', largest first."""

    value: float
    top: list[tuple[int, float]]


@dataclass
class Picked:
    tokens: list[int]
    probs: list[TokenProbs | None]


# ---------------------------------------------------------------------------------------------------------
# the chain


def _col(rows: Sequence[Row], get, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor([get(r.sampling) for r in rows], dtype=dtype).unsqueeze(1)


def _uses(rows: Sequence[Row], sampler: str, active) -> torch.Tensor:
    """[B, 1] bool: the rows whose chain has `sampler` and whose settings turn it on."""
    return torch.tensor([sampler in r.sampling.samplers and bool(active(r.sampling)) for r in rows]).unsqueeze(1)


def _bias(x: torch.Tensor, rows: Sequence[Row]) -> None:
    where = [(i, t, b) for i, r in enumerate(rows) for t, b in r.sampling.logit_bias]
    if where:
        i, t, b = zip(*where)
        x.index_put_((torch.tensor(i), torch.tensor(t)), torch.tensor(b, dtype=x.dtype), accumulate=True)


def _penalties(x: torch.Tensor, rows: Sequence[Row]) -> None:
    on = [i for i, r in enumerate(rows) if "penalties" in r.sampling.samplers and r.sampling.repeat_last_n != 0
          and (r.sampling.repeat_penalty != 1 or r.sampling.frequency_penalty or r.sampling.presence_penalty)]
    if not on:
        return
    counts = torch.zeros(len(on), x.shape[1])
    for j, i in enumerate(on):
        n = rows[i].sampling.repeat_last_n
        window = list(rows[i].history[-n:] if n > 0 else rows[i].history)
        if window:
            counts[j].index_add_(0, torch.tensor(window), torch.ones(len(window)))
    sub = [rows[i] for i in on]
    rep, freq, pres = _col(sub, lambda s: s.repeat_penalty), _col(sub, lambda s: s.frequency_penalty), \
        _col(sub, lambda s: s.presence_penalty)
    y, seen = x[on], counts > 0
    # llama.cpp: a positive logit is divided by the penalty, a negative one multiplied (dividing would raise it)
    penalized = torch.where(y <= 0, y * rep, y / rep) - counts * freq - seen.float() * pres
    x[on] = torch.where(seen, penalized, y)


def _top_n_sigma(x: torch.Tensor, rows: Sequence[Row]) -> None:
    on = _uses(rows, "top_n_sigma", lambda s: s.top_n_sigma > 0)
    if not on.any():
        return
    finite = x > NEG
    n = finite.sum(1, keepdim=True).clamp(min=1)
    mean = torch.where(finite, x, 0.0).sum(1, keepdim=True) / n
    std = (torch.where(finite, (x - mean) ** 2, 0.0).sum(1, keepdim=True) / n).sqrt()
    top = x.max(1, keepdim=True).values
    sigma = _col(rows, lambda s: s.top_n_sigma)
    x.masked_fill_(on & (finite.sum(1, keepdim=True) > 1) & (x < top - sigma * std), NEG)


def _softmax(v: torch.Tensor) -> torch.Tensor:
    """Probabilities of the live candidates of each row (0 for removed ones; a row with none stays 0)."""
    top = v.max(1, keepdim=True).values
    e = torch.where(v > NEG, torch.exp(v - torch.where(top > NEG, top, 0.0)), 0.0)
    return e / e.sum(1, keepdim=True).clamp(min=1e-38)


def _first(cond: torch.Tensor) -> torch.Tensor:
    """[B, 1]: the first column where `cond` holds in each row, K (the width) where it never does."""
    k = cond.shape[1]
    idx = torch.where(cond, torch.arange(k), k)
    return idx.min(1, keepdim=True).values


def _rank(alive: torch.Tensor) -> torch.Tensor:
    """Each candidate's place among its row's live candidates (0 for the first live one)."""
    return alive.long().cumsum(1) - 1


def _typical(v: torch.Tensor, rows: Sequence[Row], min_keep: torch.Tensor) -> None:
    on = _uses(rows, "typ_p", lambda s: s.typical_p < 1)
    if not on.any():
        return
    p = _softmax(v)
    logp = torch.log(p)
    entropy = -torch.where(p > 0, p * logp, 0.0).sum(1, keepdim=True)
    shifted = torch.where(p > 0, (-logp - entropy).abs(), math.inf)
    order = shifted.argsort(dim=1, stable=True)
    cum = p.gather(1, order).cumsum(1)
    k = torch.arange(v.shape[1])
    last = _first((cum > _col(rows, lambda s: s.typical_p)) & ((min_keep == 0) | (k >= min_keep - 1)))
    keep = torch.zeros_like(v, dtype=torch.bool).scatter_(1, order, k <= last)
    v.masked_fill_(on & ~keep, NEG)


def _top_p(v: torch.Tensor, rows: Sequence[Row], min_keep: torch.Tensor) -> None:
    on = _uses(rows, "top_p", lambda s: s.top_p < 1)
    if not on.any():
        return
    alive = v > NEG
    cum = _softmax(v).cumsum(1)
    last = _first(alive & (cum >= _col(rows, lambda s: s.top_p)) & (_rank(alive) + 1 >= min_keep))
    v.masked_fill_(on & (torch.arange(v.shape[1]) > last), NEG)


def _min_p(v: torch.Tensor, rows: Sequence[Row], min_keep: torch.Tensor) -> None:
    on = _uses(rows, "min_p", lambda s: s.min_p > 0)
    if not on.any():
        return
    alive = v > NEG
    floor = v.max(1, keepdim=True).values + torch.log(_col(rows, lambda s: s.min_p).clamp(min=1e-38))
    rank = _rank(alive)
    v.masked_fill_(on & alive & (v < floor) & (rank >= min_keep) & (rank > 0), NEG)


def _xtc(v: torch.Tensor, rows: Sequence[Row], min_keep: torch.Tensor) -> None:
    on = _uses(rows, "xtc", lambda s: s.xtc_probability > 0 and s.xtc_threshold <= 0.5)
    if not on.any():
        return
    alive = v > NEG
    chance = torch.tensor([float(torch.rand(1, generator=r.generator)) if on[i] else 1.0
                           for i, r in enumerate(rows)]).unsqueeze(1)
    on = on & (alive.sum(1, keepdim=True) >= 2) & (chance <= _col(rows, lambda s: s.xtc_probability))
    if not on.any():
        return
    above = (alive & (_softmax(v) >= _col(rows, lambda s: s.xtc_threshold))).sum(1, keepdim=True)
    cut = above - 1  # all the likely ones but the least likely of them go
    on = on & (cut > 0) & (alive.sum(1, keepdim=True) - cut >= min_keep)
    v.masked_fill_(on & alive & (_rank(alive) < cut), NEG)


def _temperature(v: torch.Tensor, rows: Sequence[Row]) -> None:
    on = _uses(rows, "temperature", lambda s: True)
    temp = _col(rows, lambda s: s.temperature, torch.float64)
    dyn = on & _uses(rows, "temperature", lambda s: s.dynatemp_range > 0)
    alive = v > NEG
    if dyn.any():
        n = alive.sum(1, keepdim=True)
        p = _softmax(v)
        entropy = -torch.where(p > 0, p * torch.log(p), 0.0).sum(1, keepdim=True).double()
        norm = entropy / torch.log(n.double()).clamp(min=1e-30)
        lo = (temp - _col(rows, lambda s: s.dynatemp_range, torch.float64)).clamp(min=0)
        hi = temp + _col(rows, lambda s: s.dynatemp_range, torch.float64)
        scaled = lo + (hi - lo) * norm.clamp(min=0) ** _col(rows, lambda s: s.dynatemp_exponent, torch.float64)
        temp = torch.where(dyn & (n > 1), scaled, torch.where(dyn, 1.0, temp))
    greedy = on & (temp <= 0)
    if greedy.any():  # only the largest live candidate stays: the first live one
        v.masked_fill_(greedy & (torch.arange(v.shape[1]) > _first(alive)), NEG)
    # Scaled after subtracting the largest: no temperature (1e-30, 100) turns a finite logit into inf - inf.
    top = v.max(1, keepdim=True).values
    scale = torch.where(on & ~greedy, temp, 1.0)
    shifted = ((v - torch.where(top > NEG, top, 0.0)).double() / scale).float()
    v.copy_(torch.where(v > NEG, shifted, NEG))


def _draw(p: torch.Tensor, rows: Sequence[Row]) -> torch.Tensor:
    """[B]: the candidate column drawn for each row from its probabilities."""
    u = torch.tensor([float(torch.rand(1, generator=r.generator)) for r in rows], dtype=torch.float64)
    cum = p.double().cumsum(1)
    target = (u * cum[:, -1]).unsqueeze(1)
    col = _first((cum >= target) & (p > 0)).squeeze(1)
    return col.clamp(max=p.shape[1] - 1)


def pick(logits: torch.Tensor, rows: Sequence[Row]) -> Picked:
    """One token for each row of `logits` ([B, V], the last position's) through its row's chain."""
    raw = logits.float()
    x = torch.nan_to_num(raw, nan=NEG, posinf=torch.finfo(torch.float32).max, neginf=NEG)
    _bias(x, rows)
    _penalties(x, rows)
    _top_n_sigma(x, rows)
    v_size = x.shape[1]
    ks = [r.sampling.top_k if "top_k" in r.sampling.samplers and 0 < r.sampling.top_k < v_size else v_size
          for r in rows]
    values, ids = x.topk(max(ks), dim=1, sorted=True)
    values.masked_fill_(torch.arange(values.shape[1]) >= torch.tensor(ks).unsqueeze(1), NEG)
    min_keep = _col(rows, lambda s: s.min_keep, torch.long)
    _typical(values, rows, min_keep)
    _top_p(values, rows, min_keep)
    _min_p(values, rows, min_keep)
    _xtc(values, rows, min_keep)
    _temperature(values, rows)
    p = _softmax(values)
    col = _draw(p, rows)
    tokens = ids.gather(1, col.unsqueeze(1)).squeeze(1)
    dead = ~(values > NEG).any(1)
    if dead.any():  # nothing live (every candidate banned, or no finite logit): the most likely token
        tokens = torch.where(dead, x.argmax(1) if bool((x > NEG).any()) else raw.nan_to_num(NEG).argmax(1), tokens)
    chosen = tokens.tolist()
    return Picked(chosen, _probs(raw, p, ids, chosen, rows))


def _probs(raw: torch.Tensor, p: torch.Tensor, ids: torch.Tensor, chosen: list[int],
           rows: Sequence[Row]) -> list[TokenProbs | None]:
    out: list[TokenProbs | None] = []
    for i, r in enumerate(rows):
        k = r.sampling.logprobs
        if k is None:
            out.append(None)
        elif r.sampling.post_sampling_probs:
            live = p[i] > 0
            pairs = sorted(zip(ids[i][live].tolist(), p[i][live].tolist()), key=lambda t: -t[1])
            mine = next((q for t, q in pairs if t == chosen[i]), 0.0)
            out.append(TokenProbs(mine, pairs[:k]))
        else:
            logp = torch.log_softmax(torch.nan_to_num(raw[i], nan=NEG), dim=0)
            top = logp.topk(min(k, logp.numel())) if k else None
            pairs = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
            out.append(TokenProbs(float(logp[chosen[i]]), pairs))
    return out
