"""scripts/ci/lint_series.py names the patch behind each ruff / mypy finding on the lines it changed.

A real series on the pinned base: a clean patch, a patch breaking upstream's ruff rules (relative import,
missing ``from __future__ import annotations``, unformatted code) and a patch adding a mypy error.
Needs git, the sdist, and ruff + mypy on PATH (the lint session installs them; skipped elsewhere).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from seriesproject import ROOT, SINK, add_flush, make_project, message  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (shutil.which("ruff") and shutil.which("mypy")),
    reason="needs ruff and mypy on PATH (nox -s lint has them)",
)
CLEAN = "Flush-the-callback-row-in-the-caller-s-session.patch"
RUFF = "Add-a-sink-helper.patch"
MYPY = "Count-callbacks-in-the-sink.patch"
HELPER = "src/airflow/callbacks/sink_helper.py"


def add_relative_import(text: str) -> str:
    return text + "\nfrom .base_callback_sink import BaseCallbackSink as Sink  # noqa: F401\n"


def new_helper(_: str) -> str:
    # No `from __future__ import annotations`, and a call the formatter would lay out differently.
    return 'import os\n\nVALUE = os.path.join( "a","b" )\n'


def add_type_error(text: str) -> str:
    old = '        """Send callback for execution."""\n'
    return text.replace(old, old + '        count: int = "none"\n        del count\n')


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess[str]:
    root = make_project(
        tmp_path_factory.mktemp("lint") / "project",
        [
            ({SINK: add_flush}, message("Flush the callback row in the caller's session")),
            ({SINK: add_relative_import, HELPER: new_helper}, message("Add a sink helper")),
            ({SINK: add_type_error}, message("Count callbacks in the sink")),
        ],
    )
    assert (root / "patches" / "series").read_text().split()[-3:] == [CLEAN, RUFF, MYPY]
    cmd = [sys.executable, str(ROOT / "scripts" / "ci" / "lint_series.py"), "--root", str(root)]
    return subprocess.run(cmd, capture_output=True, text=True)


def findings(report: subprocess.CompletedProcess[str], patch: str) -> list[str]:
    return [line for line in report.stdout.splitlines() if line.startswith(f"patches/{patch}: ")]


def test_lint_fails_and_the_clean_patch_is_not_named(report):
    assert report.returncode == 1, report.stdout + report.stderr
    assert findings(report, CLEAN) == []


def test_ruff_violations_name_the_patch_that_introduced_them(report):
    found = "\n".join(findings(report, RUFF))
    assert f"airflow-core/{SINK}:" in found and "TID252" in found  # relative import, upstream bans them
    assert f"airflow-core/{HELPER}:1: I002" in found  # from __future__ import annotations required
    assert f"airflow-core/{HELPER}:3: ruff format would reformat this line" in found


def test_new_mypy_error_names_its_patch_and_upstream_errors_do_not_count(report):
    found = findings(report, MYPY)
    assert len(found) == 1, report.stdout
    assert f"airflow-core/{SINK}:" in found[0]
    assert (
        'mypy: Incompatible types in assignment (expression has type "str", variable has type "int")'
        in found[0]
    )
    assert "mypy:" not in "\n".join(findings(report, RUFF))
