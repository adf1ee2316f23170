#!/usr/bin/env python3
"""
Export one patch of the series as what an upstream pull request needs.

``export.py PATCH [--verify LOG ...] [--out DIR]`` writes ``export/<slug>/`` (``--out`` to change):

* ``NNNN-<slug>.patch`` ``git am`` input in upstream layout (``a/airflow-core/...``): the patch with its
  regression tests added at their upstream paths (``airflow-core/tests/unit/...``), its commit message
  and trailers unchanged. If the patch does not apply to the pristine base alone, the earlier patches
  of the series that touch the same files come first (numbered before it) and ``PR.md`` says so.
* ``airflow-core/tests/unit/...`` the same test modules as files: the tests marked
  ``@pytest.mark.proves("PATCH")``, without the project-only ``proves``/``guard`` markers and without
  tests that prove other patches.
* ``airflow-core/newsfragments/00000.bugfix.rst`` upstream's towncrier fragment
  (``<PR number>.<type>.rst``); ``00000`` is a placeholder until the PR has a number.
* ``PR.md`` title and description drafted from the commit message: what, why, tests, verification
  (fail-before / pass-after per backend, read from ``nox -s verify-series-<db>`` output saved with
  ``| tee LOG`` and given with ``--verify LOG``), and what to check before opening the PR.

The patch commits are made in a throwaway clone of ``airflow-core/`` (run ``tree.py prepare`` first);
the tree itself is not touched. The folder is built beside its target and moved into place only when
complete; an existing ``--out`` is replaced only if it is an earlier export (it holds ``.series-export``),
anything else is refused. ``--verify`` logs are checked before anything is written.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
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
    "capfd", "request", "recwarn",
}  # fmt: skip
PROJECT_MARKERS = ("proves", "guard")
MARK = ".series-export"  # in every export folder: only a folder holding it is ever replaced


def marker_call(node: ast.expr) -> tuple[str, list[ast.expr]] | None:
    """``pytest.mark.NAME(args)`` or ``pytest.mark.NAME`` -> (NAME, args), else None."""
    call = node if isinstance(node, ast.Call) else None
    target = call.func if call else node
    if isinstance(target, ast.Attribute) and ast.unparse(target.value) == "pytest.mark":
        return target.attr, list(call.args) if call else []
    return None


def proved_patch(decorators: list[ast.expr]) -> str | None:
    for d in decorators:
        m = marker_call(d)
        if m and m[0] == "proves" and m[1] and isinstance(m[1][0], ast.Constant):
            return m[1][0].value
    return None


def for_upstream(source: str, patch: str) -> tuple[str, bool, set[str]]:
    """Strip a test module to the tests proving ``patch``, without project-only markers.

    Returns (new source, whether any test proves ``patch``, project-only names it uses: fixtures
    upstream does not provide, imports from the project's conftest).
    """
    module = ast.parse(source)
    drop: list[tuple[int, int]] = []  # 1-based inclusive line spans to delete
    cuts: list[tuple[int, int, int]] = []  # (line, start col, end col) in-line cuts
    found = False
    module_proves = None
    defined = {n.name for n in ast.walk(module) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    params: set[str] = set()
    for node in module.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
            items = node.value.elts if isinstance(node.value, ast.List | ast.Tuple) else [node.value]
            module_proves = proved_patch(items)
            for item in items:
                if (m := marker_call(item)) and m[0] in PROJECT_MARKERS:
                    if item.lineno == item.end_lineno and item.lineno != node.lineno:
                        drop.append((item.lineno, item.end_lineno))
                    else:
                        cuts.append((item.lineno, item.col_offset, item.end_col_offset))
    tests = [
        n for n in ast.walk(module) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
    ]
    for node in tests:
        proves = proved_patch(node.decorator_list) or module_proves
        if node.name.startswith(("test", "Test")) and proves not in (None, patch):
            start = min([d.lineno for d in node.decorator_list] + [node.lineno])
            drop.append((start, node.end_lineno))
            continue
        if node.name.startswith("test") and proves == patch:
            found = True
            params |= {a.arg for a in node.args.args + node.args.kwonlyargs} - {"self"}
        for d in node.decorator_list:
            if (m := marker_call(d)) and m[0] in PROJECT_MARKERS:
                drop.append((d.lineno, d.end_lineno))
    lines = source.splitlines(keepends=True)
    for line, start, end in sorted(cuts, reverse=True):
        text = lines[line - 1]
        head, rest = text[:start], text[end:]
        if rest.startswith(","):
            rest = rest[1:].lstrip(" ")
        elif head.rstrip().endswith(","):  # the last element: drop the comma before it
            head = head.rstrip()[:-1]
        lines[line - 1] = head + rest
    gone = {n for a, b in drop for n in range(a, b + 1)}
    out = "".join(text for n, text in enumerate(lines, 1) if n not in gone)
    out = re.sub(r"\n{4,}", "\n\n\n", out).rstrip() + "\n"
    project_imports = {
        f"import from {n.module}"
        for n in ast.walk(module)
        if isinstance(n, ast.ImportFrom)
        and n.module
        and ("conftest" in n.module or n.module.startswith("tests."))
    }
    return out, found, (params - UPSTREAM_FIXTURES - defined) | project_imports


def find_tests(root: Path, patch: str) -> dict[str, tuple[str, set[str]]]:
    """Upstream path (``airflow-core/tests/unit/...``) -> (stripped source, foreign fixtures)."""
    found = {}
    for path in sorted((root / "tests" / "unit").rglob("test_*.py")):
        source = path.read_text()
        if patch not in source:
            continue
        text, proves, foreign = for_upstream(source, patch)
        if proves:
            rel = path.relative_to(root / "tests" / "unit").as_posix()
            found[f"airflow-core/tests/unit/{rel}"] = (text, foreign)
    return found


def verification(patch: str, logs: list[Path]) -> list[str]:
    """Rows ``| backend | fails before | passes after | suite green |`` from verify-series output."""
    rows = []
    for log in logs:
        text = log.read_text(errors="replace")
        backend = re.search(r"verify-series on (\S+)", text)
        row = re.search(rf"^\| {re.escape(patch)} +\|(.*)\|\s*$", text, flags=re.M)
        if backend and row:
            rows.append(
                f"| {backend.group(1)} | " + " | ".join(c.strip() for c in row.group(1).split("|")) + " |"
            )
    return rows


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


def export(root: Path, name: str, out: Path, logs: list[Path]) -> list[str]:
    """Write the export folder; return the notes printed for the user (also in PR.md)."""
    for log in logs:
        if not log.is_file():
            raise tree.TreeError(f"--verify {log}: no such file")
    if out.is_symlink() or (out.exists() and not (out / MARK).is_file()):
        raise tree.TreeError(
            f"{out} exists and is not an export made by export.py (no {MARK} in it, or a symbolic link): "
            "refusing to replace it; give another --out or move it away"
        )
    if out.exists() and (added := sorted(files_in(out) - set((out / MARK).read_text().splitlines()[1:]))):
        raise tree.TreeError(
            f"{out} holds files export.py did not write ({', '.join(added)}): refusing to replace it; "
            "move them away first"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        notes = write_export(root, name, staging / "new", logs)
        # The marker lists what the export wrote: a later export replaces the folder only if nothing was added.
        written = sorted(files_in(staging / "new"))
        (staging / "new" / MARK).write_text("\n".join([f"export.py {name}", *written]) + "\n")
        if out.exists():
            out.rename(staging / "old")
        (staging / "new").rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return notes


def write_export(root: Path, name: str, out: Path, logs: list[Path]) -> list[str]:
    patches = tree.series(root)
    by_name = {p.name: p for p in patches}
    if name not in by_name:
        raise tree.TreeError(f"{name} is not in patches/series ({', '.join(by_name) or 'empty'})")
    patch = by_name[name]
    tests = find_tests(root, name)
    notes = []
    if not tests:
        notes.append(
            f"no test in tests/unit is marked @pytest.mark.proves({name!r}): the PR has no regression test"
        )
    for path, (_, foreign) in tests.items():
        if foreign:
            notes.append(
                f"{path} uses what upstream's tests_common does not provide: {', '.join(sorted(foreign))}"
            )
    with tempfile.TemporaryDirectory(prefix="export.") as tmp:
        repo = Path(tmp) / "repo"
        tree.git(root, "clone", "-q", "--shared", "--no-checkout", str(tree.core_dir(root)), str(repo))
        tree.git(repo, "update-ref", "--no-deref", "HEAD", "base^{commit}")
        tree.git(repo, "read-tree", "base")
        prerequisites = []
        if tree.git(repo, "apply", "--cached", "--check", "-p2", str(patch), check=False).returncode:
            prerequisites = [p for p in patches[: patches.index(patch)] if touched(p) & touched(patch)]
            notes.append(
                f"depends on {', '.join(p.name for p in prerequisites)} (exported before it, apply in order)"
            )
        for p in prerequisites:
            commit(repo, p)
        commit(repo, patch, {path: text for path, (text, _) in tests.items()})
        out.mkdir()
        tree.git(repo, "format-patch", "-q", "--zero-commit", "--no-signature", "--src-prefix=a/airflow-core/",
                 "--dst-prefix=b/airflow-core/", "-o", str(out), "base..HEAD")  # fmt: skip
    for path, (text, _) in tests.items():
        (out / path).parent.mkdir(parents=True, exist_ok=True)
        (out / path).write_text(text)
    msg = trailers.read_message(patch)
    fragment = out / "airflow-core" / "newsfragments" / "00000.bugfix.rst"
    fragment.parent.mkdir(parents=True, exist_ok=True)
    fragment.write_text(msg.subject.rstrip(".") + ".\n")
    notes.append(
        "rename airflow-core/newsfragments/00000.bugfix.rst to <PR number>.bugfix.rst once the PR exists"
    )
    (out / "PR.md").write_text(description(msg, tests, verification(name, logs), notes))
    return notes


def description(msg: trailers.Message, tests: dict, rows: list[str], notes: list[str]) -> str:
    body = msg.body.rstrip().splitlines()
    references = []
    while body and (trailers.REFERENCE.fullmatch(body[-1].strip()) or not body[-1].strip()):
        references.insert(0, body.pop().strip())
    reference = "\n".join(r for r in references if r)
    what = "\n".join(body).strip()
    test_lines = [f"- `{p}`" for p in tests] or ["- none"]
    if rows:
        verify = [
            "| backend | fails before | passes after | suite green at this step |",
            "|---|---|---|---|",
            *rows,
        ]
        verify.insert(
            0, "Each regression test fails on the base (+ earlier patches) and passes with this change:\n"
        )
    else:
        verify = ["Not recorded here: run `nox -s verify-series-<db> | tee verify-<db>.log` and export with "
                  "`--verify verify-<db>.log` to fill this in (fail-before / pass-after per backend)."]  # fmt: skip
    status = "\n".join(f"- {k}: {v}" for k, v in msg.trailers)
    parts = [
        f"# {msg.subject}",
        what,
        reference,
        "## Tests\n\nRegression tests (upstream paths):\n\n" + "\n".join(test_lines),
        "## Verification\n\n" + "\n".join(verify),
        "## Status in the series\n\n" + status,
        "## Before opening the PR\n\n" + "\n".join(f"- {n}" for n in notes),
    ]
    return "\n\n".join(p for p in parts if p) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=tree.PROJECT, help="project root (default: %(default)s)")
    parser.add_argument("patch", help="patch file name (as listed in patches/series) or path")
    parser.add_argument("--out", type=Path, help="output folder (default: export/<slug>/)")
    parser.add_argument("--verify", type=Path, action="append", default=[], help="saved verify-series output")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    name = Path(args.patch).name
    out = args.out or root / "export" / name.removesuffix(".patch")
    tree.exit_on_hangup()
    try:
        notes = export(root, name, out, args.verify)
    except tree.TreeError as e:
        print(f"export.py: {e}", file=sys.stderr)
        return 1
    except subprocess.CalledProcessError as e:
        print(f"export.py: `{' '.join(map(str, e.cmd))}` failed:\n{e.stdout}{e.stderr}", file=sys.stderr)
        return 1
    print(f"exported {name} to {out}:")
    for f in sorted(out.rglob("*")):
        if f.is_file() and f.name != MARK:
            print(f"  {f.relative_to(out)}")
    for n in notes:
        print(f"note: {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
