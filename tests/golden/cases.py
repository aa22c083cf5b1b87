"""The golden cases: every plan category of a few models, policies and paths, the gate's budget choice,
and a short training run's losses. `make_golden.py` wrote `golden.json` with the code before the gate moved
into one place (the commit before the refactor); `tests/test_golden.py` holds the code of today to it, byte
for byte."""

from __future__ import annotations

# The default model's LoRA cases plan its frozen weights in float32 (`weights: f32`), as the model was held when
# golden.json was written: loaded as stored, they are its GGUF blocks (tests/test_stored.py, test_quant_cli.py).
F32 = {"weights": "f32"}
# Full fine-tuning on the window path: the optimizer in the backward, as `auto` put it when golden.json was written
# (it now puts it there only where nothing else fits: tests/test_in_backward.py).
IN_BACKWARD = {"optimizer_in_backward": "on"}

PLANS = [  # (name, settings, policies)
    ("smollm2 lora window", {"ctx": 512, **F32}, ("off", "on", "dots", "every:2", "every:4")),
    ("smollm2 full window", {"ctx": 512, "lora": False, **IN_BACKWARD}, ("off", "on", "dots")),
    ("smollm2 lora walk exact", {"ctx": 512, "path": "walk", "ubatch": 256, **F32}, ("off", "on")),
    ("smollm2 full walk truncated", {"ctx": 512, "path": "walk", "ubatch": 128, "walk": "truncated",
                                     "lora": False}, ("off", "on")),
    ("tiny-llama full batch 2", {"model": "tiny-llama", "ctx": 256, "batch": 2, "lora": False, **IN_BACKWARD},
     ("off", "on", "dots", "every:2", "every:4")),
    ("tiny-qwen35 lora", {"model": "tiny-qwen35", "ctx": 128}, ("off", "on", "dots")),
    ("tiny-qwen35 walk exact", {"model": "tiny-qwen35", "ctx": 128, "path": "walk", "ubatch": 64}, ("off", "on")),
    ("qwen3.5-0.8b lora", {"model": "qwen3.5-0.8b", "ctx": 256}, ("off", "on")),
    ("qwen2.5-coder-1.5b lora", {"model": "qwen2.5-coder-1.5b", "ctx": 512}, ("on",)),
]

WORLD = [  # (name, settings, world size, policy): one rank's plan
    ("tiny-llama full 2 ranks", {"model": "tiny-llama", "ctx": 256, "batch": 4, "lora": False}, 2, "on"),
]

CHOICES = [  # (name, settings, budget in bytes): the gate's answer
    ("smollm2 lora budget between on and off", {"ctx": 1024, "recompute": "auto", **F32}, 1400 << 20),
    ("smollm2 full budget every", {"ctx": 1024, "lora": False, "recompute": "budget", **IN_BACKWARD}, 2450 << 20),
    ("smollm2 full refused", {"ctx": 1024, "lora": False, "recompute": "auto", **IN_BACKWARD}, 2000 << 20),
    ("tiny-llama auto fits off", {"model": "tiny-llama", "ctx": 256, "recompute": "auto"}, 8 << 30),
]

TRAIN = [  # a run's losses and its gate's plans (less the measured runtime and trace)
    ("tiny-llama lora 3 steps", {"model": "tiny-llama", "ctx": 64, "steps": 3, "recompute": "on"}),
    ("tiny-qwen35 full walk 2 steps", {"model": "tiny-qwen35", "ctx": 64, "steps": 2, "lora": False,
                                       "path": "walk", "ubatch": 32, "recompute": "off"}),
]
