"""Modules imported on first use, so that ``import ditron_ops`` stays cheap.

Importing the package defines every ``torch.ops.ditron.*`` op (schema, fake implementation,
autograd) but imports neither Triton nor any kernel or launch module: those cost half a second
on the CPU dev machine and seconds on a GPU machine, and only an op that runs needs them. An op's module names them with
``lazy_import``; the first attribute read through the placeholder imports the module and
rebinds every global of the importing module that held the placeholder to the module itself,
so later reads are plain module-attribute reads (the eager call path pays nothing per call)::

    _launch = lazy_import("._launch", globals())   # nothing imported yet
    ...
    _launch.push_combine(...)                      # first call: imports ._launch, rebinds

Placeholders belong on the implementation side of an op (plans, launches, ``precompile``): code
that torch.compile traces (public functions, their validation, fake implementations) must not
be the first to read one, since Dynamo cannot trace the import (``fullgraph=True`` fails there).
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types

from . import compiler


class LazyModule:
    """A placeholder for the module ``name``, imported on its first attribute access.

    Parameters
    ----------
    name : str
        Absolute, or relative to the importing module's package (``"._launch"``).
    importer : dict
        The importing module's ``globals()``: where the placeholder is replaced by the module.
    """

    __slots__ = ("_lazy_name", "_lazy_importer")

    def __init__(self, name: str, importer: dict):
        object.__setattr__(self, "_lazy_name",
                           importlib.util.resolve_name(name, importer.get("__package__")))
        object.__setattr__(self, "_lazy_importer", importer)

    def _load(self) -> types.ModuleType:
        name = self._lazy_name
        if name in sys.modules:
            module = importlib.import_module(name)
        else:
            # a first import (Triton's takes seconds on a GPU machine) pauses the barrier clocks
            # of virtual worlds as a compile does: peers waiting for this rank do not time out
            with compiler.activity(f"import {name}"):
                module = importlib.import_module(name)
        importer = self._lazy_importer
        for key, value in list(importer.items()):
            if value is self:
                importer[key] = module
        return module

    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__"):  # introspection (doctest, inspect)
            raise AttributeError(attr)                       # does not import
        return getattr(self._load(), attr)

    def __setattr__(self, attr: str, value) -> None:  # monkeypatching goes to the module
        setattr(self._load(), attr, value)

    def __delattr__(self, attr: str) -> None:
        delattr(self._load(), attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._lazy_name!r}>"


def lazy_import(name: str, importer: dict) -> LazyModule:
    """A placeholder of the module ``name`` for the module whose ``globals()`` is ``importer``
    (see the module docstring)."""
    return LazyModule(name, importer)
