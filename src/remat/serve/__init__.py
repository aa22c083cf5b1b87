"""`remat serve`: completions and background training jobs in one process; see docs/architecture.md."""
