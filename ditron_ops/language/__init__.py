"""Device primitives shared by every ditron kernel: ``jit``, signals with bounded waits, remote
pointers, element copies, and the start barrier (``language.barrier``). NVSHMEM device wrappers
live in ``ditron_ops.language.nvshmem`` (GPU only).
"""
from ._jit import jit
from .copy import copy_tiles
from .signals import (BAD_INPUT, SIZE_MISMATCH, TIMEOUT, deadline_after, fence_acq_rel_sys, fence_proxy_async,
                      fence_sys, now_ns, peer_base, record_error, remote_ptr, signal_add,
                      signal_set, wait_at_least)

__all__ = ["jit", "now_ns", "fence_sys", "fence_acq_rel_sys", "fence_proxy_async",
           "deadline_after", "signal_add", "signal_set", "wait_at_least", "record_error",
           "remote_ptr", "peer_base", "copy_tiles", "TIMEOUT", "SIZE_MISMATCH", "BAD_INPUT"]
