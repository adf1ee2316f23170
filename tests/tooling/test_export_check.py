"""export_check.py judges an export the way a reviewer would: its tests fail without the patch, pass with it.

Cheap: synthetic export folders, junit files written by a real pytest run, verdicts; no sdist, no database.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "ci"))
import export_check  # noqa: E402
from export_check import Export, Row, Run  # noqa: E402

TESTS = """
import pytest

def test_passes():
    assert True

def test_fails():
    assert False

def test_skipped():
    pytest.skip("no row lock on this backend")
"""


def make_export(tmp_path: Path, name: str, patches: int, modules: dict[str, str], left: str = "none") -> Path:
    folder = tmp_path / name.removesuffix(".patch")
    folder.mkdir()
    (folder / ".series-export").write_text(f"export.py {name}\n")
    for i in range(1, patches + 1):
        (folder / f"{i:04d}-patch-{i}.patch").write_text("")
    lines = []
    for path, text in modules.items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text(text)
        lines += [f"- `{path}`", f"  - project-only names left: {left}"]
    (folder / "PR.md").write_text("# title\n\n## Tests\n\n" + "\n".join(lines) + "\n")
    return folder


def test_read_export_dependencies_first_own_patch_last(tmp_path):
    module = "airflow-core/tests/unit/jobs/test_x.py"
    folder = make_export(tmp_path, "Fix-x.patch", 3, {module: "def test_a(): pass\n"})
    e = export_check.read_export(folder, 7, "Fix-x.patch")
    assert [p.name for p in e.patches] == ["0001-patch-1.patch", "0002-patch-2.patch", "0003-patch-3.patch"]
    assert e.modules == [module]
    assert e.left == []


def test_read_export_reports_names_left(tmp_path):
    modules = {"airflow-core/tests/unit/a/test_a.py": "", "airflow-core/tests/unit/b/test_b.py": ""}
    folder = make_export(tmp_path, "Fix-x.patch", 1, modules, left="other_session, scheduler_job_runner")
    e = export_check.read_export(folder, 1, "Fix-x.patch")
    assert e.left == ["other_session", "scheduler_job_runner"] * 2


def test_read_export_refuses_a_folder_export_py_did_not_write(tmp_path):
    folder = tmp_path / "Fix-x"
    folder.mkdir()
    (folder / "0001-x.patch").write_text("")
    with pytest.raises(export_check.CheckError, match="not an export"):
        export_check.read_export(folder, 1, "Fix-x.patch")


def test_read_exports_selects_by_number_or_name_and_names_unknown(tmp_path):
    names = ["A.patch", "B.patch", "C.patch"]
    for n in names:
        make_export(tmp_path, n, 1, {})
    chosen = export_check.read_exports(tmp_path, names, ["1", "C"])
    assert [(e.number, e.name) for e in chosen] == [(1, "A.patch"), (3, "C.patch")]
    with pytest.raises(export_check.CheckError, match="not in the series: 9"):
        export_check.read_exports(tmp_path, names, ["9"])
    (tmp_path / "B" / ".series-export").unlink()
    with pytest.raises(export_check.CheckError, match="B: not an export"):
        export_check.read_exports(tmp_path, names, [])


def test_read_junit_counts_a_real_pytest_run(tmp_path):
    (tmp_path / "test_mod.py").write_text(TESTS + "\nimport nonexistent_module_of_the_patch\n")
    junit = tmp_path / "junit.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        str(tmp_path),
    ]
    subprocess.run([*cmd, f"--rootdir={tmp_path}"], capture_output=True, check=False)
    run = export_check.read_junit(junit)
    # A module that cannot be imported without the patch is a failure (collection error), not "nothing ran".
    assert (run.failed, run.passed, run.skipped) == (1, 0, 0)
    (tmp_path / "test_mod.py").write_text(TESTS)
    subprocess.run([*cmd, f"--rootdir={tmp_path}"], capture_output=True, check=False)
    run = export_check.read_junit(junit)
    assert (run.failed, run.passed, run.skipped) == (1, 1, 1)
    assert run.skip_reasons == ["no row lock on this backend"]


def row(without: Run | None, with_: Run | None, modules=("m.py",), left=(), am="ok", base_ok=False) -> Row:
    r = Row(Export(1, "P.patch", Path("."), [], list(modules), list(left)), am, without, with_)
    r.base_ok = base_ok
    return r


@pytest.mark.parametrize(
    ("r", "expected"),
    [
        (row(Run(failed=2), Run(passed=2)), "ok"),
        (row(Run(failed=1, passed=1), Run(passed=2)), "ok"),  # one test the base passes too: the module fails
        (row(Run(failed=1, skipped=1), Run(passed=1, skipped=1)), "ok"),
        (row(Run(passed=2), Run(passed=2)), "passes without the patch"),
        (row(Run(passed=2), Run(passed=2), base_ok=True), "ok"),  # base_ok_on names this backend for each
        (row(Run(failed=2), Run(passed=1, failed=1)), "fails with the patch"),
        (row(Run(failed=2), Run(code=4)), "fails with the patch"),  # pytest could not run the modules
        (row(Run(skipped=2), Run(skipped=2)), "skipped here"),
        (row(Run(), Run(code=5)), "no test ran"),
        (row(None, None, modules=()), "no test exported"),
        (row(Run(failed=1), Run(passed=1), left=("other_session",)), "project-only names left"),
        (row(None, None, am="failed: 0002-x.patch: patch does not apply"), "git am failed"),
    ],
)
def test_verdict(r, expected):
    assert export_check.verdict(r) == expected


def test_table_has_one_row_per_export_and_the_cells(tmp_path):
    rows = [
        row(
            Run(failed=3, skipped=1),
            Run(passed=3, skipped=1),
            modules=["airflow-core/tests/unit/jobs/test_a.py"],
        ),
        row(None, None, am="failed: x"),
    ]
    text = export_check.table(rows, "postgres")
    lines = text.splitlines()
    assert len(lines) == 4
    assert "without the patch (postgres)" in lines[0]
    assert (
        "| `jobs/test_a.py` | none | ok | 3 failed, 0 passed, 1 skipped | 0 failed, 3 passed, 1 skipped | ok |"
        in lines[2]
    )
    assert lines[3].endswith("| failed: x | - | - | git am failed |")


def test_main_refuses_to_run_without_a_database(monkeypatch, capsys):
    monkeypatch.delenv("BACKEND", raising=False)
    monkeypatch.delenv("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", raising=False)
    assert export_check.main(["--export", "x"]) == 2
    assert "nox -s export-check-<db>" in capsys.readouterr().err


def test_skip_reasons_are_counted_for_the_log():
    """A row skipped here is printed with the reason each skipped test gives (and how many gave it)."""
    run = Run(skipped=3, skip_reasons=["no row lock on sqlite", "other", "no row lock on sqlite"])
    assert export_check.skip_counts(run) == {"no row lock on sqlite": 2, "other": 1}
    assert export_check.skip_counts(None) == {}
