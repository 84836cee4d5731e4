"""``ditron_ops.compile``: torch.compile turns tensor-parallel code into ditron's fused ops.

::

    import ditron_ops.compile
    ditron_ops.compile.enable()             # or: with ditron_ops.compile.enable(): ...
    model = torch.compile(tp_model)         # DTensor / functional collectives, as usual
    print(ditron_ops.compile.explain(model, x))

``enable`` registers a post-grad graph pass with inductor (``torch._inductor.config.
post_grad_custom_post_pass``); every graph inductor compiles afterwards is rewritten where it has
``all_gather -> mm`` (``ag_gemm``), ``mm -> reduce_scatter`` (``gemm_rs``), ``mm -> all_reduce``
(``gemm_ar``) or ``all_reduce -> add -> rms_norm`` (``all_reduce_rmsnorm``) on a process group
that maps to a ditron group (``groups``). Details and what is left: ``passes`` and docs/compile.md.

Decisions
---------
- A custom post-grad pass, not a Dynamo backend: users keep ``torch.compile``'s default backend
  and every inductor option; the pass composes with passes already registered (kept, ours added).
- Nothing here imports Dynamo or inductor before ``enable``/``explain`` is called: ``import
  ditron_ops`` stays light (tests/test_import_cost.py).
- The pass's cache key (``uuid``) holds its source, the ops, ``allow_reference``, the mode and
  what of the process decides the group mapping (``groups.mapping_fingerprint``: the NVSHMEM
  groups, not the ``TorchGroup``s made so far): inductor's FX graph cache skips the pass only
  where its result would be the same, and a graph it loads in a new process runs there (the
  ``torch:<pg name>`` it names resolves to a ``TorchGroup`` made on first use).
- Groups without symmetric memory (``TorchGroup``: the ops' synchronous reference path) are
  left unless ``allow_reference=True``: the reference is no faster than inductor's async
  collectives, so "rewritten" would promise what it does not do.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Iterable, Optional

__all__ = ["enable", "disable", "is_enabled", "explain", "Explanation", "OPS"]

OPS = ("ag_gemm", "gemm_rs", "gemm_ar", "all_reduce_rmsnorm")
log = logging.getLogger("ditron_ops.compile")
_lock = threading.Lock()
_installed: Optional[Any] = None  # our pass object while enabled


def _pass_class():
    """The ``CustomGraphPass`` subclass (defined on first use: it imports inductor)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    from . import groups, passes

    class DitronAsyncTP(CustomGraphPass):
        """Inductor post-grad pass rewriting TP collectives into ``torch.ops.ditron.*``."""

        def __init__(self, ops: tuple, allow_reference: bool = False):
            self.ops, self.allow_reference = ops, allow_reference

        def __call__(self, graph) -> None:
            passes.run_pass(graph, self.ops, self.allow_reference)

        def uuid(self) -> Any:
            files = (passes.__file__, groups.__file__, __file__)
            import torch

            groups.drop_stale()  # a loaded graph must not resolve to a destroyed process group
            return (get_hash_for_files(files).hex(), self.ops, self.allow_reference,
                    passes.compile_mode(), hasattr(torch.ops.ditron, "all_reduce_rmsnorm"),
                    groups.mapping_fingerprint())

    return DitronAsyncTP


def _current():
    import torch._inductor.config as config

    return config.post_grad_custom_post_pass


def _without_ours(value) -> tuple:
    items = () if value is None else tuple(value) if isinstance(value, (list, tuple)) else (value,)
    return tuple(p for p in items if p is not _installed and type(p).__name__ != "DitronAsyncTP")


def _set(items: tuple) -> None:
    import torch._inductor.config as config

    config.post_grad_custom_post_pass = (None if not items else items[0] if len(items) == 1
                                         else list(items))


class _Enabled(contextlib.AbstractContextManager):
    """What ``enable`` returns: enabled already; as a context manager, restores on exit."""

    def __init__(self, previous):
        self._previous = previous

    def __exit__(self, *exc) -> None:
        global _installed
        with _lock:
            import torch._inductor.config as config

            config.post_grad_custom_post_pass = self._previous
            found = _without_ours(self._previous) != _as_tuple(self._previous)
            _installed = _find_ours(self._previous) if found else None


def _as_tuple(value) -> tuple:
    return () if value is None else tuple(value) if isinstance(value, (list, tuple)) else (value,)


def _find_ours(value):
    for p in _as_tuple(value):
        if type(p).__name__ == "DitronAsyncTP":
            return p
    return None


def enable(*, ops: Iterable[str] = OPS, allow_reference: bool = False) -> _Enabled:
    """Register the rewrite pass with inductor (process-wide) for the ops named in ``ops``.

    Parameters
    ----------
    ops : iterable of str
        Targets to produce, a subset of ``OPS``: ``"ag_gemm"``, ``"gemm_rs"``, ``"gemm_ar"``,
        ``"all_reduce_rmsnorm"`` (the last only while ``torch.ops.ditron.all_reduce_rmsnorm``
        is registered when a graph is compiled).
    allow_reference : bool
        Also rewrite collectives on process groups without symmetric memory (no NVSHMEM group
        over them: a ``TorchGroup``), whose ops run the synchronous reference path (torch.
        distributed + matmul). Off by default: that path is no faster than inductor's own async
        collectives, so such patterns are left, with that reason. For tests and CPU runs.

    Returns
    -------
    context manager
        Already enabled; ``with enable(): ...`` restores the previous setting on exit.

    Notes
    -----
    Affects graphs compiled afterwards (already compiled functions keep their code; call
    ``torch._dynamo.reset()`` to recompile). The ``ditron_ops.deterministic()`` mode in force
    when a forward graph is compiled selects the deterministic ops for it and its backward; the
    compiled function is not guarded on it (switching modes needs ``torch._dynamo.reset()``).
    The inserted ops skip the eager calls' cross-rank agreement (docs/compile.md).
    """
    global _installed
    ops = tuple(ops)
    unknown = [o for o in ops if o not in OPS]
    if unknown:
        raise ValueError(f"ditron.compile.enable: unknown ops {unknown}; choose from {OPS}")
    import ditron_ops  # noqa: F401 - the torch.ops.ditron ops exist before any graph names them

    with _lock:
        previous = _current()
        ours = _pass_class()(ops, bool(allow_reference))
        _set(_without_ours(previous) + (ours,))
        _installed = ours
    return _Enabled(previous)


def disable() -> None:
    """Remove the pass (other registered passes stay)."""
    global _installed
    with _lock:
        _set(_without_ours(_current()))
        _installed = None


def is_enabled() -> bool:
    """Whether the pass is registered now."""
    if _installed is None:
        return False
    return _find_ours(_current()) is not None


class Explanation:
    """What the pass did in the graphs compiled by one ``explain`` call.

    Attributes
    ----------
    reports : list of passes.GraphReport
        One per rewritten-or-inspected graph (forward, backward or inference).
    """

    def __init__(self, reports: list):
        self.reports = reports

    @property
    def rewritten(self) -> list:
        """``[(graph kind, collective, target op, detail)]`` of every rewrite."""
        return [(r.kind, e.collective, e.op, e.detail) for r in self.reports for e in r.entries
                if e.rewritten]

    @property
    def left(self) -> list:
        """``[(graph kind, collective, op tried, reason)]`` of every pattern left as it was."""
        return [(r.kind, e.collective, e.op, e.detail) for r in self.reports for e in r.entries
                if not e.rewritten]

    def counts(self) -> dict:
        """``{target op: number of rewrites}``."""
        out: dict = {}
        for _, _, op, _ in self.rewritten:
            out[op] = out.get(op, 0) + 1
        return out

    def __str__(self) -> str:
        if not self.reports:
            return "ditron_ops.compile: no collective was seen in the compiled graphs"
        head = (f"ditron_ops.compile: {len(self.rewritten)} rewritten "
                f"({', '.join(f'{k} x{v}' for k, v in sorted(self.counts().items())) or 'none'}), "
                f"{len(self.left)} left")
        return "\n".join([head] + [str(r) for r in self.reports])

    __repr__ = __str__


def explain(fn, *args, backward: bool = True, ops: Iterable[str] = OPS,
            allow_reference: bool = False, **kwargs) -> Explanation:
    """Compile ``fn`` with the pass, run it once on ``args`` (and its backward), and report.

    Parameters
    ----------
    fn : callable or torch.nn.Module
        What you would pass to ``torch.compile``. Compiled afresh (its own backend object, the
        FX graph and AOT caches off for this call), so the pass sees every graph.
    *args, **kwargs
        Its inputs (real tensors: it runs; collective, so every rank calls ``explain``).
    backward : bool
        Also run the backward (``torch.autograd.grad`` of the outputs' sum with respect to the
        inputs and, for a module, the parameters that require grad; no ``.grad`` is written).
    ops, allow_reference
        As ``enable``.

    Returns
    -------
    Explanation
        Printable: what was rewritten into which ``torch.ops.ditron`` op, what was left and why.
        The same reports are logged at INFO on the ``ditron_ops.compile`` logger.
    """
    import torch
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    from . import passes

    def backend(gm, example_inputs):  # a fresh backend object: Dynamo compiles anew
        return compile_fx(gm, example_inputs)

    start = len(passes._reports)
    with enable(ops=ops, allow_reference=allow_reference), inductor_config.patch(fx_graph_cache=False), \
            functorch_config.patch(enable_autograd_cache=False):
        compiled = torch.compile(fn, backend=backend)
        out = compiled(*args, **kwargs)
        if backward:
            leaves = [a for a in list(args) + list(kwargs.values())
                      if isinstance(a, torch.Tensor) and a.requires_grad]
            if isinstance(fn, torch.nn.Module):
                leaves += [p for p in fn.parameters() if p.requires_grad]
            outs = [o for o in (out if isinstance(out, (tuple, list)) else [out])
                    if isinstance(o, torch.Tensor) and o.requires_grad]
            if outs and leaves:
                torch.autograd.grad(sum(o.float().sum() for o in outs), leaves, allow_unused=True)
    return Explanation(list(passes._reports[start:]))
