"""Benchmarks: side-by-side comparisons and sweeps (`remat bench`) and the scripts that write bench/results."""
