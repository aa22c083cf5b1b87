#!/usr/bin/env bash
# Regenerate the committed benchmark results in bench/results/ and their combined README table.
#
#   bench/run_all.sh            # all settings: under 20 minutes on 2 otherwise idle CPU cores
#
# Each run trains four variants side by side (remat recompute off / on, PyTorch per-layer
# checkpointing, plain eager) and writes bench.json, bench.md and bench.png into its folder.
# Walk runs add two, recompute on: the truncated walk and the window path (the walk receipt),
# once full fine-tuning and once with --lora (every variant trains the same r-8 adapter).
# SmolLM2 at ctx 2048 is full fine-tuning at ~30 s a step per variant on 2 cores: 2 steps
# there (the first is the warm-up, so its step time is one step's).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${VIRTUAL_ENV:-}" && -f .venv/bin/activate ]]; then
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
out=bench/results
mkdir -p "$out"
bench() { echo "== $*" >&2; python -m remat bench "$@" >/dev/null; }
start=$SECONDS

bench --ctx 512 --steps 4 --out "$out/smollm2-ctx512"
bench --model tiny-qwen35 --ctx 512 --steps 8 --out "$out/tiny-qwen35-ctx512"
bench --ctx 2048 --steps 2 --out "$out/smollm2-ctx2048"
bench --ctx 2048 --steps 2 --path walk --ubatch 256 --out "$out/smollm2-walk-ctx2048"
bench --ctx 2048 --steps 2 --path walk --ubatch 256 --lora --out "$out/smollm2-walk-ctx2048-lora"

python -c "from remat.bench.compare import write_summary; print(write_summary('$out'))"

# The demo three ways (float32 weights, the GGUF's blocks in float32, in the compute dtype auto picks), interleaved.
python -m remat.bench.precision >/dev/null

# Against the peers (PEERS=1; hours on 2 shared cores): the longest window in 4/8/16 GiB against Hugging Face +
# PEFT, and full fine-tuning throughput against llama.cpp's llama-finetune ($REMAT_LLAMA_FINETUNE, or
# $REMAT_LLAMA_SDIST: the llama-cpp-python sdist to build it from) and HF + PEFT. Both go on from their runs.json.
if [[ "${PEERS:-0}" == 1 ]]; then
  python -m remat.bench.longest_window >/dev/null
  python -m remat.bench.train_peers >/dev/null
fi
echo "done in $((SECONDS - start)) s" >&2
