"""The benches against remat's peers: their fits, rows and parsing (no timing), and the Hugging Face side's model."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from remat.bench import llama_cpp, peers, train_peers
from remat.bench.longest_report import (
    GiB,
    MiB,
    anchored,
    cell,
    confirmations,
    fit,
    floor_bytes,
    longest,
    max_context,
    parameter_count,
    piecewise_longest,
    predict,
    ratio,
    rows,
    side_row,
)
from tiny_gguf import write


def test_fit_line_through_two_windows_and_its_longest_window():
    coef = fit([(1000, 3 * GiB), (2000, 4 * GiB)])
    assert coef == pytest.approx([2 * GiB, GiB / 1000])
    assert longest(coef, 8 * GiB) == pytest.approx(6000)
    assert predict(coef, 6000) == pytest.approx(8 * GiB)
    assert longest(coef, GiB) == 0.0  # the intercept alone is over the budget


def test_fit_parabola_from_three_windows_never_bends_down():
    pts = [(n, 100 + 2 * n + 0.01 * n * n) for n in (100, 200, 400)]
    coef = fit(pts)
    assert coef == pytest.approx([100, 2, 0.01])
    assert predict(coef, longest(coef, 10_000)) == pytest.approx(10_000)
    concave = [(100, 100), (200, 190), (400, 300)]
    assert len(fit(concave) or []) == 2  # bending down would promise windows no run showed: the line
    assert fit([(100, 1)]) is None and fit([(100, 1), (100, 2)]) is None


def test_a_peak_that_does_not_grow_is_unbounded():
    assert longest([GiB, 0.0], 2 * GiB) == math.inf
    assert longest([3 * GiB, -1.0], 2 * GiB) == 0.0


def test_piecewise_curve_and_plans_anchored_on_measured_peaks():
    plans = {1000: 100, 2000: 200, 4000: 400}
    curve = anchored(plans, [(1000, 150), (2000, 260)])  # gaps 50 and 60: the median of two is the upper one
    assert curve == [(1000, 160), (2000, 260), (4000, 460)]
    assert piecewise_longest(curve, 360) == pytest.approx(3000)
    assert piecewise_longest(curve, 660) == pytest.approx(6000)  # past the last plan: its last segment goes on
    assert piecewise_longest(curve, 100) == 0.0
    assert anchored(plans, []) is None and anchored({1000: 1}, [(1000, 2)]) is None
    assert anchored(plans, [], offset=7) == [(1000, 107), (2000, 207), (4000, 407)]  # another model's runs


def test_side_row_statuses():
    assert side_row(9000.0, 4 * GiB, 5 * GiB, 8192, {})["status"] == "weights"
    assert side_row(None, 4 * GiB, GiB, 8192, {})["status"] == "unmeasured"
    capped = side_row(math.inf, 4 * GiB, GiB, 8192, {8192: 3 * GiB})
    assert (capped["status"], capped["window"], capped["confirmed"]) == ("capped", 8192, True)
    found = side_row(5000.7, 4 * GiB, GiB, 8192, {5000: 5 * GiB})
    assert (found["status"], found["window"], found["confirmed"]) == ("fit", 5000, False)
    assert "over the budget" in cell(found)
    assert side_row(0.4, 4 * GiB, GiB, 8192, {})["status"] == "none"
    assert "weights do not fit" in cell(side_row(1.0, GiB, 2 * GiB, 8192, {}))


def test_ratio_says_how_to_read_it():
    fit_ = {"status": "fit", "window": 1000}
    assert ratio({"status": "fit", "window": 3000}, fit_) == (3.0, "exact")
    assert ratio({"status": "capped", "window": 8192}, {"status": "fit", "window": 4096}) == (
        2.0, "at least (remat capped)")
    assert ratio({"status": "fit", "window": 3000}, {"status": "weights", "window": None}) == (
        None, "HF fits no window")
    assert ratio({"status": "weights", "window": None}, {"status": "weights", "window": None}) == (None, "")


def test_full_fine_tuning_floor_counts_grads_and_both_moments():
    assert floor_bytes(10, "hf", "full") == 160 and floor_bytes(10, "remat", "lora") == 40
    assert floor_bytes(10, "blocks", "lora", frozen=7) == 7  # the blocks' bytes, as the side's plans hold them


def test_the_float32_side_reads_a_float32_copy_of_the_gguf_with_transformers_values(tmp_path):
    """remat's float32 side trains on a GGUF that gguf-py dequantized: remat holds it as float32 weights (nothing
    quantized kept) whose values are the ones transformers loads from the quantized file (the Hugging Face side)."""
    import torch

    from remat.models.load import load_model

    src = write(tmp_path / "tiny.gguf")
    copy = llama_cpp.float32_gguf(src, tmp_path / "tiny.f32.gguf")
    as_stored = dict(load_model(str(copy)).model.named_parameters())
    hf = dict(load_model(str(src), as_stored=False).model.named_parameters())
    quantized = dict(load_model(str(src)).model.named_parameters())
    assert any(p.dtype != torch.float32 for p in quantized.values())  # held as blocks: the check can fail
    assert as_stored.keys() == hf.keys()
    assert all(p.dtype == torch.float32 and torch.equal(p, hf[k]) for k, p in as_stored.items())


@dataclass(frozen=True)
class _Case:
    label: str
    spec: str | None
    confirm_max: int


def _run(side: str, mode: str, ctx: int, purpose: str, peak: int | None = None, planned: int | None = None) -> dict:
    return {"model": "tiny", "side": side, "mode": mode, "ctx": ctx, "purpose": purpose, "peak_rss": peak,
            "planned_total": planned, "seconds": 1.0}


def test_rows_from_runs_cap_fit_and_weights():
    case = _Case("tiny", "tiny-llama", 4096)
    n, cap = parameter_count("tiny-llama"), max_context("tiny-llama")
    assert 0 < n * 4 < GiB  # the whole tiny model is far under every budget
    runs = [_run("remat", "lora", 64, "plan", planned=10 * MiB), _run("remat", "lora", 128, "plan", planned=11 * MiB),
            _run("remat", "lora", 64, "fit", 300 * MiB), _run("remat", "lora", 128, "fit", 301 * MiB),
            _run("hf", "lora", 64, "fit", 300 * MiB), _run("hf", "lora", 128, "fit", 300 * MiB + 64 * MiB)]
    got = {r["budget_gib"]: r for r in rows([case], runs, (1, 4), 2.0) if r["mode"] == "lora"}
    one = got[1]
    hf_window = int((GiB - 236 * MiB) / MiB)  # 1 MiB a token from 236 MiB at 0
    assert one["hf"]["status"] == "fit" and one["hf"]["window"] == pytest.approx(hf_window, abs=1)
    expect = "capped" if cap <= one["remat"]["fit_window"] else "fit"
    assert one["remat"]["status"] == expect
    assert one["target_met"] in (True, None)
    full = next(r for r in rows([case], runs, (1,), 2.0) if r["mode"] == "full")
    assert full["hf"]["status"] == "unmeasured" and full["ratio"] is None
    wanted = confirmations([case], runs, (1, 4))
    assert all(w <= case.confirm_max for *_, w in wanted) and len({t[1:] for t in wanted}) == len(wanted)


def test_rows_give_the_blocks_side_with_lora_its_own_floor_and_ratio():
    case = _Case("tiny", "tiny-llama", 4096)
    lora = [_run(side, "lora", ctx, purpose, peak, planned) for side, frozen in (("remat", 0), ("blocks", 0))
            for ctx, purpose, peak, planned in ((64, "plan", None, 10 * MiB), (128, "plan", None, 11 * MiB),
                                                (64, "fit", 300 * MiB, None), (128, "fit", 301 * MiB, None))]
    lora = [r | {"planned_frozen": 2 * GiB} if r["side"] == "blocks" and r["purpose"] == "plan" else r for r in lora]
    runs = lora + [_run("hf", "lora", 64, "fit", 300 * MiB), _run("hf", "lora", 128, "fit", 364 * MiB)]
    got = {(r["mode"], r["budget_gib"]): r for r in rows([case], runs, (1, 4), 2.0)}
    assert "blocks" not in got["full", 1]  # full fine-tuning trains float32 copies: no blocks side
    assert got["lora", 1]["blocks"]["status"] == "weights"  # its plans' frozen bytes (2 GiB) alone exceed 1 GiB
    assert got["lora", 1]["blocks_ratio"] is None and got["lora", 1]["remat"]["status"] in ("fit", "capped")
    four = got["lora", 4]
    assert four["blocks"]["window"] == four["remat"]["window"] and four["blocks_ratio"] == four["ratio"]


def test_llama_progress_is_read_after_the_warm_up_window():
    err = ("train: [█ ] data=0000001/0000003 loss=5.5±nan acc=4.30±0.90% t=00:01:56 ETA=00:03:53 \r"
           "noise\ntrain: [██] data=0000002/0000003 loss=5.4±0.1 acc=3.71±0.59% t=00:03:26 ETA=00:01:44 \r"
           "train: [███] data=0000003/0000003 loss=5.3±0.1 acc=4.43±0.53% t=00:04:56 ETA=00:00:00 \n")
    rate, windows, losses = llama_cpp.tokens_per_second(err, 512)
    assert rate == pytest.approx(2 * 512 / 180) and windows == 3 and losses == [5.5, 5.4, 5.3]
    assert llama_cpp.tokens_per_second("no progress", 512) == (None, 0, [])
    two = err + err.replace("t=00:0", "t=00:1")  # a second epoch: its clock starts again
    assert llama_cpp.tokens_per_second(two, 512)[:2] == (pytest.approx(4 * 512 / 360), 6)


def test_throughput_ratios_are_paired_by_round():
    rounds = [[{"side": "remat", "tokens_per_second": 10.0, "peak_rss": 3}, {"side": "llama.cpp",
               "tokens_per_second": 5.0, "peak_rss": 4}, {"side": "hf", "tokens_per_second": 8.0, "peak_rss": 5}],
              [{"side": "hf", "tokens_per_second": 2.0, "peak_rss": 6}, {"side": "remat", "tokens_per_second": 4.0,
               "peak_rss": 2}, {"side": "llama.cpp", "tokens_per_second": None, "peak_rss": None}]]
    s = train_peers.summary(rounds)
    assert s["remat_over_llama.cpp"] == {"per_round": [2.0], "median": 2.0}
    assert s["remat_over_hf"]["per_round"] == [1.25, 2.0]
    assert s["remat"]["peak_rss"] == 3 and s["hf"]["tokens_per_second"] == 5.0


def test_hf_fit_follows_the_training_phase_and_its_load_must_fit_too():
    case = _Case("tiny", "tiny-llama", 0)
    runs = [_run("hf", "lora", 64, "fit", 900 * MiB) | {"train_peak_rss": 300 * MiB, "load_peak_rss": 900 * MiB},
            _run("hf", "lora", 128, "fit", 900 * MiB) | {"train_peak_rss": 364 * MiB, "load_peak_rss": 900 * MiB}]
    by = {r["budget_gib"]: r["hf"] for r in rows([case], runs, (1, 2), 2.0) if r["mode"] == "lora"}
    # the whole-process peaks are the load's, flat: the training peaks grow 1 MiB a token from 236 MiB
    assert by[1]["window"] == min(int((GiB - 236 * MiB) / MiB), max_context("tiny-llama"))  # the load fits 1 GiB
    assert by[2]["window"] == min(int((2 * GiB - 236 * MiB) / MiB), max_context("tiny-llama"))
    heavy = [r | {"load_peak_rss": 1100 * MiB} for r in runs]  # now loading alone peaks over 1 GiB
    one = next(r["hf"] for r in rows([case], heavy, (1,), 2.0) if r["mode"] == "lora")
    assert one["status"] == "none" and one["window"] == 0


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_hugging_face_side_trains_float32_weights_of_a_gguf(tmp_path, lora):
    """As transformers loads a GGUF: every weight float32 (remat's own default keeps the blocks, which once made
    this side train only the norms of SmolLM2, 35,136 parameters, against remat's 134.5 million)."""
    from remat.models.load import load_model

    got = peers.hf_train(str(write(tmp_path / "tiny.gguf")), 32, lora=lora, steps=1, lr=1e-4)
    model = load_model(str(tmp_path / "tiny.gguf"), as_stored=False).model
    every = sum(p.numel() for p in model.parameters())
    assert got["dtype"] == "torch.float32"
    assert (got["trainable_parameters"] == every) != lora and got["trainable_parameters"] > 0


def test_a_confirming_run_over_the_budget_moves_the_fit():
    case = _Case("tiny", "tiny-llama", 4096)
    fits = [_run("hf", "lora", 64, "fit", 300 * MiB), _run("hf", "lora", 128, "fit", 364 * MiB)]
    first = next(r["hf"] for r in rows([case], fits, (1,), 2.0) if r["mode"] == "lora")
    over = _run("hf", "lora", first["window"], "confirm", GiB + 100 * MiB) | {"budget": GiB}  # it promised more
    moved = next(r["hf"] for r in rows([case], [*fits, over], (1,), 2.0) if r["mode"] == "lora")
    assert moved["window"] < first["window"] and "confirmed" not in moved
    assert (case, "hf", "lora", moved["window"], 1) in confirmations([case], [*fits, over], (1,))  # run there next
    within = _run("hf", "lora", first["window"], "confirm", GiB - MiB) | {"budget": GiB}
    kept = next(r["hf"] for r in rows([case], [*fits, within], (1,), 2.0) if r["mode"] == "lora")
    assert kept["window"] == first["window"] and kept["confirmed"]  # a run within its budget leaves the fit
    held = _run("hf", "lora", first["window"] + 50, "confirm", GiB - MiB) | {"budget": GiB}
    longer = next(r["hf"] for r in rows([case], [*fits, over, held], (1,), 2.0) if r["mode"] == "lora")
    assert longer["window"] == first["window"] + 50 and longer["confirmed"]  # a run held it: past any fit
