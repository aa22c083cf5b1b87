"""`remat bench --sweep`: every variant on a tiny model, remat bitwise equal to off, budgets kept; files."""

from __future__ import annotations

import json

import pytest

from remat.bench.sweep import NAMED, frontier, interpolated, remat_at, run_sweep

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    result = run_sweep("tiny-llama", ctx=64, steps=2, out=out, budget_points_n=5, progress=False)
    return out, result


def test_json_has_every_variant(sweep):
    out, result = sweep
    on_disk = json.loads((out / "bench.json").read_text())
    assert on_disk == json.loads(json.dumps(result))
    names = [v["variant"] for v in on_disk["variants"]]
    assert names[: len(NAMED)] == list(NAMED)
    kinds = [v["kind"] for v in on_disk["variants"]]
    assert kinds.count("torch_checkpoint") == 1
    budgets = [v for v in on_disk["variants"] if v["kind"] == "remat_budget"]
    assert len(budgets) + len(on_disk["refused"]) == len(on_disk["budgets"]) >= 5
    assert on_disk["halfway_budget"] in on_disk["budgets"]
    assert len(set(names)) == len(names)  # the halfway budget has its own name, also beside an evenly spaced one
    aot = [v["aot_budget"] for v in on_disk["variants"] if v["kind"] == "aot"]
    assert 1.0 in aot and len(aot) >= 2 and all(0 < x <= 1 for x in aot)
    for v in on_disk["variants"]:
        assert len(v["losses"]) == 2 and v["measured_peak"] > 0 and v["time_ratio"] > 0


def test_remat_bitwise_equal_off(sweep):
    _, result = sweep
    off = result["variants"][0]
    for v in result["variants"]:
        if v["kind"] in ("remat", "remat_budget"):
            assert [x.hex() for x in v["losses"]] == [x.hex() for x in off["losses"]], v["variant"]
            assert v["grad_max_abs_diff_vs_off"] == 0, v["variant"]
    assert result["targets"]["remat_losses_equal_off_bitwise"] is True


def test_budgets_kept_and_graph_measured_as_planned(sweep):
    _, result = sweep
    for v in result["variants"]:
        if v["kind"] == "remat_budget":
            assert v["planned_total"] <= v["budget"], v["variant"]
        if v["kind"] in ("remat", "remat_budget"):
            assert v["measured_graph"] == v["planned_graph"], v["variant"]
        else:
            assert v["planned_graph"] is None and v["measured_graph"] is None


def test_markdown_and_png_written(sweep):
    out, result = sweep
    text = (out / "bench.md").read_text()
    for v in result["variants"]:
        assert f"`{v['variant']}`" in text
    assert "(a)" in text and "(b)" in text and "(c)" in text
    pytest.importorskip("matplotlib")
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_frontier_and_remat_at():
    pts = [{"variant": n, "measured_peak": m, "time_ratio": t}
           for n, m, t in (("off", 10, 1.0), ("a", 6, 1.2), ("b", 7, 1.3), ("c", 4, 1.5))]
    assert [v["variant"] for v in frontier(pts)] == ["c", "a", "off"]
    assert remat_at(pts, 7)["variant"] == "a"
    assert remat_at(pts, 3) is None
    assert interpolated(frontier(pts), 5) == pytest.approx(1.35)
    assert interpolated(frontier(pts), 11) is None


def test_cli_sweep_flag():
    from remat.cli import parser

    assert parser().parse_args(["bench"]).sweep is False
    args = parser().parse_args(["bench", "--sweep", "--model", "tiny-qwen35", "--ctx", "512"])
    assert (args.sweep, args.model, args.ctx) == (True, "tiny-qwen35", 512)
