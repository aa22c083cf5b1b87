"""llama.cpp's own trainer, `llama-finetune`, for `train_peers`: found or built, its model file, its run.

The binary: `--llama-finetune PATH` or `$REMAT_LLAMA_FINETUNE`; else one built earlier in the cache
(`~/.cache/remat/llama.cpp/<sdist>/build/bin/llama-finetune`); else built there from the llama.cpp sources that
the `llama-cpp-python` sdist ships (`--llama-sdist` or `$REMAT_LLAMA_SDIST`, a .tar.gz or an unpacked folder):
CMake, CPU only, examples on, target `llama-finetune`. llama-finetune trains float32 (or float16) weights only;
the embedded SmolLM2 GGUF is Q4_1 (its token embedding Q8_0), so it trains a float32 copy, every tensor
dequantized by gguf-py: the very values remat and transformers load from the Q4_1 file.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

from remat.bench import peers

ENV_BINARY = "REMAT_LLAMA_FINETUNE"
ENV_SDIST = "REMAT_LLAMA_SDIST"
PROGRESS = re.compile(r"train: \[.*?\] data=(\d+)/(\d+) loss=([\d.]+).*? t=(\d+):(\d+):(\d+)")


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "remat" / "llama.cpp"


def find_binary(given: str | None, sdist: str | None) -> tuple[Path | None, str]:
    """The llama-finetune to run and how it was found, or None and why not."""
    for path, how in ((given, "--llama-finetune"), (os.environ.get(ENV_BINARY), f"${ENV_BINARY}")):
        if path:
            return (Path(path), how) if Path(path).is_file() else (None, f"{how} {path}: no such file")
    built = sorted(cache_root().glob("*/build/bin/llama-finetune"))
    if built:
        return built[-1], f"built earlier in {built[-1].parents[2]}"
    src = sdist or os.environ.get(ENV_SDIST)
    if not src:
        return None, f"no llama-finetune given (--llama-finetune, ${ENV_BINARY}) and no sdist to build it from " \
                     f"(--llama-sdist, ${ENV_SDIST})"
    try:
        return build(Path(src)), f"built from {src}"
    except (OSError, subprocess.CalledProcessError, tarfile.TarError) as e:
        return None, f"building llama-finetune from {src} failed: {e}"


def build(sdist: Path) -> Path:
    """Unpack the llama-cpp-python sdist into the cache and build llama-finetune from its vendored llama.cpp."""
    if shutil.which("cmake") is None:
        raise OSError("cmake is not installed")
    if sdist.is_dir():
        root = sdist
    else:
        root = cache_root() / sdist.name.removesuffix(".tar.gz")
        if not root.exists():
            with tarfile.open(sdist) as tar:
                tar.extractall(root.parent, filter="data")
    src, out = root / "vendor" / "llama.cpp", cache_root() / root.name / "build"
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cmake", "-S", str(src), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_EXAMPLES=ON",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_SERVER=OFF"], check=True,
                   capture_output=True)
    subprocess.run(["cmake", "--build", str(out), "--target", "llama-finetune", f"-j{os.cpu_count() or 2}"],
                   check=True, capture_output=True)
    return out / "bin" / "llama-finetune"


def default_float32_gguf() -> Path:
    """The embedded SmolLM2 GGUF with every tensor float32, in the cache (written once): the values remat and
    transformers load from the Q4_1 file, for a side that reads a GGUF but should hold float32 weights."""
    from remat.models.load import default_gguf_path
    cache_root().mkdir(parents=True, exist_ok=True)
    return float32_gguf(default_gguf_path(), cache_root() / "SmolLM2-135M-Instruct.f32.gguf")


def float32_gguf(src: Path, dest: Path) -> Path:
    """`src` with every tensor dequantized to float32 (gguf-py), its metadata copied, file type ALL_F32."""
    if dest.exists():
        return dest
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize

    r = GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    tmp = dest.with_suffix(".part")
    w = GGUFWriter(tmp, arch)
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name in ("general.architecture", "general.file_type"):
            continue
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
    w.add_file_type(0)  # LLAMA_FTYPE_ALL_F32
    for t in r.tensors:
        data = t.data if t.tensor_type == GGMLQuantizationType.F32 else dequantize(t.data, t.tensor_type)
        w.add_tensor(t.name, np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(dest)
    return dest


def command(binary: Path, model: Path, text: Path, ctx: int, threads: int) -> list[str]:
    """One epoch of llama-finetune over `text` in windows of `ctx` (batch and ubatch one window), AdamW, no
    validation split, the trained model written to a scratch file."""
    return [str(binary), "--model", str(model), "--file", str(text), "-c", str(ctx), "-b", str(ctx), "-ub", str(ctx),
            "-t", str(threads), "--epochs", "1", "--val-split", "0",
            "-o", str(model.parent / "llama-finetune-out.gguf")]


def tokens_per_second(stderr: str, ctx: int) -> tuple[float | None, int, list[float]]:
    """From llama-finetune's progress lines: tokens/s over the windows after each epoch's first (the warm-up), how
    many windows it trained, its losses. Its clock counts whole seconds from each epoch's start: read the rate to
    (1 s / the span)."""
    points = [(int(m[1]), float(m[3]), int(m[4]) * 3600 + int(m[5]) * 60 + int(m[6]))
              for m in PROGRESS.finditer(stderr.replace("\r", "\n"))]
    epochs: list[list[tuple[int, float, int]]] = []
    for p in points:
        if not epochs or p[0] <= epochs[-1][-1][0]:
            epochs.append([])
        epochs[-1].append(p)
    tokens = sum((e[-1][0] - e[0][0]) * ctx for e in epochs)
    span = sum(e[-1][2] - e[0][2] for e in epochs)
    return (tokens / span if span > 0 else None), sum(e[-1][0] for e in epochs), [p[1] for p in points]


def run(binary: Path, model: Path, text: Path, ctx: int, threads: int, timeout: float) -> dict:
    r = peers.measured(command(binary, model, text, ctx, threads), timeout=timeout)
    rate, windows, losses = tokens_per_second(r.stderr, ctx)
    out = {"side": "llama.cpp", "rc": r.rc, "peak_rss": r.peak_rss if r.rc == 0 else None,
           "seconds": round(r.seconds, 1), "tokens_per_second": rate, "windows": windows, "losses": losses}
    if r.rc != 0 or rate is None:
        out["error"] = r.error()
    return out
