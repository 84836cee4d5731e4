"""Input checks that raise typed errors naming the op, the argument, expected vs actual."""
from __future__ import annotations

from typing import Iterable

import torch

from .runtime.group import Group


def check_tensor(op: str, name: str, t, group: Group, dtypes: Iterable[torch.dtype],
                 min_dim: int = 0) -> None:
    """A tensor of one of ``dtypes`` on the group's device with at least ``min_dim`` dims (every
    call runs it: plain attribute reads, no torch.device objects)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"ditron.{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"ditron.{op}: {name} has dtype {str(t.dtype).replace('torch.', '')}; "
                        f"expected one of {allowed}")
    if t.is_meta:  # (False for torch.compile's fake tensors: they report the device they stand for)
        raise ValueError(f"ditron.{op}: {name} is on the meta device (no data); pass a tensor on "
                         f"{group.device}, where rank {group.rank} of {group.group_name!r} runs")
    if t.get_device() != group.device_index:
        raise ValueError(f"ditron.{op}: {name} is on {t.device} but rank {group.rank} of "
                         f"{group.group_name!r} runs on {group.device}")
    if t.dim() < min_dim:
        raise ValueError(f"ditron.{op}: {name} must have at least {min_dim} dimension(s), "
                         f"got shape {tuple(t.shape)}")


def check_sizes(op: str, name: str, sizes, group: Group) -> list[int]:
    try:
        sizes = [int(s) for s in sizes]
    except TypeError:
        raise TypeError(f"ditron.{op}: {name} must be a sequence of ints, got {sizes!r}") from None
    if len(sizes) != group.world_size:
        raise ValueError(f"ditron.{op}: {name} has {len(sizes)} entries; the group has "
                         f"{group.world_size} ranks")
    if any(s < 0 for s in sizes):
        raise ValueError(f"ditron.{op}: {name} must be non-negative, got {sizes}")
    return sizes


_MEMO_SIZE = 512


def memo(group: Group, key, validate):
    """``validate()``'s result for ``key``, remembered per group: a call whose key (op, flags,
    and dtype, device, shape, strides and alignment of every tensor) matches a validated one's
    needs no checks. ``key`` None (an argument that is not a tensor): no memo."""
    if key is None:
        return validate()
    done = group._validated
    got = done.get(key)
    if got is None:
        got = validate()
        if len(done) >= _MEMO_SIZE:
            done.clear()
        done[key] = got
    return got
