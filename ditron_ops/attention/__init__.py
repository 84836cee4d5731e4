"""Attention across ranks: ``flash_decode`` (split-KV decode over a sequence-sharded KV cache,
LSE-merged) and ``ulysses`` (sequence-parallel attention with fused exchanges). The functions are
re-exported by ``ditron_ops``; here the names are their modules."""
from . import flash_decode, ulysses

__all__ = ["flash_decode", "ulysses"]
