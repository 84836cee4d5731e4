"""GPU tier (H200): the randomized op programs of ``ditron_ops.testing.fuzz`` on virtual worlds
of W in 1..6 with the compiled kernels, bf16 and fp16, shapes across the kernels' tiles
(``fuzz.GPU_SIZES``), derandomized (the same programs every run).

One test function per part, so each can be run and timed alone (``-k programs``, ``-k
faults``, ``-k delays``, ``-k mismatch``); the counts are options (tests/conftest.py):

- ``programs``: ``--fuzz-examples`` (default 2000) programs of 3-10 calls in ``PROGRAM_PARTS``
  tests (``-k part0``, ``-k part1``: one device call each), every result checked against the
  references (bitwise where promised);
- ``faults``: ``--fuzz-fault-examples`` (default 40, half each) programs where a rank raises
  before a call or skips it: every other rank gets a DitronError within the bound, a new
  launch then works, and ``torch.cuda.memory_allocated()`` is back to its level before the
  faulty launch (no workspace, plan or MoE Buffer outlives it);
- ``delays``: ``--fuzz-delay-examples`` (default 200) programs where a rank's stream sleeps
  (``torch.cuda._sleep``) before a call: every result still right, bitwise where promised;
- ``mismatch``: ``--fuzz-mismatch-examples`` (default 100) programs where a rank disagrees in
  one call: DitronMismatchError on every rank naming op, field and values, then the program
  goes on.

Each test prints its programs' count and time (``-rP`` shows it). Session:
``TESTS=fuzz bash tools/h200_session.sh tests`` (this file's bound there: 540 s).
"""
import gc
import time

import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings

from ditron_ops.testing import fuzz

pytestmark = pytest.mark.gpu
GPU = dict(min_world=1, max_world=6, dtypes=fuzz.GPU_DTYPES, sizes=fuzz.GPU_SIZES)


def _settings(examples: int) -> settings:
    # derandomized: the same programs every run; no example database (nothing written)
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _allocated() -> int:
    """Bytes of live device tensors once garbage is gone: Python's cycles (an error's
    frames, a group and its plan cache) collected, and cuBLAS's workspaces dropped — torch keeps
    one per (cuBLAS handle, stream) for the life of the process, and every launch's ranks get
    new streams; torch's own leak checks clear them the same way."""
    gc.collect()
    torch.cuda.synchronize()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    return torch.cuda.memory_allocated()


def _report(name: str, ran: list, t0: float) -> None:
    worlds = sorted({p.world_size for p in ran})
    calls = sum(len(p.calls) for p in ran)
    print(f"{name}: {len(ran)} programs, {calls} calls, W {worlds}, "
          f"{time.monotonic() - t0:.1f} s ({1e3 * (time.monotonic() - t0) / max(1, len(ran)):.0f} ms "
          "per program)")


def _run_checked(name: str, strategy, examples: int, seeded=None) -> None:
    """``examples`` programs of ``strategy``, each run in one launch with every call checked
    (derandomized, or with the fixed seed ``seeded`` applies), then their count and time."""
    ran, t0 = [], time.monotonic()

    def run(program):
        assert fuzz.run_program(program) == ["ok"] * program.world_size
        ran.append(program)

    test = given(program=strategy)(run)
    test = settings(_settings(examples), derandomize=seeded is None)(test)
    if seeded is not None:
        test = seeded(test)
    test()
    _report(name, ran, t0)
    assert len(ran) >= examples


PROGRAM_PARTS = 2
"""``--fuzz-examples`` programs run as this many tests of their own seeds (each about 250-300 s
on the H200 at 1000 programs): one device call of at most 10 minutes holds one part."""


@pytest.mark.timeout(565)
@pytest.mark.parametrize("part", [f"part{i}" for i in range(PROGRAM_PARTS)])
def test_programs_match_references(fuzz_count, part):
    examples = -(-fuzz_count("--fuzz-examples", 2000) // PROGRAM_PARTS)
    # each part its own fixed seed (derandomize would draw the same programs in every part)
    _run_checked(f"programs ({part})", fuzz.programs(min_calls=3, max_calls=10, **GPU), examples,
                 seed(20261202 + int(part[4:])))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["raise", "skip"])
def test_faults_give_typed_errors_and_leave_no_memory(fuzz_count, kind):
    """Per program: the calls up to the faulty one run once cleanly (compiles, first-use
    state), then the faulty launch (``run_faulty_program``: the survivors' errors within the
    bound), then memory must be back to its level before it, then the clean launch again
    (a new launch works) and memory again."""
    examples = fuzz_count("--fuzz-fault-examples", 40) // 2
    ran, t0 = [], time.monotonic()

    @_settings(examples)
    @given(program=fuzz.programs(faults=(kind,), min_calls=1, max_calls=4, **GPU))
    def run(program):
        clean = fuzz.fault_free(program)
        ok = ["ok"] * program.world_size
        assert fuzz.run_program(clean) == ok
        before = _allocated()
        fuzz.run_faulty_program(program, relaunch=False)
        leaked = _allocated() - before
        assert leaked == 0, f"{leaked} bytes still allocated after the faulty launch of {program}"
        assert fuzz.run_program(clean) == ok
        leaked = _allocated() - before
        assert leaked == 0, f"{leaked} bytes still allocated after the next launch of {program}"
        ran.append(program)

    run()
    _report(f"faults ({kind})", ran, t0)
    assert len(ran) >= examples


@pytest.mark.timeout(300)
def test_delays_give_correct_results(fuzz_count):
    """A rank's stream sleeps 10^4, 10^6 or 2 x 10^7 cycles before one call (the others run
    on): every call checked as in ``test_programs_match_references``. The virtual world's
    launch gate synchronizes a rank's stream before its waiting launch, so the late rank is
    late on the host when it meets its peers; device-side skew between waiting kernels (one
    process per GPU, no gate) is not what this part exercises."""
    examples = fuzz_count("--fuzz-delay-examples", 200)
    _run_checked("delays", fuzz.programs(faults=("delay",), min_calls=2, max_calls=8, **GPU), examples)


@pytest.mark.timeout(300)
def test_mismatch_raises_on_every_rank_and_the_program_goes_on(fuzz_count):
    examples = fuzz_count("--fuzz-mismatch-examples", 100)
    _run_checked("mismatch", fuzz.programs(mismatch=True, min_calls=1, max_calls=6, **GPU), examples)
