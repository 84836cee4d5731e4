"""Attention across ranks: ``flash_decode`` (split-KV decode over a sequence-sharded KV cache,
LSE-merged) and ``ulysses`` (sequence-parallel attention with fused exchanges). The functions are
re-exported by ``ditron_ops``; here the names are their modules, and ``paged_kv`` (block
tables) with its ``csr_to_block_table`` (FlashInfer's CSR form -> a block table, on the device)."""
from . import flash_decode, paged_kv, ulysses
from .paged_kv import csr_to_block_table

__all__ = ["flash_decode", "paged_kv", "ulysses", "csr_to_block_table"]
