"""
pytest plugin for ``export.py``: what pytest itself collected, written as JSON (no test is run).

``python -m pytest --collect-only -p series_collect tests/unit`` with ``SERIES_COLLECT_OUT=FILE``
writes, for every collected item, the patch its closest ``proves`` marker names (however the module
spells it: a literal, a module constant, ``pytestmark`` lists, ``pytest.param(..., marks=...)``), the
parametrize indices of the item, and each fixture it requests (directly, through ``usefixtures`` or
through other fixtures) with the file that defines it. Parametrize arguments are not fixtures and are
listed apart. Autouse fixtures are left out (harness, not a name the test uses).

The markers the series uses are registered here too, so that ``--strict-markers`` collection of a
suite without the project's conftest works.
"""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path

import pytest

OUT_ENV = "SERIES_COLLECT_OUT"


def pytest_configure(config: pytest.Config) -> None:
    for line in ("proves(patch, base_ok_on=())", "guard", "db_test", "backend(*names)"):
        config.addinivalue_line("markers", f"{line}: (registered by series_collect)")


def _where(func) -> str | None:
    try:
        return str(Path(inspect.getsourcefile(func) or "").resolve())
    except TypeError:
        return None


def _fixtures(item: pytest.Function) -> tuple[dict[str, dict], list[str]]:
    """(name -> {file, line} for every fixture the test requests, transitively; parametrize arguments)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return {}, []
    params = sorted(getattr(getattr(item, "callspec", None), "params", {}) or {})
    wanted = list(info.argnames)
    for mark in item.iter_markers("usefixtures"):
        wanted.extend(mark.args)
    seen: dict[str, dict] = {}
    direct_params = []
    while wanted:
        name = wanted.pop(0)
        if name in seen or name in direct_params:
            continue
        defs = info.name2fixturedefs.get(name)
        if not defs:
            seen[name] = {"file": None, "line": None}
            continue
        fixturedef = defs[-1]
        func = fixturedef.func
        if getattr(func, "__name__", "") == "get_direct_param_fixture_func":
            direct_params.append(name)
            continue
        try:
            line = inspect.getsourcelines(func)[1]
        except (OSError, TypeError):
            line = None
        seen[name] = {"file": _where(func), "line": line}
        wanted.extend(n for n in fixturedef.argnames if n != "request")
    return seen, sorted(set(direct_params) | (set(params) - set(seen)))


def pytest_collection_finish(session: pytest.Session) -> None:
    out = os.environ.get(OUT_ENV)
    if not out:
        return
    items = []
    for item in session.items:
        marker = item.get_closest_marker("proves")
        proves = marker.args[0] if marker is not None and marker.args else None
        fixtures, params = _fixtures(item) if isinstance(item, pytest.Function) else ({}, [])
        callspec = getattr(item, "callspec", None)
        items.append(
            {
                "nodeid": item.nodeid,
                "file": str(Path(str(item.path)).resolve()),
                "cls": item.cls.__name__ if getattr(item, "cls", None) else None,
                "func": getattr(item, "originalname", item.name),
                "proves": proves if isinstance(proves, str) else None,
                "base_ok_on": list(marker.kwargs.get("base_ok_on", ())) if marker is not None else [],
                "indices": dict(callspec.indices) if callspec is not None else {},
                "fixtures": fixtures,
                "params": params,
            }
        )
    Path(out).write_text(json.dumps({"items": items}, indent=1))
