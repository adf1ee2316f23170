#!/usr/bin/env python3
"""
Export patches of the series as what upstream pull requests need.

``export.py PATCH|--all [--verify LOG ...] [--out DIR] [--python PY]`` writes ``export/<slug>/`` per patch
(``--all``: every patch, in series order, and the index ``export/README.md``):

* ``NNNN-<slug>.patch`` ``git am`` input in upstream layout (``a/airflow-core/...``): the patch with its
  regression tests added at their upstream paths (``airflow-core/tests/unit/...``), its commit message
  and trailers unchanged. If the patch does not apply to the pristine base alone, the earlier patches
  it needs (those touching the same files, transitively) come first and ``PR.md`` lists them.
* ``airflow-core/tests/unit/...`` the same test modules as files. Which test proves which patch is asked
  of pytest itself (``pytest --collect-only`` with the ``series_collect`` plugin, run by ``PY``, which must
  import the tests): the closest ``proves`` marker, however the module spells the patch name (literal,
  module constant, ``pytestmark`` list, ``pytest.param(..., marks=...)``). A module keeps the tests (and
  parametrize cases) proving the patch, loses ``proves``/``guard`` markers, ``skipif`` markers on the
  harness's ``carries()`` (the export holds the patches its tests need) and what only other tests used.
  Project-only names it uses (fixtures of the project's harness, ``tests/unit/harness/`` registered by its
  conftest, that upstream's ``tests_common`` does not provide; helpers imported from the project's
  modules) are copied into it from the module that defines them, with what they use, so
  that it runs in upstream's harness; what cannot be copied is reported (``project-only names left``),
  so is a definition computing a path from its own ``__file__`` (it would name another place once copied).
* No newsfragment of its own: a patch that carries one (``airflow-core/newsfragments/``) exports it.
* ``PR.md`` title and description drafted from the commit message: what and why, the code it was made
  against and what upstream main (3.4.0b2) has of it (``patches/upstream.toml``: ``[bases."<version>"]
  made-against``, a patch's ``on-main``), upstream status and related upstream work (``patches/upstream.toml``), dependencies, tests (and the upstream module each
  belongs in), verification (fail-before / pass-after per backend and the server, read from
  ``nox -s verify-series-<db>`` output saved with ``| tee LOG`` and given with ``--verify LOG``), and what
  to check before opening the PR.

The patch commits are made in a throwaway clone of ``airflow-core/`` (run ``tree.py prepare`` first);
the tree itself is not touched. The folder is built beside its target and moved into place only when
complete; an existing ``--out`` is replaced only if it is an earlier export (it holds ``.series-export``,
which lists each file it wrote with its sha256) with no file added or edited since; anything else is
refused, and so is an ``--all`` index ``README.md`` edited since it was written. ``--verify`` logs are checked before anything is written.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import trailers  # noqa: E402
import tree  # noqa: E402

# Fixtures upstream's tests_common (devel-common pytest_plugin) and pytest itself provide.
UPSTREAM_FIXTURES = {
    "dag_maker", "session", "create_task_instance", "create_task_instance_of_operator",
    "create_serialized_task_instance_of_operator", "create_dummy_dag", "create_log_template",
    "testing_dag_bundle", "get_test_dag", "mock_supervisor_comms", "create_runtime_ti", "make_ti_context",
    "time_machine", "mocker", "monkeypatch", "tmp_path", "tmp_path_factory", "caplog", "capsys",
    "capfd", "request", "recwarn", "listener_manager", "testing_team", "frozen_sleep", "cap_structlog",
    "create_task_of_operator", "run_task", "mock_xcom_backend", "secret_key", "clean_executor_loader",
}  # fmt: skip
PROJECT_MARKERS = ("proves", "guard")
# The harness's multi-base helpers (tests/unit/harness/series.py): whether the base's queue carries a patch.
# An export always holds the patches its tests need (as dependencies), so a ``skipif`` on them is dropped,
# not inlined.
PROJECT_CONDITIONS = {"carries"}
# The harness's marker factories (tests/unit/harness/series.py): ``guard_since(version, patch)`` is a ``guard`` or
# a ``proves`` marker by the base's release, so it goes like them.
PROJECT_MARK_FACTORIES = {"guard_since"}
MARK = ".series-export"  # in every export folder: only a folder holding it is ever replaced


def marker_call(node: ast.expr) -> tuple[str, list[ast.expr]] | None:
    """``pytest.mark.NAME(args)`` or ``pytest.mark.NAME`` -> (NAME, args), else None."""
    call = node if isinstance(node, ast.Call) else None
    target = call.func if call else node
    if isinstance(target, ast.Attribute) and ast.unparse(target.value) == "pytest.mark":
        return target.attr, list(call.args) if call else []
    return None


def is_project_mark(node: ast.expr) -> bool:
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in PROJECT_MARK_FACTORIES
    ):
        return True
    m = marker_call(node)
    if m and m[0] == "skipif":
        return any(isinstance(n, ast.Name) and n.id in PROJECT_CONDITIONS for a in m[1] for n in ast.walk(a))
    return bool(m and m[0] in PROJECT_MARKERS)


# --------------------------------------------------------------------------------------------------
# Which test proves which patch: asked of pytest itself (series_collect.py), not parsed from source.
# --------------------------------------------------------------------------------------------------
def collect(root: Path, python: str) -> list[dict]:
    """Collect ``tests/unit`` with pytest (``--collect-only``, nothing runs) and the series_collect plugin.

    ``python`` must be able to import the test modules (the export session's venv: the patched tree).
    The collection gets its own ``AIRFLOW_HOME`` and a sqlite DSN: no database is opened.
    """
    with tempfile.TemporaryDirectory(prefix="series-collect.") as tmp:
        out = Path(tmp) / "items.json"
        (Path(tmp) / "home").mkdir()
        paths = [str(Path(__file__).parent), str(root), os.environ.get("PYTHONPATH", "")]
        env = {
            **os.environ,
            "SERIES_COLLECT_OUT": str(out),
            "PYTHONPATH": os.pathsep.join(p for p in paths if p),
            "AIRFLOW_HOME": str(Path(tmp) / "home"),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{tmp}/collect.db",
            "BACKEND": "sqlite",
        }
        cmd = [python, "-m", "pytest", "--collect-only", "-q", "--no-header", "-p", "series_collect",
               "-p", "no:cacheprovider", "--rootdir", str(root), str(root / "tests" / "unit")]  # fmt: skip
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
        if proc.returncode not in (0, 5) or not out.is_file():
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
            raise tree.TreeError(f"collecting tests/unit with {python} -m pytest failed:\n{tail}")
        return json.loads(out.read_text())["items"]


# Facts of the queue that the harness reads from patches/series, fixed in an export (upstream has no series file to
# read them from): ``V3`` (tests/unit/harness/series.py), whether the queue carries the failure patch of series v3.
# Every queue of a release carries it; the 3.4.0b2 queue not yet (fixed_at_export()).
V3_PATCH = "Fail-a-task-instance-in-the-caller-s-transaction.patch"


def fixed_at_export(root: Path) -> dict[str, str]:
    """The harness's facts of the selected base's queue, as module-level definitions of an export."""
    try:
        v3 = V3_PATCH in {p.name for p in tree.series(root)}
    except (tree.TreeError, OSError, KeyError):
        v3 = True  # no series file (a project-less root): as the queues of the releases
    return {
        "V3": "True  # series v3: the scheduler owns its transaction" if v3 else "False  # not series v3 yet"
    }


# --------------------------------------------------------------------------------------------------
# Source edits (byte spans: ast offsets are UTF-8 byte columns)
# --------------------------------------------------------------------------------------------------
class Edits:
    def __init__(self, source: str) -> None:
        self.data = source.encode()
        self.starts = [0]
        for line in self.data.splitlines(keepends=True):
            self.starts.append(self.starts[-1] + len(line))
        self.spans: list[tuple[int, int, bytes]] = []

    def pos(self, line: int, col: int) -> int:
        return self.starts[line - 1] + col

    def lines(self, first: int, last: int) -> None:
        """Delete whole lines first..last (1-based, inclusive)."""
        self.spans.append((self.starts[first - 1], self.starts[min(last, len(self.starts) - 1)], b""))

    def node(self, node: ast.AST, replacement: str = "") -> None:
        start = self.pos(node.lineno, node.col_offset)  # type: ignore[attr-defined]
        end = self.pos(node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined]
        self.spans.append((start, end, replacement.encode()))

    def element(self, node: ast.AST) -> None:
        """Delete an element of a sequence (or a keyword argument) with its comma."""
        b = self.data
        start = self.pos(node.lineno, node.col_offset)  # type: ignore[attr-defined]
        end = self.pos(node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined]
        j = end
        while j < len(b) and b[j : j + 1] in (b" ", b"\t"):
            j += 1
        if b[j : j + 1] == b",":
            j += 1
            while j < len(b) and b[j : j + 1] in (b" ", b"\t"):
                j += 1
            self.spans.append((start, j, b""))
            return
        k = start - 1
        while k >= 0 and b[k : k + 1] in (b" ", b"\t", b"\n"):
            k -= 1
        self.spans.append((k if b[k : k + 1] == b"," else start, end, b""))

    def apply(self) -> str:
        out, last = [], 0
        for start, end, text in sorted(self.spans):
            if start < last:  # inside a span already deleted
                continue
            out += [self.data[last:start], text]
            last = end
        out.append(self.data[last:])
        lines = b"".join(out).decode().splitlines()
        text = "\n".join(line.rstrip() for line in lines)
        return re.sub(r"\n{4,}", "\n\n\n", text).strip("\n") + "\n"


def first_line(node: ast.AST) -> int:
    decorators = getattr(node, "decorator_list", [])
    return min([d.lineno for d in decorators] + [node.lineno])  # type: ignore[attr-defined]


def parametrize_names(decorator: ast.expr) -> list[str]:
    m = marker_call(decorator)
    if not m or m[0] != "parametrize" or not m[1]:
        return []
    names = m[1][0]
    if isinstance(names, ast.Constant) and isinstance(names.value, str):
        return [n.strip() for n in names.value.split(",") if n.strip()]
    if isinstance(names, ast.List | ast.Tuple):
        return [e.value for e in names.elts if isinstance(e, ast.Constant)]
    return []


def strip_marks(edits: Edits, marks: ast.expr, drop_whole: ast.AST) -> None:
    """Remove project-only markers from ``marks`` (a marker, or a list/tuple of them)."""
    if isinstance(marks, ast.List | ast.Tuple):
        project = [e for e in marks.elts if is_project_mark(e)]
        if project and len(project) == len(marks.elts):
            edits.element(drop_whole) if isinstance(drop_whole, ast.keyword) else edits.lines(
                first_line(drop_whole),
                drop_whole.end_lineno,  # type: ignore[attr-defined]
            )
        else:
            for e in project:
                edits.element(e)
    elif is_project_mark(marks):
        if isinstance(drop_whole, ast.keyword):
            edits.element(drop_whole)
        else:
            edits.lines(first_line(drop_whole), drop_whole.end_lineno)  # type: ignore[attr-defined]


def for_upstream(source: str, patch: str, items: list[dict]) -> tuple[str, bool]:
    """Strip a test module to the tests proving ``patch`` (as collected), without project-only markers.

    A test function (or class) stays if any of its collected items proves ``patch``; a parametrize case
    whose items all prove another patch goes; ``proves``/``guard`` markers go wherever they are
    (decorators, ``pytestmark``, ``pytest.param(..., marks=...)``). Returns (source, any test proves it).
    """
    module = ast.parse(source)
    edits = Edits(source)
    by_func: dict[tuple[str | None, str], list[dict]] = {}
    for it in items:
        by_func.setdefault((it["cls"], it["func"]), []).append(it)
    found = any(it["proves"] == patch for it in items)

    def keep(cls: str | None, func: str) -> bool:
        return any(it["proves"] == patch for it in by_func.get((cls, func), []))

    def edit_function(node: ast.FunctionDef | ast.AsyncFunctionDef, cls: str | None) -> None:
        mine = by_func.get((cls, node.name), [])
        for d in node.decorator_list:
            if is_project_mark(d):
                edits.lines(d.lineno, d.end_lineno)  # type: ignore[arg-type]
                continue
            names = parametrize_names(d)
            m = marker_call(d)
            if not names or not m or len(m[1]) < 2 or not isinstance(m[1][1], ast.List | ast.Tuple):
                continue
            for index, case in enumerate(m[1][1].elts):
                proving = {it["proves"] for it in mine if it["indices"].get(names[0]) == index}
                if proving and patch not in proving and proving != {None}:
                    edits.element(case)  # a case that proves another patch
                    continue
                if isinstance(case, ast.Call) and ast.unparse(case.func) == "pytest.param":
                    for kw in case.keywords:
                        if kw.arg == "marks":
                            strip_marks(edits, kw.value, kw)

    for node in module.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
            strip_marks(edits, node.value, node)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test"):
            if keep(None, node.name):
                edit_function(node, None)
            else:
                edits.lines(first_line(node), node.end_lineno)  # type: ignore[arg-type]
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            methods = [n for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
            tests = [n for n in methods if n.name.startswith("test")]
            if not any(keep(node.name, n.name) for n in tests):
                edits.lines(first_line(node), node.end_lineno)  # type: ignore[arg-type]
                continue
            for d in node.decorator_list:
                if is_project_mark(d):
                    edits.lines(d.lineno, d.end_lineno)  # type: ignore[arg-type]
            for n in tests:
                if keep(node.name, n.name):
                    edit_function(n, node.name)
                else:
                    edits.lines(first_line(n), n.end_lineno)  # type: ignore[arg-type]
    return edits.apply(), found


# --------------------------------------------------------------------------------------------------
# Project-only names: inlined from where the project defines them (its harness modules, helper modules,
# sibling test modules), so that the exported module stands alone in upstream's harness.
# --------------------------------------------------------------------------------------------------
def project_module(root: Path, module: str | None, level: int = 0) -> Path | None:
    """The project file a ``from MODULE import ...`` names (``tests.unit...``), else None."""
    if level or not module or not (module == "tests" or module.startswith("tests.") or "conftest" in module):
        return None
    base = root / Path(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate.resolve()
    return None


def top_level(module: ast.Module) -> dict[str, ast.stmt]:
    """Name -> the top-level statement that binds it (defs, classes, simple assignments, imports)."""
    names: dict[str, ast.stmt] = {}
    for node in module.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        names.setdefault(n.id, node)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                names.setdefault((alias.asname or alias.name).split(".")[0], node)
        elif isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for imp in node.body:  # type-only imports: copied into an `if TYPE_CHECKING:` block
                if isinstance(imp, ast.Import | ast.ImportFrom):
                    imp.type_checking = True  # type: ignore[attr-defined]
                    for alias in imp.names:
                        names.setdefault((alias.asname or alias.name).split(".")[0], imp)
    return names


def guarded_names(module: ast.Module) -> set[str]:
    """Names bound only inside a module-level block (``if HAS_X:`` imports, ``try``/``except ImportError``), which
    :func:`top_level` leaves out: an inlined helper that uses one would name nothing in the export."""
    bound = set()
    for node in module.body:
        if isinstance(node, ast.If | ast.Try | ast.With) and not (
            isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        ):
            for n in ast.walk(node):
                if isinstance(n, ast.Import | ast.ImportFrom):
                    bound |= {(a.asname or a.name).split(".")[0] for a in n.names}
                elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                    bound.add(n.id)
    return bound - set(top_level(module))


def one_import(node: ast.stmt, name: str) -> str | None:
    """The import of ``name`` alone that the statement ``node`` makes (its alias kept), else None."""
    if isinstance(node, ast.Import | ast.ImportFrom):
        for alias in node.names:
            if (alias.asname or alias.name).split(".")[0] == name:
                if isinstance(node, ast.ImportFrom):
                    return ast.unparse(ast.ImportFrom(module=node.module, names=[alias], level=node.level))
                return ast.unparse(ast.Import(names=[alias]))
    return None


def segment(source_lines: list[str], node: ast.stmt) -> str:
    return "".join(source_lines[first_line(node) - 1 : node.end_lineno])


class Inliner:
    """Copies project definitions (and what they use, transitively) into one exported module."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.fixed = fixed_at_export(root)
        self.cache: dict[Path, tuple[str, ast.Module, dict[str, ast.stmt]]] = {}

    def parsed(self, path: Path) -> tuple[str, ast.Module, dict[str, ast.stmt]]:
        if path not in self.cache:
            text = path.read_text()
            module = ast.parse(text)
            self.cache[path] = (text, module, top_level(module))
        return self.cache[path]

    def aliases(self, module: ast.Module) -> tuple[dict[str, Path], dict[str, tuple[Path, str]]]:
        """(local name -> project module it names, local name -> (project module, name) it imports)."""
        modules: dict[str, Path] = {}
        names: dict[str, tuple[Path, str]] = {}
        for node in ast.walk(module):  # function-local imports too
            if isinstance(node, ast.ImportFrom):
                origin = project_module(self.root, node.module, node.level)
                if origin is None:
                    continue
                for alias in node.names:
                    sub = project_module(self.root, f"{node.module}.{alias.name}")
                    if sub is not None:
                        modules[alias.asname or alias.name] = sub
                    else:
                        names[alias.asname or alias.name] = (origin, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if (origin := project_module(self.root, alias.name)) is not None and alias.asname:
                        modules[alias.asname] = origin
        return modules, names

    def inline(
        self, text: str, path: Path, fixtures: set[tuple[Path, str]]
    ) -> tuple[str, list[str], list[str]]:
        """Return (new text, names inlined, project-only names that could not be inlined).

        ``fixtures``: (defining file, name) of project fixtures the kept tests request.
        """
        module = ast.parse(text)
        own = top_level(module)
        modules, names = self.aliases(module)
        edits = Edits(text)
        left: list[str] = []
        removed: set[int] = set()
        needs: list[tuple[Path, str]] = sorted(fixtures)
        for node in ast.walk(module):  # the project imports themselves go (function-local ones too)
            if isinstance(node, ast.ImportFrom) and project_module(self.root, node.module, node.level):
                edits.lines(node.lineno, node.end_lineno)  # type: ignore[arg-type]
                removed.add(id(node))
            elif isinstance(node, ast.Import) and any(project_module(self.root, a.name) for a in node.names):
                edits.lines(node.lineno, node.end_lineno)  # type: ignore[arg-type]
                removed.add(id(node))
                # ``import tests.unit.x`` (no ``as``): its ``tests.unit.x.name`` uses are not rewritten
                left.extend(
                    f"{a.name.split('.')[0]} (import {a.name}: a dotted use is not inlined)"
                    for a in node.names
                    if not a.asname and project_module(self.root, a.name)
                )
            elif (  # `clock = other_module.clock`: the definition itself is inlined instead
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Attribute)
                and isinstance(node.value.value, ast.Name)
                and node.value.value.id in modules
                and node.value.attr == node.targets[0].id
            ):
                needs.append((modules[node.value.value.id], node.value.attr))
                edits.lines(node.lineno, node.end_lineno)  # type: ignore[arg-type]
                removed.add(id(node))
        used = {n.id for n in ast.walk(module) if isinstance(n, ast.Name)}
        for local, (origin, name) in names.items():
            if local not in used:  # imported for tests the export dropped (or a dropped skipif)
                continue
            needs.append((origin, name))
            if local != name:
                left.append(f"{local} (imported as another name: {name})")
        rewritten = {id(n) for stmt in module.body if id(stmt) in removed for n in ast.walk(stmt)}
        for n in ast.walk(module):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in modules:
                if id(n) not in rewritten:
                    needs.append((modules[n.value.id], n.attr))
                    edits.node(n, n.attr)
                    rewritten.add(id(n))
        defs: list[str] = []
        imports: list[str] = []
        type_imports: list[str] = []
        done: set[tuple[Path, str]] = set()
        emitted: set[int] = set()
        inlined: list[str] = []
        taken = {name: "own" for name, node in own.items() if id(node) not in removed}
        own_guarded = guarded_names(module)

        def visit(origin: Path, name: str) -> None:
            if (origin, name) in done:
                return
            done.add((origin, name))
            if origin.resolve() == path.resolve():
                return
            src, mod, top = self.parsed(origin)
            node = top.get(name)
            if node is None:
                left.append(f"{name} (from {origin.relative_to(self.root)})")
                return
            if isinstance(node, ast.Import | ast.ImportFrom):
                if isinstance(node, ast.ImportFrom) and (
                    sub := project_module(self.root, node.module, node.level)
                ):
                    for alias in node.names:
                        if (alias.asname or alias.name) == name:
                            visit(sub, alias.name)
                    return
                for alias in node.names:
                    if (alias.asname or alias.name).split(".")[0] == name:
                        one = (
                            ast.ImportFrom(module=node.module, names=[alias], level=node.level)
                            if isinstance(node, ast.ImportFrom)
                            else ast.Import(names=[alias])
                        )
                        line = ast.unparse(one)
                        if taken.get(name) == "own" and one_import(own[name], name) != line:
                            # The module binds the name otherwise (``from datetime import timezone`` where the
                            # helper uses airflow's ``timezone``): the copy would call the module's.
                            left.append(f"{name} (the module binds another: the inlined helpers use {line})")
                        elif name in taken and taken[name] != line and taken[name] != "own":
                            left.append(f"{name} (import clashes)")
                        elif name not in taken:
                            taken[name] = line
                            if getattr(node, "type_checking", False):
                                type_imports.append(line)
                                visit(origin, "TYPE_CHECKING")
                            else:
                                imports.append(line)
                return
            if name in UPSTREAM_FIXTURES and isinstance(node, ast.FunctionDef):
                return  # upstream's tests_common provides it (the project's harness mirrors it)
            if name in self.fixed and name not in taken:
                taken[name] = "def"
                defs.append(f"{name} = {self.fixed[name]}")
                return
            if name in taken:
                same = name in own and ast.dump(own[name]) == ast.dump(node)
                if taken[name] == "own" and not same:
                    left.append(f"{name} (from {origin.relative_to(self.root)}: the module defines another)")
                return
            if any(isinstance(n, ast.Name) and n.id == "__file__" for n in ast.walk(node)):
                # A path relative to the helper's own file (the project's root, its scripts/ci, its
                # pyproject.toml) names another place once copied into an upstream test module.
                left.append(f"{name} (from {origin.relative_to(self.root)}: a path from its __file__)")
                return
            taken[name] = "def"
            if id(node) in emitted:  # ``A, B = ...`` binds several names: one copy
                return
            emitted.add(id(node))
            o_modules, o_names = self.aliases(mod)
            o_edits = Edits(segment(src.splitlines(keepends=True), node))
            shift = first_line(node) - 1
            refs: list[tuple[Path, str]] = []
            # A function-local import from a project module (e.g. a fixture importing a helper lazily): the
            # import goes, its names are inlined like the module's own project imports.
            for n in ast.walk(node):
                if (
                    n is not node
                    and isinstance(n, ast.ImportFrom)
                    and (sub := project_module(self.root, n.module, n.level)) is not None
                ):
                    o_edits.lines(n.lineno - shift, n.end_lineno - shift)  # type: ignore[operator]
                    for a in n.names:
                        if a.asname and a.asname != a.name:
                            left.append(f"{a.asname} (imported as another name: {a.name})")
                        refs.append((sub, a.name))
            local = {
                (a.asname or a.name).split(".")[0]
                for n in ast.walk(node)
                if isinstance(n, ast.Import | ast.ImportFrom)
                and n is not node
                and not (isinstance(n, ast.ImportFrom) and project_module(self.root, n.module, n.level))
                for a in n.names
            }
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):  # its parameters and local variables
                local |= {a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)}
                local |= {
                    n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
                }
            annotations = set()
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):  # evaluated where the def is
                args = node.args.args + node.args.kwonlyargs + node.args.posonlyargs
                for a in [node.returns, *(x.annotation for x in args)]:
                    annotations |= {id(m) for m in ast.walk(a)} if a is not None else set()
            for n in ast.walk(node):
                if isinstance(n, ast.Name) and n.id in local and id(n) not in annotations:
                    continue
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in o_modules:
                    refs.append((o_modules[n.value.id], n.attr))
                    o_edits.spans.append(
                        (
                            o_edits.pos(n.lineno - shift, n.col_offset),
                            o_edits.pos(n.end_lineno - shift, n.end_col_offset),  # type: ignore[operator]
                            n.attr.encode(),
                        )
                    )
                elif isinstance(n, ast.Name) and n.id != name and n.id in top:
                    if n.id in o_names:
                        refs.append(o_names[n.id])
                    elif n.id not in o_modules:
                        refs.append((origin, n.id))
                elif (
                    isinstance(n, ast.Name)
                    and n.id in guarded_names(mod)
                    and n.id not in taken
                    and n.id not in own_guarded
                ):
                    left.append(
                        f"{n.id} (from {origin.relative_to(self.root)}: bound in a module-level block)"
                    )
            for ref in refs:
                visit(*ref)
            defs.append(o_edits.apply())
            inlined.append(f"{name} (from {origin.relative_to(self.root)})")

        for origin, name in needs:
            visit(origin, name)
        body = edits.apply()
        if not defs and not imports:
            return body, inlined, left
        lines = body.splitlines(keepends=True)
        new_module = ast.parse(body)
        last_import = max(
            (n.end_lineno or 0 for n in new_module.body if isinstance(n, ast.Import | ast.ImportFrom)),
            default=0,
        )
        block = "".join(i + "\n" for i in imports)
        if type_imports:
            block += "\nif TYPE_CHECKING:\n" + "".join(f"    {i}\n" for i in type_imports)
        # The definitions go before the module's first def/class, after its constants (an inlined default
        # argument may use a constant the module defines identically), unless a constant uses them.
        names = {n for d in defs for n in top_level(ast.parse(d))}
        at = last_import
        for n in new_module.body:
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                at = first_line(n) - 1
                break
            if (
                not isinstance(n, ast.Import | ast.ImportFrom)
                and {m.id for m in ast.walk(n) if isinstance(m, ast.Name)} & names
            ):
                break
        if at == last_import or not defs:
            at = last_import
            text = "".join(lines[:at]) + block
        else:
            text = "".join(lines[:last_import]) + block + "\n" + "".join(lines[last_import:at])
        if defs:
            text += (
                "\n\n# Inlined from the patch series' harness (defined in its harness / helper modules).\n"
            )
            text += "\n\n".join(d.rstrip("\n") + "\n" for d in defs)
        text += "\n\n" + "".join(lines[at:])
        return re.sub(r"\n{4,}", "\n\n\n", text), inlined, left


def prune(text: str) -> str:
    """Drop top-level helpers, constants and imports nothing left in the module uses (repeatedly)."""
    while True:
        module = ast.parse(text)
        used: set[str] = set()
        shadowed: set[int] = set()  # names a function imports itself do not use the module's import
        for f in ast.walk(module):
            if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef):
                mine = {
                    (a.asname or a.name).split(".")[0]
                    for i in ast.walk(f)
                    if isinstance(i, ast.Import | ast.ImportFrom)
                    for a in i.names
                }
                outer = {  # annotations are evaluated where the def is, not in its body
                    id(m)
                    for a in [f.returns, *(x.annotation for x in f.args.args + f.args.kwonlyargs)]
                    if a is not None
                    for m in ast.walk(a)
                }
                shadowed |= {
                    id(n)
                    for n in ast.walk(f)
                    if isinstance(n, ast.Name) and n.id in mine and id(n) not in outer
                }
        for n in ast.walk(module):
            if isinstance(n, ast.Name) and id(n) not in shadowed:
                used.add(n.id)
            elif isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
                used |= {a.arg for a in n.args.args + n.args.kwonlyargs + n.args.posonlyargs}
            elif isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.isidentifier():
                used.add(n.value)  # usefixtures("name"), getfixturevalue("name"), __all__
        edits = Edits(text)
        changed = False
        for node in module.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                if node.name.startswith(("test", "Test")) or node.name in used:
                    continue
                if any(
                    "fixture" in ast.unparse(d) and "autouse" in ast.unparse(d) for d in node.decorator_list
                ):
                    continue
                edits.lines(first_line(node), node.end_lineno)  # type: ignore[arg-type]
                changed = True
            elif isinstance(node, ast.Assign) and all(
                isinstance(t, ast.Name)
                or (isinstance(t, ast.Tuple | ast.List) and all(isinstance(e, ast.Name) for e in t.elts))
                for t in node.targets
            ):  # ``A = ...`` or ``A, B = ...``: goes when none of its names is used
                ids = {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
                if ids & {"pytestmark", "__all__"} or ids & used_outside(module, node):
                    continue
                edits.lines(node.lineno, node.end_lineno)  # type: ignore[arg-type]
                changed = True
            elif isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
                imports = [n for n in node.body if isinstance(n, ast.Import | ast.ImportFrom)]
                unused = [
                    n for n in imports if not any((a.asname or a.name).split(".")[0] in used for a in n.names)
                ]
                if unused and len(unused) == len(node.body):
                    edits.lines(node.lineno, node.end_lineno)  # type: ignore[arg-type]
                    changed = True
                elif unused:
                    for n in unused:
                        edits.lines(n.lineno, n.end_lineno)  # type: ignore[arg-type]
                    changed = True
            elif isinstance(node, ast.ImportFrom | ast.Import):
                if isinstance(node, ast.ImportFrom) and node.module == "__future__":
                    continue
                keep = [a for a in node.names if (a.asname or a.name).split(".")[0] in used]
                if len(keep) == len(node.names):
                    continue
                changed = True
                if not keep:
                    edits.lines(node.lineno, node.end_lineno)  # type: ignore[arg-type]
                else:
                    node.names = keep
                    edits.node(node, ast.unparse(node))
        if not changed:
            return text
        text = edits.apply()


def used_outside(module: ast.Module, stmt: ast.stmt) -> set[str]:
    inner = {id(n) for n in ast.walk(stmt)}
    return {n.id for n in ast.walk(module) if isinstance(n, ast.Name) and id(n) not in inner}


def find_tests(root: Path, patch: str, items: list[dict]) -> dict[str, tuple[str, list[str], list[str]]]:
    """Upstream path (``airflow-core/tests/unit/...``) -> (module for upstream, names inlined, names left).

    ``items``: what :func:`collect` returned. Names left: project-only names the module still uses
    (fixtures upstream does not provide and that could not be inlined, imports from the project).
    """
    unit = (root / "tests" / "unit").resolve()
    by_file: dict[str, list[dict]] = {}
    for it in items:
        by_file.setdefault(it["file"], []).append(it)
    inliner = Inliner(root)
    found = {}
    for file, its in sorted(by_file.items()):
        if not any(it["proves"] == patch for it in its):
            continue
        path = Path(file)
        kept = [it for it in its if it["proves"] == patch]
        text, _ = for_upstream(path.read_text(), patch, its)
        fixtures = set()
        for it in kept:
            for name, where in it["fixtures"].items():
                origin = Path(where["file"]) if where["file"] else None
                if name in UPSTREAM_FIXTURES or origin is None or origin == path:
                    continue
                if origin.is_relative_to(unit):
                    fixtures.add((origin, name))
        text, inlined, left = inliner.inline(text, path, fixtures)
        text = prune(text)
        module = ast.parse(text)
        # What prune dropped (a helper only a dropped marker used, e.g. ``proves(_applied_last(...))``, and
        # what it alone pulled in from the harness) is neither inlined nor a name left.
        referenced = {n.id for n in ast.walk(module) if isinstance(n, ast.Name)}
        left = [name for name in left if name.split(" ", 1)[0] in referenced]
        bound = top_level(module)
        inlined = [name for name in inlined if name.split(" ", 1)[0] in bound]
        defined = {n.name for n in module.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
        for it in kept:
            for name, where in it["fixtures"].items():
                if name in UPSTREAM_FIXTURES or name in defined:
                    continue
                origin = Path(where["file"]) if where["file"] else None
                if origin is None or origin.is_relative_to(unit):
                    left.append(f"fixture {name}")
        left += [
            f"import from {n.module}"
            for n in ast.walk(module)
            if isinstance(n, ast.ImportFrom) and (project_module(root, n.module, n.level) or n.level)
        ]
        rel = path.relative_to(unit).as_posix()
        found[f"airflow-core/tests/unit/{rel}"] = (text, inlined, sorted(set(left)))
    return found


def commit(repo: Path, patch: Path, files: dict[str, str] | None = None) -> None:
    """Apply ``patch`` to the index of ``repo`` (plus ``files``) and commit it with its own message."""
    tree.git(repo, "apply", "--cached", "-p2", str(patch))
    for rel, text in (files or {}).items():
        blob = subprocess.run(["git", "-C", str(repo), "hash-object", "-w", "--stdin"], input=text, text=True,
                              capture_output=True, check=True).stdout.strip()  # fmt: skip
        tree.git(
            repo, "update-index", "--add", "--cacheinfo", f"100644,{blob},{rel.removeprefix('airflow-core/')}"
        )
    info = subprocess.run(["git", "mailinfo", "-k", os.devnull, os.devnull], input=patch.read_text(), text=True,
                          capture_output=True, check=True).stdout  # fmt: skip
    head = dict(line.split(": ", 1) for line in info.splitlines() if ": " in line)
    msg = trailers.read_message(patch)
    body = msg.body + "\n\n" + "".join(f"{k}: {v}\n" for k, v in msg.trailers)
    env = {"GIT_AUTHOR_NAME": head.get("Author", "unknown"), "GIT_AUTHOR_EMAIL": head.get("Email", "unknown"),
           "GIT_AUTHOR_DATE": head.get("Date", "")}  # fmt: skip
    subprocess.run(["git", "-C", str(repo), "commit", "-q", "--no-verify", "-F", "-"], input=f"{msg.subject}\n\n{body}",
                   text=True, env={**os.environ, **tree.GIT_ENV, **env}, check=True, capture_output=True)  # fmt: skip


def touched(patch: Path) -> set[str]:
    return set(re.findall(r"^diff --git a/(\S+) b/", patch.read_text(errors="replace"), flags=re.M))


def files_in(folder: Path) -> set[str]:
    """The files below ``folder`` (relative paths), its marker left out."""
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if not p.is_dir()} - {MARK}


def refuse_out(out: Path) -> None:
    """Refuse an ``--out`` that is not an earlier export or holds files the export did not write."""
    if out.is_symlink() or (out.exists() and not (out / MARK).is_file()):
        raise tree.TreeError(
            f"{out} exists and is not an export made by export.py (no {MARK} in it, or a symbolic link): "
            "refusing to replace it; give another --out or move it away"
        )
    if not out.exists():
        return
    written = marked(out)
    if added := sorted(files_in(out) - set(written)):
        raise tree.TreeError(
            f"{out} holds files export.py did not write ({', '.join(added)}): refusing to replace it; "
            "move them away first"
        )
    edited = [f for f, sha in written.items() if sha and (out / f).is_file() and sha256_of(out / f) != sha]
    if edited:
        raise tree.TreeError(
            f"{out}: {', '.join(sorted(edited))} changed since export.py wrote it: refusing to replace it; "
            "save your changes elsewhere (or give another --out) first"
        )


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def marked(out: Path) -> dict[str, str | None]:
    """The files the marker of ``out`` lists, with the sha256 they were written with (None: an older marker)."""
    found: dict[str, str | None] = {}
    for line in (out / MARK).read_text().splitlines()[1:]:
        m = re.fullmatch(r"([0-9a-f]{64})  (.+)", line)
        found[m[2] if m else line] = m[1] if m else None
    return found


def export(root: Path, name: str, out: Path, logs: list[Path], items: list[dict]) -> Exported:
    """Write the export folder; return what it holds (notes are printed for the user, also in PR.md)."""
    for log in logs:
        if not log.is_file():
            raise tree.TreeError(f"--verify {log}: no such file")
    refuse_out(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        result = write_export(root, name, staging / "new", logs, items)
        # The marker lists what the export wrote and its sha256: a later export replaces the folder only if
        # nothing was added or edited.
        written = [f"{sha256_of(staging / 'new' / f)}  {f}" for f in sorted(files_in(staging / "new"))]
        (staging / "new" / MARK).write_text("\n".join([f"export.py {name}", *written]) + "\n")
        if out.exists():
            out.rename(staging / "old")
        (staging / "new").rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return result


@dataclass
class Exported:
    name: str
    notes: list[str]
    tests: dict[str, tuple[str, list[str], list[str]]]
    depends_on: list[str] = field(default_factory=list)
    fragment: str | None = None


def added_lines(patch: Path) -> str:
    return "\n".join(
        line[1:] for line in patch.read_text(errors="replace").splitlines() if line.startswith("+")
    )


def defined_names(patch: Path, repo: Path | None = None) -> set[str]:
    """Names a patch's added lines define (``def``/``class``/module assignments) that the base (``repo`` at
    ``base``) does not have anywhere in ``src``."""
    text = added_lines(patch)
    names = set(re.findall(r"^\s*(?:async\s+)?(?:def|class)\s+(\w+)", text, flags=re.M))
    names |= set(re.findall(r"^([A-Za-z_]\w*)\s*(?::[^=]+)?=", text, flags=re.M))
    names = {n for n in names if len(n) > 3}
    if repo is not None:
        names = {
            n
            for n in names
            if tree.git(repo, "grep", "-q", "-w", n, "base", "--", "src", check=False).returncode
        }
    return names


def prerequisites(repo: Path, patches: list[Path], patch: Path, declared: list[Path] = ()) -> list[Path]:
    """Earlier patches ``patch`` needs, transitively: those touching the same files when it does not apply to
    the base alone, those defining a name its added lines use (a function a later patch calls), and
    ``declared`` (``needs`` in ``patches/upstream.toml``: what its tests' scenario needs) with theirs."""
    alone = not tree.git(repo, "apply", "--cached", "--check", "-p2", str(patch), check=False).returncode
    needed: set[Path] = set(declared)
    defines = {p: defined_names(p, repo) for p in patches[: patches.index(patch)]}
    todo = [patch, *declared]
    while todo:
        current = todo.pop()
        words = set(re.findall(r"\w+", added_lines(current)))
        for p in patches[: patches.index(current)]:
            if p in needed:
                continue
            same_file = touched(p) & touched(current) and not (current is patch and alone)
            if same_file or defines[p] & words:
                needed.add(p)
                todo.append(p)
    return [p for p in patches if p in needed]


def declared_needs(root: Path, patches: list[Path], patch: Path) -> list[Path]:
    """The earlier patches ``patches/upstream.toml`` says ``patch``'s tests need (``needs = [...]``)."""
    names = patch_notes(root, patch).get("needs", [])
    earlier = {p.name: p for p in patches[: patches.index(patch)]}
    unknown = [n for n in names if n not in earlier]
    if unknown:
        raise tree.TreeError(
            f"patches/upstream.toml: {patch.name} needs {', '.join(unknown)}, not an earlier patch of the series"
        )
    return [earlier[n] for n in names]


def upstream_notes(root: Path) -> dict:
    """``patches/upstream.toml``: per-patch relation to upstream work, shared context, upstream test modules."""
    path = root / "patches" / "upstream.toml"
    return tomllib.loads(path.read_text()) if path.is_file() else {}


def patch_notes(root: Path, patch: Path) -> dict:
    """``patch``'s table in ``patches/upstream.toml``. A patch of a base's own queue (``patches/<base>/``) reads
    its ``[patches."<name>".bases."<base>"]`` keys over the shared ones (its ``needs`` name that queue's patches)."""
    notes = upstream_notes(root).get("patches", {}).get(patch.name, {})
    if patch.parent.name == "patches":
        return notes
    return {**notes, **notes.get("bases", {}).get(patch.parent.name, {})}


def write_export(root: Path, name: str, out: Path, logs: list[Path], items: list[dict]) -> Exported:
    patches = tree.series(root)
    by_name = {p.name: p for p in patches}
    if name not in by_name:
        raise tree.TreeError(f"{name} is not in patches/series ({', '.join(by_name) or 'empty'})")
    patch = by_name[name]
    tests = find_tests(root, name, items)
    notes = []
    if not tests:
        notes.append(
            f"no test in tests/unit is marked @pytest.mark.proves({name!r}): the PR has no regression test"
        )
    if any(inlined for _, inlined, _ in tests.values()):
        notes.append(
            "the imports of inlined helpers are appended after the module's own, unsorted: let upstream's "
            "prek hooks (ruff check --fix, ruff format) order them before pushing"
        )
    for path, (_, _, left) in tests.items():
        if left:
            notes.append(f"{path} uses what upstream's tests_common does not provide: {', '.join(left)}")
    with tempfile.TemporaryDirectory(prefix="export.") as tmp:
        repo = Path(tmp) / "repo"
        tree.git(root, "clone", "-q", "--shared", "--no-checkout", str(tree.core_dir(root)), str(repo))
        tree.git(repo, "update-ref", "--no-deref", "HEAD", "base^{commit}")
        tree.git(repo, "read-tree", "base")
        needed = prerequisites(repo, patches, patch, declared_needs(root, patches, patch))
        try:
            for p in needed:
                commit(repo, p)
            commit(repo, patch, {path: text for path, (text, _, _) in tests.items()})
        except subprocess.CalledProcessError:  # the same-file guess was not enough: every earlier patch
            tree.git(repo, "reset", "-q", "--soft", "base")
            tree.git(repo, "read-tree", "base")
            needed = patches[: patches.index(patch)]
            for p in needed:
                commit(repo, p)
            commit(repo, patch, {path: text for path, (text, _, _) in tests.items()})
        if needed:
            notes.append(
                f"depends on {', '.join(p.name for p in needed)} (exported before it, apply in order)"
            )
        out.mkdir()
        tree.git(repo, "format-patch", "-q", "--zero-commit", "--no-signature", "--src-prefix=a/airflow-core/",
                 "--dst-prefix=b/airflow-core/", "-o", str(out), "base..HEAD")  # fmt: skip
    for path, (text, _, _) in tests.items():
        (out / path).parent.mkdir(parents=True, exist_ok=True)
        (out / path).write_text(text)
    msg = trailers.read_message(patch)
    fragments = sorted(f for f in touched(patch) if f.startswith("airflow-core/newsfragments/"))
    if fragments:
        notes.append(
            f"newsfragment: {', '.join(fragments)} (in the patch; upstream's towncrier takes it as is)"
        )
    else:
        notes.append(
            "no newsfragment: upstream asks for one for significant (user-visible behaviour) changes; this "
            "patch changes no documented behaviour, its changelog line is the PR title"
        )
    result = Exported(name, notes, tests, [p.name for p in needed], fragments[0] if fragments else None)
    (out / "PR.md").write_text(description(root, msg, result, verification(name, logs), patches))
    return result


def verification(patch: str, logs: list[Path]) -> list[str]:
    """Rows ``| backend (server) | fails before | passes after | suite green |`` from verify-series output."""
    rows = []
    for log in logs:
        text = log.read_text(errors="replace")
        backend = re.search(r"verify-series on (\S+)", text)
        server = re.search(r"^database server: (.+)$", text, flags=re.M)
        row = re.search(rf"^\| {re.escape(patch)} +\|(.*)\|\s*$", text, flags=re.M)
        if backend and row:
            where = backend.group(1) + (f" ({server.group(1).strip()})" if server else "")
            rows.append(f"| {where} | " + " | ".join(c.strip() for c in row.group(1).split("|")) + " |")
    return rows


def upstream_module(notes: dict, path: str) -> str | None:
    rel = path.removeprefix("airflow-core/tests/unit/")
    return notes.get("test-modules", {}).get(rel)


def description(
    root: Path, msg: trailers.Message, result: Exported, rows: list[str], patches: list[Path]
) -> str:
    body = msg.body.rstrip().splitlines()
    references = []
    while body and (trailers.REFERENCE.fullmatch(body[-1].strip()) or not body[-1].strip()):
        references.insert(0, body.pop().strip())
    reference = "\n".join(r for r in references if r)
    what = "\n".join(body).strip()
    notes = upstream_notes(root)
    mine = patch_notes(root, next(p for p in patches if p.name == result.name))
    upstream = []
    if status := mine.get("status"):
        upstream.append(f"**Status:** {status.strip()}")
    if relation := mine.get("relation"):
        upstream.append(relation.strip())
    if context := notes.get("context", {}).get("text"):
        upstream.append(context.strip())
    test_lines = []
    for path, (_, inlined, left) in result.tests.items():
        line = f"- `{path}`"
        if target := upstream_module(notes, path):
            line += f": belongs in upstream's `airflow-core/tests/unit/{target}` (kept apart here while the series is in flux)"
        test_lines.append(line)
        if inlined:
            test_lines.append(f"  - project helpers inlined into it: {', '.join(inlined)}")
        test_lines.append(f"  - project-only names left: {', '.join(left) if left else 'none'}")
    if not test_lines:
        test_lines = ["- none"]
    if rows:
        verify = [
            "Each regression test fails on the base (+ the earlier patches of the series) and passes with "
            "this change (`nox -s verify-series-<db>`; matrix: the backends below):\n",
            "| backend | fails before | passes after | suite green at this step |",
            "|---|---|---|---|",
            *rows,
        ]
    else:
        verify = ["Not recorded here: run `nox -s verify-series-<db> | tee verify-<db>.log` and export with "
                  "`--verify verify-<db>.log` to fill this in (fail-before / pass-after per backend)."]  # fmt: skip
    names = [p.name for p in patches]
    depends = (
        ["This PR needs, merged first (their exports come first in this folder, apply in order):", ""]
        + [f"- {trailers.read_message(patches[names.index(d)]).subject} (`{d}`)" for d in result.depends_on]
        if result.depends_on
        else ["Applies to the release on its own."]
    )
    if why := mine.get("needs-why"):
        depends.append(f"\nNeeded for its tests' scenario, not for the patch to apply: {why.strip()}")
    k = names.index(result.name)
    if k:
        depends.append(
            f"\nIts tests were proven at base + patches 1..{k} of the series (this is patch {k + 1}); "
            "the patches it does not depend on textually may still be needed for a test's scenario."
        )
    status = "\n".join(f"- {key}: {value}" for key, value in msg.trailers)
    version = tree.base_config(root)["version"]
    base_note = notes.get("bases", {}).get(version, {})
    made_against = [base_note.get("made-against", f"apache-airflow-core {version} (PyPI sdist).")]
    if on_main := mine.get("on-main"):
        made_against.append(f"**On upstream main:** {on_main.strip()}")
    parts = [
        f"# {msg.subject}",
        what,
        reference,
        "## Made against\n\n" + "\n\n".join(m.strip() for m in made_against),
        "## Upstream status and related work\n\n" + "\n\n".join(upstream) if upstream else "",
        "## Depends on\n\n" + "\n".join(depends),
        "## Tests\n\nRegression tests (upstream paths; they use only the fixtures and markers upstream's "
        "`tests_common` pytest plugin provides):\n\n" + "\n".join(test_lines),
        "## Verification\n\n" + "\n".join(verify),
        "## Status in the series\n\n" + status,
        "## Before opening the PR\n\n" + "\n".join(f"- {n}" for n in result.notes),
    ]
    return "\n\n".join(p for p in parts if p) + "\n"


def index(results: list[Exported], root: Path) -> str:
    """The table ``--all`` writes to ``export/README.md``."""
    lines = [
        "",
        "One PR per patch, in dependency (series) order. Open them in this order.",
        "",
        "| # | patch | depends on | test modules exported | project-only names left | newsfragment |",
        "|---|---|---|---|---|---|",
    ]
    names = [r.name for r in results]
    for i, r in enumerate(results, 1):
        deps = ", ".join(str(names.index(d) + 1) for d in r.depends_on if d in names) or "-"
        mods = "<br>".join(f"`{p.removeprefix('airflow-core/tests/unit/')}`" for p in r.tests) or "**none**"
        left = "; ".join(f"{', '.join(v[2])}" for v in r.tests.values() if v[2]) or "none"
        lines.append(f"| {i} | `{r.name}` | {deps} | {mods} | {left} | {r.fragment or '-'} |")
    return "\n".join(lines) + "\n"


INDEX_HEAD = "<!-- written by scripts/ci/export.py --all; replaced by the next --all -->"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=tree.PROJECT, help="project root (default: %(default)s)")
    parser.add_argument("patch", nargs="?", help="patch file name (as listed in patches/series) or path")
    parser.add_argument("--all", action="store_true", help="export every patch of the series, in order")
    parser.add_argument(
        "--out", type=Path, help="output folder (default: export/<slug>/; with --all: export/)"
    )
    parser.add_argument("--verify", type=Path, action="append", default=[], help="saved verify-series output")
    parser.add_argument(
        "--python", default=sys.executable, help="interpreter that can import the tests (default: this one)"
    )
    args = parser.parse_args(argv)
    if bool(args.all) == bool(args.patch):
        parser.error("give one patch or --all")
    root = args.root.resolve()
    tree.exit_on_hangup()
    try:
        names = [p.name for p in tree.series(root)] if args.all else [Path(args.patch).name]
        base = args.out or root / "export"
        outs = {n: (base / n.removesuffix(".patch")) if args.all or not args.out else args.out for n in names}
        if not args.all and not args.out:
            outs = {names[0]: root / "export" / names[0].removesuffix(".patch")}
        for log in args.verify:
            if not log.is_file():
                raise tree.TreeError(f"--verify {log}: no such file")
        for out in outs.values():
            refuse_out(out)
        readme = base / "README.md"
        if args.all and readme.exists():
            head, _, rest = readme.read_text().partition("\n")
            sha, _, body = rest.partition("\n")
            if head != INDEX_HEAD:
                raise tree.TreeError(f"{readme} was not written by export.py --all: refusing to replace it")
            if re.fullmatch(r"<!-- sha256 [0-9a-f]{64} -->", sha) and sha[12:76] != sha256_text(body):
                raise tree.TreeError(
                    f"{readme} changed since export.py --all wrote it: refusing to replace it; save your "
                    "changes elsewhere first"
                )
        items = collect(root, args.python)
        results = [export(root, n, outs[n], args.verify, items) for n in names]
    except tree.TreeError as e:
        print(f"export.py: {e}", file=sys.stderr)
        return 1
    except subprocess.CalledProcessError as e:
        print(f"export.py: `{' '.join(map(str, e.cmd))}` failed:\n{e.stdout}{e.stderr}", file=sys.stderr)
        return 1
    for r in results:
        out = outs[r.name]
        print(f"exported {r.name} to {out}:")
        for f in sorted(out.rglob("*")):
            if f.is_file() and f.name != MARK:
                print(f"  {f.relative_to(out)}")
        for n in r.notes:
            print(f"note: {n}")
    if args.all:
        body = index(results, root)
        readme.write_text(f"{INDEX_HEAD}\n<!-- sha256 {sha256_text(body)} -->\n{body}")
        print(f"\n{readme}:\n{readme.read_text()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
