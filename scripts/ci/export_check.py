#!/usr/bin/env python3
"""
Check every export of ``export.py --all`` the way a reviewer would take it: on a pristine tree from the sdist.

``export_check.py [--export DIR] [PATCH ...]`` (run by ``nox -s export-check-<db>``: the session's venv,
its database in the environment as for ``pytest``):

1. exports the whole series with ``export.py --all`` into a throwaway directory (``--export DIR``: check
   an existing export instead);
2. unpacks the pinned, sha256-checked sdist (the one ``tree.py prepare`` uses) into a throwaway git
   repository in upstream's layout (``airflow-core/`` at its root, commit tagged ``base``);
3. for each export (``PATCH``: only these, by number or file name), from ``base``: ``git am`` the
   patches it depends on (the files before its own in the folder, in order), puts its test modules at
   their upstream paths (``airflow-core/tests/unit/...``) and runs them with pytest: they must fail
   (the patch itself is not applied); then ``git am`` its own patch, which adds the same modules, and
   runs them again: they must pass.

pytest runs in that tree with the tree's ``src`` first on ``PYTHONPATH`` (checked: ``airflow`` must be
imported from there, not from ``airflow-core/``) and with the project's ``tests/unit/conftest.py`` as a
plugin (``-p tests.unit.conftest``): it stands in for upstream's ``tests_common`` and gives the
upstream-named fixtures their upstream semantics. The task SDK's ``config_templates`` link in the venv
is pointed at the throwaway tree for the run and restored after.

Prints a table patch -> test modules exported -> project-only names left (from the export's PR.md)
-> git am -> without the patch -> with it -> verdict, and exits 1 unless every verdict is ``ok`` or
``skipped here`` (every test skipped on this backend, with the reason the test gives). The throwaway
directory is removed at the end, also on error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import tree  # noqa: E402

TESTS = Path("airflow-core") / "tests" / "unit"


class CheckError(Exception):
    pass


@dataclass
class Export:
    """One export folder: its patches (dependencies first, its own last), test modules, names left."""

    number: int
    name: str
    folder: Path
    patches: list[Path]
    modules: list[str]
    left: list[str]


@dataclass
class Run:
    """The outcome of one pytest run over an export's modules."""

    passed: int = 0
    failed: int = 0
    skipped: int = 0
    code: int = 0
    tail: str = ""
    skip_reasons: list[str] = field(default_factory=list)

    def cell(self) -> str:
        text = f"{self.failed} failed, {self.passed} passed"
        return text + (f", {self.skipped} skipped" if self.skipped else "")


@dataclass
class Row:
    export: Export
    am: str = "-"  # "ok" or what failed
    without: Run | None = None
    with_: Run | None = None
    note: str = ""
    base_ok: bool = (
        False  # every test of the patch says (base_ok_on) the base is not vulnerable on this backend
    )


def read_export(folder: Path, number: int, name: str) -> Export:
    """Read an export folder written by export.py (``NNNN-*.patch`` files, test modules, PR.md)."""
    if not (folder / ".series-export").is_file():
        raise CheckError(f"{folder}: not an export of export.py (no .series-export)")
    patches = sorted(folder.glob("[0-9][0-9][0-9][0-9]-*.patch"))
    if not patches:
        raise CheckError(f"{folder}: no NNNN-*.patch file")
    modules = sorted(p.relative_to(folder).as_posix() for p in (folder / TESTS).rglob("*.py"))
    pr = (folder / "PR.md").read_text() if (folder / "PR.md").is_file() else ""
    left = []
    for value in re.findall(r"project-only names left: (.+)$", pr, flags=re.M):
        if value.strip() != "none":
            left += [v.strip() for v in value.split(",")]
    return Export(number, name, folder, patches, modules, left)


def read_exports(export_dir: Path, names: list[str], wanted: list[str]) -> list[Export]:
    """The exports of the series' patches (``names``, in order), restricted to ``wanted`` (numbers or names)."""
    chosen = []
    for number, name in enumerate(names, 1):
        if (
            wanted
            and str(number) not in wanted
            and name not in wanted
            and name.removesuffix(".patch") not in wanted
        ):
            continue
        folder = export_dir / name.removesuffix(".patch")
        if not folder.is_dir():
            raise CheckError(f"{folder}: missing (run `nox -s export -- --all`, or drop --export)")
        chosen.append(read_export(folder, number, name))
    unknown = [w for w in wanted if not any(w in (str(e.number), e.name, e.name[:-6]) for e in chosen)]
    if unknown:
        raise CheckError(f"not in the series: {', '.join(unknown)}")
    return chosen


def read_junit(path: Path) -> Run:
    """Count passed / failed (failures and errors, collection errors too) / skipped in a junit file."""
    run = Run()
    if not path.is_file():
        return run
    for case in ET.parse(path).getroot().iter("testcase"):
        tags = {child.tag: child for child in case}
        if "failure" in tags or "error" in tags:
            run.failed += 1
        elif "skipped" in tags:
            run.skipped += 1
            run.skip_reasons.append(tags["skipped"].get("message", ""))
        else:
            run.passed += 1
    return run


def verdict(row: Row) -> str:
    """What the row proves: ``ok`` (fails without, passes with), ``skipped here``, or what is wrong."""
    if not row.export.modules:
        return "no test exported"
    if row.export.left:
        return "project-only names left"
    if row.am != "ok":
        return "git am failed"
    without, with_ = row.without, row.with_
    if without is None or with_ is None:
        return "not run"
    if with_.failed or (with_.code not in (0, 5) and not with_.passed + with_.skipped):
        return "fails with the patch"
    if not with_.passed:
        return "skipped here" if with_.skipped else "no test ran"
    if not without.failed:
        return "ok" if row.base_ok else "passes without the patch"
    return "ok"


GOOD = ("ok", "skipped here")


def skip_counts(run: Run | None) -> dict[str, int]:
    """Each skip reason of ``run`` and how many tests gave it, in first-seen order."""
    counts: dict[str, int] = {}
    for reason in run.skip_reasons if run else []:
        counts[reason] = counts.get(reason, 0) + 1
    return counts


def table(rows: list[Row], backend: str) -> str:
    lines = [
        f"| # | patch | test modules exported | project-only names left | git am | without the patch "
        f"({backend}) | with it ({backend}) | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        e = r.export
        mods = "<br>".join(f"`{m.removeprefix(TESTS.as_posix() + '/')}`" for m in e.modules) or "none"
        lines.append(
            f"| {e.number} | `{e.name.removesuffix('.patch')}` | {mods} | {', '.join(e.left) or 'none'} | "
            f"{r.am} | {r.without.cell() if r.without else '-'} | {r.with_.cell() if r.with_ else '-'} | "
            f"{verdict(r)}{f' ({r.note})' if r.note else ''} |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Running: a pristine tree from the sdist, git am, pytest.
# --------------------------------------------------------------------------------------------------
def pristine(root: Path, dest: Path) -> Path:
    """A git repository at ``dest`` with the sha256-checked sdist at ``airflow-core/``, tagged ``base``."""
    cfg = tree.base_config(root)
    dest.mkdir()
    tree.unpack_sdist(tree.fetch_sdist(cfg), dest / "airflow-core")
    tree.git(dest, "init", "-q", "-b", "main")
    tree.git(dest, "config", "core.autocrlf", "false")
    (dest / ".git" / "info" / "exclude").write_text("__pycache__/\n*.py[co]\n.pytest_cache/\n")
    tree.git(dest, "add", "-A")
    tree.git(dest, "commit", "-q", "-m", f"{cfg['package']} {cfg['version']} (pristine sdist)")
    tree.git(dest, "tag", "base")
    return dest


def git_am(repo: Path, patch: Path) -> str | None:
    """``git am`` one patch; None if it applied, else why not (the am is aborted)."""
    proc = tree.git(repo, "am", "-q", "--keep-cr", str(patch), check=False)
    if proc.returncode:
        tree.git(repo, "am", "--abort", check=False)
        return f"{patch.name}: " + " ".join((proc.stdout + proc.stderr).split())[:200]
    return None


def run_pytest(repo: Path, modules: list[str], root: Path) -> Run:
    """Run ``modules`` (paths in ``repo``) with pytest in ``repo/airflow-core`` and the project's conftest."""
    core = repo / "airflow-core"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(core / "src"), str(root)])}
    with tempfile.TemporaryDirectory(prefix="export-check-junit.") as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-ra", "--strict-markers", "-p", "no:cacheprovider",
               "-o", "asyncio_mode=strict", "-p", "tests.unit.conftest", f"--rootdir={core}",
               f"--junitxml={junit}", *(str(repo / m) for m in modules)]  # fmt: skip
        proc = subprocess.run(cmd, cwd=core, env=env, capture_output=True, text=True)
        run = read_junit(junit)
    run.code = proc.returncode
    run.tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-80:])
    if proc.returncode not in (0, 1) and not run.passed + run.failed + run.skipped:
        run.failed += 1  # pytest could not run the modules (import error in the conftest, usage error, ...)
    return run


def airflow_from(repo: Path, root: Path) -> Path:
    """Where ``import airflow`` finds the package with the tree's PYTHONPATH."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo / "airflow-core" / "src"), str(root)])}
    code = "import airflow, pathlib; print(pathlib.Path(airflow.__file__).resolve().parent)"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=repo)
    if proc.returncode:
        raise CheckError(
            f"`import airflow` failed with the throwaway tree on PYTHONPATH:\n{proc.stderr[-2000:]}"
        )
    return Path(proc.stdout.strip().splitlines()[-1])


def check_one(repo: Path, e: Export, root: Path) -> Row:
    row = Row(e)
    tree.git(repo, "reset", "-q", "--hard", "base")
    tree.git(repo, "clean", "-q", "-fdx")
    for p in e.patches[:-1]:
        if why := git_am(repo, p):
            row.am = f"failed: {why}"
            return row
    for m in e.modules:
        if (repo / m).exists():
            row.am, row.note = "ok", f"{m} exists before the patch"
            return row
        (repo / m).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(e.folder / m, repo / m)
    if e.modules:
        row.without = run_pytest(repo, e.modules, root)
    tree.git(repo, "clean", "-q", "-fdx")
    if why := git_am(repo, e.patches[-1]):
        row.am = f"failed: {why}"
        return row
    row.am = "ok"
    different = [
        m
        for m in e.modules
        if not (repo / m).is_file() or (repo / m).read_bytes() != (e.folder / m).read_bytes()
    ]
    if different:
        row.note = f"the patch's copy differs from the folder's: {', '.join(different)}"
        return row
    if e.modules:
        row.with_ = run_pytest(repo, e.modules, root)
    return row


def templates_link() -> Path:
    return Path(sysconfig.get_paths()["purelib"]) / "airflow" / "config_templates"


def expected_to_pass(row: Row, items: list[dict]) -> None:
    """Mark ``row`` ok when every test proving its patch names this backend in ``base_ok_on`` (the export drops
    the marker: upstream has none), i.e. the project says the base is not vulnerable here. ``items``: what
    ``export.collect`` returned."""
    backend = os.environ["BACKEND"]
    mine = [it for it in items if it["proves"] == row.export.name]
    if mine and all(backend in it["base_ok_on"] for it in mine):
        row.base_ok = True
        row.note = f"passes without it here: every test's base_ok_on names {backend}"


def check(root: Path, export_dir: Path | None, wanted: list[str], work: Path) -> list[Row]:
    names = [p.name for p in tree.series(root)]
    if export_dir is None:
        export_dir = work / "export"
        sys.path.insert(0, str(Path(__file__).parent))
        import export

        print(f"exporting the series into {export_dir} ...", flush=True)
        if export.main(["--root", str(root), "--all", "--out", str(export_dir), "--python", sys.executable]):
            raise CheckError("export.py --all failed (its message is above)")
    exports = read_exports(export_dir, names, wanted)
    repo = pristine(root, work / "repo")
    found = airflow_from(repo, root)
    if not found.is_relative_to(repo):
        raise CheckError(
            f"airflow is imported from {found}, not from the throwaway tree: is PYTHONPATH ignored?"
        )
    link = templates_link()
    old = os.readlink(link) if link.is_symlink() else None
    rows = []
    items: list[dict] | None = None
    try:
        if old is not None:  # the task SDK reads core's config.yml there (see noxfile.install)
            link.unlink()
            link.symlink_to(repo / "airflow-core" / "src" / "airflow" / "config_templates")
        for e in exports:
            print(
                f"[{e.number}/{len(names)}] {e.name}: {len(e.patches) - 1} dependencies, {len(e.modules)} module(s)",
                flush=True,
            )
            row = check_one(repo, e, root)
            if verdict(row) == "passes without the patch":
                if items is None:  # collected once, only when needed
                    import export

                    items = export.collect(root, sys.executable)
                expected_to_pass(row, items)
            rows.append(row)
            print(f"  -> {verdict(row)}", flush=True)
            for label, run in (("without", row.without), ("with", row.with_)):
                for reason, n in skip_counts(run).items():
                    print(f"  skipped {label} the patch: {n} x {reason}", flush=True)
            for label, run in (("without", row.without), ("with", row.with_)):
                if run and verdict(row) not in GOOD:
                    print(f"  pytest {label} the patch (exit {run.code}):\n{run.tail}", flush=True)
    finally:
        if old is not None:
            if link.is_symlink():
                link.unlink()
            link.symlink_to(old)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=tree.PROJECT, help="project root (default: %(default)s)")
    parser.add_argument(
        "--export", type=Path, help="check this export of `export.py --all` instead of a fresh one"
    )
    parser.add_argument("patch", nargs="*", help="only these patches (number in the series or file name)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    backend = os.environ.get("BACKEND")
    if not backend or not os.environ.get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"):
        print("export_check.py: run it in a test session's database (nox -s export-check-<db>): "
              "BACKEND and AIRFLOW__DATABASE__SQL_ALCHEMY_CONN are not set", file=sys.stderr)  # fmt: skip
        return 2
    tree.exit_on_hangup()
    work = Path(tempfile.mkdtemp(prefix="export-check."))
    try:
        rows = check(root, args.export.resolve() if args.export else None, args.patch, work)
    except (CheckError, tree.TreeError) as e:
        print(f"export_check.py: {e}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nexports checked on {backend}, pristine {tree.base_config(root)['version']} from the sdist:\n")
    print(table(rows, backend))
    bad = [r for r in rows if verdict(r) not in GOOD]
    print(
        f"\n{len(rows) - len(bad)} of {len(rows)} exports ok or skipped here"
        + (f"; wrong: {', '.join(str(r.export.number) for r in bad)}" if bad else "")
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
