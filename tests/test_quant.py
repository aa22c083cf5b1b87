"""remat::dequantize against gguf-py's own `gguf.quants.dequantize`, bit for bit (float32 bit patterns, NaNs
included), on random blocks with extreme and special scales and on every tensor of the shipped GGUF."""

from __future__ import annotations

import platform
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from remat.base.settings import Note
from remat.models import native, quant
from remat.models.load import default_gguf_path

Q = gguf.GGMLQuantizationType
# Halves that stress the scales: infinities, signalling and quiet NaNs with payloads, zeros of both signs, the
# smallest subnormal, the largest finite, and ordinary values.
SPECIAL_HALVES = np.array([0x7C00, 0xFC00, 0x7C01, 0xFE01, 0x7E00, 0x7D55, 0x0000, 0x8000, 0x0001, 0x7BFF, 0xFBFF,
                           0x3C00, 0x1400], dtype=np.uint16)
# Where each type keeps its half-precision scales in a block (d, and the min where it has one).
SCALES = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2),
          Q.Q6_K: (208,), Q.F16: (0,), Q.BF16: (0,), Q.F32: ()}


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _ours(raw: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> np.ndarray:
    return quant.dequantize(torch.from_numpy(np.array(raw)), int(qtype), list(shape), torch.float32).numpy()


def _random_blocks(qtype: Q, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """Random bytes (every bit pattern of the quants and the sub-block scales), with the half scales of every
    other block set to the specials, alone and in pairs."""
    rng = np.random.default_rng(seed)
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, (rows * blocks_per_row, size), dtype=np.uint8)
    special = SPECIAL_HALVES.view(np.uint8).reshape(-1, 2)
    for at in SCALES[qtype]:
        picks = rng.integers(0, len(special), len(raw) // 2)
        raw[::2][:, at:at + 2] = special[picks]
    return raw.reshape(rows, -1)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # gguf-py's numpy on NaN and infinite scales
@pytest.mark.parametrize("qtype", sorted(quant.KEPT), ids=lambda q: Q(q).name)
def test_random_blocks_bit_for_bit(qtype):
    raw = _random_blocks(Q(qtype), rows=48, blocks_per_row=3, seed=int(qtype))
    want = gguf.quants.dequantize(raw, Q(qtype))
    got = _ours(raw, Q(qtype), want.shape)
    assert got.shape == want.shape and got.dtype == np.float32
    differ = np.flatnonzero(_bits(got) != _bits(want))
    assert differ.size == 0, [(hex(_bits(want).flat[i]), hex(_bits(got).flat[i])) for i in differ[:5]]
    if qtype not in (Q.F32, Q.BF16):
        assert np.isnan(want).any() and np.isinf(want).any()  # the specials reached the values


def test_every_f16_and_bf16_bit_pattern():
    # The CPU's half-to-float conversion quiets signalling NaNs; gguf-py (numpy) keeps their bits.
    every = np.arange(1 << 16, dtype=np.uint16).view(np.uint8).reshape(1, -1)
    for qtype in (Q.F16, Q.BF16):
        want = gguf.quants.dequantize(every, qtype)
        assert (_bits(_ours(every, qtype, want.shape)) == _bits(want)).all(), qtype.name


def test_every_tensor_of_the_shipped_gguf():
    reader = gguf.GGUFReader(default_gguf_path())
    seen = set()
    for t in reader.tensors:
        raw = np.asarray(t.data).view(np.uint8).reshape(*t.data.shape[:-1], -1)
        want = gguf.quants.dequantize(t.data, t.tensor_type)
        got = _ours(raw, t.tensor_type, want.shape)
        assert (_bits(got) == _bits(want)).all(), t.name
        seen.add(t.tensor_type.name)
    assert seen == {"Q4_1", "Q8_0", "F32"} and len(reader.tensors) == 272


def test_output_dtype_is_the_argument():
    raw = _random_blocks(Q.Q8_0, rows=4, blocks_per_row=2, seed=1)
    raw[:, 0:2] = raw[:, 34:36] = np.array([0x1400], np.uint16).view(np.uint8)  # small finite scales
    exact = quant.dequantize(torch.from_numpy(raw), int(Q.Q8_0), [4, 64], torch.float32)
    half = quant.dequantize(torch.from_numpy(raw), int(Q.Q8_0), [4, 64], torch.bfloat16)
    assert half.dtype == torch.bfloat16 and torch.equal(half, exact.to(torch.bfloat16))


@pytest.mark.parametrize("qtype", sorted(SCALES, key=int), ids=lambda q: q.name)
def test_a_narrower_dtype_is_made_piece_by_piece_as_the_float32_values_cast(qtype, monkeypatch):
    """Into bfloat16 and float16 the weight is dequantized a piece of rows at a time; every piece boundary (one
    or two blocks a piece here) leaves each value the float32 one cast, NaN payloads included."""
    size = gguf.GGML_QUANT_SIZES[qtype][0]
    raw = torch.from_numpy(_random_blocks(qtype, rows=6, blocks_per_row=3, seed=4))
    shape = [6, 3 * size]
    exact = quant.dequantize(raw, int(qtype), shape, torch.float32)
    monkeypatch.setattr(quant, "PIECE", 2 * size)  # two blocks a piece: pieces end inside rows and at their ends
    for dtype in (torch.bfloat16, torch.float16):
        got = quant.dequantize(raw, int(qtype), shape, dtype)
        assert got.dtype == dtype and torch.equal(got.view(torch.int16), exact.to(dtype).view(torch.int16))


def test_bad_blocks_are_refused():
    raw = torch.zeros(4, 34, dtype=torch.uint8)
    with pytest.raises(ValueError, match="do not hold"):
        quant.dequantize(raw, int(Q.Q8_0), [4, 64], torch.float32)  # 2 blocks a row need 68 bytes
    with pytest.raises(ValueError, match="no dequantization kernel"):
        quant.dequantize(raw, int(Q.Q2_K), [4, 256], torch.float32)


def test_the_fake_kernel_sizes_the_float_copy():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        blocks = torch.empty(1536, 360, dtype=torch.uint8)
        out = torch.ops.remat.dequantize(blocks, int(Q.Q4_1), [1536, 576], torch.float32)
    assert out.shape == (1536, 576) and out.dtype == torch.float32


# ------------------------------------------------------------------------------------ the compiled kernels

FINITE_HALVES = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x7BFF, 0xFBFF, 0x3C00, 0x1400, 0xB800],
                         dtype=np.uint16)


def _finite_blocks(qtype: Q, blocks: int, seed: int) -> np.ndarray:
    """Random blocks whose half scales are finite: random halves, and the extremes (zeros, subnormals, the
    largest) in every third block."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (blocks, gguf.GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    for at in SCALES[qtype]:
        h = rng.integers(0, 1 << 16, blocks).astype(np.uint16)
        h[(h & 0x7C00) == 0x7C00] ^= 0x4000  # no infinity or NaN
        h[::3] = FINITE_HALVES[rng.integers(0, len(FINITE_HALVES), len(h[::3]))]
        raw[:, at:at + 2] = h.view(np.uint8).reshape(-1, 2)
    return raw


@pytest.mark.parametrize("qtype", sorted(native.TYPES), ids=lambda q: Q(q).name)
def test_the_compiled_kernels_bit_for_bit(qtype, monkeypatch):
    """Every block type the C kernels make, into float32 and bfloat16, against gguf-py (bfloat16: its values cast
    by torch), on one thread and on three (3,001 blocks: uneven shares); the op makes them there, not by torch
    ops."""
    assert native.library() is not None, "this machine has a C compiler: the kernels must build"
    raw = _finite_blocks(Q(qtype), 3001, seed=int(qtype))
    want = torch.from_numpy(gguf.quants.dequantize(raw, Q(qtype)).reshape(len(raw), -1))
    monkeypatch.setitem(quant._KERNELS, qtype, None)  # the torch kernel, were it called, would fail
    threads = torch.get_num_threads()
    try:
        for n, dtype, bits in ((1, torch.float32, torch.int32), (3, torch.float32, torch.int32),
                               (1, torch.bfloat16, torch.int16), (3, torch.bfloat16, torch.int16)):
            torch.set_num_threads(n)
            got = quant.dequantize(torch.from_numpy(raw), int(qtype), list(want.shape), dtype)
            assert got.dtype == dtype and torch.equal(got.view(bits), want.to(dtype).view(bits)), (n, dtype)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(platform.system() != "Linux", reason="reads /proc/self/maps")
def test_the_kernels_share_torchs_openmp_threads():
    """The kernels' threads are the OpenMP team torch's ops run on (its libgomp, loaded once): a second runtime's
    threads would wait for cores torch's workers still spin on after each op."""
    assert native.library() is not None
    maps = Path("/proc/self/maps").read_text().splitlines()
    openmp = {line.split()[-1] for line in maps if any(r in line for r in ("libgomp", "libomp", "libiomp"))}
    assert len(openmp) == 1, openmp  # one runtime: GNU's (torch's), LLVM's or Intel's


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64-v2 is an x86 target")
def test_the_kernels_built_without_avx512_bit_for_bit(monkeypatch, tmp_path):
    """Q4_1 and Q8_0 have vector code for AVX-512 CPUs (this machine's): built for a CPU without it, the
    per-element loop makes them, with the same values."""
    monkeypatch.setattr(native, "FLAGS", tuple(f if f != "-march=native" else "-march=x86-64-v2" for f in native.FLAGS))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    native.library.cache_clear()
    try:
        assert native.library() is not None
        for qtype in (Q.Q4_1, Q.Q8_0):
            raw = _finite_blocks(qtype, 1001, seed=7)
            want = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(len(raw), -1))
            for dtype, bits in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16)):
                got = native.dequantize(torch.from_numpy(raw), int(qtype), dtype)
                assert got is not None and torch.equal(got.view(bits), want.to(dtype).view(bits)), (qtype, dtype)
    finally:
        native.library.cache_clear()


@pytest.mark.parametrize("qtype", sorted(native.TYPES), ids=lambda q: Q(q).name)
def test_a_scale_not_finite_leaves_the_weight_to_the_torch_kernels(qtype):
    raw = _finite_blocks(Q(qtype), 40, seed=5)
    assert native.dequantize(torch.from_numpy(raw), int(qtype), torch.float32) is not None
    raw[37, SCALES[Q(qtype)][-1]:][:2] = SPECIAL_HALVES[:1].view(np.uint8)  # one block's scale: +infinity
    assert native.dequantize(torch.from_numpy(raw), int(qtype), torch.float32) is None
    with np.errstate(all="ignore"):
        want = gguf.quants.dequantize(raw, Q(qtype))
        assert (_bits(_ours(raw, Q(qtype), want.shape)) == _bits(want)).all()


def test_without_a_compiler_the_torch_kernels_make_the_shipped_weights(monkeypatch, tmp_path):
    """No C compiler: said once, as a note, and every tensor of the shipped GGUF still bit for bit."""
    native.library.cache_clear()
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    try:
        with pytest.warns(Note, match="no C compiler"):
            assert native.library() is None
        test_every_tensor_of_the_shipped_gguf()
    finally:
        native.library.cache_clear()
