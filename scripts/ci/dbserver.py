#!/usr/bin/env python3
"""
Throwaway PostgreSQL / MariaDB servers for the test sessions, started from the local binaries.

``throwaway(backend)`` is a context manager yielding a SQLAlchemy DSN for a fresh ``airflow`` database
on a server of its own (temporary data directory, free loopback port, its own socket), stopped and
deleted on exit, including on failure or Ctrl-C. Used by the noxfile when no DSN is given in
``AIRFLOW__DATABASE__SQL_ALCHEMY_CONN``. ``python dbserver.py check DSN`` (run with the session's
Python, which has the drivers) waits at most 15 s for the DSN to answer and prints the server version;
on failure it names host, port and database, never the password.

A missing binary is reported with the Debian package that provides it.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

PACKAGES = {"initdb": "postgresql", "pg_ctl": "postgresql", "mariadbd": "mariadb-server",
            "mariadb-install-db": "mariadb-server", "mariadb-admin": "mariadb-client"}  # fmt: skip


class ServerError(Exception):
    """The server could not be started; the message names the binary, package or log."""


def _binary(name: str) -> str:
    if name in ("initdb", "pg_ctl"):
        found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=lambda p: int(p.split("/")[4]))
        path = found[-1] if found else shutil.which(name)
    else:
        path = shutil.which(name) or next(iter(glob.glob(f"/usr/sbin/{name}")), None)
    if not path:
        raise ServerError(f"{name} not found: install the Debian package {PACKAGES[name]}")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_postgres(cmd: list[str]) -> list[str]:
    # initdb and postgres refuse to run as root; Debian's package creates the postgres user.
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


@contextlib.contextmanager
def _postgres(tmp: Path) -> Iterator[str]:
    initdb, pg_ctl = _binary("initdb"), _binary("pg_ctl")
    if os.geteuid() == 0:
        shutil.chown(tmp, "postgres")
    data, port = tmp / "data", _free_port()
    subprocess.run(_as_postgres([initdb, "-D", str(data), "-A", "trust", "-U", "postgres", "-E", "UTF8"]),
                   check=True, capture_output=True)  # fmt: skip
    opts = f"-p {port} -k {tmp} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
    start = _as_postgres(
        [pg_ctl, "-D", str(data), "-l", str(tmp / "log"), "-o", opts, "-w", "-t", "60", "start"]
    )
    if subprocess.run(start, capture_output=True).returncode:
        raise ServerError(f"postgres did not start: {(tmp / 'log').read_text()[-2000:]}")
    try:
        createdb = str(Path(initdb).with_name("createdb"))
        subprocess.run(_as_postgres([createdb, "-h", str(tmp), "-p", str(port), "-U", "postgres", "airflow"]),
                       check=True, capture_output=True)  # fmt: skip
        yield f"postgresql+psycopg2://postgres@127.0.0.1:{port}/airflow"
    finally:
        subprocess.run(
            _as_postgres([pg_ctl, "-D", str(data), "-m", "immediate", "stop"]), capture_output=True
        )


@contextlib.contextmanager
def _mariadb(tmp: Path) -> Iterator[str]:
    install, server, admin = _binary("mariadb-install-db"), _binary("mariadbd"), _binary("mariadb-admin")
    data, sock, port = tmp / "data", tmp / "mysql.sock", _free_port()
    user = ["--user=root"] if os.geteuid() == 0 else []
    subprocess.run([install, "--no-defaults", f"--datadir={data}", "--auth-root-authentication-method=normal",
                    "--skip-test-db", *user], check=True, capture_output=True)  # fmt: skip
    log = open(tmp / "log", "w")
    proc = subprocess.Popen(
        [server, "--no-defaults", f"--datadir={data}", f"--socket={sock}", f"--port={port}",
         "--bind-address=127.0.0.1", f"--pid-file={tmp / 'pid'}", "--innodb-flush-log-at-trx-commit=0",
         "--max-connections=300", *user],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        ping = [admin, f"--socket={sock}", "-uroot", "--connect-timeout=1", "ping"]
        deadline = time.monotonic() + 60
        while subprocess.run(ping, capture_output=True).returncode:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise ServerError(f"mariadbd did not start: {(tmp / 'log').read_text()[-2000:]}")
            time.sleep(0.2)  # polling a starting server, not synchronising tests
        sql = "CREATE DATABASE airflow CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci"
        subprocess.run(
            [shutil.which("mariadb") or "mysql", f"--socket={sock}", "-uroot", "-e", sql], check=True
        )
        yield f"mysql+mysqldb://root@127.0.0.1:{port}/airflow"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@contextlib.contextmanager
def throwaway(backend: str) -> Iterator[str]:
    """Start a throwaway server for ``backend`` ("postgres" or "mysql"); yield its DSN; stop and delete it."""
    starter = {"postgres": _postgres, "mysql": _mariadb}[backend]
    tmp = Path(tempfile.mkdtemp(prefix=f"airflow-series-{backend}."))
    # SIGTERM (a CI time-out, `kill`) would end the process without unwinding: make it an exit that
    # runs the clean-up below, so no server is left behind.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        with starter(tmp) as dsn:
            yield dsn
    finally:
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(tmp, ignore_errors=True)


def check(dsn: str, timeout: float = 15.0) -> str:
    """Connect to ``dsn`` within ``timeout`` seconds; return "<dialect> <server version>" or exit 1."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    url = make_url(dsn)
    where = f"host {url.host or 'localhost'}, port {url.port or 'default'}, database {url.database}"
    args = {"connect_timeout": int(timeout)} if url.get_backend_name() in ("postgresql", "mysql") else {}
    deadline, error = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            engine = create_engine(url, connect_args=args)
            with engine.connect() as conn:
                if url.get_backend_name() == "sqlite":
                    version = conn.execute(text("select sqlite_version()")).scalar()
                else:
                    version = conn.execute(text("select version()")).scalar()
            engine.dispose()
            return f"{url.get_backend_name()} {version}"
        except Exception as e:
            error = str(e).splitlines()[0]
            time.sleep(0.5)  # retrying a connection, not synchronising tests
    sys.exit(f"database not reachable within {timeout:.0f} s ({where}): {error}")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "check":
        sys.exit("usage: dbserver.py check DSN")
    print(f"database server: {check(sys.argv[2])}")
