"""The soak (``tools/soak.py``, ``ditron_ops.testing.soak``) in the CPU interpreter: a quick run
of every op family passes and writes its CSV and JSON (the long run, marker ``slow``: 100 cycles);
a wrong result and memory growth after every shape was seen make it fail."""
import csv
import json

import pytest
import torch

from ditron_ops.testing import soak

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter tier")


@pytest.mark.parametrize("calls", [
    pytest.param(40, id="quick", marks=pytest.mark.timeout(120)),
    pytest.param(1200, id="long", marks=[pytest.mark.slow, pytest.mark.timeout(1800)])])
def test_soak_every_family_passes(tmp_path, capsys, calls):
    """Every family, cycle after cycle in one world: 4 cycles in the default run, 100 in the
    long run (marker ``slow``)."""
    assert soak.main(["--calls", str(calls), "--world-size", "2", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "soak_summary.json").read_text())
    assert summary["wrong"] == 0 and summary["calls"] >= calls
    assert summary["families"] == sorted(soak.FAMILIES)
    assert summary["cycles"] > summary["seen_after_cycle"] == soak.VARIANTS
    rows = list(csv.DictReader(open(tmp_path / "soak_cycles.csv")))
    assert len(rows) == summary["cycles"] and int(rows[-1]["calls"]) == summary["calls"]
    assert "soak: PASS" in capsys.readouterr().out


def test_wrong_result_and_stale_output_fail(tmp_path, monkeypatch):
    """An all_reduce that returns its first output again (stale: the cycles alternate input
    sets), and an all_gather whose output is off by one, are counted; the run exits 1."""
    real, gather, first = soak.all_reduce, soak.all_gather, {}

    def stale(x, group, **kw):
        return first.setdefault(group.rank, real(x, group, **kw))

    monkeypatch.setattr(soak, "all_reduce", stale)
    assert soak.main(["--calls", "4", "--world-size", "2", "--only", "all_reduce",
                      "--out", str(tmp_path)]) == 1
    summary = json.loads((tmp_path / "soak_summary.json").read_text())
    assert summary["wrong"] > 0 and all("all_reduce" in name for name in summary["wrong_by_case"])
    monkeypatch.setattr(soak, "all_gather", lambda x, group, **kw: gather(x, group, **kw) + 1)
    assert soak.main(["--calls", "3", "--world-size", "2", "--only", "all_gather",
                      "--out", str(tmp_path)]) == 1


def test_memory_growth_after_every_shape_was_seen(tmp_path, monkeypatch, capsys):
    """Allocated bytes that still grow after cycle ``VARIANTS`` fail the run (the records are
    faked here: a CPU has no device allocator); ``analyze`` finds the last growth."""
    records = iter([(100, 150), (120, 170), (120, 160), (130, 180)])
    monkeypatch.setattr(soak, "_record_memory", lambda group, high: next(records))
    assert soak.main(["--calls", "4", "--world-size", "2", "--only", "all_to_all",
                      "--out", str(tmp_path)]) == 1
    summary = json.loads((tmp_path / "soak_summary.json").read_text())
    assert summary["wrong"] == 0 and summary["memory_grew_after_seen"]
    assert summary["memory_stops_growing_after_cycle"] == 4 and summary["high_water_bytes"] == 180
    assert "GREW after every shape was seen" in capsys.readouterr().out
    assert soak.analyze([100, 120, 120, 110, 120], seen=2) == (2, False)
    assert soak.analyze([100, 100, 100], seen=2) == (1, False)
    assert soak.analyze([100, 120, 120, 121], seen=2) == (4, True)
    assert soak.analyze([100, 90, 95, 100, 101], seen=2) == (5, True)


def test_an_op_that_raises_exits_2(tmp_path, monkeypatch):
    def broken(*args, **kw):
        raise RuntimeError("broken op")

    monkeypatch.setattr(soak, "all_to_all", broken)
    assert soak.main(["--calls", "3", "--world-size", "2", "--only", "all_to_all",
                      "--out", str(tmp_path)]) == 2
    assert "broken op" in json.loads((tmp_path / "soak_summary.json").read_text())["error"]


def test_order_exact_references_use_the_batch_invariant_tiles(monkeypatch):
    """Deterministic gemm_rs / gemm_ar run batch-invariant tilings only, so the soak's and the
    fuzz programs' order-exact references must too: default mode's rule may pick another
    tiling (H200: 128x128/w4 for the soak's 2048 x 1024 case), whose bits may differ."""
    import ditron_ops
    from ditron_ops.testing import fuzz

    modes = []
    for mod in (soak, fuzz):
        real = mod.matmul

        def spy(*args, real=real, **kw):
            modes.append(kw.get("deterministic"))
            return real(*args, **kw)

        monkeypatch.setattr(mod, "matmul", spy)

    def body(group):
        a, b = torch.randn(40, 8), torch.randn(8, 16)
        return [torch.equal(soak._order_exact(a, b, group), fuzz._order_exact(a, b, group))]

    assert ditron_ops.launch(body, 1) == [[True]]
    assert modes == [True, True]
