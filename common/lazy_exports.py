"""A package's names resolved on first use (PEP 562), so importing the package costs nothing.

The control plane plans with pure modules (dag.graph, compression.wire_sizes) whose packages
also export torch-heavy names; with eager ``__init__`` imports, a node that only agrees on plans
would load torch (~200 MiB RSS) for nothing.
"""

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    namespace: dict[str, Any], exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for a package whose ``exports`` maps name -> module."""

    def get_attribute(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # later lookups find it without this function
        return value

    def list_names() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return get_attribute, list_names
