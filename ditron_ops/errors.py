"""Exceptions raised by ditron_ops."""
from __future__ import annotations

import traceback


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
    peer : int or None
        The rank it waited for (-1 when not one peer, e.g. a size disagreement; None when
        unknown).
    epoch : int or None
        The call number (per group and purpose) the wait belonged to (None: a host meeting
        outside any call, e.g. a workspace allocation).
    """

    def __init__(self, op: str, rank: int, peer, epoch, detail: str = ""):
        self.op, self.rank, self.peer, self.epoch = op, rank, peer, epoch
        self.detail = what = detail or f"waited for rank {peer} and it never arrived"
        when = "" if epoch is None else f" at epoch {epoch}"
        super().__init__(
            f"ditron {op}: rank {rank} timed out{when}: {what}. "
            "Every rank of the group must call the same ops in the same order with agreeing sizes; "
            "raise the bound with Group.timeout_s or DITRON_TIMEOUT_S if peers are merely slow "
            "(e.g. compiling)."
        )


class DitronSizeMismatchError(DitronTimeoutError):
    """Ranks disagreed about a size that must agree (found in-kernel, reported like a timeout)."""


class DitronInputError(DitronError):
    """An argument's values (not its shape or dtype) are out of range, e.g. flash_decode's
    ``kv_lens`` outside ``[0, S_max]``: raised by the host check, or at the next host check after
    a kernel met it (the kernel clamps the value, so it never reads outside the input).

    Attributes
    ----------
    op, argument : str
    rank, index, value : int
        The rank, the element's index and its value.
    """

    def __init__(self, op: str, argument: str, rank: int, index: int, value: int, rule: str):
        self.op, self.argument, self.rank, self.index, self.value = op, argument, rank, index, value
        super().__init__(f"ditron {op}: rank {rank} passed {argument}[{index}] = {value}; {rule}")


class DitronMismatchError(DitronSizeMismatchError):
    """Ranks called a collective with disagreeing arguments, found by the host agreement
    (``runtime.agreement``) before anything was launched or written; raised on every rank.

    Attributes
    ----------
    op, rank, peer : str, int, int
        The op, this rank, and the first rank whose call differs from this rank's.
    field : str
        What differs (``"dtype"``, ``"N"``, ``"deterministic"``, ...; ``"op"`` when the peer
        called another collective at this point).
    mine, theirs
        This rank's value and the peer's.
    epoch : None
        No call was launched.
    """

    def __init__(self, op: str, rank: int, peer: int, field: str, mine, theirs):
        self.op, self.rank, self.peer, self.epoch = op, rank, peer, None
        self.field, self.mine, self.theirs = field, mine, theirs
        DitronError.__init__(
            self,
            f"ditron {op}: ranks disagree on {field}: rank {rank} passed {_show(mine)}, rank "
            f"{peer} passed {_show(theirs)}. Every rank of the group must call the same ops in "
            "the same order with agreeing arguments; nothing was launched.")


def _show(value) -> str:
    return str(value).replace("torch.", "")


def clear_frames(exc: BaseException) -> None:
    """Drop the locals of every finished frame of ``exc``'s tracebacks (and its causes')."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__
