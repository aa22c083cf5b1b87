"""`remat bench`: four variants side by side on a tiny model (six on the walk path); files and schema."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from remat.bench.compare import VARIANTS, WALK_VARIANTS, run_bench


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    result = run_bench("tiny-llama", ctx=64, batch=2, steps=2, out=out, progress=False)
    return out, result


def test_json_schema(bench):
    out, result = bench
    on_disk = json.loads((out / "bench.json").read_text())
    assert on_disk == json.loads(json.dumps(result))
    for key in ("model", "ctx", "batch", "path", "device", "variants", "ratios"):
        assert key in on_disk
    assert (on_disk["ctx"], on_disk["batch"], on_disk["path"]) == (64, 2, "window")
    assert on_disk["device"].split()[0] in ("cpu", "cuda")
    assert [v["variant"] for v in on_disk["variants"]] == list(VARIANTS)
    for v in on_disk["variants"]:
        assert {"variant", "planned_graph", "measured_peak", "step_seconds", "losses"} <= set(v)
        assert len(v["losses"]) == 2 and all(isinstance(x, float) for x in v["losses"])
        assert isinstance(v["step_seconds"], float) and v["step_seconds"] > 0
        assert isinstance(v["measured_peak"], int) and v["measured_peak"] > 0
    assert all(isinstance(r, float) for r in on_disk["ratios"].values())


def test_planned_graph_only_for_remat(bench):
    _, result = bench
    by = {v["variant"]: v for v in result["variants"]}
    for name in ("remat_off", "remat_on"):
        assert isinstance(by[name]["planned_graph"], int) and by[name]["planned_graph"] > 0
        assert isinstance(by[name]["measured_graph"], int) and by[name]["measured_graph"] > 0
    for name in ("torch_checkpoint", "eager"):
        assert by[name]["planned_graph"] is None and by[name]["measured_graph"] is None
    assert by["remat_on"]["planned_graph"] < by["remat_off"]["planned_graph"]


def test_recompute_losses_bitwise_equal(bench):
    _, result = bench
    by = {v["variant"]: v for v in result["variants"]}
    assert [x.hex() for x in by["remat_on"]["losses"]] == [x.hex() for x in by["remat_off"]["losses"]]
    assert result["loss_equality"]["on_equals_off_bitwise"] is True
    # same data and weights: the losses fall together, and per-layer checkpointing changes nothing forward
    assert by["torch_checkpoint"]["losses"][0] == by["eager"]["losses"][0]
    assert abs(by["remat_off"]["losses"][0] - by["eager"]["losses"][0]) < 1e-4


def test_markdown_table_names_every_variant(bench):
    out, _ = bench
    text = (out / "bench.md").read_text()
    assert "| variant |" in text
    for name in VARIANTS:
        assert f"`{name}`" in text
    assert "bitwise equal" in text


def test_png_written(bench):
    pytest.importorskip("matplotlib")
    out, _ = bench
    data = (out / "bench.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"


def test_summary_table(bench, tmp_path):
    from remat.bench.compare import write_summary

    out, _ = bench
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "bench.json").write_text((out / "bench.json").read_text())
    text = write_summary(tmp_path).read_text()
    assert "[tiny](tiny/bench.md)" in text and "tiny-llama ctx 64" in text


@pytest.fixture(scope="module")
def walk_bench():
    return run_bench("tiny-llama", ctx=64, steps=2, path="walk", ubatch=16, progress=False)


def test_walk_six_variants(walk_bench):
    result = walk_bench
    assert [v["variant"] for v in result["variants"]] == [*VARIANTS, *WALK_VARIANTS]
    assert (result["path"], result["walk"], result["lora"]) == ("walk", "exact", None)
    by = {v["variant"]: v for v in result["variants"]}
    assert "exact walk" in by["remat_on"]["loss"] and "truncated walk" in by["remat_on_truncated"]["loss"]
    assert "walk" not in by["remat_on_window"]["loss"]
    for name in WALK_VARIANTS:
        assert by[name]["planned_graph"] > 0 and by[name]["measured_peak"] > 0 and len(by[name]["losses"]) == 2
    assert {"memory_on_over_window_on", "time_on_over_truncated"} <= set(result["ratios"])
    assert {"walk_peak_le_window_on", "peak_on_le_checkpoint", "walk_time_le_1.5x_truncated",
            "walk_losses_match_window"} <= set(result["targets"])


def test_exact_walk_losses_match_window(walk_bench):
    by = {v["variant"]: v for v in walk_bench["variants"]}
    for x, y in zip(by["remat_on"]["losses"], by["remat_on_window"]["losses"], strict=True):
        assert abs(x - y) <= 1e-5 * abs(y)
    assert walk_bench["loss_equality"]["walk_losses_match_window"] is True
    assert walk_bench["targets"]["walk_losses_match_window"] is True
    assert walk_bench["loss_equality"]["on_equals_off_bitwise"] is True  # A and B both run the exact walk
    # the truncated walk: the same forward on the first step, another gradient after it
    assert by["remat_on_truncated"]["losses"][0] == by["remat_on"]["losses"][0]


def test_walk_markdown_and_summary(walk_bench, tmp_path):
    from remat.bench.compare import markdown, write_outputs, write_summary

    text = markdown(walk_bench)
    for name in (*VARIANTS, *WALK_VARIANTS):
        assert f"`{name}`" in text
    assert "exact walk" in text and "full" in text and "later losses differ" in text
    write_outputs(walk_bench, tmp_path / "walk")
    summary = write_summary(tmp_path).read_text()
    assert "[walk](walk/bench.md)" in summary and "`remat_on_window`" in summary


def test_lora_trains_the_adapter_only():
    result = run_bench("tiny-llama", ctx=64, steps=2, lora=True, progress=False)
    assert result["lora"] == 8
    counts = {v["trainable_parameters"] for v in result["variants"]}
    assert len(counts) == 1  # every variant trains the same adapter
    assert 0 < counts.pop() < result["parameters"]
    by = {v["variant"]: v for v in result["variants"]}
    assert by["remat_on"]["losses"] == by["remat_off"]["losses"]  # the same adapter init
    from remat.bench.compare import markdown

    assert "LoRA r8" in markdown(result)


def test_steps_below_two_refused():
    from remat.base.settings import UsageError

    with pytest.raises(UsageError, match="at least 2"):
        run_bench("tiny-llama", ctx=16, steps=1, progress=False)


def test_cli_lora_flag():
    from remat.cli import parser

    assert parser().parse_args(["bench"]).lora is False  # the bench's default: full fine-tuning
    args = parser().parse_args(["bench", "--lora", "--path", "walk", "--walk", "truncated"])
    assert (args.lora, args.path, args.walk) == (True, "walk", "truncated")


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="resident pages are read from Linux's pagemap")
def test_resident_bytes_are_the_pages_the_process_holds(tmp_path):
    """What `resident_bytes` counts of a tensor follows the process's resident set: of a file mapped lazily (as
    safetensors' weights are), the pages read, not those the page cache holds; of an allocation, the pages
    written. The trainer takes it off the resident set after loading: what is left is the tokenizer's and the
    loader's (`runtime`)."""
    import os

    import torch

    from remat.core.process import resident, resident_bytes

    mib = 1 << 20
    path = tmp_path / "weights"
    path.write_bytes(os.urandom(32 * mib))  # in the page cache now
    mapped = torch.from_file(str(path), size=32 * mib, dtype=torch.uint8)
    assert resident_bytes([mapped]) < mib
    torch.zeros(8 * mib, dtype=torch.uint8)[-mib:].sum()  # the sum's own first-use memory (threads), before
    before = resident()
    assert mapped[: 8 * mib].sum() > 0  # read
    grown, held = resident() - before, resident_bytes([mapped])
    assert 8 * mib <= held < 9 * mib and abs(grown - held) < mib, (grown, held)
    made = torch.empty(16 * mib, dtype=torch.uint8)
    made[: 4 * mib] = 1
    assert 4 * mib <= resident_bytes([made, made[5:]]) < 5 * mib  # a storage once, however many views


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="the process peak reads Linux's VmHWM")
def test_process_peak_measures_the_step_not_the_heap_before():
    """Two variants interleaved in one process, as the bench runs them: eager, whose step frees ~25 MiB,
    much of it heap (tensors under the 1 MiB mmap threshold), then per-layer checkpointing, whose step takes
    that heap again. Each timed step's process peak above its start is at least half of what its forward and
    backward allocate (the warm-up's measured peak). Read from an untrimmed heap, the checkpointed step grew
    the resident set by next to nothing (0-2 MiB of its 11.7)."""
    import copy

    import torch

    from remat.bench import compare as bench
    from remat.core.process import reuse_freed_memory
    from remat.models import load as models

    reuse_freed_memory()  # as run_bench does
    base = models.load_model("tiny-llama", seed=0).model
    variants = [bench.eager_variant("eager", base, False),
                bench.eager_variant("torch_checkpoint", copy.deepcopy(base), True)]
    for v in variants:
        v.optimizer = torch.optim.AdamW(v.params, lr=1e-4)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # seconds, where 2 threads on 2 busy cores spin for minutes
    try:
        for i, (input_ids, labels) in enumerate(bench.random_batches(259, batch=4, ctx=512, steps=3)):
            for v in variants:
                bench.run_step(v, input_ids, labels, torch.device("cpu"), warm_up=i == 0)
    finally:
        torch.set_num_threads(threads)
    for v in variants:
        assert v.measured_peak is not None and v.measured_peak > 8 * 2**20
        assert len(v.process_peaks) == 2 and len(v.seconds) == len(v.losses) == 3
        assert min(v.process_peaks) >= v.measured_peak / 2, (v.name, v.process_peaks, v.measured_peak)


def test_precision_bench_files_are_its_runs_and_its_as_filed_commit_is_here():
    """The committed precision bench (`python -m remat.bench.precision`): its summary and Markdown are what its raw
    runs give (neither edited by hand), its float32 variants' losses one sequence, and the commit it runs as filed is
    in this repository's history (a worktree of it can be made)."""
    from remat.bench import peers, precision

    res = json.loads((precision.OUT / "bench.json").read_text())
    assert precision.summary(res["runs"]) == res["summary"]
    assert (precision.OUT / "bench.md").read_text() == precision.markdown(res)
    assert precision.same_losses(res["runs"]) and res["same_losses"]
    assert {r["variant"] for rnd in res["runs"] for r in rnd} == set(precision.VARIANTS)
    subprocess.run(["git", "-C", str(peers.ROOT), "cat-file", "-e", f"{precision.AS_FILED}^{{commit}}"], check=True)
