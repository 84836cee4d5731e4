"""Exceptions raised by ditron_ops."""
from __future__ import annotations


class DitronError(RuntimeError):
    """Base class of ditron_ops runtime errors (bad input raises TypeError/ValueError instead)."""


class DitronTimeoutError(DitronError):
    """A bounded device-side wait expired: a peer never arrived (or arrived with mismatched sizes).

    Attributes
    ----------
    op : str
        The op whose kernel waited.
    rank : int
        The rank that waited.
    peer : int
        The rank it waited for (-1 when not one peer, e.g. a size disagreement).
    epoch : int
        The call number (per group and purpose) the wait belonged to.
    """

    def __init__(self, op: str, rank: int, peer: int, epoch: int, detail: str = ""):
        self.op, self.rank, self.peer, self.epoch = op, rank, peer, epoch
        what = detail or f"waited for rank {peer} and it never arrived"
        super().__init__(
            f"ditron {op}: rank {rank} timed out at epoch {epoch}: {what}. "
            "Every rank of the group must call the same ops in the same order with agreeing sizes; "
            "raise the bound with Group.timeout_s or DITRON_TIMEOUT_S if peers are merely slow "
            "(e.g. compiling)."
        )


class DitronSizeMismatchError(DitronTimeoutError):
    """Ranks disagreed about a size that must agree (found in-kernel, reported like a timeout)."""
