"""LoRA training, checkpoints and resume, through the trainer and the real CLI."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from remat.base.settings import TrainSettings
from remat.training import checkpoints
from remat.training.train import finetune


def run_tiny(**kw) -> dict:
    base = {"model": "tiny-llama", "ctx": 64, "batch": 2, "steps": 3}
    return finetune(TrainSettings(**{**base, **kw}), progress=False).as_dict()


def test_lora_is_the_default_and_only_the_adapter_trains():
    r = run_tiny()
    assert r["settings"]["lora"] is True
    assert 0 < r["trainable_parameters"] < r["frozen_parameters"]
    # the base is frozen: the planner counts it in `frozen`, the adapter in `params`
    assert r["plan"]["params"] == 4 * r["trainable_parameters"]
    assert r["plan"]["frozen"] >= 4 * r["frozen_parameters"]
    full = run_tiny(lora=False)
    assert full["plan"]["params"] > r["plan"]["params"] and full["trainable_parameters"] > r["trainable_parameters"]


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen35"])
def test_lora_recompute_on_off_bitwise_with_dropout(model):
    on = run_tiny(model=model, recompute="on", lora_dropout=0.1)
    off = run_tiny(model=model, recompute="off", lora_dropout=0.1)
    assert on["recompute"] and not off["recompute"]
    assert on["losses"] == off["losses"]
    # dropout really draws: another seed trains differently
    assert run_tiny(model=model, recompute="on", lora_dropout=0.1, seed=1)["losses"] != on["losses"]


def test_resume_gives_the_same_losses_as_an_uninterrupted_run(tmp_path):
    whole = run_tiny(steps=6, lora_dropout=0.1, out=str(tmp_path / "a"), save_every=2)
    assert [Path(c).name for c in whole["checkpoints"]] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    ckpt = tmp_path / "a" / "checkpoint-2"
    assert {p.name for p in ckpt.iterdir()} == {"trainable.safetensors", "optimizer.pt", "rng.pt",
                                                 "trainer_state.json"}
    # continue from step 2 in a fresh folder: the losses match the uninterrupted run bitwise
    resumed = run_tiny(steps=6, lora_dropout=0.1, out=str(tmp_path / "b"), resume=str(ckpt))
    assert resumed["resumed_from"] == str(ckpt)
    assert resumed["losses"] == whole["losses"]
    assert {Path(f).name for f in resumed["outputs"]} >= {"adapter_config.json", "adapter_model.safetensors",
                                                           "adapter.gguf"}


def test_resume_refuses_a_folder_without_checkpoints(tmp_path):
    with pytest.raises(checkpoints.CheckpointError, match="no complete checkpoint"):
        run_tiny(resume=str(tmp_path))


def _cli(*args: str, env: dict | None = None, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "remat", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **kw)


def test_sigkill_during_a_save_leaves_the_previous_checkpoint_resumable(tmp_path):
    """Full fine-tuning of the real SmolLM2: a checkpoint is ~1.5 GB, so a save takes long enough to be
    caught in the middle. The kill lands while a temporary checkpoint folder exists."""
    out = tmp_path / "run"
    common = ["finetune", "--full", "--ctx", "32", "--json", "--seed", "3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # a thread per run: the last two run side by side
    proc = _cli(*common, "--steps", "2", "--save-every", "1", "--out", str(out), env=env)  # killed saving step 2
    deadline = time.monotonic() + 1200
    killed = False
    while time.monotonic() < deadline and proc.poll() is None:
        complete = list(out.glob("checkpoint-*")) if out.exists() else []
        partial = list(out.glob(".checkpoint-*")) if out.exists() else []
        if complete and partial:
            os.kill(proc.pid, signal.SIGKILL)
            killed = True
            break
        time.sleep(0.01)
    _, err = proc.communicate()
    assert killed, f"the run ended before a save could be interrupted: {err[-500:]}"
    latest = checkpoints.latest(out)
    state = json.loads((latest.path / "trainer_state.json").read_text())
    assert state["step"] == latest.step == len(state["losses"])
    assert load_file(latest.path / "trainable.safetensors")  # whole, readable

    resumed = _cli(*common, "--steps", "2", "--out", str(out), "--resume", str(out), env=env)
    whole = _cli(*common, "--steps", "2", env=env)
    r_out, r_err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, r_err
    w_out, w_err = whole.communicate(timeout=600)
    assert whole.returncode == 0, w_err
    assert json.loads(r_out)["losses"] == json.loads(w_out)["losses"]
    assert json.loads(r_out)["losses"][:latest.step] == state["losses"]


def test_export_merge_writes_a_loadable_model(tmp_path):
    from transformers import AutoModelForCausalLM

    r = run_tiny(out=str(tmp_path / "adapter"))
    done = subprocess.run([sys.executable, "-m", "remat", "export", "--merge", "--adapter",
                           str(tmp_path / "adapter"), "--out", str(tmp_path / "merged")],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert any(p.name.endswith(".safetensors") for p in (tmp_path / "merged").iterdir())
    assert r["outputs"] and sum(p.numel() for p in merged.parameters()) > 0
    bad = subprocess.run([sys.executable, "-m", "remat", "export", "--merge", "--adapter",
                          str(tmp_path / "nothing"), "--out", str(tmp_path / "m2")],
                         capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "error" in bad.stderr
    assert torch.is_tensor(next(merged.parameters()))


def test_latest_checkpoint_of_a_folder_being_deleted_is_none_found(tmp_path):
    """A finished job's checkpoints are deleted while GET /train/<id> may be looking for the latest one:
    the lookup answers "no checkpoint" (CheckpointError), never a FileNotFoundError (the server's 500)."""
    import contextlib
    import shutil
    import threading

    root, stop = tmp_path / "job", threading.Event()

    def churn():
        while not stop.is_set():  # the folder comes and goes, as fast as it can
            root.mkdir(exist_ok=True)
            shutil.rmtree(root, ignore_errors=True)

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        for _ in range(20000):
            with contextlib.suppress(checkpoints.CheckpointError):
                checkpoints.latest(root)
    finally:
        stop.set()
        thread.join()
