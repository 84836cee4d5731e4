import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


def pytest_addoption(parser):
    # each tier has its own default count (tests/test_fuzz_sequences.py: CPU interpreter,
    # tests/gpu/test_fuzz_gpu.py: H200); an option given applies to the tier that runs
    group = parser.getgroup("fuzz", "randomized op programs (ditron_ops.testing.fuzz)")
    # the CPU tier's defaults: the default run's count, then the long run's (marker slow)
    group.addoption("--fuzz-examples", type=int, default=None,
                    help="random programs to run (default: 30 / 300 with -m slow on the CPU "
                         "tier, 2000 on the GPU)")
    group.addoption("--fuzz-fault-examples", type=int, default=None,
                    help="programs where a rank raises before or skips a call, half each "
                         "(default: 20 / 60 with -m slow on the CPU, 40 on the GPU)")
    group.addoption("--fuzz-mismatch-examples", type=int, default=None,
                    help="programs where a rank disagrees in one call (default: 20 / 100 with "
                         "-m slow on the CPU, 100 on the GPU)")
    group.addoption("--fuzz-delay-examples", type=int, default=None,
                    help="GPU tier: programs where a rank's stream is late to a call (default 200)")


@pytest.fixture
def fuzz_count(request):
    """``fuzz_count(option, default)``: the ``--fuzz-*`` option's value, or this tier's
    ``default`` when the option was not given."""
    def count(option: str, default: int) -> int:
        value = request.config.getoption(option)
        return default if value is None else value
    return count
