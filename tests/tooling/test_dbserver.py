"""scripts/ci/dbserver.py: `check` keeps its deadline, names permanent errors at once and never prints a
password; throwaway servers go away on SIGHUP (issue 15, cases 4, 6, 7).

Needs SQLAlchemy and psycopg2 (the tooling session installs them); the server tests need the local
PostgreSQL / MariaDB binaries (packages postgresql, mariadb-server).
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
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DBSERVER = ROOT / "scripts" / "ci" / "dbserver.py"
sys.path.insert(0, str(ROOT / "scripts" / "ci"))
import dbserver  # noqa: E402

SECRET = "s3cret-pw"


def check(dsn: str, timeout: float = 15) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run ``dbserver.py check`` with the DSN in the environment (never argv); return (proc, seconds)."""
    env = {**os.environ, "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": dsn}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(DBSERVER), "check", "--timeout", str(timeout)],
                          env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    return proc, time.monotonic() - start


@pytest.fixture(scope="module")
def postgres():
    if not any(Path("/usr/lib/postgresql").glob("*/bin/initdb")):
        pytest.skip("needs the postgresql package (initdb, pg_ctl)")
    with dbserver.throwaway("postgres") as dsn:
        yield dsn


@pytest.mark.parametrize(
    ("dsn", "expected"),
    [
        (f"postgress://airflow:{SECRET}@127.0.0.1:5/airflow", "unknown database dialect 'postgress'"),
        (f"postgresql+pg8000://airflow:{SECRET}@127.0.0.1:5/airflow", "driver pg8000 is not installed"),
        (f"postgresql://airflow:{SECRET}@127.0.0.1:port/airflow", "not a valid SQLAlchemy URL"),
        (f"postgresql//airflow:{SECRET}@127.0.0.1/airflow", "not a valid SQLAlchemy URL"),
    ],
    ids=["dialect", "driver", "port", "scheme"],
)
def test_bad_dsn_is_reported_at_once_without_the_password(dsn: str, expected: str):
    proc, took = check(dsn)
    assert proc.returncode == 1
    assert took < 10, f"a permanent error took {took:.1f} s (the deadline is 15 s)"
    assert expected in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert SECRET not in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("who", "database", "expected"),
    [
        ("postgres", "no_such_db", 'database "no_such_db" does not exist'),
        ("nobody", "airflow", 'role "nobody"'),
    ],
    ids=["database", "user"],
)
def test_permanent_server_errors_are_reported_at_once_by_cause(postgres: str, who, database, expected):
    port = postgres.rsplit(":", 1)[1].split("/")[0]
    proc, took = check(f"postgresql+psycopg2://{who}:{SECRET}@127.0.0.1:{port}/{database}")
    assert proc.returncode == 1
    assert took < 10, f"a permanent error took {took:.1f} s (the deadline is 15 s)"
    assert expected in proc.stderr and SECRET not in proc.stderr, proc.stderr


def test_reachable_database_is_reported_without_the_password(postgres: str):
    proc, _ = check(postgres.replace("postgres@", f"postgres:{SECRET}@"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("database server: postgresql PostgreSQL")
    assert SECRET not in proc.stdout + proc.stderr


def test_deadline_holds_against_a_server_that_resets_then_hangs():
    """Three connections are reset, the next ones hang: the check must still end within its deadline."""
    import psycopg2  # noqa: F401  (imported before the clock starts: a cold import takes seconds on a busy machine)
    import sqlalchemy  # noqa: F401

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    port, hanging, stop = server.getsockname()[1], [], threading.Event()

    def serve() -> None:
        resets = 0
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            if resets < 3:
                resets += 1
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                conn.close()  # RST
            else:
                hanging.append(conn)  # accepted, never answered

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    start = time.monotonic()
    try:
        dbserver.check(f"postgresql+psycopg2://airflow:{SECRET}@127.0.0.1:{port}/airflow", timeout=4)
    except BaseException as e:  # noqa: BLE001 (the error type is part of what is checked below)
        error = e
    finally:
        took = time.monotonic() - start
        stop.set()
        thread.join(5)
        server.close()
        for c in hanging:
            c.close()
    assert took < 4.5, f"took {took:.1f} s for a 4 s deadline"
    assert isinstance(error, dbserver.CheckError)
    assert "not reachable within 4 s" in str(error) and SECRET not in str(error)


@pytest.mark.parametrize("backend", ["postgres", "mysql"])
def test_sighup_stops_the_throwaway_server_and_removes_its_folder(backend: str):
    need = {"postgres": "initdb", "mysql": "mariadbd"}[backend]
    if not (
        shutil.which(need)
        or list(Path("/usr/lib/postgresql").glob(f"*/bin/{need}"))
        or Path(f"/usr/sbin/{need}").exists()
    ):
        pytest.skip(f"needs {need}")
    tmp = Path(tempfile.mkdtemp(prefix="dbserver-test."))
    tmp.chmod(0o755)  # the postgres user must reach the server's folder inside it
    code = (
        "import sys, dbserver\n"
        f"with dbserver.throwaway({backend!r}) as dsn:\n"
        "    print(dsn, flush=True); sys.stdin.read()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=DBSERVER.parent, env={**os.environ, "TMPDIR": str(tmp)},
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        dsn = proc.stdout.readline().strip()
        assert dsn, "the throwaway server did not start"
        port = int(dsn.rsplit(":", 1)[1].split("/")[0])
        assert [p.name.split(".")[0] for p in tmp.iterdir()] == [f"airflow-series-{backend}"]
        proc.send_signal(signal.SIGHUP)
        proc.wait(60)
        assert list(tmp.iterdir()) == [], "its temporary folder is left behind"
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
    finally:
        if proc.poll() is None:
            proc.communicate("", timeout=60)
        stop_leftovers(tmp)
        shutil.rmtree(tmp, ignore_errors=True)


def stop_leftovers(tmp: Path) -> None:
    """Stop a server the code under test left running (so a failing run leaves nothing behind)."""
    for pidfile in [*tmp.glob("*/data/postmaster.pid"), *tmp.glob("*/pid")]:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pidfile.read_text().split()[0]), signal.SIGKILL)


@pytest.mark.parametrize(
    ("dsn", "shown"),
    [
        ("postgresql://u:secretpw@127.0.0.1:5/x", "postgresql://u:***@127.0.0.1:5/x"),
        ("postgresql://u:sec/ret@pw@127.0.0.1:5/x", "postgresql://u:***@127.0.0.1:5/x"),
        ("postgresql://u@127.0.0.1:5/x?password=secretpw", "postgresql://u@127.0.0.1:5/x?***"),
        ("mysql+mysqldb://root@127.0.0.1:3306/airflow", "mysql+mysqldb://root@127.0.0.1:3306/airflow"),
        ("u:secretpw@127.0.0.1/x", "***"),
        # a raw "?" in the password (SQLAlchemy's make_url takes it as part of the password)
        ("postgresql://u:hunter2?x@127.0.0.1:5/x", "postgresql://u:***@127.0.0.1:5/x"),
        ("postgresql://u:hun?ter@2@127.0.0.1:5/x?sslmode=require", "postgresql://u:***@127.0.0.1:5/x?***"),
        ("postgresql://u@127.0.0.1:5/x?password=a?b", "postgresql://u@127.0.0.1:5/x?***"),
    ],
)
def test_masked_hides_every_form_of_password(dsn: str, shown: str):
    assert dbserver.masked(dsn) == shown


def test_the_throwaway_mariadb_ignores_the_operators_client_settings(tmp_path: Path, monkeypatch):
    """~/.my.cnf's [client] host (and MYSQL_HOST) sent the start-up ping and `CREATE DATABASE airflow` over TCP
    to the operator's server; the throwaway server got no database (issue 31)."""
    if not shutil.which("mariadbd") and not Path("/usr/sbin/mariadbd").exists():
        pytest.skip("needs the mariadb-server package")
    with socket.socket() as s:  # a port nothing listens on, standing for the operator's server
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / ".my.cnf").write_text(f"[client]\nhost=127.0.0.1\nport={port}\n")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("MYSQL_HOST", "127.0.0.1")
    monkeypatch.setenv("MYSQL_TCP_PORT", str(port))
    start = time.monotonic()
    with dbserver.throwaway("mysql") as dsn:
        started = time.monotonic() - start
        ours = dsn.rsplit(":", 1)[1].split("/")[0]
        sql = "SHOW DATABASES LIKE 'airflow'"
        client = [shutil.which("mariadb") or "mysql", "--no-defaults", "--protocol=tcp", "-h127.0.0.1"]
        shown = subprocess.run(
            [*client, f"-P{ours}", "-uroot", "-N", "-e", sql], capture_output=True, text=True
        )
    assert started < 50, f"the start-up ping did not reach the throwaway server ({started:.0f} s)"
    assert shown.stdout.split() == ["airflow"], shown.stderr
