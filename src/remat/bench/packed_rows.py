"""Where a packed layer (`remat.serve.packed`) should switch from the int4 kernel to its dequantized weight: ms per
product of `rows` bfloat16 rows by a weight of random blocks, through `Packed.kernel` and through `Packed.dense`,
the best of a few runs, at one thread by default (the figures in `packed.DENSE_ROWS`' comment).

    python -m remat.bench.packed_rows                     # SmolLM2-135M's shapes, Q4_1 and the Q8_0 head
    python -m remat.bench.packed_rows --types all --shape 576x1536

Prints one line per weight: `rows: kernel / dense` ms.
"""

from __future__ import annotations

import argparse
import time

import gguf
import numpy as np
import torch

from remat.serve import packed

Q = gguf.GGMLQuantizationType
ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 512)
SMOLLM2 = ((Q.Q4_1, 576, 576), (Q.Q4_1, 1536, 576), (Q.Q4_1, 576, 1536), (Q.Q8_0, 49152, 576))
HALVES = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2)}


def random_blocks(qtype: Q, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """[n, row bytes] of random quants and sub-block scales, the float16 scales finite: ±[2^-10, 2^-2]."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n * k // block, size), dtype=np.uint8)
    for at in HALVES[qtype]:
        halves = (rng.choice([-1, 1], len(raw)) * 2.0 ** rng.uniform(-10, -2, len(raw))).astype(np.float16)
        raw[:, at:at + 2] = halves.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(raw.reshape(n, -1))


def _best(f, x: torch.Tensor, runs: int) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        f(x)
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def measure(qtype: Q, n: int, k: int, rows: tuple[int, ...] = ROWS) -> list[tuple[int, float, float]]:
    """[(rows, kernel ms, dense ms)] for a weight [n, k] of `qtype`."""
    p = packed.pack(qtype, random_blocks(qtype, n, k), (n, k))
    runs = 3 if n * k > 1 << 24 else 7
    out = []
    for m in rows:
        x = torch.randn(m, k).bfloat16()
        out.append((m, _best(p.kernel, x, runs), _best(p.dense, x, runs)))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--types", default="", help="'all' (the packable types) at --shape; default SmolLM2's")
    ap.add_argument("--shape", default="576x1536", help="NxK for --types")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    weights = list(SMOLLM2)
    if args.types:
        n, k = (int(v) for v in args.shape.split("x"))
        weights = [(Q(t), n, k) for t in sorted(packed.PACKABLE)]
    for qtype, n, k in weights:
        cells = "  ".join(f"{m}: {a:.2f}/{b:.2f}" for m, a, b in measure(qtype, n, k))
        print(f"{qtype.name} {n}x{k} (dense from {packed.DENSE_ROWS[qtype]})  {cells}", flush=True)


if __name__ == "__main__":
    main()
