"""``python -m ditron_ops.bench``: the quick collectives bench writes a CSV and a PNG."""
import csv

import pytest
import torch

from ditron_ops.bench import LAYER_CONFIGS, local_gemm_shape
from ditron_ops.bench.__main__ import main
from ditron_ops.bench.harness import Result, read_csv
from ditron_ops.bench.plots import draw, footer, plan_panels


def test_list_names_the_registered_benches(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "collectives" in out and "overhead" in out


def test_local_gemm_shape():
    assert local_gemm_shape("LLaMA-3.1-70B") == (8192, 28672 // 8, 8192)
    assert len(LAYER_CONFIGS) == 7
    with pytest.raises(ValueError, match="unknown model"):
        local_gemm_shape("nope")


def _row(case, w, ratio, model="", shape="", impl="ours", baseline="base"):
    return Result("b", case, w, "bf16", impl, 1.0, baseline, ratio, shape=shape, model=model)


def test_plan_bars_per_model_or_per_case():
    """Cases with a row per model shape: a bar group per model (geo-mean last) and a bar per case;
    otherwise a group per case and a bar per world size; shared label words go to the note."""
    per_model = [_row(c, 1, r, m, s) for c, m, s, r in [
        ("P1 a", "M1", "8x8x8", 0.9), ("P1 a", "M2", "8x16x8", 1.1), ("P1 a", "", "geo-mean", 1.0),
        ("P1 b", "M1", "8x8x8", 0.8), ("P1 b", "M2", "8x16x8", 0.7), ("P1 b", "", "geo-mean", 0.75)]]
    [pan] = plan_panels(per_model)
    assert pan.kind == "bars" and pan.xs == ["M1", "M2", "geo-mean"]
    assert pan.series == {"a": [(0, 0.9), (1, 1.1), (2, 1.0)], "b": [(0, 0.8), (1, 0.7), (2, 0.75)]}
    assert pan.note == "P1 W=1"

    two_sizes = [_row(c, w, r) for c, w, r in [("local S=8192", 2, 0.5), ("local S=32768", 2, 0.9),
                                               ("local S=8192", 4, 0.6)]]
    [pan] = plan_panels(two_sizes)  # two values are a comparison, not a sweep
    assert pan.kind == "bars" and pan.xs == ["S=8192", "S=32768"]
    assert pan.series == {"W=2": [(0, 0.5), (1, 0.9)], "W=4": [(0, 0.6)]}


def test_plan_sweep_and_model_layers_split():
    """An M sweep (>= 3 values on one line) is a lines panel; the model layers beside it are a
    bars panel that also holds the sweep's row at their common M; byte sizes sweep too."""
    rows = [_row(f"op {m} M=8192", 2, r, m) for m, r in [("A", 1.2), ("B", 1.0), ("C", 1.1)]]
    rows += [_row(f"op C M={n}", 2, r, "C") for n, r in [(128, 0.4), (512, 0.9)]]
    bars, lines = plan_panels(rows)
    assert bars.kind == "bars" and bars.xs == ["A", "B", "C"] and bars.note == "op M=8192 W=2"
    assert lines.kind == "lines" and lines.xlabel == "M (rows)" and lines.xs == [128, 512, 8192]
    assert lines.series == {"": [(128, 0.4), (512, 0.9), (8192, 1.1)]}

    sizes = [_row(c, w, 1.0 + w / 10) for w in (1, 8) for c in ("4KiB", "16KiB", "1MiB")]
    [pan] = plan_panels(sizes)
    assert pan.kind == "lines" and pan.xs == [4096, 16384, 1 << 20] and list(pan.series) == ["W=1", "W=8"]

    kv = [_row(f"B={b} KV={k}", 1, 1.0) for b in (1, 8, 64) for k in (4096, 32768, 131072)]
    [pan] = plan_panels(kv)  # as many B as KV values: the label's last (the inner loop) is x
    assert pan.xlabel == "KV length" and list(pan.series) == ["B=1", "B=8", "B=64"]


def test_plan_merges_single_bars():
    """One bar per impl where each impl has a single case (overhead); one op's single-series
    variants share a panel (moe dispatch det/default)."""
    one_each = [_row("W=1", 1, r, impl=i) for i, r in [("ag_gemm", 0.5), ("all_gather", 0.7)]]
    [pan] = plan_panels(one_each)
    assert pan.xs == ["ag_gemm", "all_gather"] and pan.series == {"": [(0, 0.5), (1, 0.7)]}
    variants = [_row(c, 8, 2.0, impl=i) for i in ("dispatch det", "dispatch default")
                for c in ("T=128 bf16", "T=4096 bf16")]
    [pan] = plan_panels(variants)
    assert pan.impl == "dispatch" and list(pan.series) == ["det", "default"]


def test_figure_sweep_log2_lines_categorical_bars_linear_ratio():
    """The drawn figure: a sweep panel has a log2 x axis with plain ticks and no bars, a
    categorical panel bars; both ratio axes are linear with plain tick labels; footer present."""
    pytest.importorskip("matplotlib")
    from matplotlib.container import BarContainer

    rows = [_row(f"op {m} M=8192", 2, r, m) for m, r in [("A", 1.2), ("B", 1.0), ("C", 1.1)]]
    rows += [_row(f"op C M={n}", 2, r, "C") for n, r in [(128, 0.4), (1024, 0.9)]]
    machine = {"device_name": "GPU X", "torch": "2.0", "triton": "3.0", "git_commit": "abc1234"}
    fig = draw(plan_panels(rows), "title", footer(machine))
    bars_ax, lines_ax = fig.axes[:2]
    fig.canvas.draw()
    assert any(isinstance(c, BarContainer) for c in bars_ax.containers)
    assert lines_ax.get_xscale() == "log" and lines_ax.xaxis.get_transform().base == 2
    assert not lines_ax.containers and lines_ax.get_lines()
    assert [t.get_text() for t in lines_ax.get_xticklabels()] == ["128", "1k", "8k"]
    for ax in (bars_ax, lines_ax):
        assert ax.get_yscale() == "linear"
        labels = [t.get_text() for t in ax.get_yticklabels()]
        assert labels and not any("$" in t or "e" in t for t in labels), labels
        assert any(line.get_ydata()[0] == 1.0 for line in ax.get_lines())  # the 1.0 line
    assert "abc1234" in fig.get_supxlabel() and "GPU X" in fig.get_supxlabel()


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


def test_gemm_sweep_shapes_follow_the_rule():
    """Issue 20's sweep: at least 40 distinct seeded shapes in the ranges, each at least 8 GFLOP,
    with N off the multiples of 128 and K off the multiples of 64 among them, rows of 16 bytes."""
    from ditron_ops.bench.gemm_sweep import MIN_GFLOP, RANGES, sweep_shapes

    shapes = sweep_shapes()
    assert len(set(shapes)) == len(shapes) >= 40 and shapes == sweep_shapes()  # seeded
    for dim, (lo, hi) in zip("mnk", RANGES.values()):
        values = [s["mnk".index(dim)] for s in shapes]
        assert lo <= min(values) and max(values) <= hi, dim
    assert all(2 * m * n * k >= MIN_GFLOP * 1e9 and n % 8 == 0 and k % 8 == 0 for m, n, k in shapes)
    assert sum(n % 128 != 0 for _, n, _ in shapes) >= 8 and sum(k % 64 != 0 for *_, k in shapes) >= 8


def test_gemm_sweep_quick_writes_rows(tmp_path):
    import csv

    from ditron_ops.bench.__main__ import main

    assert main(["gemm_sweep", "--quick", "--rounds", "1", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(next(tmp_path.glob("gemm_sweep-*.csv")))))
    shapes = [r for r in rows if r["shape"] != "geo-mean"]
    assert [r["case"] for r in shapes] == ["sweep fp16"] * 3 + ["models fp16"]
    assert all(float(r["rel_err"]) < 1e-2 for r in shapes)
    assert {r["case"] for r in rows if r["shape"] == "geo-mean"} == {"sweep fp16", "models fp16"}
    assert all(r["split_k"] == "1" for r in shapes)  # the K slices the rule ran (the interpreter: 1)


def test_gemm_models_sets_follow_the_rule():
    """The ``models`` set: tensor-parallel shards (TP 2/4/8) of at least 8 public model configs
    of different families, M seeded in [256, 16384] with values off the multiples of 128; the
    ``deterministic`` set: model shards at every M of the issue's list."""
    from ditron_ops.bench.gemm_sweep import (DETERMINISTIC_M, MODELS_M, deterministic_shapes,
                                             models_shapes)
    from ditron_ops.bench.shapes import MODEL_CONFIGS, tp_shards

    shapes = models_shapes()
    assert shapes == models_shapes() and len(shapes) >= 40  # seeded
    models = {name.split(" tp")[0] for name in shapes.values()}
    assert len(models) >= 8 and models <= set(MODEL_CONFIGS)
    assert {name.split()[-2] for name in shapes.values()} == {"tp2", "tp4", "tp8"}
    shards = tp_shards()
    assert all((n, k) in shards and MODELS_M[0] <= m <= MODELS_M[1] and k % 8 == 0
               for m, n, k in shapes)
    assert sum(m % 128 != 0 for m, _, _ in shapes) >= 8
    det = deterministic_shapes()
    assert sorted({m for m, _, _ in det}) == sorted(DETERMINISTIC_M)
    assert all((n, k) in shards for _, n, k in det) and len({(n, k) for _, n, k in det}) >= 5


def test_model_shards_split_the_layers():
    """A shard's (N, K) at TP t: QKV and gate/up split N, O and down split K."""
    from ditron_ops.bench.shapes import MODEL_CONFIGS

    llama = MODEL_CONFIGS["Llama-3-70B"]
    assert llama.shards(8) == {"qkv": (1280, 8192), "o": (8192, 1024),
                               "gate_up": (7168, 8192), "down": (8192, 3584)}
    assert MODEL_CONFIGS["Qwen2.5-7B"].shards(8) == {}  # 28 heads do not split over 8


def test_overhead_quick_pairs_rounds(tmp_path):
    """The overhead bench's paired rounds: one row per op with the median paired ratio."""
    import csv

    from ditron_ops.bench.__main__ import main

    assert main(["overhead", "--quick", "--rounds", "2", "--dtype", "fp32", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(next(tmp_path.glob("overhead-*.csv")))))
    assert len(rows) == 10 and all(float(r["host_ratio_vs_matmul"]) > 0 for r in rows)
    assert {r["impl"] for r in rows} >= {"ag_gemm/fused", "all_reduce", "flash_decode"}


def test_serving_quick_runs_both_parts(tmp_path):
    """``bench serving --quick`` (the interpreter, bf16 asked: run in fp32): the paged decode
    rows and the fused-norm rows in one CSV, every time positive."""
    import csv

    from ditron_ops.bench.__main__ import main

    assert main(["serving", "--quick", "--rounds", "1", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(next(tmp_path.glob("serving-*.csv")))))
    parts = {r["case"].split()[0] for r in rows}
    assert parts == {"paged", "norm"} and all(float(r["time_us"]) > 0 for r in rows)


def test_fp8_quick_rows_of_every_part(tmp_path):
    """``bench fp8 --quick`` (the interpreter's one tiny shape): rows of the three modes and of
    both fused ops' overhead (``fused``: ag_gemm_scaled, ``fused_rs``: gemm_rs_scaled), with
    the gathered bytes; a geo-mean per case."""
    import csv

    from ditron_ops.bench.__main__ import main

    assert main(["fp8", "--quick", "--rounds", "1", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(next(tmp_path.glob("fp8-*.csv")))))
    cases = {r["case"] for r in rows}
    assert cases == {f"{p}{m}" for p in ("", "fused ", "fused_rs ")
                     for m in ("tensor", "row", "block")}, cases
    assert all(float(r["time_us"]) > 0 for r in rows)
    assert all(int(r["gathered_bytes"]) > 0 for r in rows
               if r["case"].startswith("fused ") and r["shape"] != "geo-mean")


def test_fp8_quick_present_rows(tmp_path):
    """``bench fp8 --only present`` (the interpreter: the portable waiting consumer only): a row
    per mode, the consumer over packed rows with every chunk present giving the scaled core's
    product (fp16 C: the interpreter's bf16 arithmetic is off)."""
    import csv

    from ditron_ops.bench.__main__ import main

    assert main(["fp8", "--quick", "--only", "present", "--rounds", "1",
                 "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(next(tmp_path.glob("fp8-*.csv")))))
    rows = [r for r in rows if r["shape"] != "geo-mean"]
    assert {r["case"] for r in rows} == {f"present {m}" for m in ("tensor", "row", "block")}
    assert all(float(r["rel_err"]) < 1e-2 for r in rows), rows
