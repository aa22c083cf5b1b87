"""`remat bench`: four variants side by side on a tiny model; files and schema."""

from __future__ import annotations

import json

import pytest

from remat.bench import VARIANTS, run_bench


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
    from remat.bench import write_summary

    out, _ = bench
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "bench.json").write_text((out / "bench.json").read_text())
    text = write_summary(tmp_path).read_text()
    assert "[tiny](tiny/bench.md)" in text and "tiny-llama ctx 64" in text


def test_steps_below_two_refused():
    from remat.settings import UsageError

    with pytest.raises(UsageError, match="at least 2"):
        run_bench("tiny-llama", ctx=16, steps=1, progress=False)
