"""verify_series.py judges real pytest results: a test that passes without its patch proves nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "ci"))
import verify_series  # noqa: E402

# The same junit properties tests/unit/conftest.py attaches to a test marked proves(...).
CONFTEST = """
import pytest

def pytest_collection_modifyitems(items):
    for item in items:
        m = item.get_closest_marker("proves")
        item.user_properties.append(("proves", m.args[0]))
        item.user_properties.append(("base_ok", "sqlite" in m.kwargs.get("base_ok_on", ())))
"""
TESTS = """
import pytest

@pytest.mark.proves("fix.patch")
def test_useless():
    assert True  # passes on the base: proves nothing

@pytest.mark.proves("fix.patch")
def test_real():
    assert False, "the bug, as on the base"

@pytest.mark.proves("fix.patch", base_ok_on=("sqlite",))
def test_not_vulnerable_here():
    assert True

@pytest.mark.proves("fix.patch")
def test_skipped():
    pytest.skip("cannot run on this backend")
"""


def run(tmp_path: Path) -> dict[str, verify_series.Outcome]:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_fix.py").write_text(TESTS)
    junit = tmp_path / "junit.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "markers=proves",
        str(tmp_path),
    ]
    subprocess.run([*cmd, f"--junitxml={junit}", f"--rootdir={tmp_path}"], capture_output=True, check=False)
    return verify_series.outcomes(junit)


def test_useless_test_is_reported_as_not_proving(tmp_path: Path):
    cell = verify_series.judge_before(run(tmp_path))
    assert [p.split("::")[-1] for p in cell.problems] == [
        "test_useless: passes without its patch: does not prove it"
    ]
    assert (cell.ok, cell.skipped) == (2, 1)
    assert str(cell) == "WRONG 2 (1 skipped)"


def test_failures_after_the_patch_are_wrong(tmp_path: Path):
    cell = verify_series.judge_passing(run(tmp_path), "with its patch")
    assert [p.split("::")[-1] for p in cell.problems] == ["test_real: fails with its patch"]
