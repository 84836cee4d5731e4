"""Long-lived symmetric memory of one (group, purpose): a signal pad and a grow-only data buffer.

Signal pad (``int64``, symmetric, zeroed once, never reset; W = world size)::

    [0, W)        arrivals[src]   programs of rank ``src`` that finished writing to this rank
                                  (cumulative over calls; a call waits for ``epoch * programs``)
    [W, 3W)       meta[parity][src]  elements ``src`` wrote for the call of that epoch parity
    3W            epoch           calls completed by this rank on this workspace
    3W + 1        done            programs of the running call that finished (reset by the last)

Data (symmetric bytes) is double buffered by epoch parity: a call of epoch ``e`` writes half
``e % 2``. Rank r writes half ``e % 2`` of a peer again only at epoch ``e + 2``, after it has
waited for that peer's ``e + 1`` arrival, which the peer sends after it finished reading epoch
``e`` (its calls are stream ordered). So no extra acknowledgement is needed.
"""
from __future__ import annotations

import itertools
from typing import Optional

import torch

from .group import Group, SymmetricBuffer

_MIN_DATA_BYTES = 1 << 20


class Workspace:
    """Symmetric signal pad + grow-only data buffer for one (group, purpose).

    Parameters
    ----------
    group : Group
        Must have symmetric memory (virtual or nvshmem backend).
    purpose : str
        Name of the user (e.g. ``"collectives"``); each purpose has its own epochs.
    """

    def __init__(self, group: Group, purpose: str):
        self.group, self.purpose = group, purpose
        w = group.world_size
        self.arrivals_offset, self.meta_offset = 0, w
        self.epoch_offset, self.done_offset = 3 * w, 3 * w + 1
        self.signal_words = 6 * w + 8  # the largest layout: ag_gemm's pull mode (see its kernels)
        self.signal: SymmetricBuffer = group.alloc_symmetric(self.signal_words * 8)
        self.data: Optional[SymmetricBuffer] = None
        self.calls = 0  # host count of launches (error messages; graph replays do not count)

    @property
    def data_bytes(self) -> int:
        return 0 if self.data is None else self.data.nbytes

    def signal_pad(self) -> torch.Tensor:
        """This rank's signal pad as ``int64 [signal_words]``."""
        return self.signal.local.view(torch.int64)

    def ensure_data(self, nbytes: int) -> SymmetricBuffer:
        """Grow the data buffer to at least ``nbytes`` (collective when it grows; never shrinks).

        Every rank must ask for the same ``nbytes`` (they derive it from rank-uniform sizes).
        """
        if nbytes <= self.data_bytes:
            return self.data
        grown = max(int(nbytes), 2 * self.data_bytes, _MIN_DATA_BYTES)
        grown = (grown + 255) // 256 * 256
        group = self.group
        group.refuse_during_capture(f"needs {grown} bytes of new symmetric memory")
        if group.device.type == "cuda":
            torch.cuda.current_stream(group.device).synchronize()
        group.barrier()  # every rank's kernels using the old buffer have finished
        if self.data is not None:
            group.free_symmetric(self.data)
            self.data = None
        self.data = group.alloc_symmetric(grown)
        return self.data

    def row_offsets(self, sizes, op: str) -> torch.Tensor:
        """Device ``int32 [W+1]`` table of first rows (``[0, s0, s0+s1, ...]``), cached per
        layout so no call uploads it; a new layout during CUDA-graph capture raises."""
        cache = self.__dict__.setdefault("_offsets", {})
        key = tuple(int(s) for s in sizes)
        if key not in cache:
            self.group.refuse_during_capture(f"sees the row layout {list(key)} of {op} first")
            table = torch.tensor(list(itertools.accumulate((0,) + key)), dtype=torch.int32)
            cache[key] = table.to(self.group.device)
        return cache[key]

    def release(self) -> None:
        """Collective free of both buffers."""
        if self.data is not None:
            self.group.free_symmetric(self.data)
            self.data = None
        if self.signal is not None:
            self.group.free_symmetric(self.signal)
            self.signal = None
