"""``python -m ditron_ops.bench``: the quick collectives bench writes a CSV and a PNG."""
import csv

import pytest
import torch

from ditron_ops.bench import LAYER_CONFIGS, local_gemm_shape
from ditron_ops.bench.__main__ import main
from ditron_ops.bench.harness import Result, _plot_series, read_csv


def test_list_names_the_registered_benches(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "collectives" in out and "overhead" in out


def test_local_gemm_shape():
    assert local_gemm_shape("LLaMA-3.1-70B") == (8192, 28672 // 8, 8192)
    assert len(LAYER_CONFIGS) == 7
    with pytest.raises(ValueError, match="unknown model"):
        local_gemm_shape("nope")


def test_plot_series_per_case_or_per_model():
    """A panel whose cases have a row per model shape plots a line per case over the models
    (geo-mean last); otherwise a line per world size over the cases."""
    def row(case, w, model, shape, ratio):
        return Result("b", case, w, "bf16", "ours", 1.0, "base", ratio, shape=shape, model=model)

    per_model = [row(c, 1, m, s, r) for c, m, s, r in [
        ("P1 a", "M1", "8x8x8", 0.9), ("P1 a", "M2", "8x16x8", 1.1), ("P1 a", "", "geo-mean", 1.0),
        ("P1 b", "M1", "8x8x8", 0.8), ("P1 b", "M2", "8x16x8", 0.7), ("P1 b", "", "geo-mean", 0.75)]]
    xs, series = _plot_series(per_model)
    assert xs == ["M1", "M2", "geo-mean"]
    assert series == {"P1 a": [(0, 0.9), (1, 1.1), (2, 1.0)], "P1 b": [(0, 0.8), (1, 0.7), (2, 0.75)]}

    per_case = [row(c, w, "", "", r) for c, w, r in [("M=128", 2, 0.5), ("M=512", 2, 0.9),
                                                      ("M=128", 4, 0.6)]]
    xs, series = _plot_series(per_case)
    assert xs == ["M=128", "M=512"]
    assert series == {"W=2": [(0, 0.5), (1, 0.9)], "W=4": [(0, 0.6)]}


def test_quick_collectives_writes_csv_and_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    argv = ["collectives", "--quick", "--world-sizes", "2", "--dtype", "fp32", "--out", str(tmp_path)]
    assert main(argv) == 0
    csvs = list(tmp_path.glob("collectives-fp32-*-quick.csv"))
    assert len(csvs) == 1
    with open(csvs[0], newline="") as fh:
        rows = list(csv.DictReader(fh))
    ops = {"all_gather", "reduce_scatter", "all_reduce/one_shot", "all_reduce/two_shot"}
    assert {r["impl"] for r in rows} == ops
    assert len(rows) == 3 * len(ops)  # three quick cases
    for r in rows:
        assert r["world_size"] == "2" and r["dtype"] == "fp32"
        assert float(r["time_us"]) > 0 and float(r["baseline_us"]) > 0 and float(r["ratio"]) > 0
        assert float(r["max_abs_err"]) < 1e-4
        assert r["baseline"] == "torch reference (virtual world)"
        assert r["torch"] and r["triton"] and r["timestamp"] and r["git_commit"]
    png = csvs[0].with_suffix(".png")
    assert png.exists() and png.stat().st_size > 0
    assert "all_reduce/two_shot" in capsys.readouterr().out

    # the CSV reads back into the same results, and ``plot`` redraws the PNG from it
    results, machine = read_csv(csvs[0])
    assert [(r.impl, r.case, r.world_size) for r in results] == [
        (r["impl"], r["case"], int(r["world_size"])) for r in rows]
    for r, row in zip(results, rows):
        assert r.ratio == pytest.approx(float(row["ratio"]), rel=1e-3)
        assert r.extra["max_abs_err"] == row["max_abs_err"]
    assert machine["git_commit"] == rows[0]["git_commit"]
    png.unlink()
    assert main(["plot", str(csvs[0])]) == 0
    assert png.exists() and png.stat().st_size > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tier (gloo processes)")
def test_tp_bench_under_torchrun_gloo(tmp_path):
    """The multi-GPU bench runs end to end under torchrun (2 CPU processes, torch backend over
    gloo, tiny shapes) and rank 0 alone writes the per-world-size CSV."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "ditron_ops.bench", "tp", "--quick", "--dtype", "fp32", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[:4000]}"
    rows = list(csv.DictReader(open(tmp_path / "tp-w2-fp32-cpu-quick.csv")))
    assert [r["case"].split()[0] for r in rows] == ["ag_gemm", "gemm_rs", "gemm_ar", "flash_decode"]
    assert all(r["world_size"] == "2" and float(r["time_us"]) > 0 for r in rows)
