"""`remat serve --compile`: the decode step of one sequence through `torch.compile`, against the same served model
decoding eagerly (transformers' forward). A tiny GGUF of every kept type (tests/tiny_gguf.py): its layers go through
the int4 kernel, Q6_K ones from float32, as the server decodes them.

Tolerance, and why: inductor fuses the elementwise work between the products (RMSNorm, rotary, SiLU, the
residual adds) into loops of its own that sum in another order than eager's kernels, so an activation can differ
by a float32 ulp; the products take bfloat16 rows, and such an activation can round to the other bfloat16
neighbour (2^-9 of it), which the products carry to the logits. Measured on this model: most steps' logits equal
bit for bit, the others within 0.6% of the logits' scale. So: half the steps within 1e-4 of the scale, every step
within 2% (a step reading the wrong cache columns is off by the scale itself). The tokens fed are the same for
both runs (the eager run's greedy ones), so one near tie cannot send the two apart.
"""

from __future__ import annotations

import threading

import pytest
import torch

from remat.serve.batch import GROW, BatchCache, prefill_cache
from remat.serve.engine import Engine
from tiny_gguf import write

PROMPT = [1, 72, 101, 108, 108, 111]
STEPS = GROW + 20  # past the first buffer's capacity: the engine grows it before a compiled step


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = write(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    e = Engine(str(path), compile=True, n_ctx=1024)
    loading = threading.Thread(target=e.load)  # as the server loads it: compiled in one thread, run in another
    loading.start()
    loading.join()
    yield e
    e.close()


def _decode(engine: Engine, tokens: list[int] | None) -> tuple[list[int], torch.Tensor]:
    """Teacher-forced decoding of `tokens` (None: greedy) after PROMPT, through a batch cache as the decode loop
    runs it: the tokens fed and each step's logits."""
    one = prefill_cache(engine.model)
    fed, logits = [], []
    with torch.inference_mode():
        out = engine.forward(torch.tensor([PROMPT]), one)
        batch = BatchCache(engine.n_ctx)
        batch.join(one, len(PROMPT))
        for i in range(STEPS):
            token = int(out.logits[0, -1].argmax()) if tokens is None else tokens[i]
            out = engine.forward(**batch.inputs([token]), cache=batch.cache)
            batch.advance()
            fed.append(token)
            logits.append(out.logits[0, -1])
    return fed, torch.stack(logits)


@pytest.fixture
def steps(engine, monkeypatch) -> list[bool]:
    """Whether each forward from now on ran the compiled step."""
    seen: list[bool] = []

    def call(model, *args, **kw):
        seen.append(model is engine._compiled)
        return Engine._call(engine, model, *args, **kw)
    monkeypatch.setattr(engine, "_call", call)
    return seen


def test_the_compiled_step_gives_the_eager_models_logits(engine, steps, monkeypatch):
    assert engine._compiled is not None, "the step did not compile"
    with monkeypatch.context() as eager:
        eager.setattr(engine, "_compiled", None)
        tokens, want = _decode(engine, None)
    assert not any(steps)
    steps.clear()
    _, got = _decode(engine, tokens)
    assert steps == [False] + [True] * STEPS  # the prompt eager, every decode step compiled
    scale = want.abs().max()
    assert scale > 0.1
    err = (got - want).abs().amax(dim=1)
    assert err.max() <= 0.02 * scale, f"compiled logits differ by {err.max()} (scale {scale})"
    assert (err <= 1e-4 * scale).sum() >= STEPS // 2, f"{(err > 1e-4 * scale).sum()} of {STEPS} steps differ"


def test_rows_that_were_not_traced_decode_eagerly(engine, steps):
    """Two rows (a mask, a batch of two) are not the traced step: eager."""
    with torch.inference_mode():
        batch = BatchCache(engine.n_ctx)
        for prompt in (PROMPT, PROMPT[:3]):
            one = prefill_cache(engine.model)
            engine.forward(torch.tensor([prompt]), one)
            batch.join(one, len(prompt))
        out = engine.forward(**batch.inputs([5, 5]), cache=batch.cache)
    assert steps == [False] * 3 and out.logits.shape[0] == 2
