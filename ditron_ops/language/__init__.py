"""Device primitives shared by every ditron kernel: ``jit``, signals with bounded waits, remote
pointers. NVSHMEM device wrappers live in ``ditron_ops.language.nvshmem`` (GPU only).
"""
from ._jit import jit
from .signals import (ERR_EPOCH, ERR_KIND, ERR_OP, ERR_PEER, ERR_RANK, ERR_STATUS, ERR_WORDS,
                      KIND_SIZE_MISMATCH, KIND_TIMEOUT, SIZE_MISMATCH, TIMEOUT, deadline_after,
                      fence_acq_rel_sys, fence_proxy_async, fence_sys, now_ns, record_error,
                      peer_base, remote_ptr, signal_add, signal_set, wait_at_least)

__all__ = ["jit", "now_ns", "fence_sys", "fence_acq_rel_sys", "fence_proxy_async",
           "deadline_after", "signal_add", "signal_set", "wait_at_least", "record_error",
           "remote_ptr", "peer_base", "ERR_STATUS", "ERR_OP", "ERR_RANK", "ERR_PEER", "ERR_EPOCH",
           "ERR_KIND", "ERR_WORDS", "KIND_TIMEOUT", "KIND_SIZE_MISMATCH", "TIMEOUT",
           "SIZE_MISMATCH"]
