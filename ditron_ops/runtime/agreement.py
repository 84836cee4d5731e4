"""Cross-rank agreement: every rank calls a collective with the same signature.

A signature is what every rank's call must share — the op, dtype, the dimensions that must
agree, flags, impl/algorithm — as ``(op, ((field, value), ...))``. The public functions call
``agree`` from their validation (``_validation.memo``), so it runs once per validated call key,
never on the eager fast path. A signature this group has agreed on before is not exchanged
again: ``group._agreed`` is keyed by the signature alone, which every rank's same call sequence
makes the same, so all ranks reach the exchange together (a plan or validation key, which holds
per-rank strides, rows and alignment, could miss on one rank only). A new signature is exchanged
with the peers (``Group.all_gather_object``: two host barriers in a virtual world, one
all-gather over the process group under torchrun) and a disagreement raises
``DitronMismatchError`` on every rank, naming the field and both values, before anything is
launched or written. An agreed new signature also has every rank meet before the call's first
waiting launch (``Group.meet_before_next_wait``), after each built (and compiled) its plans.

Limits: ranks that disagree between two signatures both agreed on earlier are not caught here
(the kernels' size and fingerprint checks still catch most); a rank whose signature is new
while its peers' is not waits at the exchange, and every rank raises ``DitronTimeoutError``.
"""
from __future__ import annotations

from ..errors import DitronMismatchError, DitronTimeoutError
from .tracing import tracing

CAPACITY = 4096
"""Agreed signatures kept per group; when full, all ranks forget them at the same call."""


def agree(group, op: str, fields: tuple) -> None:
    """Raise ``DitronMismatchError`` on every rank unless all ranks call ``op`` with the same
    ``fields`` (``((name, value), ...)``, hashable, picklable)."""
    if group.world_size == 1 or tracing():
        return  # compiling: checked when the eager call validated (traces are per process)
    signature = (op, fields)
    agreed = group._agreed
    if signature in agreed:
        return
    group.refuse_during_capture(f"checks a new {op} signature with its peers")
    try:
        seen = group.all_gather_object(signature)
    except DitronTimeoutError as err:  # name the op whose arguments were being agreed on
        raise DitronTimeoutError(op, group.rank, err.peer, None,
                                 detail=f"{err.detail} (agreeing on this call's arguments)") from None
    for peer, other in enumerate(seen):
        if other != signature:
            raise _mismatch(op, group.rank, peer, signature, other)
    group.meet_before_next_wait()  # every rank compiles this call's plans first
    if len(agreed) >= CAPACITY:  # the same call on every rank: the memo forgets with it, so
        agreed.clear()           # every rank's next new call key validates (and agrees) again
        group._validated.clear()
    agreed.add(signature)


def _mismatch(op: str, rank: int, peer: int, mine: tuple, theirs: tuple) -> DitronMismatchError:
    if theirs[0] != op:
        return DitronMismatchError(op, rank, peer, "op", op, theirs[0])
    for (name, value), (other_name, other_value) in zip(mine[1], theirs[1]):
        if (name, value) != (other_name, other_value):
            return DitronMismatchError(op, rank, peer, name, value, other_value)
    return DitronMismatchError(op, rank, peer, "signature", mine[1], theirs[1])
