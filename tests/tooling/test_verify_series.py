"""verify_series.py judges real pytest results: a test that passes without its patch proves nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "ci"))
import verify_series  # noqa: E402

# The same junit properties tests/unit/harness/series.py attaches to a test marked proves(...).
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


# One pytest run per tree state (verify()): step j's tests (patch j's and the guards), then, last, the
# tests of patch j + 1 (--proves-last, which tests/unit/harness/series.py orders last; this conftest does the
# same).
MERGED_CONFTEST = """
import pytest

@pytest.fixture(scope="session")
def shared():
    yield
    import os
    if os.environ.get("BREAK_SESSION_TEARDOWN"):
        raise RuntimeError("a session fixture's teardown fails")

def pytest_collection_modifyitems(items):
    for item in items:
        m = item.get_closest_marker("proves")
        if m:
            item.user_properties.append(("proves", m.args[0]))
            item.user_properties.append(("base_ok", False))
        if item.get_closest_marker("guard"):
            item.user_properties.append(("guard", True))
    last = [i for i in items if (m := i.get_closest_marker("proves")) and m.args[0] == "next.patch"]
    items[:] = [i for i in items if i not in last] + last
"""
MERGED_TESTS = """
import pytest

LEFT_BEHIND = []

@pytest.mark.proves("next.patch")
def test_next_bug(shared):
    LEFT_BEHIND.append("state of a failing test")
    assert False, "the bug patch 2 fixes, as at base + 1"

@pytest.mark.proves("next.patch")
def test_next_passes(shared):
    assert True  # proves nothing: must be reported

@pytest.mark.proves("fix.patch")
def test_fix(shared):
    assert not LEFT_BEHIND, "run after a failing test of the next patch"

def test_guard(shared):
    assert not LEFT_BEHIND
"""
# A test of the next patch that is also a guard: a separate run of step j's suite (--proves 1..j --guards)
# selects it, so it must pass there.
GUARD_OF_NEXT = """
import pytest

@pytest.mark.guard
@pytest.mark.proves("next.patch")
def test_next_and_guard():
    assert False
"""


def run_merged(tmp_path: Path, **env: str) -> dict[str, verify_series.Outcome]:
    (tmp_path / "conftest.py").write_text(MERGED_CONFTEST)
    (tmp_path / "test_merged.py").write_text(MERGED_TESTS)
    junit = tmp_path / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly"]
    cmd += ["-o", "markers=proves", f"--junitxml={junit}", f"--rootdir={tmp_path}", str(tmp_path)]
    subprocess.run(cmd, capture_output=True, check=False, env={**os.environ, **env})
    return verify_series.outcomes(junit)


def short(cell: verify_series.Cell) -> tuple[str, list[str]]:
    return str(cell), [p.split("::")[-1] for p in cell.problems]


def test_merged_run_judges_the_step_and_the_next_patch_apart(tmp_path: Path):
    after, suite, before = verify_series.judge_run(run_merged(tmp_path), 1, "fix.patch", "next.patch")
    assert short(after) == ("ok 1", [])
    assert short(suite) == ("ok 2", [])  # the next patch's failing test is not in the step's suite
    assert short(before) == ("WRONG 1", ["test_next_passes: passes without its patch: does not prove it"])


def test_merged_run_first_and_last_step(tmp_path: Path):
    results = run_merged(tmp_path)
    assert verify_series.judge_run(results, 0, None, "next.patch")[:2] == (None, None)
    after, suite, before = verify_series.judge_run(results, 2, "next.patch", None)
    assert before is None
    assert short(suite)[0] == "WRONG 3"  # without a next patch, every test is the step's


def test_session_teardown_error_on_the_last_test_is_no_proof(tmp_path: Path):
    """pytest reports a session fixture's failing teardown on the run's last test, a next patch's test."""
    results = run_merged(tmp_path, BREAK_SESSION_TEARDOWN="1")
    assert results["test_merged::test_next_passes"].teardown_only
    _, suite, before = verify_series.judge_run(results, 1, "fix.patch", "next.patch")
    assert short(suite) == ("ok 2", [])
    assert str(before) == "WRONG 1"
    assert [p.split("::")[-1].split(":")[0] for p in before.problems] == ["test_next_passes"]
    assert "error in teardown" in before.problems[0]


def test_a_run_that_dies_names_its_last_test_and_keeps_stderr(tmp_path: Path, monkeypatch):
    """No junit report (the process died in a test, or a usage error): say where, with pytest's stderr."""
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    (tmp_path / "tests" / "unit" / "test_dies.py").write_text(
        "import os\n\ndef test_fine():\n    pass\n\ndef test_dies():\n    os._exit(3)\n"
    )
    monkeypatch.setattr(verify_series, "ROOT", tmp_path)
    with pytest.raises(RuntimeError) as died:
        verify_series.run_pytest(["-p", "no:randomly"], [])
    assert "(exit 3," in str(died.value)
    last_line = str(died.value).split("stderr:")[0].rstrip().splitlines()[-1]
    assert last_line.startswith("tests/unit/test_dies.py::test_dies")
    with pytest.raises(RuntimeError) as usage:
        verify_series.run_pytest(["--no-such-option"], [])
    assert "unrecognized arguments: --no-such-option" in str(usage.value)


def test_a_guard_of_the_next_patch_is_also_in_the_steps_suite(tmp_path: Path):
    (tmp_path / "test_guard_of_next.py").write_text(GUARD_OF_NEXT)
    _, suite, before = verify_series.judge_run(run_merged(tmp_path), 1, "fix.patch", "next.patch")
    assert short(suite) == ("WRONG 2", ["test_next_and_guard: fails at base + 1 patches"])
    assert before.ok == 2  # and it fails before the next patch, as its other test does


# A suite test leaves something behind that breaks only the setup of the next patch's test (run last): the
# merged run shows such a failure in the "fails before" cell ("N in setup") instead of passing it off silently.
SETUP_LEFTOVER_TESTS = """
import pytest

LEFT_BEHIND = []

@pytest.fixture
def clean():
    assert not LEFT_BEHIND, "the step's suite left something behind"

def test_guard_leaves_state():
    LEFT_BEHIND.append("a lock nobody released")

@pytest.mark.proves("next.patch")
def test_next_bug(clean):
    assert False, "the bug"
"""


def test_fail_before_in_setup_is_shown(tmp_path: Path):
    (tmp_path / "conftest.py").write_text(MERGED_CONFTEST)
    (tmp_path / "test_leftover.py").write_text(SETUP_LEFTOVER_TESTS)
    junit = tmp_path / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly"]
    cmd += ["-o", "markers=proves", f"--junitxml={junit}", f"--rootdir={tmp_path}", str(tmp_path)]
    subprocess.run(cmd, capture_output=True, check=False)
    results = verify_series.outcomes(junit)
    assert results["test_leftover::test_next_bug"].setup_only
    _, _, before = verify_series.judge_run(results, 1, "fix.patch", "next.patch")
    assert short(before) == ("ok 1 (1 in setup)", [])
