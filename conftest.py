"""Before any test or doctest touches CUDA: the variables virtual ranks need (see
``ditron_ops._env.prepare_cuda_for_virtual_ranks``).

The CPU tier's whole-suite runs (``python -m pytest -q``, ``python -m pytest -q -m slow``: no
paths given, so pytest runs ``testpaths``) use two pytest-xdist workers when xdist is installed
(the dev extra) and there is no GPU: the interpreter's virtual world holds the GIL, so one
process uses one core. Not on a GPU (two processes' spinning kernels on one device), not when
tests are named on the command line, ``-n`` is given (``-n 0``: serial), or ``-p no:xdist``."""
import pytest

from ditron_ops import _env

_env.prepare_cuda_for_virtual_ranks()

CPU_TIER_WORKERS = 2


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    option = config.option
    if (not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput")
            or getattr(option, "numprocesses", 0) is not None
            or config.args_source != pytest.Config.ArgsSource.TESTPATHS
            or option.collectonly or option.usepdb):
        return
    import torch

    if not torch.cuda.is_available():
        option.numprocesses = CPU_TIER_WORKERS
