"""Helpers for tests: per-rank inputs, collective checks against order-exact references."""
from .checks import check_collectives, make_input, run_gloo

__all__ = ["check_collectives", "make_input", "run_gloo"]
