"""TRL's `environment_factory` contract for a Python environment class, shared by `grpo envs serve` (which hosts
one over OpenEnv) and `grpo train` (which runs one in the trainer's process):

- `reset(self, **row)` starts an episode from a training row's fields;
- every other public method is a tool, its name, type hints and docstring the tool's schema;
- `get_reward(self)`, optional, is the episode's reward; `close(self)`, optional, ends it.

Standard library only: the environment host's install has none of the trainer's dependencies.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys

# Not tools: the episode's own methods, and the names OpenEnv reserves for its messages.
NOT_TOOLS = frozenset({"reset", "get_reward", "close"})
RESERVED = frozenset({"step", "state"})


def public_tools(cls: type) -> list[str]:
    """The public methods of `cls` that are tools (all but reset, get_reward, close); ValueError for a class
    without `reset` or with a method OpenEnv reserves (`grpo envs serve` serves the same classes)."""
    names = sorted(name for name, _ in inspect.getmembers(cls, callable)
                   if not name.startswith("_") and name not in NOT_TOOLS)
    reserved = sorted(RESERVED.intersection(names))
    if reserved:
        raise ValueError(f"{cls.__name__}: methods named {reserved} cannot be tools (OpenEnv reserves the names)")
    if not callable(getattr(cls, "reset", None)):
        raise ValueError(f"{cls.__name__}: no reset(self, **row) method")
    return names


def load_class(target: str) -> type:
    """`module:Class`, the module found from the working directory first (as uvicorn does)."""
    module_name, _, class_name = target.partition(":")
    if not module_name or not class_name:
        raise ValueError(f"{target!r}: expected module:Class")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    cls = getattr(importlib.import_module(module_name), class_name, None)
    if not isinstance(cls, type):
        raise ValueError(f"{target!r}: {module_name} has no class {class_name}")
    return cls
