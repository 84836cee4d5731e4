"""Paged KV caches for ``flash_decode``: the block-table checks, the CSR-to-table conversion and
the gather of pages into a contiguous cache (tests, references, benchmarks).

Layout (FlashAttention's ``flash_attn_with_kvcache`` and vLLM's): ``k_cache``/``v_cache``
``[num_blocks, page_size, Hkv, D]`` (or one ``[num_blocks, 2, page_size, Hkv, D]`` tensor),
``block_table [B, max_blocks]`` int32: key ``n`` of sequence ``b`` lives in page
``block_table[b, n // page_size]`` at slot ``n % page_size``. Entries past a sequence's pages
are never read (any value; ``csr_to_block_table`` writes -1 there).

Everything here is plain torch (no Triton import: ``import ditron_ops`` stays cheap).
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch

from ..errors import DitronInputError
from ..runtime.tracing import tracing

PAGE_SIZES = tuple(1 << i for i in range(9))
"""Accepted page sizes: powers of two 1..256 (powers of two: a key block never straddles a page
boundary unevenly; pages of at least the kernel's key block, 128 keys on the GPU, are read with
one table entry per block, smaller pages gather each key's row through the table)."""
TABLE_ARG = "block_table.flatten()"
"""How error messages name a table entry: index ``b * max_blocks + column`` of the flattened
table (one integer fits ``DitronInputError``'s index)."""


_VIEWS: dict = {}
"""``id(kv)`` -> ``(weakref to kv, (address, shape, strides), k view, v view)`` of the one-tensor
caches seen (``split_kv``); an entry leaves with its tensor (``weakref.finalize``)."""


def split_kv(k_cache: torch.Tensor, v_cache: Optional[torch.Tensor]):
    """``(k, v)`` views of a paged cache: the pair as given, or the halves of one
    ``[num_blocks, 2, page_size, Hkv, D]`` tensor (``v_cache`` None; no copy).

    The halves of a tensor are made once and kept while it lives (a cache is one long-lived
    tensor per layer): per call a dictionary look-up and a metadata comparison, not two views.
    They are views of ``kv.detach()``, which holds the storage but not ``kv`` itself, so
    dropping ``kv`` drops them (and its memory)."""
    if v_cache is not None:
        return k_cache, v_cache
    if not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 5 or k_cache.shape[1] != 2:
        shape = tuple(k_cache.shape) if isinstance(k_cache, torch.Tensor) else type(k_cache).__name__
        raise ValueError("ditron.flash_decode: with v_cache=None, k_cache must be one paged "
                         f"cache [num_blocks, 2, page_size, Hkv, D]; got {shape}")
    if type(k_cache) is not torch.Tensor or k_cache.requires_grad or tracing():
        return k_cache[:, 0], k_cache[:, 1]  # fake / traced / autograd tensors: plain views
    meta = (k_cache.data_ptr(), k_cache.shape, k_cache.stride())
    got = _VIEWS.get(id(k_cache))
    if got is not None and got[0]() is k_cache and got[1] == meta:
        return got[2], got[3]
    k, v = k_cache.detach().unbind(1)
    key = id(k_cache)
    if got is None or got[0]() is not k_cache:  # a new tensor (or a dead one's reused id)
        weakref.finalize(k_cache, _VIEWS.pop, key, None)
    _VIEWS[key] = (weakref.ref(k_cache), meta, k, v)
    return k, v


def validate_table(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   block_table) -> int:
    """Shape checks of a paged call that the contiguous checks do not cover; the page size.

    ``k_cache``/``v_cache`` are ``[num_blocks, page_size, Hkv, D]`` of one shape (the batch
    check of the contiguous form does not apply: pages are shared by the batch).
    """
    if not isinstance(block_table, torch.Tensor):
        raise TypeError("ditron.flash_decode: block_table must be a torch.Tensor, got "
                        f"{type(block_table).__name__}")
    if block_table.dtype != torch.int32:
        raise TypeError(f"ditron.flash_decode: block_table has dtype "
                        f"{str(block_table.dtype).replace('torch.', '')}; expected int32 "
                        "(FlashAttention / vLLM block tables)")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("ditron.flash_decode: paged k_cache/v_cache must be equal "
                         f"[num_blocks, page_size, Hkv, D]; got {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    page = k_cache.shape[1]
    if page not in PAGE_SIZES:
        raise ValueError(f"ditron.flash_decode: page_size (k_cache.shape[1]) must be a power of "
                         f"two in 1..256, got {page}")
    b = q.shape[0]
    if block_table.dim() != 2 or block_table.shape[0] != b:
        raise ValueError(f"ditron.flash_decode: block_table must be [B = {b}, max_blocks]; got "
                         f"{tuple(block_table.shape)}")
    if block_table.shape[1] > 1 and block_table.stride(1) != 1:
        raise ValueError("ditron.flash_decode: block_table's rows must be contiguous "
                         f"(stride(1) == 1); got strides {block_table.stride()}")
    return page


def capacity(k_cache: torch.Tensor, block_table: torch.Tensor) -> int:
    """Most keys a sequence can hold: the table's ``max_blocks x page_size``, 0 when the cache
    has no pages (a rank holding none of the sequence)."""
    return block_table.shape[1] * k_cache.shape[1] if k_cache.shape[0] > 0 else 0


def plan_blocks(max_blocks: int) -> int:
    """The table width a plan is built for: ``max_blocks`` rounded up to three significant
    bits (4, 5, 6, 7 times a power of two; exact up to 8), so a table that grows by a page per
    step meets a new plan at most four times per doubling, and plans for at most 25% more keys
    than the table holds (key ranges past the table's capacity are empty programs)."""
    shift = max(max_blocks.bit_length() - 3, 0)
    return -(-max_blocks >> shift) << shift


def plan_capacity(k_cache: torch.Tensor, block_table: torch.Tensor) -> int:
    """``capacity`` of the planned width (``plan_blocks``): what the partition is made for."""
    return plan_blocks(block_table.shape[1]) * k_cache.shape[1] if k_cache.shape[0] > 0 else 0


def check_host(group, kv_lens: torch.Tensor, block_table: torch.Tensor, page: int,
               num_blocks: int) -> None:
    """Host tensors (the interpreter tier): raise ``DitronInputError`` for a length outside
    ``[0, capacity]`` (a table too short counts here) or a used entry outside ``[0,
    num_blocks)`` (-1 inside ``kv_lens`` included). On a GPU the kernel finds the same (no host
    sync per call) and records it."""
    top = block_table.shape[1] * page if num_blocks > 0 else 0
    bad = ((kv_lens < 0) | (kv_lens > top)).nonzero()
    if len(bad):
        i = int(bad[0, 0])
        raise DitronInputError("flash_decode", "kv_lens", group.rank, i, int(kv_lens[i]),
                               f"lengths must lie in [0, max_blocks x page_size = {top}] (the "
                               "block table's capacity; 0 when the cache has no pages; -1 is "
                               "csr_to_block_table's mark of an invalid row: last_page_len "
                               "outside [1, page_size] or pages outside kv_indices)")
    used = torch.arange(block_table.shape[1])[None, :] < ((kv_lens.long() + page - 1) // page)[:, None]
    wrong = (used & ((block_table < 0) | (block_table >= num_blocks))).flatten().nonzero()
    if len(wrong):
        i = int(wrong[0, 0])
        raise DitronInputError("flash_decode_paged", TABLE_ARG, group.rank, i,
                               int(block_table.flatten()[i]),
                               f"the pages a sequence uses must lie in [0, num_blocks = {num_blocks})")


def csr_to_block_table(kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                       last_page_len: torch.Tensor, max_blocks: int, page_size: int, *,
                       out: Optional[tuple] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's paged-KV description (CSR) as a block table and lengths, on the device.

    Parameters
    ----------
    kv_indptr : torch.Tensor
        ``[B + 1]`` int32/int64: sequence ``b``'s pages are ``kv_indices[kv_indptr[b]:
        kv_indptr[b + 1]]``.
    kv_indices : torch.Tensor
        ``[nnz]`` int32/int64 page ids.
    last_page_len : torch.Tensor
        ``[B]``: keys in each sequence's last page, in ``[1, page_size]`` for a sequence with
        pages (FlashInfer's rule; ignored for a sequence without pages, whose length is 0).
    max_blocks : int
        Columns of the table, given by the caller: the conversion never reads a device value on
        the host (no synchronization, CUDA-graph capturable). A sequence with more pages keeps
        its first ``max_blocks``, and its length then exceeds the table's capacity, which
        ``flash_decode`` reports (``DitronInputError`` on kv_lens) instead of reading past it.
    page_size : int
    out : (torch.Tensor, torch.Tensor), optional
        ``(block_table [B, max_blocks] int32, kv_lens [B] int32)`` to write in place (static
        tensors of a captured decode step).

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        ``block_table [B, max_blocks]`` int32 (-1 past each sequence's pages) and ``kv_lens
        [B]`` int32 = ``(pages - 1) x page_size + last_page_len`` (0 without pages).
    """
    for name, t in (("kv_indptr", kv_indptr), ("kv_indices", kv_indices),
                    ("last_page_len", last_page_len)):
        if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64) or t.dim() != 1:
            raise TypeError(f"ditron.csr_to_block_table: {name} must be a 1-D int32/int64 tensor")
    b = last_page_len.shape[0]
    if kv_indptr.shape[0] != b + 1:
        raise ValueError(f"ditron.csr_to_block_table: kv_indptr has {kv_indptr.shape[0]} entries; "
                         f"last_page_len has {b}, so B + 1 = {b + 1} expected")
    if not isinstance(max_blocks, int) or max_blocks < 0:
        raise ValueError(f"ditron.csr_to_block_table: max_blocks must be an int >= 0, got {max_blocks!r}")
    if page_size not in PAGE_SIZES:
        raise ValueError(f"ditron.csr_to_block_table: page_size must be a power of two in 1..256, "
                         f"got {page_size}")
    device = kv_indptr.device
    start = kv_indptr[:-1].long()
    count = kv_indptr[1:].long() - start
    cols = torch.arange(max_blocks, device=device)
    nnz = kv_indices.shape[0]
    if nnz:
        at = (start[:, None] + cols[None, :]).clamp(0, nnz - 1)  # clamped reads; masked below
        table = torch.where(cols[None, :] < count[:, None], kv_indices[at].to(torch.int32), -1)
    else:
        table = torch.full((b, max_blocks), -1, dtype=torch.int32, device=device)
    last = last_page_len.long()
    ok = (count >= 0) & (start >= 0) & (start + count <= nnz)
    ok &= (count == 0) | ((last >= 1) & (last <= page_size))
    lens = torch.where(count > 0, (count - 1) * page_size + last, 0)
    lens = torch.where(ok, lens, -1).to(torch.int32)  # -1: an invalid row (see Returns)
    if out is None:
        return table.to(torch.int32), lens
    out[0].copy_(table)
    out[1].copy_(lens)
    return out[0], out[1]


def gather_pages(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """``[B, max_blocks x page_size, Hkv, D]``: every sequence's pages in table order (entries
    outside the cache give zeros). Plain torch; for references and benchmarks."""
    nb, page = cache.shape[0], cache.shape[1]
    b, cols = block_table.shape
    ok = (block_table >= 0) & (block_table < nb)
    if nb == 0:
        return cache.new_zeros((b, cols * page) + tuple(cache.shape[2:]))
    pages = cache[block_table.long().clamp(0, nb - 1)]  # [B, cols, page, Hkv, D]
    pages = torch.where(ok[:, :, None, None, None], pages, torch.zeros((), dtype=cache.dtype,
                                                                        device=cache.device))
    return pages.reshape((b, cols * page) + tuple(cache.shape[2:]))
