"""Attention across ranks: ``flash_decode`` (split-KV decode over a sequence-sharded KV cache,
LSE-merged). The function is re-exported by ``ditron_ops``; here the name is its module."""
from . import flash_decode

__all__ = ["flash_decode"]
