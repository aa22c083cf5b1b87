"""The public Python API: `remat.__all__`, and the README's example run as it is written, its gate answer
held to `remat plan`'s (a real process) and its losses to the model's own eager backward."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import conformance
import remat

README = Path(__file__).resolve().parents[1] / "README.md"
pytestmark = pytest.mark.usefixtures("one_thread")


def _example() -> str:
    text = README.read_text()
    start = text.index("<!-- api-example")
    return re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)


def test_every_public_name_resolves_and_importing_remat_loads_no_torch():
    assert sorted(remat.__all__) == remat.__all__ and all(getattr(remat, n) is not None for n in remat.__all__)
    with pytest.raises(AttributeError):
        remat.no_such_name  # noqa: B018
    out = subprocess.run([sys.executable, "-c", "import remat, sys; print('torch' in sys.modules)"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_readme_example_runs_and_answers_as_the_command_line(tmp_path):
    scope: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(_example(), "README.md", "exec"), scope)
    losses = [float(x) for x in re.findall(r"loss (\S+)", printed.getvalue())]
    assert len(losses) == 3 and all(x > 0 for x in losses)
    # the gate's answer is `remat plan`'s (the plans from the model's config, on fake weights)
    cli = subprocess.run([sys.executable, "-m", "remat", "plan", "--model", "tiny-llama", "--ctx", "64", "--full",
                          "--dtype", "float32",
                          "--recompute", "auto", "--memory-budget", str(1 << 30) + "B", "--json"],
                         capture_output=True, text=True, check=True, cwd=tmp_path)
    answer = json.loads(cli.stdout)
    admitted = scope["admitted"]
    assert answer["policy"] == admitted.policy
    assert answer["plans"] == {k: p.as_dict() for k, p in admitted.plans.items()}
    # the model is as it was: no hooks, its own attention
    assert not any(m._forward_hooks for m in scope["model"].modules())
    assert scope["model"].config._attn_implementation != "remat"


def test_the_steps_loss_and_grads_are_the_models_own(get_case):
    """The API's step on a fresh model: its loss and grads equal the model's own eager forward and backward
    (`model(input_ids, labels=...)`, within the conformance matrix's 1e-5: remat's attention is SDPA with
    transformers' masks, the model's may run another kernel), and `unprepare` leaves no hook behind."""
    c = get_case("tiny-llama")
    labels = c.labels.clone()
    labels[:, -1] = -100  # transformers shifts its labels: the last position has no target there
    model = remat.load_model("tiny-llama").model
    planner = remat.Planner(model)
    inputs = remat.StepInputs.of(model)
    loss, grads = planner.build(remat.StepShape("window", *c.ids.shape, None, 0), "on")(*inputs.args(c.ids, labels))
    remat.unprepare(model)
    assert not any(m._forward_hooks for m in model.modules())
    eager, eager_grads = conformance.oracle(model, c.ids, labels, list(inputs.trainable))
    torch.testing.assert_close(loss, eager, rtol=1e-5, atol=0)
    for name, g, e in zip(inputs.trainable, grads, eager_grads):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-7, msg=name)


def test_nothing_is_kept_on_the_model(get_case):
    """After plans, a budget search, a walk and a run, no module of the model (nor PEFT's wrapper) carries remat's
    state: the planner holds its caches. What `prepare` puts on (its layer hooks) is documented and undone."""
    from remat.models.adapters import LoraSettings, apply_lora
    from remat.training.walk import Walk

    c = get_case("tiny-qwen35")
    model = apply_lora(remat.load_model("tiny-qwen35").model, LoraSettings())
    planner = remat.Planner(model)
    window = remat.StepShape("window", *c.ids.shape, None, 0)
    walk = remat.StepShape("walk", c.ids.shape[0], c.ids.shape[1], 32, 0, "exact")
    planner.plans(window, ("off", "on", "dots", "every:2"))
    budget = planner.plans(window, ("on", "off"))
    planner.choose(window, "budget", (budget["on"].total + budget["off"].total) // 2)
    planner.build(window, "on")(*remat.StepInputs.of(model).args(c.ids, c.labels))
    planner.plans(walk)
    Walk(model, c.ids.shape[0], c.ids.shape[1], 32, True, planner.probes)
    kept = [f"{name or 'model'}.{k}" for name, m in [("", model), *model.named_modules()] for k in vars(m)
            if k.startswith("_remat")]
    assert kept == [], kept
    remat.unprepare(model)
    assert not any(m._forward_hooks for m in model.modules())
