"""Tiny llama GGUF files for tests, written with gguf-py's own writer and quantizers.

Rows of 256 and 512 elements, so every kept type fits them (K-types need whole blocks of 256). gguf-py cannot
quantize K-types, so their blocks are random bytes with small scales (the values stay in a trainable range).
The tokenizer is the tiny presets' byte-level one, written as llama.cpp writes a gpt2 vocabulary.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from remat.models.load import tiny_tokenizer

Q = gguf.GGMLQuantizationType
HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 512, 2, 4, 2, 259

# One type per kind of weight: every kept type appears, and rows of both lengths.
MIXED = {"token_embd": Q.Q8_0, "output": Q.Q6_K, "attn_q": Q.Q4_K, "attn_k": Q.Q5_K, "attn_v": Q.Q6_K,
         "attn_output": Q.Q4_0, "ffn_gate": Q.Q4_1, "ffn_up": Q.Q5_0, "ffn_down": Q.Q5_1}


# Where a type gguf-py cannot quantize keeps its half super-block scales (d, and dmin where it has one).
SCALES_AT = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q3_K: (108,), Q.Q2_K: (80, 82)}


def _random_blocks(rng: np.random.Generator, qtype: Q, rows: int, cols: int) -> np.ndarray:
    """Random blocks whose super-block scales are small halves (2^-12), so values stay near 0.1."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for at in SCALES_AT.get(qtype, ()):
        raw[:, at:at + 2] = np.array([2.0 ** -12], np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def tensor(rng: np.random.Generator, qtype: Q, shape: tuple[int, ...]) -> tuple[np.ndarray, Q]:
    """A tensor of `shape` (numpy order, rows last) as gguf-py writes `qtype`: raw blocks, or floats."""
    if qtype not in (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0):  # gguf-py cannot quantize it
        return _random_blocks(rng, qtype, int(np.prod(shape[:-1])), shape[-1]), qtype
    values = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    return gguf.quants.quantize(values, qtype), qtype


def write(path: Path, types: dict[str, Q] | None = None, *, tied: bool = False, seed: int = 0,
          extra: dict[str, tuple[np.ndarray, Q]] | None = None) -> Path:
    """A loadable llama GGUF at `path`: `types` per kind of weight (default MIXED), norms F32."""
    types = {**MIXED, **(types or {})}
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(2048)
    writer.add_block_count(LAYERS)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    _tokenizer(writer)
    tensors = {"token_embd.weight": tensor(rng, types["token_embd"], (VOCAB, HIDDEN)),
               "output_norm.weight": (np.ones(HIDDEN, np.float32), Q.F32)}
    if not tied:
        tensors["output.weight"] = tensor(rng, types["output"], (VOCAB, HIDDEN))
    head_dim = HIDDEN // HEADS
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * head_dim, HIDDEN),
              "attn_v": (KV_HEADS * head_dim, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
              "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN), "ffn_down": (HIDDEN, INTER)}
    for i in range(LAYERS):
        for kind, shape in shapes.items():
            tensors[f"blk.{i}.{kind}.weight"] = tensor(rng, types[kind], shape)
        for norm in ("attn_norm", "ffn_norm"):
            tensors[f"blk.{i}.{norm}.weight"] = ((1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32), Q.F32)
    tensors.update(extra or {})
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype if qtype not in (Q.F32, Q.F16) else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tokenizer(writer: gguf.GGUFWriter) -> None:
    tok = tiny_tokenizer()
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    assert [i for _, i in vocab] == list(range(VOCAB))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types([gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.CONTROL] * 3)
    writer.add_token_merges([])  # none: transformers recovers them from the scores, which gives none here
    writer.add_token_scores([0.0] * VOCAB)
    writer.add_eos_token_id(258)
    writer.add_pad_token_id(256)
