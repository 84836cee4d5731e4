"""The world: groups, symmetric memory, workspaces, and the three backends."""
from .group import (Group, SymmetricBuffer, current_group, register_group, resolve_group,
                    set_default_group, unregister_group, using_group)
from .split import split_sizes, split_start
from .torch_backend import TorchGroup
from .virtual import VirtualGroup, VirtualWorld, launch
from .workspace import Workspace

__all__ = ["Group", "SymmetricBuffer", "Workspace", "VirtualGroup", "VirtualWorld", "TorchGroup",
           "launch", "current_group", "resolve_group", "register_group", "unregister_group",
           "set_default_group", "using_group", "split_sizes", "split_start"]
