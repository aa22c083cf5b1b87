"""remat: train language models in less memory by recomputing per-layer intermediates."""

import os

# Nothing is ever fetched from a hub at run time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
