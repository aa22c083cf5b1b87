"""The optimizer in the backward (`training/in_backward.py`): each parameter's AdamW update inside the step. The
oracles: a plain eager AdamW loop (the same grads, stepped after the backward: the parameters bitwise alike), the
trainer stepping after the backward (losses bitwise alike), the model's own eager forward and backward with AdamW
(losses within the traced step's tolerance), and the measured step (the plan's `graph` and `step` to the byte)."""

from __future__ import annotations

import copy

import pytest
import torch

from planning import plan_settings
from remat.base.settings import GateRefused, TrainSettings, UsageError
from remat.core.graph import StepInputs
from remat.core.plan import measure, plan
from remat.core.recompute import rewrite
from remat.models.hf import causal_lm_loss
from remat.models.load import load_model
from remat.models.steps import window_step
from remat.training import gate, in_backward, step
from remat.training.train import finetune

pytestmark = pytest.mark.usefixtures("one_thread")
TINY = {"model": "tiny-llama", "ctx": 64, "batch": 2, "lora": False}


def run(**kw) -> dict:
    return finetune(TrainSettings(**{**TINY, "steps": 3, **kw}), progress=False).as_dict()


def batch(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, vocab, (2, 64), generator=g) for _ in range(2))  # type: ignore[return-value]


@pytest.mark.parametrize("policy", ["off", "on"])
def test_the_updates_are_a_plain_adamw_steps_on_the_same_grads(policy):
    """Three steps: the step's own grads handed to a plain AdamW after the backward (the oracle), against the
    same step run with each update inside it. Every parameter and AdamW state bitwise alike after each step."""
    model = load_model("tiny-llama", seed=0).model
    oracle = copy.deepcopy(model)
    tg = window_step(model, *batch(model.config.vocab_size, 0))
    tg = tg if policy == "off" else rewrite(tg)
    mine, theirs = StepInputs.of(model), StepInputs.of(oracle)
    params, reference = list(mine.trainable.values()), list(theirs.trainable.values())
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    plain = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.0)
    in_backward.ready_state(opt)
    updating = in_backward.updating(tg, in_backward.Update(opt, params))
    for seed in range(3):
        ids, labels = batch(model.config.vocab_size, seed)
        with torch.no_grad():
            loss, grads = tg(*theirs.args(ids, labels))  # the oracle: grads, then AdamW after the backward
            for p, g in zip(reference, grads, strict=True):
                p.grad = g
            plain.step()
            plain.zero_grad(set_to_none=True)
            updated_loss, none = updating(*mine.args(ids, labels))
        assert torch.equal(loss, updated_loss) and none == []
        assert all(p.grad is None for p in params)
        for name, a, b in zip(mine.trainable, params, reference, strict=True):
            assert torch.equal(a, b), name
            assert all(torch.equal(x, y) for x, y in zip(opt.state[a].values(), plain.state[b].values())), name


def test_the_trainer_gives_the_losses_of_stepping_after_the_backward():
    """Full fine-tuning with the optimizer in the backward: its losses are bitwise those of stepping after the
    backward (the default, `auto`, where that fits), and its plan holds no set of grads."""
    inside = run(optimizer_in_backward="on")
    after = run()
    assert inside["settings"]["optimizer_in_backward"] == "on" and after["settings"]["optimizer_in_backward"] == "off"
    assert inside["losses"] == after["losses"]
    assert inside["plan"]["grads"] == 0 < after["plan"]["grads"]


def test_auto_puts_the_optimizer_in_the_backward_only_where_nothing_else_fits():
    """Full fine-tuning, `auto`: after the backward (the faster) where some policy fits so; in the backward where
    only so the job fits; refused, with the in-backward plans, where nothing fits either way."""
    s = TrainSettings(**TINY)
    smallest = {where: min(p.total for p in plan_settings(s.model_copy(update={"optimizer_in_backward": where}),
                                                          step.LADDER).values()) for where in ("off", "on")}
    assert smallest["on"] < smallest["off"]
    for budget, where in ((smallest["off"], "off"), (smallest["off"] - 1, "on"), (smallest["on"], "on")):
        admitted = gate.admit(s, gate.Budget(budget, "--memory-budget"))
        assert admitted.settings.optimizer_in_backward == where and admitted.shape.updates == (where == "on"), budget
        assert admitted.plan.total <= budget
    with pytest.raises(GateRefused) as refused:
        gate.admit(s, gate.Budget(smallest["on"] - 1, "--memory-budget"))
    assert min(p["total"] for p in refused.value.plans.values()) == smallest["on"]


def test_the_updates_follow_the_models_own_backward_and_adamw():
    """Three steps of the updating step against the model's own eager forward and backward with a plain AdamW
    loop: losses within 1e-5, parameters within 1e-5 of their scale (the traced step rounds as the model's)."""
    model = load_model("tiny-llama", seed=0).model
    eager = copy.deepcopy(model)
    params = list(StepInputs.of(model).trainable.values())
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    plain = torch.optim.AdamW(eager.parameters(), lr=1e-2, weight_decay=0.0)
    in_backward.ready_state(opt)
    ids, labels = batch(model.config.vocab_size, 0)
    updating = in_backward.updating(window_step(model, ids, labels), in_backward.Update(opt, params))
    for seed in range(3):
        ids, labels = batch(model.config.vocab_size, seed)
        with torch.no_grad():
            loss, _ = updating(*StepInputs.of(model).args(ids, labels))
        reference = causal_lm_loss(eager, ids, labels)
        reference.backward()
        plain.step()
        plain.zero_grad(set_to_none=True)
        assert abs(loss.item() - reference.item()) <= 1e-5 * reference.item()
    for (name, a), b in zip(model.named_parameters(), eager.parameters(), strict=True):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max(), name


@pytest.mark.parametrize("policy", ["off", "on"])
def test_the_plan_is_the_measured_step(policy):
    """The updating step observed on real storages (its grads counted as they are made, given back after their
    update; each update's AdamW temporaries as they are held) is the plan with the optimizer in the backward."""
    model = load_model("tiny-llama", seed=0).model
    ids, labels = batch(model.config.vocab_size, 0)
    tg = window_step(model, ids, labels)
    tg = tg if policy == "off" else rewrite(tg)
    params = list(StepInputs.of(model).trainable.values())
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
    in_backward.ready_state(opt)
    updating = in_backward.updating(tg, in_backward.Update(opt, params))
    with torch.no_grad():
        _, measured = measure(updating, StepInputs.of(model).args(ids, labels))
    planned = plan(tg, updates=True)
    assert (measured.graph, measured.step) == (planned.graph, planned.step)
    assert planned.grads == planned.workspace == 0
    after = plan(tg)
    # the grads never all exist at once: with recompute, the backward's peak was the grads' (without, the forward's)
    assert planned.step < after.step if policy == "on" else planned.step == after.step


def test_every4_plans_below_the_layer_policy_with_it():
    """SmolLM2, full fine-tuning at ctx 2048: stepping after the backward, every policy's total is held up by the
    whole set of grads and the update (2,376 MiB each); in the backward, every:4 plans below on."""
    after = plan_settings(TrainSettings(ctx=2048, lora=False, optimizer_in_backward="off"), ("on", "every:4"))
    inside = plan_settings(TrainSettings(ctx=2048, lora=False, optimizer_in_backward="on"), ("on", "every:4"))
    assert after["every:4"].total == after["on"].total
    assert inside["every:4"].total < inside["on"].total < after["on"].total


@pytest.mark.parametrize("change, why", [({"accumulate": 2}, "--accumulate 2 sums"),
                                         ({"path": "walk", "ubatch": 32}, "the walk adds"),
                                         ({"world": 2}, "several ranks")])
def test_where_it_does_not_apply_on_is_refused_in_one_line_and_auto_is_off(change, why):
    world = change.pop("world", 1)
    config = load_model("tiny-llama").model.config
    asked = TrainSettings(**TINY, **change, optimizer_in_backward="on")
    with pytest.raises(UsageError, match=f"^--optimizer-in-backward on does not apply: {why}[^\n]*$"):
        gate.settled(asked, config, world)
    auto = gate.settled(asked.model_copy(update={"optimizer_in_backward": "auto"}), config, world)
    assert auto.optimizer_in_backward == "off"
    assert step.not_in_backward(auto, world).startswith(why.replace("--accumulate 2 sums", "--accumulate 2"))


def test_a_resumed_run_is_the_uninterrupted_one(tmp_path):
    """Checkpoints of a run with the optimizer in the backward hold AdamW's usual state: resumed (in the backward,
    or stepping after it), the losses are the uninterrupted run's, bitwise."""
    whole = run(steps=4, out=str(tmp_path / "a"), save_every=2)
    ckpt = str(tmp_path / "a" / "checkpoint-2")
    assert run(steps=4, out=str(tmp_path / "b"), resume=ckpt)["losses"] == whole["losses"]
    after = run(steps=4, out=str(tmp_path / "c"), resume=ckpt, optimizer_in_backward="off")
    assert after["losses"] == whole["losses"]
