"""GPU tier (H200): cold start (issue 25). A first all_reduce and a first ag_gemm in a fresh
process with an empty Triton cache work at W = 2 and W = 8 with a 2 s wait bound (peers do not
count a rank's compile time), compile a handful of variants (not every op's 166), and print
their times; ``precompile`` fills a cache that a later first call then only loads from."""
import difflib
import json
import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "cold_start.py")


def _first_call(case: str, world: int, cache: str) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=cache, DITRON_TIMEOUT_S="2",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, TOOL, "--child", case, str(world)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"\ncold start: {row}")
    return row


@pytest.mark.parametrize("world", [2, 8])
@pytest.mark.parametrize("case,most", [("all_reduce", 2), ("ag_gemm", 8)])
def test_first_call_with_an_empty_cache(case, most, world, tmp_path):
    row = _first_call(case, world, str(tmp_path))
    assert row["ok"], row
    # only this op's variants: all_reduce one (push_combine), ag_gemm its plan's few
    assert 1 <= row["compiled"] <= most, row
    assert row["second_s"] < row["first_s"], row


def test_precompile_then_a_first_call_compiles_from_the_cache():
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache,
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run([sys.executable, "-m", "ditron_ops", "precompile", "--ops",
                               "all_reduce", "ag_gemm", "--dtypes", "bf16", "fp32"], env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        print("\n" + proc.stdout.strip())
        assert "kernel variant(s) compiled" in proc.stdout
        assert "ditron: compiling kernels for precompile" in proc.stderr  # the progress line
        entries = len(os.listdir(cache))
        row = _first_call("all_reduce", 2, cache)
        assert row["ok"] and len(os.listdir(cache)) == entries, row  # nothing new on disk


def test_precompile_covers_a_first_fp8_call():
    """``precompile --dtypes fp8 bf16`` for the fp8 ops, then a first fused ``ag_gemm_scaled``
    (row scales, bias) and ``gemm_rs_scaled`` (block scales, rank 0's bias) at W = 2: nothing
    new on disk."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache,
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run([sys.executable, "-m", "ditron_ops", "precompile", "--ops",
                               "ag_gemm_scaled", "gemm_rs_scaled", "--dtypes", "fp8", "bf16"],
                              env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        print("\n" + proc.stdout.strip())
        before = set(os.listdir(cache))
        row = _first_call("fp8", 2, cache)
        new = [_entry(os.path.join(cache, d)) for d in set(os.listdir(cache)) - before]
        print(json.dumps({"missed": [e["name"] for e in new]}))
        for e in new:  # the missed variant's TTIR against the nearest precompiled one's
            same = [p for p in map(_entry, (os.path.join(cache, d) for d in before))
                    if p["name"] == e["name"]]
            best = max(same, key=lambda p: difflib.SequenceMatcher(
                None, p["text"], e["text"]).ratio(), default=None)
            if best is not None:
                diff = difflib.unified_diff(best["text"], e["text"], "precompiled", "missed",
                                            n=0, lineterm="")
                print("\n".join(list(diff)[:60]))
        assert row["ok"] and not new, row  # (the printout above names what precompile missed)


def _entry(path: str) -> dict:
    """A Triton cache entry's kernel name and TTIR signature (argument types, divisibility and
    constants: what the variant is keyed by)."""
    out = {"name": None, "func": "", "text": []}
    for f in sorted(os.listdir(path)):
        if f.endswith((".ttir", ".source")) and not out["func"]:
            out["name"] = f.rsplit(".", 1)[0]
            with open(os.path.join(path, f)) as fh:
                # (locations dropped: only the body's constants and ops tell variants apart)
                out["text"] = [re.sub(r" loc\((?:[^()]|\([^()]*\))*\)", "", ln).rstrip()
                               for ln in fh]
            out["func"] = next((ln.strip() for ln in out["text"] if "tt.func public" in ln), "")
        elif f.endswith(".json") and not f.startswith("__grp"):
            with open(os.path.join(path, f)) as fh:
                meta = json.load(fh)
            out["options"] = {k: v for k, v in sorted(meta.items()) if k not in ("hash", "name")}
    out["text"] += [f"option {k} {v}" for k, v in out.get("options", {}).items()]
    return out
