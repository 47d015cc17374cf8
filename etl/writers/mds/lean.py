"""streaming's packages registered bare, so that the MDS writer's modules import
without torch (:func:`lean_streaming`).

A module of its own, which the writer (:mod:`etl.writers.mds.writer`) calls before its
imports: the writing task imports the writer, so a helper kept in the task's module
would make an import cycle.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["lean_streaming"]


# streaming's packages whose __init__ the MDS writer's import skips (lean_streaming).
_BARE_PACKAGES = ("", "base", "base/format", "base/format/base", "base/format/mds")


def lean_streaming() -> None:
    """Let a process import streaming's MDS encodings, compression and hashing (what
    :mod:`etl.writers.mds.writer` uses) without running its packages' ``__init__``
    modules, which import every dataset class and with them torch, transformers,
    scikit-learn and more: ~5-7 s in a fresh process on a 2-core machine, against
    ~0.2 s for the modules the writer needs.

    The packages are registered as bare packages (a path, no code), so the submodules
    load from the installed files as usual, and each runs its own ``__init__`` the first
    time anything else is asked of it (:func:`_init_on_demand`): a later ``from
    streaming import StreamingDataset`` in the same process (the driver's verify-export,
    a reader) works as after a plain import. A no-op where streaming is already imported."""
    import importlib.util
    import types

    if "streaming" in sys.modules:
        return
    spec = importlib.util.find_spec("streaming")
    if spec is None or not spec.submodule_search_locations:
        return  # not installed: the import below fails with the usual message
    root = list(spec.submodule_search_locations)[0]
    for rel in _BARE_PACKAGES:
        name = ".".join(["streaming", *[p for p in rel.split("/") if p]])
        module = types.ModuleType(name)
        folder = os.path.join(root, *rel.split("/"))
        module.__path__ = [folder]
        module.__package__ = name
        module.__file__ = os.path.join(folder, "__init__.py")
        module.__getattr__ = _init_on_demand(module)
        sys.modules[name] = module


def _init_on_demand(package) -> Callable[[str], Any]:
    """A bare package's module ``__getattr__`` (PEP 562): asked for a name it lacks
    that is not one of its submodules (those the import system loads as usual), it
    runs the package's own ``__init__`` in its namespace, once, and answers from it."""
    folder = package.__path__[0]

    def __getattr__(attr: str) -> Any:
        submodule = (os.path.isdir(os.path.join(folder, attr))
                     or os.path.isfile(os.path.join(folder, f"{attr}.py")))
        if attr.startswith("__") or submodule:
            raise AttributeError(f"module {package.__name__!r} has no attribute {attr!r}")
        del package.__dict__["__getattr__"]
        with open(package.__file__, "rb") as f:
            code = compile(f.read(), package.__file__, "exec")
        exec(code, package.__dict__)  # noqa: S102 -- the installed package's own __init__
        return getattr(package, attr)

    return __getattr__
