import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


def pytest_addoption(parser):
    group = parser.getgroup("fuzz", "randomized op programs (tests/test_fuzz_sequences.py)")
    group.addoption("--fuzz-examples", type=int, default=150,
                    help="random programs to run (default 150, the CPU tier's count)")
    group.addoption("--fuzz-fault-examples", type=int, default=20,
                    help="random programs with an injected fault to run (default 20)")
