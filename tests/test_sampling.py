"""The vectorized sampler chain (`remat.serve.sampling`) against llama.cpp's samplers written out by hand, one row
at a time in plain Python floats, from llama.cpp's C (src/llama-sampler.cpp of the llama.cpp that
llama-cpp-python 0.3.36 ships): the candidates each row keeps and the probabilities its draw uses."""

from __future__ import annotations

import math
import random

import pytest
import torch

from remat.serve.sampling import SAMPLERS, Row, Sampling, pick, sampler_names

V = 300


def softmax(cur: list[list]) -> None:
    top = max(c[1] for c in cur)
    e = [math.exp(c[1] - top) for c in cur]
    for c, x in zip(cur, e):
        c[2] = x / sum(e)


def reference(logits: list[float], s: Sampling, history: list[int]) -> dict[int, float]:
    """llama.cpp's chain for one row: {token: probability} of the candidates the draw chooses among (XTC's
    coin always comes up: the tests set its probability to 1)."""
    x = list(logits)
    for t, b in s.logit_bias:
        x[t] += b
    on = set(s.samplers)
    if "penalties" in on and s.repeat_last_n != 0:
        window = history[-s.repeat_last_n:] if s.repeat_last_n > 0 else history
        for t in set(window):
            n = window.count(t)
            x[t] = x[t] * s.repeat_penalty if x[t] <= 0 else x[t] / s.repeat_penalty
            x[t] -= n * s.frequency_penalty + s.presence_penalty
    cur = [[i, v, 0.0] for i, v in enumerate(x) if v != -math.inf]
    if "top_n_sigma" in on and s.top_n_sigma > 0 and len(cur) > 1:
        mean = sum(c[1] for c in cur) / len(cur)
        std = math.sqrt(sum((c[1] - mean) ** 2 for c in cur) / len(cur))
        top = max(c[1] for c in cur)
        cur = [c for c in cur if c[1] >= top - s.top_n_sigma * std]
    cur.sort(key=lambda c: -c[1])
    if "top_k" in on and s.top_k > 0:
        cur = cur[:s.top_k]
    if "typ_p" in on and s.typical_p < 1:
        softmax(cur)
        entropy = -sum(c[2] * math.log(c[2]) for c in cur if c[2] > 0)
        order = sorted(range(len(cur)), key=lambda i: abs(-math.log(cur[i][2]) - entropy))
        total, last = 0.0, len(order)
        for i, idx in enumerate(order):
            total += cur[idx][2]
            if total > s.typical_p and (s.min_keep == 0 or i >= s.min_keep - 1):
                last = i + 1
                break
        cur = sorted((cur[i] for i in order[:last]), key=lambda c: -c[1])
    if "top_p" in on and s.top_p < 1:
        softmax(cur)
        total = 0.0
        for i, c in enumerate(cur):
            total += c[2]
            if total >= s.top_p and i + 1 >= s.min_keep:
                cur = cur[:i + 1]
                break
    if "min_p" in on and s.min_p > 0:
        floor = cur[0][1] + math.log(s.min_p)
        keep = [c for i, c in enumerate(cur) if c[1] >= floor or i < max(1, s.min_keep)]
        cur = keep
    if "xtc" in on and s.xtc_probability > 0 and s.xtc_threshold <= 0.5 and len(cur) >= 2:
        softmax(cur)
        last = 0
        for i, c in enumerate(cur):
            if c[2] < s.xtc_threshold:
                break
            last = i
        if len(cur) - last >= s.min_keep and last > 0:
            cur = cur[last:]
    if "temperature" in on:
        t = s.temperature
        if s.dynatemp_range > 0 and len(cur) > 1:
            softmax(cur)
            entropy = -sum(c[2] * math.log(c[2]) for c in cur if c[2] > 0)
            lo, hi = max(0.0, t - s.dynatemp_range), t + s.dynatemp_range
            t = lo + (hi - lo) * (entropy / math.log(len(cur))) ** s.dynatemp_exponent
        if t <= 0:
            cur = cur[:1]
        else:
            for c in cur:
                c[1] /= t
    softmax(cur)
    return {c[0]: c[2] for c in cur}


CASES = [
    Sampling(),  # llama.cpp's defaults
    Sampling(temperature=0),  # greedy
    Sampling(top_k=0, top_p=0.5, min_p=0),  # top-k off: the whole vocabulary
    Sampling(top_k=100, typical_p=0.6, min_keep=3, temperature=1.3),
    Sampling(top_k=50, top_p=1.0, min_p=0.2, min_keep=5),
    Sampling(xtc_probability=1.0, xtc_threshold=0.02, top_k=60, min_p=0),
    Sampling(dynatemp_range=0.5, dynatemp_exponent=2.0, temperature=0.9),
    Sampling(top_n_sigma=1.5, top_k=0, top_p=1.0, min_p=0),
    Sampling(repeat_penalty=1.3, repeat_last_n=8, frequency_penalty=0.4, presence_penalty=0.7),
    Sampling(repeat_penalty=1.3, repeat_last_n=-1, samplers=("top_k", "temperature")),  # penalties left out
    Sampling(logit_bias=((5, 15.0), (9, 12.0), (9, -math.inf), (11, -2.5), (5, 1.0)), top_k=20),
    Sampling(samplers=("penalties", "min_p", "temperature"), repeat_penalty=0.8, min_p=0.1),
]


def test_the_chain_keeps_what_llamacpp_keeps_row_by_row():
    """Every case in one batch (each row its own settings): the same candidates with the same probabilities."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(CASES), V, generator=g) * 3
    rng = random.Random(0)
    history = [[rng.randrange(V) for _ in range(20)] for _ in CASES]
    rows = [Row(Sampling(**{**s.__dict__, "logprobs": V, "post_sampling_probs": True}),
                torch.Generator().manual_seed(i), list(h)) for i, (s, h) in enumerate(zip(CASES, history))]
    picked = pick(logits, rows)
    for i, (s, p) in enumerate(zip(CASES, picked.probs)):
        want = reference(logits[i].tolist(), s, history[i])
        assert p is not None
        got = dict(p.top)
        assert set(got) == set(want), (i, s, sorted(set(got) ^ set(want))[:10])
        assert max(abs(got[t] - want[t]) for t in want) < 1e-5, (i, s)
        assert picked.tokens[i] in want and p.value == pytest.approx(want[picked.tokens[i]], abs=1e-5)


def test_draws_follow_the_probabilities_and_the_seed():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2] + [1e-9] * 7]))
    s = Sampling(temperature=1.0, top_k=0, top_p=1.0, min_p=0)
    row = Row(s, torch.Generator().manual_seed(1))
    counts = [0, 0, 0]
    for _ in range(3000):
        counts[pick(logits, [row]).tokens[0]] += 1
    assert [c / 3000 for c in counts] == pytest.approx([0.5, 0.3, 0.2], abs=0.03)
    def draws(seed: int) -> list[int]:
        r = Row(s, torch.Generator().manual_seed(seed))
        return [pick(logits, [r]).tokens[0] for _ in range(20)]
    assert draws(7) == draws(7) != draws(8)


def test_logprobs_are_the_models_own():
    """Reported log-probabilities are log_softmax of the logits given, before bias and penalties."""
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(3))
    rows = [Row(Sampling(temperature=0, logprobs=4, logit_bias=((0, 50.0),)), torch.Generator()),
            Row(Sampling(logprobs=0), torch.Generator().manual_seed(1))]
    picked = pick(logits, rows)
    assert picked.tokens[0] == 0  # the bias wins the greedy pick
    for i, p in enumerate(picked.probs):
        want = torch.log_softmax(logits[i].double(), 0)
        assert p is not None and p.value == pytest.approx(float(want[picked.tokens[i]]), abs=1e-5)
        top = want.topk(4)
        expect = list(zip(top.indices.tolist(), top.values.tolist()))[:len(p.top)]
        assert [t for t, _ in p.top] == [t for t, _ in expect]
        assert [v for _, v in p.top] == pytest.approx([v for _, v in expect], abs=1e-5)
    assert len(picked.probs[1].top) == 0


def test_sampler_names():
    assert sampler_names(["Top-K", "typical_p", "nucleus", "temp"]) == ("top_k", "typ_p", "top_p", "temperature")
    assert sampler_names(["top_k", "typ_p", "top_p", "min_p", "temp"]) == ("top_k", "typ_p", "top_p", "min_p",
                                                                           "temperature")
    assert sampler_names("kypmt") == ("top_k", "typ_p", "top_p", "min_p", "temperature")
    assert sampler_names(list(SAMPLERS)) == SAMPLERS
    with pytest.raises(ValueError, match="order"):
        sampler_names(["temperature", "top_k"])
    with pytest.raises(ValueError, match="not supported"):
        sampler_names(["top_k", "infill"])
    with pytest.raises(ValueError, match="unknown sampler 'bogus'"):
        sampler_names(["bogus"])
