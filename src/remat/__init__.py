"""remat: train language models in less memory by recomputing per-layer intermediates."""
