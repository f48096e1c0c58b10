"""The public API: every package's ``__all__`` is sorted, unique and complete."""

from __future__ import annotations

import ast
import importlib
import inspect
import types
from pathlib import Path

import pytest

PACKAGES = [
    "asyncrefit",
    "asyncrefit.transport",
    "asyncrefit.local",
    "asyncrefit.ray",
    "asyncrefit.trainer",
    "asyncrefit.vllm",
]


def defined_names(module: types.ModuleType) -> set[str]:
    """Public names bound by the package's ``__init__.py`` itself (imports, defs, assigns)."""
    path = Path(inspect.getfile(module))
    assert path.name == "__init__.py"
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            names.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if not n.startswith("_")}


@pytest.mark.parametrize("name", PACKAGES)
def test_all_is_sorted_and_unique(name: str) -> None:
    module = importlib.import_module(name)
    exported = list(module.__all__)
    assert exported, f"{name}.__all__ is empty"
    assert all(isinstance(n, str) for n in exported)
    assert exported == sorted(exported), f"{name}.__all__ is not sorted"
    assert len(exported) == len(set(exported)), f"{name}.__all__ has duplicates"


@pytest.mark.parametrize("name", PACKAGES)
def test_all_names_exist(name: str) -> None:
    module = importlib.import_module(name)
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert missing == []


@pytest.mark.parametrize("name", PACKAGES)
def test_every_public_attribute_is_exported(name: str) -> None:
    module = importlib.import_module(name)
    public = {
        n
        for n, v in vars(module).items()
        if not n.startswith("_") and not isinstance(v, types.ModuleType)
    }
    assert public - set(module.__all__) == set()
    assert set(module.__all__) <= public
    # The same, read from the source: names bound by __init__.py that are not modules.
    in_source = {
        n for n in defined_names(module) if not isinstance(getattr(module, n), types.ModuleType)
    }
    assert in_source == set(module.__all__)


def test_star_import_gives_exactly_all() -> None:
    namespace: dict[str, object] = {}
    exec("from asyncrefit import *", namespace)
    import asyncrefit

    assert set(namespace) - {"__builtins__"} == set(asyncrefit.__all__)
