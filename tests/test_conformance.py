"""The conformance matrix: each decoder-only causal LM of the installed transformers trains in remat exactly
as the model defines it, or is refused before training with a one-line reason naming the feature.

Families come from transformers' causal-LM auto mapping (tests/conformance.py builds each as a tiny
model that keeps its features). For each: (i) remat's loss and grads, recompute off and on, against the
model's own eager forward + backward (relative difference <= 1e-5, fp32; grads per tensor, `conformance.grads_rel`:
a gradient that is a sum cancelling to near zero is held to the largest one's scale); (ii) recompute on == off
bitwise; (iii) planned graph peak == measured; (iv) the exact walk's window loss == the one-graph
window's, its grads == the model's own (per tensor, `conformance.grads_rel`); (v) LoRA trains (one
step changes the adapter, its grads are PEFT's own eager backward's); (vi) `remat verify` finds every
recompute clone equal; (vii) the user's path: trained from a folder written by `save_pretrained` through
`finetune` as the CLI calls it, its losses bitwise the same run's on the model in memory. Each family's
checks run once (`conformance.check`).
"""

from __future__ import annotations

import pytest
import torch

import conformance as C

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = C.matrix_families()


@pytest.fixture
def known(request):
    """`known(name, check)`: mark the test as an expected (strict) failure when the matrix lists one."""

    def mark(name: str, check: str) -> None:
        reason = C.KNOWN_FAILURES.get((name, check))
        if reason:
            request.applymarker(pytest.mark.xfail(reason=reason, strict=True))

    return mark


def _no_errors(r: C.Report, check: str) -> None:
    assert check not in r.errors, f"{r.name} {check}: {r.errors[check]}"


def _refusal_is_one_line(message: str) -> None:
    assert message and "\n" not in message and len(message) < 400, message


def test_the_matrix_is_generated_from_transformers():
    names = {f.name for f in C.families()}
    assert {"llama", "mistral", "gemma2", "mixtral", "qwen3_moe", "falcon", "mamba"} <= names
    assert len(FAMILIES) >= 45
    skipped = [f for f in C.families() if f.skip is not None]
    assert all(f.skip for f in skipped)  # every family left out says why


@pytest.mark.parametrize("name", FAMILIES)
def test_loss_and_grads_are_the_models(name, known):
    """(i) and (ii): against `model(input_ids, labels=labels).loss.backward()`, recompute off and on."""
    known(name, "ubatch")
    r = C.check(name)
    _no_errors(r, "ubatch")
    if "ubatch" in r.refused:
        _refusal_is_one_line(r.refused["ubatch"])
        return
    for key in ("off", "on"):
        assert r.loss_rel[key] <= C.TOL, (key, r.loss_rel)
        assert r.grad_rel[key] <= C.TOL, (key, r.grad_rel)
    assert r.bitwise, "recompute on and off differ"


@pytest.mark.parametrize("name", FAMILIES)
def test_planned_graph_peak_is_measured(name, known):
    """(iii) with recompute on: the planner's peak is what the run holds."""
    known(name, "plan")
    r = C.check(name)
    if "ubatch" in r.refused:
        pytest.skip(r.refused["ubatch"])
    _no_errors(r, "ubatch")
    assert r.planned == r.measured > 0


@pytest.mark.parametrize("name", FAMILIES)
def test_walk_loss_is_the_window_loss(name, known):
    """(iv) the exact walk (chunks over the cache and carried state, the backward in reverse) gives the
    one-graph loss and the model's own grads, or is refused."""
    known(name, "walk")
    r = C.check(name)
    _no_errors(r, "walk")
    if "walk" in r.refused:
        _refusal_is_one_line(r.refused["walk"])
        # refused for the walk itself, or for the model as a whole (then the window path says so too)
        assert r.refused["walk"].startswith("the walk path does not support") or "ubatch" in r.refused
        return
    assert r.walk_rel is not None and r.walk_rel <= C.TOL, r.walk_rel
    assert r.walk_grad_rel is not None and r.walk_grad_rel <= C.TOL, r.walk_grad_rel  # the exact walk


@pytest.mark.parametrize("name", FAMILIES)
def test_lora_trains(name, known):
    """(v) with a LoRA adapter on every linear layer PEFT accepts: the adapter's grads are PEFT's own eager
    ones, and one step (no weight decay) changes the adapter."""
    known(name, "LoRA")
    r = C.check(name)
    _no_errors(r, "LoRA")
    if "LoRA" in r.refused:
        _refusal_is_one_line(r.refused["LoRA"])
        return
    assert r.lora_grad_rel is not None and r.lora_grad_rel <= C.TOL, r.lora_grad_rel  # PEFT's own backward
    assert r.lora_changed


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_router_aux_loss_is_the_models(name):
    """With output_router_logits the model adds its load-balancing loss: remat's loss includes it, and the
    walk, which sees one chunk's routing at a time, refuses it before training."""
    from remat.core.graph import StepInputs
    from remat.models import load as models
    from remat.models import steps
    from remat.models.hf import UnsupportedModel
    from remat.models.steps import window_step

    ids, labels = C.batch()
    reference = C.build(name, attn=None, output_router_logits=True)
    loss, _ = C.oracle(reference, ids, labels, [])
    plain = C.build(name, attn=None)
    without_aux, _ = C.oracle(plain, ids, labels, [])
    assert loss != without_aux  # the aux loss is really part of the model's loss
    model = models.build_from_config(C.tiny_config(name, output_router_logits=True)).train()
    tg = window_step(model, ids, labels)
    with torch.no_grad():
        ours, _ = tg(*StepInputs.of(model).args(ids, labels))
    assert C.rel(ours, loss) <= C.TOL
    with pytest.raises(UnsupportedModel, match="router aux loss"):
        steps.chunk_step(model, C.BATCH, C.SEQ, C.UBATCH)


@pytest.mark.parametrize("name", FAMILIES)
def test_verify_finds_every_clone_equal(name, known):
    """(vi) `remat verify` on the rewritten step: every recompute clone equals its original where the backward
    reads it (routers' top-k included: their values divided in place after, their indices what is read)."""
    known(name, "verify")
    r = C.check(name)
    if "ubatch" in r.refused:
        pytest.skip(r.refused["ubatch"])
    _no_errors(r, "ubatch")
    assert r.verify == "", r.verify


def test_verify_finds_a_planted_difference_in_a_router():
    """A router's recomputed top-k made to pick other experts (its input negated): verify names it, at the
    output the backward reads (the indices), though its values are not compared."""
    from torch.ops import aten

    from remat.core.graph import StepInputs
    from remat.core.recompute import CLONE_OF, read_outputs, rewrite, verify
    from remat.models import load as models
    from remat.models.steps import window_step

    ids, labels = C.batch()
    model = models.build_from_config(C.tiny_config("mixtral")).train()
    rt = rewrite(window_step(model, ids, labels))
    clone = next(n for n in rt.graph.nodes if n.target is aten.topk.default and CLONE_OF in n.meta)
    assert read_outputs(clone) == [1]  # its indices alone are read
    with rt.graph.inserting_before(clone):
        flipped = rt.graph.call_function(aten.neg.default, (clone.args[0],))
    clone.args = (flipped, *clone.args[1:])
    rt.gm.recompile()
    d = verify(rt, StepInputs.of(model).args(ids, labels)).first_difference
    assert d is not None and (d.node, d.op, d.output) == (clone.name, str(aten.topk.default), 1), d


@pytest.mark.parametrize("name", FAMILIES)
def test_trains_from_a_saved_folder(name, known):
    """(vii) the user's path: the tiny model and tokenizer saved with `save_pretrained`, trained from the folder
    by `finetune` with the CLI's hooks (the gate from the config read off the folder, then the weights): its
    losses, step by step, are bitwise the same run's on the model held in memory."""
    known(name, "folder")
    r = C.check(name)
    _no_errors(r, "folder")
    if "folder" in r.refused:
        _refusal_is_one_line(r.refused["folder"])
        assert "ubatch" in r.refused  # refused from a folder only as the model is refused in memory
        return
    assert r.folder_losses is not None and len(r.folder_losses) == C.FOLDER_STEPS
    assert r.folder_losses == r.memory_losses, (r.folder_losses, r.memory_losses)


@pytest.mark.parametrize("name", ["bamba", "gemma3_text"])
def test_the_cli_trains_a_saved_folder(name, tmp_path):
    """`remat finetune --model <folder>` itself (a process of its own, as a user runs it) on a saved tiny model:
    Bamba's config holds `time_step_limit: [0.0, inf]` (written as `{"__float__": "Infinity"}`), Gemma 3 sliding
    windows and softcapping; the losses are bitwise the in-memory run's."""
    import json
    import subprocess
    import sys

    model, tokenizer = C.save(name, tmp_path)
    s = C.folder_settings(tmp_path)
    cmd = [sys.executable, "-m", "remat", "finetune", "--model", str(tmp_path), "--ctx", str(s.ctx), "--batch",
           str(s.batch), "--steps", str(s.steps), "--full", "--recompute", s.recompute, "--json",
           "--dtype", "float32"]  # a process of its own resolves auto for its CPU
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    receipt = json.loads(run.stdout)
    assert receipt["policy"] == s.recompute
    assert receipt["losses"] == C.in_memory_losses(model, tokenizer, s)
