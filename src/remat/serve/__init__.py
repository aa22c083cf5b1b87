"""`remat serve`: completions and background training jobs in one process (shared/DESIGN.md §7)."""
