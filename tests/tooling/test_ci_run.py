""".ci/run with a stand-in `nox` (and stand-ins for its set-up commands): how the bases run side by side end."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Every nox call stands for a long one (a base's first is tooling/lint/tests): it records its pid, then waits.
FAKE_NOX = """#!/bin/sh
echo $$ >> "{pids}"
exec "{python}" -c 'import time; time.sleep(120)'
"""
FAKE_PYTHON = """#!/bin/sh
[ "$1 $2" = "-m pip" ] && exit 0  # .ci/run's `pip install nox uv`
exec "{python}" "$@"
"""


def executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] not in "ZX"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_to_ci_run_stops_the_sessions_of_every_base(tmp_path: Path, sig: signal.Signals):
    """CI's cancel or timeout sends SIGTERM to .ci/run: no base's session may go on without it."""
    pids = tmp_path / "pids"
    pids.touch()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    executable(bin_dir / "nox", FAKE_NOX.format(pids=pids, python=sys.executable))
    executable(bin_dir / "python3", FAKE_PYTHON.format(python=sys.executable))
    for name in ("pkg-config", "redis-server", "apt-get"):
        executable(bin_dir / name, "#!/bin/sh\nexit 0\n")
    # A copy of the repository's parts .ci/run reads: it writes .ci/logs/<base>.log beside itself, and the
    # real .ci/logs holds the last real run's logs.
    root = tmp_path / "root"
    (root / ".ci").mkdir(parents=True)
    shutil.copy(ROOT / ".ci" / "run", root / ".ci" / "run")
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    shutil.copytree(ROOT / "patches", root / "patches")
    run = subprocess.Popen(
        ["bash", str(root / ".ci" / "run")],
        env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    started: list[int] = []
    try:
        deadline = time.monotonic() + 60
        bases = len(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["airflow-series"]["bases"])
        while len(started) < bases and time.monotonic() < deadline:  # every base's first session
            started = [int(p) for p in pids.read_text().split()]
            time.sleep(0.1)  # polling a file, bounded by the deadline
        assert len(started) == bases, started
        run.send_signal(sig)
        code = run.wait(timeout=30)
        deadline = time.monotonic() + 15
        while any(alive(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.1)  # polling /proc, bounded by the deadline
        assert [p for p in started if alive(p)] == []
        assert code == 128 + sig  # exits like a shell stopped by that signal, after stopping the bases
    finally:
        for p in started:
            if alive(p):
                os.kill(p, signal.SIGKILL)
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
