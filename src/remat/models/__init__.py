"""The model glue: transformers models loaded and prepared, their steps traced, caches for the walk, LoRA adapters."""
