"""Package ``__init__``s that import nothing until a name is used (PEP 562).

vLLM imports the worker extension (``weightsync.engines.vllm.worker``) inside its worker
processes, and every package on that path runs its ``__init__`` first; so those import the
modules behind their public names only when a name is asked for. Standard library only.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def exports(package: str, table: Mapping[str, tuple[str, ...]]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package``: ``table`` maps each module (relative to
    ``package``) to the public names it defines; a name that is the module's own last
    component is the module itself. The value is cached in the package."""
    where_is = {name: module for module, names in table.items() for name in names}

    def __getattr__(name: str) -> Any:
        where = where_is.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(where, package)
        value = module if where.rsplit(".", 1)[-1] == name else getattr(module, name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
