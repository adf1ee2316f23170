"""scripts/ci/deploy_check.py: bad input is one line naming the cause (issue 31, item 5).

The full check (the released Airflow from the package index, migrate, rollback) runs as `nox -s
deploy-check-<db>`; these tests need no network.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "scripts" / "ci" / "deploy_check.py"


def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(CHECK), "--backend", "sqlite", *args], capture_output=True,
                          text=True, env={**os.environ, **env}, timeout=300)  # fmt: skip


def error_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("deploy_check.py: "), proc.stderr
    return lines[0]


def test_a_missing_wheel_is_named(tmp_path: Path):
    assert "no such wheel (`nox -s build` makes it)" in error_line(run("--wheel", str(tmp_path / "x.whl")))


def test_no_network_to_the_package_index_is_one_line_naming_the_step(tmp_path: Path):
    wheel = tmp_path / "apache_airflow_core-3.3.2+series.1.abc-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(
            "apache_airflow_core-3.3.2+series.1.abc.dist-info/METADATA", "Version: 3.3.2+series.1.abc\n"
        )
    closed = "http://127.0.0.1:9/simple"  # nothing listens on port 9 (discard)
    temp = tmp_path / "temp"
    temp.mkdir()
    env = {"UV_DEFAULT_INDEX": closed, "UV_INDEX_URL": closed, "PIP_INDEX_URL": closed, "TMPDIR": str(temp)}
    proc = run("--wheel", str(wheel), **env)
    line = error_line(proc)
    assert "[1] install the released apache-airflow==3.3.2 from the package index" in line
    assert "Failed to fetch: http://127.0.0.1:9/simple/" in line
    assert line.endswith("Connection refused (os error 111)")
    assert not list(temp.iterdir())  # its temporary folder (venv, AIRFLOW_HOME) is gone


def test_a_file_that_is_not_a_wheel_is_named(tmp_path: Path):
    """Before: a BadZipFile or StopIteration traceback (issue 31)."""
    text, empty = tmp_path / "notes.whl", tmp_path / "empty.whl"
    text.write_text("not a zip\n")
    with zipfile.ZipFile(empty, "w") as z:
        z.writestr("x.txt", "x")
    assert f"{text}: not a wheel (File is not a zip file)" in error_line(run("--wheel", str(text)))
    assert f"{empty}: not a wheel (no .dist-info/METADATA with a Version)" in error_line(
        run("--wheel", str(empty))
    )
