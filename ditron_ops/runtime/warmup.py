"""Warm-up: compile and load every kernel variant before any kernel that waits is launched.

A Triton compile or module load while a peer's kernel spins can deadlock virtual ranks that share
one GPU (measured on the H200; the bounded waits turn it into a timeout, not a hang). Each op
family registers a function that launches each of its kernel variants once on a private
one-rank setup, where no wait can block. ``launch`` and the nvshmem init call ``warmup``.
"""
from __future__ import annotations

import threading
from typing import Callable

import torch

_registry: dict[str, Callable[[torch.device], None]] = {}
_done: set[tuple[str, str]] = set()
_lock = threading.Lock()


def pointer_table(*tensors: torch.Tensor) -> torch.Tensor:
    """``int64`` device table of the tensors' base addresses (a one-rank symmetric buffer)."""
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=tensors[0].device)


def one_rank_pad(device: torch.device, preset=()) -> tuple:
    """What a warm-up launch needs as a one-rank world, where no wait can block: a signal pad
    (``int64 [16]``, first words ``preset``), its pointer table, the error claim word and the
    host-readable error record (pinned on CUDA)."""
    from .error_record import ERR_WORDS

    sig = torch.zeros(16, dtype=torch.int64, device=device)
    if preset:
        sig[:len(preset)] = torch.tensor(list(preset), dtype=torch.int64)
    claim = torch.zeros(1, dtype=torch.int64, device=device)
    record = torch.zeros(ERR_WORDS, dtype=torch.int64, pin_memory=device.type == "cuda")
    return sig, pointer_table(sig), claim, record


def register_warmup(name: str, fn: Callable[[torch.device], None]) -> None:
    """Register ``fn(device)`` that launches every kernel variant of an op family once."""
    _registry[name] = fn


def warmup(device: torch.device) -> None:
    """Run every registered warm-up not yet run for ``device`` (no-op on CPU: the interpreter
    has nothing to compile)."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    with _lock, torch.cuda.device(device):
        for name, fn in list(_registry.items()):
            key = (name, str(device))
            if key not in _done:
                fn(device)
                _done.add(key)
        torch.cuda.synchronize(device)
