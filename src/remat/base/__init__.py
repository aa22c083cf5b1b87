"""The torch-free base: every setting once, the errors, atomic files, the collector's pause."""
