#!/usr/bin/env python3
"""
Throwaway PostgreSQL / MariaDB servers for the test sessions, started from the local binaries.

``throwaway(backend)`` is a context manager yielding a SQLAlchemy DSN for a fresh ``airflow`` database
on a server of its own (temporary data directory, free loopback port, its own socket), stopped and
deleted on exit, including on failure, Ctrl-C, SIGTERM or SIGHUP. Used by the noxfile when no DSN is
given in ``AIRFLOW__DATABASE__SQL_ALCHEMY_CONN``. ``python dbserver.py check`` (run with the session's
Python, which has the drivers) reads the DSN from ``AIRFLOW__DATABASE__SQL_ALCHEMY_CONN`` (never argv,
which nox echoes), waits at most 15 s in all for it to answer and prints the server version. Errors that
retrying cannot fix (bad URL, unknown dialect, missing driver, missing database, access denied) are
reported at once by their cause; no message shows the password. Unless ``DB_RESET=true``, it refuses a
database that holds Airflow data (rows in ``dag``, ``connection``, ...): the suite resets its schema.

A missing binary is reported with the Debian package that provides it.
"""

from __future__ import annotations

import contextlib
import glob
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

PACKAGES = {"initdb": "postgresql", "pg_ctl": "postgresql", "mariadbd": "mariadb-server",
            "mariadb-install-db": "mariadb-server", "mariadb-admin": "mariadb-client"}  # fmt: skip


DSN_ENV = "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"
# Tables whose rows are an operator's data (the suite empties every table of the schema it is given).
AIRFLOW_DATA = ("dag", "dag_run", "task_instance", "connection", "variable", "serialized_dag", "xcom", "job")
# Connection errors that retrying cannot fix (PostgreSQL, MySQL/MariaDB, sqlite messages).
PERMANENT = re.compile(
    r"does not exist|password authentication failed|no pg_hba\.conf entry|Access denied|Unknown database"
    r"|unable to open database file",
)


class ServerError(Exception):
    """The server could not be started; the message names the binary, package or log."""


class CheckError(Exception):
    """The DSN cannot be used; the message names the cause and never the password."""


def masked(dsn: str) -> str:
    """``dsn`` without its secrets: the password and the query string (which may hold one) become ``***``.

    Parsed by hand, the same in the nox process (no SQLAlchemy) and in a session's Python; a password may
    contain ``/``, ``:`` or ``@`` (the host follows the last ``@``). Not a URL at all: ``***``.
    """
    scheme, sep, rest = dsn.partition("://")
    if not sep:
        return "***"
    # The password may hold a raw "?" (SQLAlchemy takes all up to the "@" as the password): the userinfo
    # is cut off before the query is, so no part of a password is shown as host or query.
    userinfo = re.match(r"([^:/@?]*)(:.*)?@(?=[^@]*$)", rest, re.S)
    user = f"{userinfo[1]}{':***' if userinfo[2] is not None else ''}@" if userinfo else ""
    host, question, _query = rest[userinfo.end() if userinfo else 0 :].partition("?")
    return f"{scheme}://{user}{host}{'?***' if question else ''}"


NOT_AIRFLOW = " (not an Airflow database)"


def airflow_data(conn) -> list[str]:
    """The tables of AIRFLOW_DATA in the database of ``conn`` that hold rows.

    A database without Airflow's ``alembic_version`` table is not Airflow's: a reset still drops its tables
    that bear Airflow's names (``log``, ``session``, ``trigger``, ...) with their rows, so any table of it
    holding rows is listed (marked with NOT_AIRFLOW).
    """
    from sqlalchemy import inspect, text

    present = set(inspect(conn).get_table_names())

    def rows(t: str) -> bool:
        quoted = conn.dialect.identifier_preparer.quote(t)
        return conn.execute(text(f"SELECT 1 FROM {quoted} LIMIT 1")).first() is not None

    held = [t for t in AIRFLOW_DATA if t in present and rows(t)]
    if held or "alembic_version" in present:
        return held
    return [t + NOT_AIRFLOW for t in sorted(present) if rows(t)]


def refusal(tables: list[str]) -> str:
    if any(t.endswith(NOT_AIRFLOW) for t in tables):
        names = ", ".join(t.removesuffix(NOT_AIRFLOW) for t in tables)
        return (
            f"the database is not an Airflow database (no alembic_version table) and holds rows (in {names}); "
            "a reset would drop those of its tables that bear Airflow's names (log, session, ...): refusing to "
            "reset it; DB_RESET=true (breeze's --db-reset) allows it, or give an empty database"
        )
    return (
        f"the database holds Airflow data (rows in {', '.join(tables)}): refusing to reset it; DB_RESET=true "
        "(breeze's --db-reset) allows it, or give an empty database"
    )


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
        # The clients read ~/.my.cnf, /etc/mysql/ and MYSQL_HOST, whose host would take them over TCP to
        # another server (an operator's): no option files, the socket of ours only.
        ours = ["--no-defaults", "--protocol=socket", "--host=localhost", f"--socket={sock}", "-uroot"]
        ping = [admin, *ours, "--connect-timeout=1", "ping"]
        deadline = time.monotonic() + 60
        while subprocess.run(ping, capture_output=True).returncode:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise ServerError(f"mariadbd did not start: {(tmp / 'log').read_text()[-2000:]}")
            time.sleep(0.2)  # polling a starting server, not synchronising tests
        sql = "CREATE DATABASE airflow CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci"
        subprocess.run([shutil.which("mariadb") or "mysql", *ours, "-e", sql], check=True)
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
    # SIGTERM (a CI time-out, `kill`) and SIGHUP (the terminal closed) would end the process without
    # unwinding: make them an interrupt that runs the clean-up below, so no server or folder is left.
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        with starter(tmp) as dsn:
            yield dsn
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(tmp, ignore_errors=True)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def check(dsn: str, timeout: float = 15.0) -> str:
    """Connect to ``dsn`` within ``timeout`` seconds in all; return "<dialect> <server version>".

    Raises CheckError at once for a cause retrying cannot fix, after the deadline for the others.
    """
    deadline = time.monotonic() + timeout
    from sqlalchemy import create_engine, exc, text
    from sqlalchemy.engine import make_url

    try:
        url = make_url(dsn)
    except (exc.ArgumentError, ValueError) as e:
        raise CheckError(
            f"{DSN_ENV} is not a valid SQLAlchemy URL ({masked(dsn)}): {e}".replace(dsn, "***")
        ) from None

    def hide(message: str) -> str:
        return message.replace(url.password, "***") if url.password else message

    where = f"host {url.host or 'localhost'}, port {url.port or 'default'}, database {url.database}"
    try:
        create_engine(url).dispose()
    except exc.NoSuchModuleError:
        dialect, _, driver = url.drivername.partition("+")
        what = f"driver {driver!r} of dialect {dialect!r}" if driver else f"database dialect {dialect!r}"
        raise CheckError(f"unknown {what} in {masked(dsn)}") from None
    except ImportError as e:
        raise CheckError(
            f"driver {e.name} is not installed in {sys.executable} (for {masked(dsn)})"
        ) from None
    network = url.get_backend_name() in ("postgresql", "mysql")
    last, outcome = ["no attempt finished"], {}

    def attempts() -> None:
        while (left := deadline - time.monotonic()) > 0:
            # Each try gets the time left, not the whole timeout.
            args = {"connect_timeout": max(1, math.ceil(left))} if network else {}
            engine = create_engine(url, connect_args=args)
            try:
                with engine.connect() as conn:
                    name = url.get_backend_name()
                    version = conn.execute(
                        text(f"select {'sqlite_version' if name == 'sqlite' else 'version'}()")
                    )
                    outcome["version"] = f"{name} {version.scalar()}"
                    if (held := airflow_data(conn)) and os.environ.get("DB_RESET", "").lower() != "true":
                        outcome["error"] = f"{where}: {refusal(held)}"
                return
            except exc.DBAPIError as e:
                last[0] = hide(str(e.orig).strip().splitlines()[0] if e.orig else str(e))
                if PERMANENT.search(last[0]):
                    outcome["error"] = f"database not usable ({where}): {last[0]}"
                    return
            finally:
                engine.dispose()
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))  # retrying a connection, not a test

    # The deadline holds even where a driver's own timeout does not (a server that accepts, then hangs).
    worker = threading.Thread(target=attempts, daemon=True)
    worker.start()
    worker.join(max(0.0, deadline - time.monotonic()))
    if "error" in outcome:
        raise CheckError(outcome["error"])
    if "version" in outcome:
        return outcome["version"]
    raise CheckError(f"database not reachable within {timeout:.0f} s ({where}): {last[0]}")


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Check the database in $" + DSN_ENV)
    parser.add_argument("command", choices=["check"])
    parser.add_argument("--timeout", type=float, default=15.0, help="seconds in all (default: %(default)s)")
    args = parser.parse_args(argv)
    dsn = os.environ.get(DSN_ENV)
    if not dsn:
        print(f"dbserver.py check: {DSN_ENV} is not set", file=sys.stderr)
        return 1
    try:
        print(f"database server: {check(dsn, args.timeout)}")
    except CheckError as e:
        print(f"dbserver.py check: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
