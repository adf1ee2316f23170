#!/usr/bin/env python3
"""
Lint what the series changes in ``airflow-core/`` like upstream does, naming the patch behind each finding.

For the Python files the series adds or modifies (``git diff base series`` in ``airflow-core/``):

* ``ruff check`` and ``ruff format --diff`` with upstream's settings (``ruff-upstream.toml`` beside this
  file: line length 110, ``from __future__ import annotations`` required, no relative imports, ...);
* ``mypy`` (``--ignore-missing-imports``) on the touched modules, at ``base`` and at ``series``: only
  errors the series adds count, so upstream's own errors do not.

Only findings on lines the series changed are reported (and new mypy errors anywhere in the touched
modules); ``git blame base..series`` maps each line to the commit, and so the patch, that last changed it. The trees are read from git (``git archive``), so
the working tree of ``airflow-core/`` is neither read nor moved. Run with ruff and mypy on PATH, after
``tree.py prepare``. Exits 1 if anything is reported.

Usage: ``lint_series.py [--root ROOT] [--no-mypy]``
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import tree  # noqa: E402

CONFIG = Path(__file__).with_name("ruff-upstream.toml")
MYPY = ["--ignore-missing-imports", "--follow-imports=silent", "--python-version=3.10", "--no-error-summary",
        "--show-error-codes", "--no-pretty", "--no-color-output", "--hide-error-context"]  # fmt: skip
MYPY_LINE = re.compile(r"^(?P<path>[^:]+):(?P<line>\d+): error: (?P<msg>.*?)(?:  \[(?P<code>[\w-]+)\])?$")


def patch_commits(root: Path) -> dict[str, str]:
    """Map each commit of ``base..series`` in ``airflow-core/`` to its patch file name (series order)."""
    core = tree.core_dir(root)
    commits = tree.git(core, "rev-list", "--reverse", "base..series").stdout.split()
    names = [p.name for p in tree.series(root)]
    if len(commits) != len(names):
        raise tree.TreeError(
            f"airflow-core/ has {len(commits)} commit(s) above base but patches/series lists {len(names)}: "
            "run `nox -s prepare` (or `refresh` if you edited the tree)"
        )
    return dict(zip(commits, names))


def touched_files(core: Path) -> list[str]:
    """Python files (paths relative to ``airflow-core/``) that the series adds or modifies."""
    out = tree.git(core, "diff", "--name-only", "--diff-filter=AMR", "base", "series", "--", "*.py").stdout
    return sorted(out.split())


def changed_lines(core: Path, path: str, commits: dict[str, str]) -> dict[int, str]:
    """Line number at ``series`` -> patch name, for the lines of ``path`` the series wrote."""
    out = tree.git(core, "blame", "--line-porcelain", "base..series", "--", path).stdout
    lines, current = {}, None
    for text in out.splitlines():
        head = re.match(r"^([0-9a-f]{40}) \d+ (\d+)", text)
        if head:
            current = (head.group(1), int(head.group(2)))
        elif text.startswith("\t") and current and current[0] in commits:
            lines[current[1]] = commits[current[0]]
    return lines


def export(core: Path, ref: str, dest: Path) -> Path:
    """Write the tree of ``ref`` (its ``src/`` only) to ``dest`` and return it."""
    dest.mkdir(parents=True)
    archive = dest.with_suffix(".tar")
    tree.git(core, "archive", "-o", str(archive), ref, "src")
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    archive.unlink()
    return dest


def ruff_findings(work: Path, files: list[str]) -> list[tuple[str, int, int, str]]:
    """(path, first line, last line, message) for ``ruff check`` and ``ruff format --diff`` on ``files``."""
    found = []
    cmd = ["ruff", "check", "--config", str(CONFIG), "--no-cache", "--output-format=json", "--exit-zero"]
    for d in json.loads(
        subprocess.run([*cmd, *files], cwd=work, capture_output=True, text=True, check=True).stdout
    ):
        path = Path(d["filename"]).resolve().relative_to(work.resolve()).as_posix()
        msg = f"{d['code']} {d['message']}"
        found.append((path, d["location"]["row"], d["end_location"]["row"], msg))
    for path in files:
        proc = subprocess.run(["ruff", "format", "--config", str(CONFIG), "--no-cache", "--diff", path],
                              cwd=work, capture_output=True, text=True)  # fmt: skip
        if proc.returncode not in (0, 1):
            raise RuntimeError(f"ruff format failed on {path}:\n{proc.stderr}")
        old = 0
        for text in proc.stdout.splitlines():
            m = re.match(r"^@@ -(\d+)", text)
            if m:
                old = int(m.group(1))
            elif text.startswith("-") and not text.startswith("---"):
                found.append((path, old, old, "ruff format would reformat this line"))
                old += 1
            elif text.startswith(" "):
                old += 1
    return found


def mypy_errors(work: Path, files: list[str], cache: Path) -> list[tuple[str, int, str]]:
    """(path, line, "message [code]") for mypy errors in ``files`` (those that exist in ``work``)."""
    present = [f for f in files if (work / f).is_file()]
    if not present:
        return []
    cmd = ["mypy", *MYPY, f"--cache-dir={cache}", *present]
    proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True)
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"mypy could not run (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}")
    errors = []
    for text in proc.stdout.splitlines():
        m = MYPY_LINE.match(text)
        if m and m.group("path") in present:
            errors.append((m.group("path"), int(m.group("line")), f"{m.group('msg')} [{m.group('code')}]"))
    return errors


def new_mypy_errors(base: list[tuple[str, int, str]], series: list[tuple[str, int, str]]):
    """Errors at ``series`` beyond those at ``base`` with the same file and message (lines move)."""
    left = Counter((p, m) for p, _, m in base)
    new = []
    for p, line, m in series:
        if left[(p, m)]:
            left[(p, m)] -= 1
        else:
            new.append((p, line, m))
    return new


def lint(root: Path, with_mypy: bool = True) -> list[str]:
    """Return ``patches/NAME: airflow-core/PATH:LINE: message`` for every finding on a changed line."""
    core = tree.core_dir(root)
    commits = patch_commits(root)
    files = touched_files(core)
    if not files:
        return []
    owner = {f: changed_lines(core, f, commits) for f in files}
    findings: list[tuple[str, int, int, str]] = []
    with tempfile.TemporaryDirectory(prefix="lint-series.") as tmp:
        series_tree = export(core, "series", Path(tmp) / "series")
        findings += ruff_findings(series_tree, files)
        if with_mypy:
            # Per checkout (git-ignored .nox/) and base (.ci/run lints the bases at once): linters running at
            # the same time must not share one mypy cache (concurrent writers left it corrupt and mypy crashed
            # on the base export).
            cache = root / ".nox" / "mypy-cache" / tree.cfg_version(root)
            base_errors = mypy_errors(export(core, "base", Path(tmp) / "base"), files, cache / "base")
            series_errors = mypy_errors(series_tree, files, cache / "series")
            findings += [(p, n, n, f"mypy: {m}") for p, n, m in new_mypy_errors(base_errors, series_errors)]
    report = []
    for path, first, last, msg in sorted(set(findings)):
        patches = sorted({owner[path][n] for n in range(first, last + 1) if n in owner[path]})
        if patches:
            report.append(f"{', '.join('patches/' + p for p in patches)}: airflow-core/{path}:{first}: {msg}")
        elif msg.startswith("mypy:"):  # new, but on a line no patch wrote: caused by a change elsewhere
            report.append(f"the series (line not changed by it): airflow-core/{path}:{first}: {msg}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=tree.PROJECT, help="project root (default: %(default)s)")
    parser.add_argument("--no-mypy", action="store_true", help="ruff only")
    args = parser.parse_args(argv)
    try:
        report = lint(args.root.resolve(), with_mypy=not args.no_mypy)
    except tree.TreeError as e:
        print(f"lint_series.py: {e}", file=sys.stderr)
        return 1
    for line in report:
        print(line)
    print(f"lint-series: {len(report)} finding(s) on lines the series changed")
    return 1 if report else 0


if __name__ == "__main__":
    sys.exit(main())
