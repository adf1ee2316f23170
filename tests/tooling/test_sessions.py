"""The nox sessions with a DSN given like breeze does, SIGHUP and the tree lock (issue 15, cases 4, 5, 7, 9).

Runs real `nox` sessions of this project (its airflow-core/ and .nox/ venvs, built on first use) against a
throwaway PostgreSQL holding Airflow's schema and one row of the operator's data. Slow (a few minutes).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "ci"))
import dbserver  # noqa: E402

SECRET = "s3cret-pw"
ONE_TEST = "tests/unit/jobs/test_scheduler_callback_sink_signature.py"
NOX = shutil.which("nox")
pytestmark = pytest.mark.skipif(not NOX, reason="needs nox on PATH")


def nox(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "BACKEND",
                                                               "DB_RESET", "VIRTUAL_ENV")}  # fmt: skip
    return subprocess.run([NOX, "-f", str(ROOT / "noxfile.py"), *args], cwd=ROOT, env={**clean, **env},
                          capture_output=True, text=True, timeout=1200)  # fmt: skip


@pytest.fixture(scope="module")
def given():
    """A server the user "gives" us: Airflow's schema (made by the suite) and the operator's connection row."""
    if not any(Path("/usr/lib/postgresql").glob("*/bin/initdb")):
        pytest.skip("needs the postgresql package")
    from sqlalchemy import create_engine, text

    with dbserver.throwaway("postgres") as dsn:
        dsn = dsn.replace("postgres@", f"postgres:{SECRET}@")
        proc = nox(
            "-s",
            "tests-postgres",
            "--",
            ONE_TEST,
            AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=dsn,
            BACKEND="postgres",
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr  # an empty database is fine to use
        engine = create_engine(dsn)
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO connection (conn_id, conn_type, is_encrypted, is_extra_encrypted) "
                    "VALUES ('prod_db', 'postgres', false, false)"
                )
            )
        yield dsn, engine, proc.stdout + proc.stderr
        engine.dispose()


def connections(engine) -> list[str]:
    from sqlalchemy import text

    with engine.connect() as conn:
        return list(conn.execute(text("SELECT conn_id FROM connection")).scalars())


def test_database_holding_airflow_data_is_refused_and_the_password_never_printed(given):
    dsn, engine, first_run = given
    proc = nox(
        "-s", "tests-postgres", "--", ONE_TEST, AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=dsn, BACKEND="postgres"
    )
    out = proc.stdout + proc.stderr
    assert connections(engine) == ["prod_db"]
    assert proc.returncode != 0
    assert "holds Airflow data (rows in connection): refusing to reset it; DB_RESET=true" in out, out
    assert SECRET not in first_run + out


def test_pytest_run_directly_refuses_a_database_holding_airflow_data(given):
    """The suite's own guard (``_initialize_db``, tests/unit/harness/db.py), for pytest run without nox on the
    operator's DSN."""
    dsn, engine, _ = given
    python = ROOT / ".nox" / "tests-postgres" / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("DB_RESET", "VIRTUAL_ENV", "AIRFLOW_HOME")}
    env.update({"AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": dsn, "BACKEND": "postgres"})
    proc = subprocess.run([str(python), "-m", "pytest", "-p", "no:cacheprovider", ONE_TEST], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert connections(engine) == ["prod_db"]
    assert proc.returncode == 4, out
    assert "holds Airflow data (rows in connection): refusing to reset it" in out


@pytest.mark.parametrize("backend", [None, "postgres"])
def test_dsn_is_ignored_unless_backend_names_the_session(given, backend):
    dsn, engine, _ = given
    env = {"AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": dsn, **({"BACKEND": backend} if backend else {})}
    proc = nox("-s", "tests-sqlite", "--", ONE_TEST, **env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    why = "BACKEND is not set" if backend is None else "BACKEND=postgres"
    assert f"AIRFLOW__DATABASE__SQL_ALCHEMY_CONN is ignored by tests-sqlite ({why};" in out, out
    assert SECRET not in out
    assert connections(engine) == ["prod_db"]


def test_password_in_the_query_string_is_never_printed():
    """libpq and SQLAlchemy take ``?password=`` too; pytest's header showed it (hide_password masks the
    URL's password only)."""
    if not any(Path("/usr/lib/postgresql").glob("*/bin/initdb")):
        pytest.skip("needs the postgresql package")
    with dbserver.throwaway("postgres") as dsn:
        proc = nox(
            "-s",
            "tests-postgres",
            "--",
            ONE_TEST,
            AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"{dsn}?password={SECRET}",
            BACKEND="postgres",
        )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "backend postgres: postgresql+psycopg2://postgres@127.0.0.1:" in out  # the header is there
    assert SECRET not in out


def test_second_session_does_not_move_the_tree_while_one_holds_it():
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, tree; from pathlib import Path\n"
         "with tree.locked(Path(sys.argv[1]), 'nox -s verify-series-postgres'):\n"
         "    print('held', flush=True); sys.stdin.read()", str(ROOT)],
        cwd=ROOT / "scripts" / "ci", stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        proc = nox("-s", "prepare", SERIES_LOCK_TIMEOUT="1")
        assert proc.returncode != 0
        assert "airflow-core/ is in use by nox -s verify-series-postgres" in proc.stdout + proc.stderr
    finally:
        holder.communicate("", timeout=30)


def processes_with(variable: str) -> list[int]:
    """Pids of processes whose environment holds ``variable`` (``NAME=value``)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        with contextlib.suppress(OSError):
            if variable.encode() in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
    return found


def test_sighup_stops_the_session_its_server_and_removes_its_folders():
    """A closed terminal (SIGHUP to nox) while the tests run: no server, no temporary folder is left."""
    tmp = Path(tempfile.mkdtemp(prefix="sessions-test."))
    tmp.chmod(0o755)  # the postgres user must reach the server's folder inside it
    clean = {
        k: v for k, v in os.environ.items() if k not in ("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "BACKEND")
    }
    proc = subprocess.Popen([NOX, "-f", str(ROOT / "noxfile.py"), "-s", "tests-postgres", "--", ONE_TEST],
                            cwd=ROOT, env={**clean, "TMPDIR": str(tmp)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        log = []
        for line in proc.stderr:  # nox's log, until pytest starts (or nox ends)
            log.append(line)
            if line.startswith("nox > pytest "):
                break
        pidfiles = list(tmp.glob("airflow-series-postgres.*/data/postmaster.pid"))
        assert len(pidfiles) == 1, "the throwaway server is not running:\n" + "".join(log)
        port = int(pidfiles[0].read_text().splitlines()[3])  # postmaster.pid: pid, data dir, start, port
        proc.send_signal(signal.SIGHUP)
        proc.communicate(timeout=120)
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        deadline = time.monotonic() + 60
        while users := processes_with(f"TMPDIR={tmp}"):  # a child nox started must not outlive it
            assert time.monotonic() < deadline, f"processes of the session are still running: {users}"
            time.sleep(0.2)  # polling for processes to exit, bounded
        assert list(tmp.iterdir()) == [], "temporary folders are left behind"
    finally:
        if proc.poll() is None:
            proc.kill()
        for pidfile in tmp.glob("*/data/postmaster.pid"):  # what a failing run left: stop it
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pidfile.read_text().split()[0]), signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)


def test_ctrl_c_during_verify_series_puts_the_tree_back_and_says_so():
    """Ctrl-C (SIGINT to the terminal's process group) during a verify-series step: a message, no traceback,
    airflow-core/ back at the full series and clean, so a rerun starts from there."""
    clean = {
        k: v for k, v in os.environ.items() if k not in ("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "BACKEND")
    }
    proc = subprocess.Popen([NOX, "-f", str(ROOT / "noxfile.py"), "-s", "verify-series-sqlite"], cwd=ROOT,
                            env=clean, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True,
                            # as in a terminal: a session started in the background inherits SIGINT ignored
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    try:
        log = []
        for line in proc.stdout:  # until the first step's pytest runs (base + 0 patches)
            log.append(line)
            if line.startswith("[1/"):
                break
        assert log and log[-1].startswith("[1/"), "".join(log)
        time.sleep(3)  # let the step's pytest start; any moment of the step must do
        os.killpg(proc.pid, signal.SIGINT)
        out = "".join(log) + proc.communicate(timeout=300)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert "verify_series.py: interrupted; no verdict" in out, out
    assert "Traceback" not in out, out
    core = ROOT / "airflow-core"
    head = subprocess.run(
        ["git", "-C", str(core), "rev-parse", "HEAD", "series"], capture_output=True, text=True
    )
    assert len(set(head.stdout.split())) == 1, head.stdout
    status = subprocess.run(["git", "-C", str(core), "status", "--porcelain"], capture_output=True, text=True)
    assert status.stdout == ""


def _purge_trace_on(python: Path, dsn: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess, str]:
    """Run ``benchmarks/purge_trace.py`` (it resets its database) on ``dsn`` as a careless user would: no
    DB_RESET, no BACKEND; returns the process and its output."""
    env = {k: v for k, v in os.environ.items() if k not in ("DB_RESET", "VIRTUAL_ENV", "BACKEND")}
    env.update({"AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": dsn, "AIRFLOW_HOME": str(tmp_path / "home")})
    proc = subprocess.run([str(python), "benchmarks/purge_trace.py", str(ROOT)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    return proc, proc.stdout + proc.stderr


def test_benchmark_run_directly_refuses_a_database_that_is_not_airflows_and_holds_rows(tmp_path):
    """An application's database (no alembic_version) whose ``log`` table holds its rows: Airflow's reset
    drops and recreates ``log`` (and keeps ``orders``), so the rows would be lost; it is refused like one
    holding Airflow data, and nothing is changed."""
    from sqlalchemy import create_engine, text

    python = ROOT / ".nox" / "tests-sqlite" / "bin" / "python"
    if not python.exists():  # the venv of tests-sqlite: the patched tree, airflow importable
        assert nox("-s", "tests-sqlite", "--", ONE_TEST).returncode == 0
    dsn = f"sqlite:///{tmp_path / 'app.db'}"
    engine = create_engine(dsn)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE log (id INTEGER PRIMARY KEY, msg VARCHAR(50))"))
        conn.execute(text("INSERT INTO log (msg) VALUES ('app audit row')"))
        conn.execute(text("CREATE TABLE orders (id INTEGER PRIMARY KEY)"))
    proc, out = _purge_trace_on(python, dsn, tmp_path)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT msg FROM log")).scalars().all() == ["app audit row"], out
    engine.dispose()
    assert proc.returncode == 1, out
    assert "not an Airflow database (no alembic_version table) and holds rows (in log)" in out, out


def test_benchmark_run_directly_refuses_a_database_holding_airflow_data(tmp_path):
    """benchmarks/ reset the database of AIRFLOW__DATABASE__SQL_ALCHEMY_CONN, where an operator's Airflow may
    have put it: one holding Airflow data is refused unless DB_RESET=true (the rule of the test sessions)."""
    from sqlalchemy import create_engine, text

    python = ROOT / ".nox" / "tests-sqlite" / "bin" / "python"
    if not python.exists():  # the venv of tests-sqlite: the patched tree, airflow importable
        assert nox("-s", "tests-sqlite", "--", ONE_TEST).returncode == 0
    dsn = f"sqlite:///{tmp_path / 'prod.db'}"
    engine = create_engine(dsn)
    with engine.begin() as conn:  # not Airflow's schema: the one table the check reads, with a row
        conn.execute(text("CREATE TABLE dag (dag_id VARCHAR(250) PRIMARY KEY)"))
        conn.execute(text("INSERT INTO dag VALUES ('prod')"))
    proc, out = _purge_trace_on(python, dsn, tmp_path)
    assert proc.returncode == 1, out
    assert "holds Airflow data (rows in dag): refusing to reset it" in out, out
    with engine.connect() as conn:
        assert conn.execute(text("SELECT dag_id FROM dag")).scalars().all() == ["prod"]
    engine.dispose()


def test_an_async_dsn_in_the_environment_is_not_the_tests_async_engine(tmp_path: Path):
    """An operator's exported AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC was Airflow's async engine in the
    tests while the sync one was the session's throwaway database (issue 31)."""
    (tmp_path / "showasync.py").write_text(
        "def pytest_sessionstart(session):\n"
        "    from airflow import settings\n\n"
        "    print(f'\\nASYNC-DSN={settings.SQL_ALCHEMY_CONN_ASYNC}\\n', flush=True)\n"
    )
    operators = f"sqlite+aiosqlite:///{tmp_path}/operators.db"
    proc = nox("-s", "tests-sqlite", "--", ONE_TEST, "-p", "showasync", "-s",
               PYTHONPATH=str(tmp_path), AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC=operators)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC is ignored: the async engine uses the session's" in out
    shown = next(line for line in out.splitlines() if line.startswith("ASYNC-DSN="))
    assert "operators.db" not in shown and "/airflow-series-sqlite." in shown, shown
