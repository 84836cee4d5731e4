"""Compiling for the H200 (sm_90) on a machine without a GPU: Triton's driver replaced by a
stand-in whose target is sm_90, so ``kernel.warmup(...)`` compiles to a cubin with the ptxas
Triton ships (``tools/sm90_compile.py``, ``tools/ws_probe.py --compile-only``)."""
from __future__ import annotations


def use_sm90_stand_in_driver() -> None:
    """Make Triton compile for ``GPUTarget("cuda", 90, 32)`` in this process (no launches)."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver as active_driver

    class _Driver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

    active_driver.set_active(_Driver())
