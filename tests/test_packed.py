"""Serving from the stored blocks (`remat.serve.packed`): each repacked type against `remat::dequantize` (which is
gguf-py's `gguf.quants.dequantize` bit for bit, tests/test_quant.py) on random blocks, and the served default model
(SmolLM2-135M's GGUF: Q4_1 layers, a Q8_0 tied embedding and head) against the same model dequantized to float32.

Tolerances, and why: the int4 kernel takes its scales and zeros in bfloat16 (8 bits of mantissa; the file's are
float16, 11), and returns bfloat16. A weight it reads is (q4 - 8) * bf16(scale) + bf16(zero), so it differs from
q * scale + offset by at most 2^-9 of |q4 - 8| * |scale| (the scale's rounding), plus 2^-9 of |zero| (the zero's:
Q4_1's zero is m + 8d, rounded once), plus 2^-9 of the result (the output's rounding). The bound below is that
with room (2^-8): an error of one step of q (|scale|) is far above it.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from remat.serve import packed

Q = gguf.GGMLQuantizationType
# where each type keeps its float16 scale (and min) in a block
HALVES = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2)}


def _random_blocks(qtype: Q, n: int, k: int, seed: int) -> torch.Tensor:
    """[n, row bytes] of random quants and sub-block scales, the float16 scales finite: ±[2^-10, 2^-2]."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n * k // block, size), dtype=np.uint8)
    for at in HALVES[qtype]:
        halves = (rng.choice([-1, 1], len(raw)) * 2.0 ** rng.uniform(-10, -2, len(raw))).astype(np.float16)
        raw[:, at:at + 2] = halves.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(raw.reshape(n, -1))


def _kernel_weight(p: packed.Packed, k: int) -> torch.Tensor:
    """The weight the kernel multiplies by, [N, K]: the packed layer's product with the identity."""
    return p.mm(torch.eye(k)).T


@pytest.mark.parametrize("qtype", sorted(packed.PACKABLE), ids=lambda q: Q(q).name)
def test_packed_weight_is_the_dequantized_one(qtype):
    n, k = 48, 512
    blocks = _random_blocks(Q(qtype), n, k, seed=int(qtype))
    want = torch.ops.remat.dequantize(blocks, int(qtype), (n, k), torch.float32)
    q, scale, offset = packed.integers(int(qtype), blocks, (n, k))
    lo, hi = packed.PACKABLE[Q(qtype)]
    assert int(q.min()) >= lo and int(q.max()) <= hi and int(q.max()) - int(q.min()) > (hi - lo) // 2

    def per_group(t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(packed.GROUP, dim=1)

    assert torch.equal(q * per_group(scale) + per_group(offset), want)  # the integers are the weight, exactly
    p = packed.pack(int(qtype), blocks, (n, k))
    got = _kernel_weight(p, k)
    bound = 2.0 ** -8 * (q.abs() * per_group(scale.abs()) + per_group(offset.abs() + 16 * scale.abs()) + want.abs())
    err = (got - want).abs()
    assert (err <= bound).all(), float((err - bound).max())
    assert p.parts == (2 if hi - lo > 15 else 1)
    assert p.nbytes == p.parts * (n * k // 2 + n * k // packed.GROUP * 4)


def test_rows_of_any_shape_and_dtype():
    n, k = 64, 256
    blocks = _random_blocks(Q.Q4_1, n, k, seed=1)
    p = packed.pack(Q.Q4_1, blocks, (n, k))
    w = torch.ops.remat.dequantize(blocks, Q.Q4_1, (n, k), torch.float32)
    x = torch.randn(2, 3, k)
    y = p.mm(x)
    assert y.shape == (2, 3, n) and y.dtype == torch.float32
    ref = x.bfloat16().float() @ w.T
    assert torch.allclose(y, ref, rtol=2 ** -6, atol=2 ** -6 * float(ref.abs().max()))


def test_unpackable_types_are_refused():
    with pytest.raises(ValueError, match="Q6_K"):
        packed.integers(Q.Q6_K, torch.zeros(1, 210, dtype=torch.uint8), (1, 256))


# -- the served default model -------------------------------------------------------------------------

PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,")
STEPS = 16
# The largest logit difference measured between the two on these prompts was 0.5 (logits reach ~40): the bfloat16
# products of the 30 layers. A bound 3 times that.
LOGIT_TOLERANCE = 1.5


def _engine(weights: str, adapters: list[dict] | None = None):
    from remat.serve.engine import Engine

    engine = Engine(None, weights=weights, adapters=(lambda: adapters or []))
    engine.load()
    return engine


@pytest.fixture(scope="module")
def engines():
    return {w: _engine(w) for w in ("float32", "blocks")}


def _greedy(engine, prompt: str) -> tuple[list[int], torch.Tensor]:
    from remat.serve.batch import prefill_cache

    cache, tokens, logits = prefill_cache(engine.model), [], []
    with torch.inference_mode():
        out = engine.forward(torch.tensor([engine.prompt_ids(prompt)]), cache)
        for _ in range(STEPS):
            logits.append(out.logits[0, -1])
            tokens.append(int(logits[-1].argmax()))
            out = engine.forward(torch.tensor([tokens[-1:]]), cache)
    return tokens, torch.stack(logits)


def test_default_model_is_packed(engines):
    blocks, dense = engines["blocks"], engines["float32"]
    assert blocks.serving["layers"] == 211 and blocks.serving["float"] == 0  # 210 Q4_1 layers and the Q8_0 head
    assert blocks.serving["packed"] > 0 and dense.serving["packed"] == 0
    ids = torch.tensor([[0, 5, 49151, 5]])
    emb = blocks.model.get_input_embeddings()
    assert torch.equal(emb(ids), dense.model.get_input_embeddings()(ids))  # rows dequantized where looked up
    assert blocks.vocab_size() == dense.vocab_size() == 49152


def test_greedy_tokens_equal_the_dequantized_model(engines):
    """Served from the blocks (bfloat16 products, float32 activations) vs the same GGUF dequantized to float32."""
    for prompt in PROMPTS:
        got, got_logits = _greedy(engines["blocks"], prompt)
        want, want_logits = _greedy(engines["float32"], prompt)
        assert got == want, prompt
        assert float((got_logits - want_logits).abs().max()) < LOGIT_TOLERANCE, prompt


def _adapter(path) -> str:
    """A random LoRA adapter of the default model (B nonzero: it changes the logits), saved as PEFT saves it."""
    import peft

    from remat.models.load import load_model

    torch.manual_seed(0)
    model = load_model(None, as_stored=False).model
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                             init_lora_weights=False)
    peft.get_peft_model(model, config).save_pretrained(str(path))
    return str(path)


def test_lora_adapter_on_the_packed_layers(engines, tmp_path):
    """An adapter moves the packed model's logits as it moves the float32 model's."""
    adapters = [{"id": 0, "path": _adapter(tmp_path / "a"), "scale": 1.0}]
    for engine in engines.values():
        engine.adapter_source = lambda: adapters
    shifted = {}
    for weights, engine in engines.items():
        plain = _greedy(engine, PROMPTS[0])[1]
        engine.apply_lora(engine.lora_key(None))
        try:
            shifted[weights] = _greedy(engine, PROMPTS[0])[1] - plain
        finally:
            engine.apply_lora(())
    assert float(shifted["float32"].abs().max()) > 10 * LOGIT_TOLERANCE  # the adapter matters
    assert float((shifted["blocks"] - shifted["float32"]).abs().max()) < 2 * LOGIT_TOLERANCE
