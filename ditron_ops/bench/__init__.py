"""Benchmarks: ``python -m ditron_ops.bench <name> [--world-sizes 1,2,4,8] [--dtype bf16] ...``.

Each bench is a function ``run(cfg: BenchConfig) -> list[Result]`` in a module of this package,
registered with ``@register(name, help=...)``; the CLI imports every module here (``discover``),
so a new bench needs no other edit. Every run writes ``<out>/<name>-<dtype>-<device>.csv`` (one
typed row per measurement plus machine, versions and git commit) and a PNG of
``ratio = baseline / ours`` per case, and prints an aligned table.

Importing this package registers nothing and touches no device; benches load on ``discover()``.
"""
from .harness import (BENCHES, Bench, BenchConfig, Result, discover, finish, host_time_spmd,
                      register, time_spmd)
from .shapes import LAYER_CONFIGS, ModelShape, local_gemm_shape, local_gemm_shapes

__all__ = ["BENCHES", "Bench", "BenchConfig", "Result", "discover", "finish", "register",
           "time_spmd", "host_time_spmd", "LAYER_CONFIGS", "ModelShape", "local_gemm_shape",
           "local_gemm_shapes"]
