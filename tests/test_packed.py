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
import pytest
import torch

from remat.bench.packed_rows import random_blocks as _random_blocks
from remat.serve import packed

Q = gguf.GGMLQuantizationType


def _kernel_weight(p: packed.Packed, k: int) -> torch.Tensor:
    """The weight the kernel multiplies by, [N, K]: its product with the identity."""
    return p.kernel(torch.eye(k, dtype=torch.bfloat16)).float().T


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
    # the dense path (many rows) multiplies by the weight dequantized to bfloat16: each weight rounded once
    assert torch.equal(p.dense(torch.eye(k, dtype=torch.bfloat16)).float().T, want.bfloat16().float())
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


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0], ids=lambda q: Q(q).name)
def test_many_rows_take_the_dense_path(qtype):
    """Below the type's `DENSE_ROWS` the product is the kernel's, from there the dequantized weight's (and the two
    differ there: else this would not tell them apart); a weight taller than `CHUNK` is dequantized in pieces."""
    n, k = packed.CHUNK + 64, 64
    p = packed.pack(qtype, _random_blocks(qtype, n, k, seed=2), (n, k))
    assert p.dense_rows == packed.DENSE_ROWS[qtype]
    for m in (1, p.dense_rows - 1, p.dense_rows, 2 * p.dense_rows):
        x = torch.randn(m, k)
        kernel, dense = p.kernel(x.bfloat16()).float(), p.dense(x.bfloat16()).float()
        assert not torch.equal(kernel, dense)
        assert torch.equal(p.mm(x), dense if m >= p.dense_rows else kernel), m
    w = torch.ops.remat.dequantize(_random_blocks(qtype, n, k, seed=2), int(qtype), (n, k), torch.bfloat16)
    assert torch.equal(dense, (x.bfloat16() @ w.T).float())


@pytest.mark.parametrize("bias", [False, True])
def test_pack_model_serves_a_stored_linear(bias):
    """`pack_model` on a stored Linear: its forward is the packed product (plus its bias), its weight still reads."""
    from remat.models import stored

    torch.manual_seed(0)
    n, k = 64, 128
    layer = torch.nn.Sequential(torch.nn.Linear(k, n, bias=bias))
    blocks = _random_blocks(Q.Q4_1, n, k, seed=3)
    stored.keep(layer, {"0.weight": (blocks, int(Q.Q4_1))})
    w = torch.ops.remat.dequantize(blocks, int(Q.Q4_1), (n, k), torch.float32)
    assert packed.pack_model(layer) == {"packed": n * k // 2 + n * k // packed.GROUP * 4, "layers": 1, "float": 0}
    x = torch.randn(3, k)
    want = torch.nn.functional.linear(x, w, layer[0].bias)
    with torch.no_grad():
        got = layer(x)
    assert torch.equal(got, packed.pack(Q.Q4_1, blocks, (n, k)).mm(x) + (layer[0].bias if bias else 0))
    assert torch.allclose(got, want, rtol=2 ** -6, atol=2 ** -6 * float(want.abs().max()))
    assert torch.equal(layer[0].weight, w)


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


LONG = " ".join(f"Item {i}: the {w} is on the table." for i, w in enumerate(["cup", "book", "key", "pen"] * 8))


def test_long_prefill_dense_equals_the_kernel(engines, monkeypatch):
    """A long prompt's prefill (one forward of its ~300 tokens) runs the packed layers densely (`Packed.dense`):
    its greedy continuation equals the one prefilled through the int4 kernel alone, and the float32 model's; the
    logits agree within LOGIT_TOLERANCE (both are bfloat16 products of the same weights, rounded differently)."""
    engine = engines["blocks"]
    assert len(engine.prompt_ids(LONG)) > max(packed.DENSE_ROWS.values())
    calls = []
    dense = packed.Packed.dense
    monkeypatch.setattr(packed.Packed, "dense", lambda self, rows: calls.append(rows.shape[0]) or dense(self, rows))
    got, got_logits = _greedy(engine, LONG)
    assert len(calls) == 210 and set(calls) == {len(engine.prompt_ids(LONG))}  # every Q4_1 layer, at the prefill
    monkeypatch.setattr(packed.Packed, "dense", packed.Packed.kernel)
    kernel, kernel_logits = _greedy(engine, LONG)
    want, want_logits = _greedy(engines["float32"], LONG)
    assert got == kernel == want
    assert float((got_logits - kernel_logits).abs().max()) < LOGIT_TOLERANCE
    assert float((got_logits - want_logits).abs().max()) < LOGIT_TOLERANCE


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
