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
    "asyncrefit.abc",
    "asyncrefit.planning",
    "asyncrefit.transport",
    "asyncrefit.local",
    "asyncrefit.ray",
    "asyncrefit.trainer",
    "asyncrefit.vllm",
]


def defined_names(module: types.ModuleType) -> set[str]:
    """Public names bound by the module's own source (imports, defs, assigns)."""
    path = Path(inspect.getfile(module))
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


@pytest.mark.parametrize("name", ["asyncrefit", "asyncrefit.abc", "asyncrefit.planning"])
def test_public_names_say_the_module_they_are_imported_from(name: str) -> None:
    """Tracebacks and reprs name ``asyncrefit.VersionError``, not a private module."""
    module = importlib.import_module(name)
    for attr in module.__all__:
        value = getattr(module, attr)
        if isinstance(value, type) or inspect.isfunction(value):
            assert value.__module__ in {name, "asyncrefit", "asyncrefit.abc"}, (attr, value)


def test_every_exception_is_exported_from_the_facade() -> None:
    import asyncrefit
    from asyncrefit import _exceptions

    errors = {
        n
        for n, v in vars(_exceptions).items()
        if isinstance(v, type)
        and issubclass(v, BaseException)
        and v.__module__.startswith("asyncrefit")
    }
    assert errors <= set(asyncrefit.__all__)


def test_moved_names_still_import_with_a_deprecation_warning() -> None:
    import asyncrefit

    moved = asyncrefit._MOVED
    assert moved
    for name, where in moved.items():
        with pytest.warns(DeprecationWarning, match=where):
            value = getattr(asyncrefit, name)
        assert value is getattr(importlib.import_module(where), name)
    with pytest.raises(AttributeError):
        asyncrefit.no_such_name  # noqa: B018


def test_moved_names_pickle_by_their_new_home() -> None:
    """Records that cross a process boundary pickle by a name that resolves."""
    import pickle

    from asyncrefit import ParamSpec
    from asyncrefit.abc import BucketAck

    ack = BucketAck(bucket=1, nbytes=8, seconds=0.5)
    assert pickle.loads(pickle.dumps(ack)) == ack
    spec = ParamSpec(name="w", shape=(2, 3), dtype="bfloat16")
    assert ParamSpec.__module__ == "asyncrefit"
    assert pickle.loads(pickle.dumps(spec)) == spec
