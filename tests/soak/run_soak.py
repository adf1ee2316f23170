#!/usr/bin/env python
#
# Licensed to the Apache Software Foundation (ASF) under one
# or more contributor license agreements.  See the NOTICE file
# distributed with this work for additional information
# regarding copyright ownership.  The ASF licenses this file
# to you under the Apache License, Version 2.0 (the
# "License"); you may not use this file except in compliance
# with the License.  You may obtain a copy of the License at
#
#   http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing,
# software distributed under the License is distributed on an
# "AS IS" BASIS, WITHOUT WARRANTIES OR CONDITIONS OF ANY
# KIND, either express or implied.  See the License for the
# specific language governing permissions and limitations
# under the License.
"""
Chaos soak with real Airflow processes (issue #10).

Run with the Python of a virtualenv in which the tree under test (editable ``airflow-core``, base or
series) is installed; the Airflow CLI used is ``Path(sys.executable).parent / "airflow"``::

    AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=postgresql+psycopg2://postgres@127.0.0.1:5432/soak \\
        python tests/soak/run_soak.py --backend postgres --duration 360 --seed 42 \\
        --report soak-postgres-series --label series

What it does:

1. builds a throwaway ``AIRFLOW_HOME`` (DAGs from ``tests/soak/dags``, the slow-listener plugin from
   ``tests/soak/plugins``), resets the given database (``airflow db reset -y``: drop all, migrate
   to head) -- THE DATABASE IS WIPED -- and installs an audit copy of the
   ``callback`` table (``soak_callback_audit``, filled by an ``AFTER INSERT`` trigger; the
   dag-processor deletes ``callback`` rows it has run);
2. starts ``airflow api-server``, ``airflow dag-processor`` and ``airflow scheduler`` on loopback
   ports (LocalExecutor, 20 s heartbeat timeout, 5 s detection interval), each in its own session
   / process group; ``--schedulers N`` runs N schedulers on the database; ``--executor celery`` adds a
   throwaway ``redis-server`` broker on a free loopback port and ``--workers`` Celery workers (result
   backend: the metadata database), restarted one after another during the run (SIGTERM warm
   shutdown, some SIGKILL); ``--listener openlineage`` enables the OpenLineage provider's listener with
   its HTTP transport on a loopback endpoint that never answers;
3. runs a seeded, time-bounded chaos loop: every 3-8 s it SIGKILLs or SIGSTOPs (and later SIGCONTs)
   a task process it can identify as its own -- a descendant of its own scheduler, with its
   ``AIRFLOW_HOME`` in the environment and a process title ``airflow worker -- [LocalExecutor: ]<ti_id>``
   naming a RUNNING task instance of its own database. Exited components are restarted; a scheduler exit
   is recorded with the last error line of its log;
4. stops everything it started (also on Ctrl-C, SIGTERM, SIGHUP or failure; the work runs in a child
   process of its own session, so a caller that kills this process right after interrupting it does
   not cut the shutdown short), then scans for processes carrying its ``AIRFLOW_HOME`` and kills and
   reports any orphan;
5. analyses the callback file, the audit table, the task-instance tables and the scheduler log,
   prints a report and writes it as Markdown (``REPORT.md``) and JSON (``REPORT.json``).

Exit status: 0 no finding in the series' areas and no other scheduler exit; 1 a scheduler exit in the
series' areas (IntegrityError/ForeignKeyViolation on task_reschedule and other races in task-failure
handling) or a try with more than one failure/retry callback (``--strict`` adds every other finding);
2 the soak itself failed (setup, orphans left); 3 no series finding, but the scheduler exited for a
reason outside the series' areas (e.g. MariaDB-only SQL Airflow does not support) -- not a pass.
With ``--expect-races`` (the pristine release) 1 becomes 0 only if every exit was in the series' areas, a
task instance succeeded and no orphan was left; the verdict of a 1 names what else went wrong. A database
holding Airflow data is refused unless ``DB_RESET=true``; an existing report is never overwritten.

sqlite is refused: Airflow documents SQLite as a development backend without concurrent writers, and
this deployment has scheduler, api-server, dag-processor and task processes writing at once; a soak
there would measure SQLite's locking, not the series.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import json
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "scripts" / "ci"))
import dbserver  # noqa: E402  (masked DSN, the Airflow-data check of the test sessions)

AIRFLOW = Path(sys.executable).parent / "airflow"
REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"

# Task processes: the LocalExecutor worker (supervisor) "airflow worker -- LocalExecutor: <ti_id>", a Celery
# pool process running a workload "airflow supervisor: <ti_id>" (BaseExecutor.run_workload), and the task
# runner they fork, "airflow worker -- <ti_id>".
TITLE_RE = re.compile(
    r"^airflow (?:worker -- (LocalExecutor(?:-[^:]*)?: )?|(supervisor): )"
    r"([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})"
)
EVENT_RE = re.compile(
    r"Received executor event with state failed for task instance TaskInstanceKey\(dag_id='([^']*)', "
    r"task_id='([^']*)', run_id='([^']*)', try_number=(\d+), map_index=(-?\d+)\)"
)
ACCESS_RE = re.compile(r"request finished\b.*?\bmethod=(\w+).*?\bpath=(\S+).*?\bstatus_code=(\d+)")
# 3.1.x's api-server logs uvicorn's access line instead (no timestamp): "PATCH /execution/... HTTP/1.1" 409
UVICORN_ACCESS_RE = re.compile(r'"(\w+) (/\S*) HTTP/[\d.]+" (\d{3})\b')


def access_match(line: str) -> re.Match | None:
    return ACCESS_RE.search(line) or UVICORN_ACCESS_RE.search(line)


LOG_ISO_RE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?)(Z|[+-]\d\d:?\d\d)?")
UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
STATE_MISMATCH_RE = re.compile(r"finished with state (\w+), but the task instance's state attribute is (\w+)")
LOG_TS_RE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)")
# Final line of a Python traceback / an exception named in a log line.
EXC_LINE_RE = re.compile(
    r"((?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Violation|Deadlock|Timeout|Exit))(?::|\b)\s*(.*)"
)
ERROR_LEVEL_RE = re.compile(r"\[(error|critical|exception)\s*\]|\bERROR\b|\bCRITICAL\b|Traceback")

# Scheduler exits whose cause is in the areas the series fixes: races in task-failure handling
# (heartbeat-timeout scan, TI retry preparation, callbacks, stale executor events).
SERIES_EXIT_PATTERNS = [
    (
        "task_reschedule FK/IntegrityError",
        re.compile(
            r"(IntegrityError|ForeignKeyViolation).*task_reschedule|task_reschedule.*(IntegrityError|foreign key)",
            re.I,
        ),
    ),
    (
        "task_instance_history IntegrityError",
        re.compile(r"(IntegrityError|ForeignKeyViolation|UniqueViolation).*task_instance_history", re.I),
    ),
    ("callback IntegrityError", re.compile(r"(IntegrityError|ForeignKeyViolation).*\bcallback\b", re.I)),
    ("IntegrityError", re.compile(r"IntegrityError|ForeignKeyViolation|UniqueViolation")),
    ("StaleDataError/ObjectDeletedError", re.compile(r"StaleDataError|ObjectDeletedError")),
    (
        "deadlock / lock wait",
        re.compile(r"Deadlock|deadlock detected|Lock wait timeout|LockNotAvailable", re.I),
    ),
]
# Scheduler exits outside the series' areas, with their cause.
OUTSIDE_EXIT_PATTERNS = [
    (
        "MariaDB: unsupported SQL (WITH ... DELETE ... RETURNING; Airflow does not support MariaDB)",
        re.compile(r"1064.*(RETURNING|DELETE|WITH)|You have an error in your SQL syntax", re.I),
    ),
    (
        "database connection lost",
        re.compile(r"OperationalError.*(server closed|Lost connection|gone away|Connection refused)", re.I),
    ),
]


def log(msg: str) -> None:
    # after a SIGHUP the terminal is gone: the shutdown must go on without its output
    with contextlib.suppress(OSError):
        print(f"[soak {datetime.datetime.now().strftime('%H:%M:%S')}] {msg}", flush=True)


def run_detached(argv: list[str], python: str = sys.executable, **extra_env: str) -> int:
    """
    Run the soak in a child process in its own session and wait for it, forwarding SIGINT, SIGTERM and
    SIGHUP to it as SIGTERM. A caller may kill this process right after interrupting it (nox sends
    SIGTERM 0.3 s after Ctrl-C and SIGKILL 0.2 s later; a closed terminal takes its process group
    along): the child, outside that process group, still stops every process it started.
    """
    env = dict(os.environ, SOAK_DETACHED="1", **extra_env)
    child = subprocess.Popen([python, str(Path(__file__).resolve()), *argv], env=env, start_new_session=True)

    def forward(signum, frame):
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signal.SIGTERM)

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, forward)
    return child.wait()


def run_installed(args: argparse.Namespace, argv: list[str]) -> int:
    """``--installed WHEEL``: make the operator's installation in a temporary venv, then soak with its Python."""
    import deploy_check  # scripts/ci: the venv of the released Airflow, as `nox -s deploy-check-<db>` makes it

    wheel = Path(args.installed).resolve()
    if not wheel.is_file():
        print(f"soak: --installed {args.installed}: no such wheel (`nox -s build` makes it)", file=sys.stderr)
        return 2
    try:
        version = deploy_check.wheel_version(wheel)
    except deploy_check.CheckFailed as e:
        print(f"soak: --installed: {e}", file=sys.stderr)
        return 2
    rest, skip = [], False
    for a in argv:  # the same soak, without the installation options
        if skip or a.startswith(("--installed=", "--installed-with=")):
            skip = False
            continue
        skip = a in ("--installed", "--installed-with")
        if not skip:
            rest.append(a)
    # Removed by the soak's own child at its end too: nox may SIGKILL this process right after a Ctrl-C.
    tmp = tempfile.mkdtemp(prefix="soak-installed.")
    try:
        # Checked in an Airflow home of its own: `airflow version` would write into the caller's.
        venv, env = Path(tmp) / "venv", deploy_check.operator_env(Path(tmp) / "home")
        try:
            py, pip = deploy_check.release_venv(venv, version.split("+", 1)[0], args.installed_with, env)
            deploy_check.run([pip, "install", "--no-deps", str(wheel)], env, "pip install --no-deps WHEEL")
            checked = deploy_check.run([pip, "check"], env, "pip check")
            shown = deploy_check.run([str(venv / "bin" / "airflow"), "version"], env, "airflow version")
        except deploy_check.CheckFailed as e:
            print(f"soak: --installed: {e}", file=sys.stderr)
            return 2
        log(f"installed {wheel.name} over apache-airflow=={version.split('+', 1)[0]} "
            f"({' '.join(args.installed_with)}): pip check: {checked}; airflow version {shown.splitlines()[-1]}")  # fmt: skip
        return run_detached(rest, python=py, SOAK_INSTALLED_VENV=tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class SoakError(Exception):
    """The soak itself could not run (setup failed, orphans left, ...)."""


# --------------------------------------------------------------------------------------------------
# /proc helpers
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    sid: int
    starttime: int  # clock ticks since boot; (pid, starttime) identifies a process
    state: str
    title: str


def read_proc(pid: int) -> Proc | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            title = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    rest = stat[stat.rfind(")") + 2 :].split()
    # rest[0]=state rest[1]=ppid rest[2]=pgrp rest[3]=session ... rest[19]=starttime
    return Proc(pid, int(rest[1]), int(rest[3]), int(rest[19]), rest[0], title)


def all_procs() -> dict[int, Proc]:
    procs = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            p = read_proc(int(name))
            if p is not None:
                procs[p.pid] = p
    return procs


def proc_env_home(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for item in f.read().split(b"\0"):
                if item.startswith(b"AIRFLOW_HOME="):
                    return item[len(b"AIRFLOW_HOME=") :].decode(errors="replace")
    except OSError:
        return None
    return None


def is_descendant(procs: dict[int, Proc], pid: int, ancestor: int) -> bool:
    seen = set()
    while pid in procs and pid not in seen:
        seen.add(pid)
        if procs[pid].ppid == ancestor:
            return True
        pid = procs[pid].ppid
    return False


def same_process(p: Proc) -> bool:
    cur = read_proc(p.pid)
    return cur is not None and cur.starttime == p.starttime


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------------------
# Components
# --------------------------------------------------------------------------------------------------
@dataclass
class Component:
    name: str
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen | None = None
    started_at: float = 0.0
    log_offset: int = 0  # where this incarnation's output starts in log_path
    starts: int = 0
    pids: list[int] = field(default_factory=list)  # main pid of every incarnation
    restarting: bool = False  # stopped on purpose (rolling restart): not an exit to record


@dataclass
class Exit:
    component: str
    at: float
    returncode: int | None
    error_line: str
    category: str  # "series" | "outside" | "unclassified"
    cause: str


def classify_exit(text: str) -> tuple[str, str]:
    for cause, rx in SERIES_EXIT_PATTERNS:
        if rx.search(text):
            return "series", cause
    for cause, rx in OUTSIDE_EXIT_PATTERNS:
        if rx.search(text):
            return "outside", cause
    return "unclassified", "unknown"


def last_error_line(text: str) -> str:
    """Last line of an incarnation's output that names an exception (else last error-level line)."""
    lines = text.splitlines()
    for line in reversed(lines):
        m = EXC_LINE_RE.search(line)
        if m and not line.lstrip().startswith(("File ", "During handling", "The above exception")):
            if re.search(r"(Error|Exception|Violation)\b", m.group(1)):
                return line.strip()[:500]
    for line in reversed(lines):
        if ERROR_LEVEL_RE.search(line):
            return line.strip()[:500]
    return (lines[-1].strip()[:500]) if lines else ""


class Soak:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rng = random.Random(args.seed)
        self.home = Path(args.home) if args.home else Path(tempfile.mkdtemp(prefix=f"soak-{args.backend}-"))
        self.home.mkdir(parents=True, exist_ok=True)
        self.callback_file = self.home / "callbacks.jsonl"
        self.listener_file = self.home / "listener.jsonl"
        self.port = free_port()
        self.celery = args.executor == "celery"
        self.redis_port = free_port() if self.celery else 0
        self.blackhole: socket.socket | None = None
        self.blackhole_conns: list[tuple[float, socket.socket]] = []
        self.blackhole_accepted = 0
        self.ol_port = self._start_blackhole() if args.listener == "openlineage" else 0
        # duplicate_dispatch (LocalExecutor): request files for the scheduler-side plugin, see
        # plugins/soak_duplicate_dispatch.py; the try's own processes are not touched
        self.duplicates = args.executor == "local" and not args.no_duplicate_dispatch
        self.duplicate_dir = self.home / "duplicate-dispatch"
        self.duplicated_ti_ids: set[str] = set()
        self.env = self._build_env()
        self.components: dict[str, Component] = {}
        self.session_ids: set[int] = set()
        self.log_sizes_at_stop: dict[str, int] = {}
        self.exits: list[Exit] = []
        self.actions: list[dict[str, Any]] = []
        self.stopped: dict[tuple[int, int], tuple[Proc, float]] = {}  # (pid,start) -> (proc, resume_at)
        self.no_target_ticks = 0
        self.engine = None
        self.t_launch = 0.0
        self.t_start = 0.0  # first task process seen: the soak clock starts
        self.t_chaos_end = 0.0
        self.t_end = 0.0
        self.warmup_s = 0.0
        self.load_start = self.load_end = ""
        self.orphans: list[dict[str, Any]] = []
        self.orphans_left: list[dict[str, Any]] = []
        self.interrupted = False
        self.restarts: list[dict[str, Any]] = []  # rolling restarts of Celery workers
        self.faulted_ti_ids: set[str] = set()  # tries (TI ids) whose processes a fault or restart hit
        self.deploy: list[str] = []  # workers still to restart in the current wave
        self.deploy_step: dict[str, Any] | None = None
        self.next_deploy = 0.0
        self.heartbeat_max: dict[str, float] = {}  # scheduler job id -> max heartbeat age seen (s)
        self.heartbeat_last: dict[str, datetime.datetime] = {}
        self.heartbeat_samples = 0
        self.next_sample = 0.0

    # ---------------------------------------------------------------- setup
    def _build_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
        from cryptography.fernet import Fernet

        base_url = f"http://127.0.0.1:{self.port}"
        env.update(
            {
                "AIRFLOW_HOME": str(self.home),
                "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
                "AIRFLOW__CORE__DAGS_FOLDER": str(self.home / "dags"),
                "AIRFLOW__CORE__PLUGINS_FOLDER": str(self.home / "plugins"),
                "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
                "AIRFLOW__CORE__FERNET_KEY": Fernet.generate_key().decode(),
                "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{base_url}/execution/",
                "AIRFLOW__CORE__PARALLELISM": "8",
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": self.args.dsn,
                "AIRFLOW__API__BASE_URL": base_url,
                "AIRFLOW__API__WORKERS": "1",
                "AIRFLOW__API__SECRET_KEY": secrets.token_hex(16),
                "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(32),
                "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "20",
                "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "5",
                "AIRFLOW__SCHEDULER__ORPHANED_TASKS_CHECK_INTERVAL": "20",
                # safety net for workers lost before their TI left QUEUED (default 600 s)
                "AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT": "90",
                "AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT_CHECK_INTERVAL": "15",
                # _orphan_unreferenced_assets emits WITH ... DELETE ... RETURNING, which MariaDB
                # rejects; same value on every backend so runs are comparable.
                "AIRFLOW__SCHEDULER__PARSING_CLEANUP_INTERVAL": "1000000",
                "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "30",
                "AIRFLOW__DAG_PROCESSOR__PARSING_PROCESSES": "1",
                "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
                "SOAK_CALLBACK_FILE": str(self.callback_file),
                "SOAK_LISTENER_FILE": str(self.listener_file),
                "SOAK_LISTENER_SLEEP": str(self.args.listener_sleep),
                **({"SOAK_DUPLICATE_DIR": str(self.duplicate_dir)} if self.duplicates else {}),
                "PYTHONUNBUFFERED": "1",
            }
        )
        if self.celery:
            env.update(
                {
                    "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
                    "AIRFLOW__CELERY__BROKER_URL": f"redis://127.0.0.1:{self.redis_port}/0",
                    # Celery's database result backend on the metadata database (its SQLAlchemy URL)
                    "AIRFLOW__CELERY__RESULT_BACKEND": f"db+{self.args.dsn}",
                    "AIRFLOW__CELERY__WORKER_CONCURRENCY": str(self.args.worker_concurrency),
                }
            )
        if self.args.listener == "openlineage":
            # The real OpenLineage listener with its HTTP transport pointed at an endpoint that accepts
            # connections and never answers; [openlineage] execution_timeout stays at its default.
            transport = {
                "type": "http",
                "url": f"http://127.0.0.1:{self.ol_port}",
                "endpoint": "api/v1/lineage",
            }
            env["AIRFLOW__OPENLINEAGE__TRANSPORT"] = json.dumps(transport)
            env["AIRFLOW__OPENLINEAGE__NAMESPACE"] = "soak"
            # openlineage 2.15.0 emits 'ol.emit.attempts' without the name variables 3.3's metric
            # registry requires for legacy names: every emission failed before its HTTP request.
            env["AIRFLOW__METRICS__LEGACY_NAMES_ON"] = "False"
        else:
            env["AIRFLOW__OPENLINEAGE__DISABLED"] = "True"  # in case the provider is installed
        return env

    def _start_blackhole(self) -> int:
        """A loopback HTTP endpoint that accepts connections and never answers (closed at the end)."""
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        self.blackhole = sock

        def accept() -> None:
            while True:
                try:
                    conn, _ = sock.accept()
                except OSError:  # closed by stop_all
                    return
                # held open, never read from or answered; closed after 5 minutes (file descriptors)
                now = time.monotonic()
                self.blackhole_conns.append((now, conn))
                self.blackhole_accepted += 1
                while self.blackhole_conns and self.blackhole_conns[0][0] < now - 300:
                    self.blackhole_conns.pop(0)[1].close()

        threading.Thread(target=accept, name="ol-blackhole", daemon=True).start()
        return sock.getsockname()[1]

    def airflow(self, *cmd: str, timeout: float = 600) -> None:
        out = self.home / "setup.log"
        with out.open("ab") as f:
            f.write(f"\n$ airflow {' '.join(cmd)}\n".encode())
            f.flush()
            rc = subprocess.run(
                [str(AIRFLOW), *cmd],
                env=self.env,
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                start_new_session=True,
            ).returncode
        if rc != 0:
            tail = out.read_text(errors="replace").splitlines()[-15:]
            raise SoakError(f"airflow {' '.join(cmd)} failed (rc={rc}):\n" + "\n".join(tail))

    def setup(self) -> None:
        for sub in ("dags", "plugins"):
            shutil.copytree(
                HERE / sub, self.home / sub, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__")
            )
        self.callback_file.touch()
        self.listener_file.touch()
        if self.duplicates:
            self.duplicate_dir.mkdir(exist_ok=True)
        from sqlalchemy import create_engine

        self.engine = create_engine(self.args.dsn, pool_pre_ping=True, pool_size=2)
        # The DSN comes from the environment, where an operator's own Airflow may have put it: a database
        # holding Airflow data is wiped only when DB_RESET=true says so (the rule of the test sessions).
        with self.engine.connect() as conn:
            held = dbserver.airflow_data(conn)
        if held and os.environ.get("DB_RESET", "").lower() != "true":
            raise SoakError(
                f"{dbserver.masked(self.args.dsn)}: {dbserver.refusal(held)}; nothing was changed"
            )
        self._drop_audit()
        log(f"home {self.home}; resetting database (airflow db reset -y) ...")
        t = time.monotonic()
        self.airflow("db", "reset", "-y")  # drops everything, then migrates to head
        log(f"database ready in {time.monotonic() - t:.0f}s; installing callback audit trigger")
        self._install_audit()

    def _drop_audit(self) -> None:
        from sqlalchemy import text

        with self.engine.begin() as c:
            if self.args.backend == "postgres":
                c.execute(text("DROP TABLE IF EXISTS soak_callback_audit"))
                c.execute(text("DROP FUNCTION IF EXISTS soak_callback_audit_fn() CASCADE"))
            else:
                c.execute(text("DROP TRIGGER IF EXISTS soak_callback_audit_trg"))
                c.execute(text("DROP TABLE IF EXISTS soak_callback_audit"))

    def _install_audit(self) -> None:
        from sqlalchemy import inspect, text

        # 3.2+: table `callback` (type, data = {req_class, req_data}); 3.1.x: `callback_request`
        # (callback_type = the request's class name, callback_data = the request's JSON).
        if inspect(self.engine).has_table("callback"):
            table, type_col, data_col = "callback", "type", "data"
        else:
            table, type_col, data_col = "callback_request", "callback_type", "callback_data"
        with self.engine.begin() as c:
            if self.args.backend == "postgres":
                c.execute(
                    text(
                        "CREATE TABLE soak_callback_audit (seq bigserial PRIMARY KEY, id text, type text,"
                        " data text, created_at timestamptz, audited_at timestamptz DEFAULT clock_timestamp())"
                    )
                )
                c.execute(
                    text(
                        "CREATE FUNCTION soak_callback_audit_fn() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
                        " INSERT INTO soak_callback_audit (id, type, data, created_at)"
                        f" VALUES (NEW.id::text, NEW.{type_col}, NEW.{data_col}::text, NEW.created_at);"
                        " RETURN NEW; END $$"
                    )
                )
                c.execute(
                    text(
                        f"CREATE TRIGGER soak_callback_audit_trg AFTER INSERT ON {table}"
                        " FOR EACH ROW EXECUTE FUNCTION soak_callback_audit_fn()"
                    )
                )
            else:
                c.execute(
                    text(
                        "CREATE TABLE soak_callback_audit (seq bigint AUTO_INCREMENT PRIMARY KEY, id varchar(64),"
                        " type varchar(64), data longtext, created_at datetime(6),"
                        " audited_at datetime(6) DEFAULT CURRENT_TIMESTAMP(6))"
                    )
                )
                c.execute(
                    text(
                        f"CREATE TRIGGER soak_callback_audit_trg AFTER INSERT ON {table} FOR EACH ROW"
                        " INSERT INTO soak_callback_audit (id, type, data, created_at)"
                        f" VALUES (NEW.id, NEW.{type_col}, NEW.{data_col}, NEW.created_at)"
                    )
                )

    # ---------------------------------------------------------------- components
    def start(self, name: str) -> None:
        comp = self.components[name]
        comp.log_offset = comp.log_path.stat().st_size if comp.log_path.exists() else 0
        with comp.log_path.open("ab") as f:
            f.write(
                f"\n===== soak: start #{comp.starts + 1} of {name} at {datetime.datetime.now().isoformat()} =====\n".encode()
            )
            comp.log_offset = f.tell()
            comp.popen = subprocess.Popen(
                comp.argv,
                env=self.env,
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=self.home,
            )
        comp.started_at = time.monotonic()
        comp.starts += 1
        comp.pids.append(comp.popen.pid)
        comp.restarting = False
        self.session_ids.add(comp.popen.pid)  # start_new_session: sid == pid of the component
        log(f"started {name} pid={comp.popen.pid}")

    def start_all(self) -> None:
        logs = self.home / "logs"
        logs.mkdir(exist_ok=True)
        a = str(AIRFLOW)
        comps = [
            Component(
                "api-server",
                [a, "api-server", "--host", "127.0.0.1", "--port", str(self.port)],
                logs / "api-server.log",
            ),
            Component("dag-processor", [a, "dag-processor"], logs / "dag-processor.log"),
        ]
        comps += [
            Component(name, [a, "scheduler", "--skip-serve-logs"], logs / f"{name}.log")
            for name in self.scheduler_names()
        ]
        if self.celery:
            redis_dir = self.home / "redis"
            redis_dir.mkdir(exist_ok=True)
            # throwaway broker: own port on loopback, no persistence, never the machine's 6379
            redis_argv = [REDIS_SERVER, "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", ""]
            redis_argv += ["--appendonly", "no", "--dir", str(redis_dir), "--daemonize", "no"]
            comps.insert(0, Component("redis", redis_argv, logs / "redis.log"))
            for name in self.worker_names():
                argv = [a, "celery", "worker", "--concurrency", str(self.args.worker_concurrency)]
                argv += ["--celery-hostname", f"{name}@soak", "--pid", str(self.home / f"{name}.pid")]
                comps.append(Component(name, [*argv, "--skip-serve-logs"], logs / f"{name}.log"))
        self.components = {c.name: c for c in comps}
        if self.celery:
            self.start("redis")
            self._wait_port(self.redis_port, "redis")
        self.start("api-server")
        self._wait_api(self.args.warmup_timeout)
        self.start("dag-processor")
        for name in self.scheduler_names():
            self.start(name)
        for name in self.worker_names():
            self.start(name)

    def scheduler_names(self) -> list[str]:
        return ["scheduler"] + [f"scheduler-{i}" for i in range(2, self.args.schedulers + 1)]

    def worker_names(self) -> list[str]:
        return [f"worker-{i}" for i in range(1, self.args.workers + 1)] if self.celery else []

    def _wait_port(self, port: int, name: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.components[name].popen.poll() is not None:
                raise SoakError(f"{name} exited rc={self.components[name].popen.returncode}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                log(f"{name} up on 127.0.0.1:{port}")
                return
            time.sleep(0.3)
        raise SoakError(f"{name} not listening on 127.0.0.1:{port} after {timeout}s")

    def _wait_api(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.port}/api/v2/monitor/health"
        while time.monotonic() < deadline:
            comp = self.components["api-server"]
            if comp.popen.poll() is not None:
                raise SoakError(f"api-server exited rc={comp.popen.returncode}; see {comp.log_path}")
            with contextlib.suppress(Exception):
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        log(f"api-server up on 127.0.0.1:{self.port}")
                        return
            time.sleep(1)
        raise SoakError(
            f"api-server not healthy after {timeout}s; see {self.components['api-server'].log_path}"
        )

    def check_components(self) -> None:
        for name, comp in self.components.items():
            if comp.popen is None or comp.popen.poll() is None or comp.restarting:
                continue
            rc = comp.popen.returncode
            # give its process group a moment, then make sure nothing of this incarnation is left
            self._kill_session(comp.popen.pid, grace=0)
            text = comp.log_path.read_bytes()[comp.log_offset :].decode(errors="replace")
            err = last_error_line(text)
            category, cause = classify_exit(self._exit_context(text))
            ex = Exit(name, time.monotonic() - (self.t_start or self.t_launch), rc, err, category, cause)
            self.exits.append(ex)
            log(
                f"{name} exited rc={rc} after {time.monotonic() - comp.started_at:.0f}s [{category}: {cause}]: {err}"
            )
            time.sleep(2)
            self.start(name)

    @staticmethod
    def _exit_context(text: str) -> str:
        """The exit's own exception, for classification: the log record of the last traceback (with all of
        that traceback's chained exceptions) to the end; else the last 80 lines. An error the scheduler
        logged and survived before it (a lock wait timeout, say) is not the cause of the exit."""
        lines = text.splitlines()
        last_tb = max(
            (i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line), default=None
        )
        if last_tb is None:
            return "\n".join(lines[-80:])
        start = last_tb
        while start > 0 and not LOG_ISO_RE.match(lines[start]):
            start -= 1
        return "\n".join(lines[start:])

    # ---------------------------------------------------------------- chaos
    def own_task_procs(self) -> list[tuple[str, str, Proc]]:
        """(role, ti_id, proc) for task processes that are provably ours."""
        # Task processes descend from a scheduler (LocalExecutor) or from a Celery worker of ours.
        owners = self.worker_names() if self.celery else self.scheduler_names()
        roots = [
            c.popen.pid
            for c in (self.components[n] for n in owners)
            if c.popen is not None and c.popen.poll() is None
        ]
        if not roots:
            return []
        procs = all_procs()
        found = []
        for p in procs.values():
            m = TITLE_RE.match(p.title)
            if not m or p.state in ("Z", "X"):
                continue
            if not any(is_descendant(procs, p.pid, root) for root in roots):
                continue
            # setproctitle reuses the environ block for the longer title, so /proc/PID/environ of
            # a task process is usually unreadable garbage: refuse only a *different* AIRFLOW_HOME.
            env_home = proc_env_home(p.pid)
            if env_home is not None and env_home != str(self.home):
                continue
            found.append((m.group(3), p))
        if not found:
            return []
        ids = self._own_ti_ids()
        found = [f for f in found if f[0] in ids]
        # Role by tree, not by title: a freshly forked task runner still carries its supervisor's
        # title ("LocalExecutor: <ti_id>") until it sets its own.
        pids_by_ti = collections.defaultdict(set)
        for ti_id, p in found:
            pids_by_ti[ti_id].add(p.pid)
        return [("runner" if p.ppid in pids_by_ti[ti_id] else "supervisor", ti_id, p) for ti_id, p in found]

    def _own_ti_ids(self) -> set[str]:
        """Ids of this soak's task instances that are RUNNING in its database.

        Faults hit running tries only: a worker killed while its TI is still QUEUED never reports
        back, and the TI would sit in QUEUED until ``task_queued_timeout`` -- starving the soak
        instead of exercising the failure handling it is about.
        """
        from sqlalchemy import text

        with self.engine.connect() as c:
            return {
                norm_uuid(r[0])
                for r in c.execute(text("SELECT id FROM task_instance WHERE state = 'running'"))
            }

    def chaos_tick(self) -> None:
        own = self.own_task_procs()
        # a duplicated try is left to its duplicate: its outcome shows what the copy's event did
        own = [
            o
            for o in own
            if (o[2].pid, o[2].starttime) not in self.stopped and o[1] not in self.duplicated_ti_ids
        ]
        if not own:
            self.no_target_ticks += 1
            return
        by_ti: dict[str, dict[str, Proc]] = collections.defaultdict(dict)
        for role, ti_id, p in own:
            by_ti[ti_id][role] = p
        kinds = [
            ("kill_runner", 0.35),
            ("kill_supervisor", 0.25),
            ("stop_supervisor", 0.25),
            ("stop_runner", 0.15),
        ]
        if self.duplicates:
            kinds.append(("duplicate_dispatch", 0.2))
        kind = self.rng.choices([k for k, _ in kinds], weights=[w for _, w in kinds])[0]
        if kind == "duplicate_dispatch":
            self.duplicate_dispatch(by_ti)
            return
        role = kind.split("_", 1)[1]
        candidates = sorted(ti for ti, roles in by_ti.items() if role in roles)
        if not candidates:
            # e.g. a supervisor that has not forked its runner yet: fall back to the other role
            role = "supervisor" if role == "runner" else "runner"
            kind = kind.split("_", 1)[0] + "_" + role
            candidates = sorted(ti for ti, roles in by_ti.items() if role in roles)
        ti_id = candidates[self.rng.randrange(len(candidates))]
        target = by_ti[ti_id][role]
        if not same_process(target):
            self.no_target_ticks += 1
            return
        rec = {
            "t": round(time.monotonic() - self.t_start, 1),
            "kind": kind,
            "ti_id": ti_id,
            "pid": target.pid,
        }
        try:
            if kind.startswith("kill"):
                os.kill(target.pid, signal.SIGKILL)
                if role == "supervisor" and "runner" in by_ti[ti_id] and same_process(by_ti[ti_id]["runner"]):
                    # the worker is lost as a whole: do not leave its task runner behind
                    os.kill(by_ti[ti_id]["runner"].pid, signal.SIGKILL)
                    rec["also_killed_runner"] = by_ti[ti_id]["runner"].pid
            else:
                hold = round(self.rng.uniform(*self.args.stop_seconds), 1)
                os.kill(target.pid, signal.SIGSTOP)
                self.stopped[(target.pid, target.starttime)] = (target, time.monotonic() + hold)
                rec["hold_s"] = hold
        except ProcessLookupError:
            rec["kind"] = kind + "_vanished"
        self.actions.append(rec)
        self.faulted_ti_ids.add(ti_id)
        log(
            f"chaos: {rec['kind']} ti={ti_id} pid={target.pid}"
            + (f" for {rec['hold_s']}s" if "hold_s" in rec else "")
        )

    def duplicate_dispatch(self, by_ti: dict[str, dict[str, Proc]]) -> None:
        """
        Ask the scheduler (plugin ``soak_duplicate_dispatch``) to send a running try's workload to its
        LocalExecutor a second time. Only tries whose task runner runs and that no fault hit (nor an
        earlier duplicate), and no other fault hits them afterwards: a try this fails is a healthy one
        failed by the event of another process. Not sensors: a reschedule sensor's poke lasts a few
        seconds, so its copy's FAILED event meets the try between two pokes (the stale-event case,
        counted apart), not a running process.
        """
        from sqlalchemy import text

        with self.engine.connect() as c:
            long_running = {
                norm_uuid(r[0])
                for r in c.execute(
                    text(
                        "SELECT id FROM task_instance WHERE state = 'running' AND operator NOT LIKE '%Sensor'"
                    )
                )
            }
        candidates = sorted(
            ti
            for ti, roles in by_ti.items()
            if "runner" in roles
            and ti in long_running
            and ti not in self.faulted_ti_ids
            and ti not in self.duplicated_ti_ids
        )
        if not candidates:
            self.no_target_ticks += 1
            return
        ti_id = candidates[self.rng.randrange(len(candidates))]
        (self.duplicate_dir / ti_id).write_text(f"{time.time()}\n")
        self.duplicated_ti_ids.add(ti_id)
        self.actions.append(
            {"t": round(time.monotonic() - self.t_start, 1), "kind": "duplicate_dispatch", "ti_id": ti_id}
        )
        log(f"chaos: duplicate_dispatch ti={ti_id} (requested from the scheduler)")

    def resume_due(self, force: bool = False) -> None:
        now = time.monotonic()
        for key, (p, resume_at) in list(self.stopped.items()):
            if force or now >= resume_at:
                if same_process(p):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, signal.SIGCONT)
                del self.stopped[key]

    # ---------------------------------------------------------------- rolling restarts (Celery)
    def deploy_tick(self, new_waves: bool = True) -> None:
        """
        One step of a rolling restart as in a deploy: worker after worker, SIGTERM to the worker's
        main process (Celery warm shutdown: running tasks finish; SIGKILL of its session after
        ``--warm-grace`` s, like a container's grace period) or, with probability ``--kill-share``,
        SIGKILL of the worker's whole session (a killed container); then a new worker, and the next
        one once it is ready.
        """
        now = time.monotonic()
        step = self.deploy_step
        if step is None:
            if not self.deploy:
                if not new_waves or now < self.next_deploy:
                    return
                self.deploy = self.worker_names()
                log(f"deploy: rolling restart of {', '.join(self.deploy)}")
            comp = self.components[self.deploy.pop(0)]
            if comp.popen is None or comp.popen.poll() is not None:
                return  # exited on its own: check_components restarts it
            kind = "kill" if self.rng.random() < self.args.kill_share else "warm"
            rec = {
                "t": round(now - self.t_start, 1),
                "worker": comp.name,
                "kind": kind,
                "pid": comp.popen.pid,
            }
            running = {
                m.group(3)
                for p in all_procs().values()
                if p.sid == comp.popen.pid and (m := TITLE_RE.match(p.title))
            }
            rec["tis_running"] = len(running)
            self.faulted_ti_ids.update(running)
            comp.restarting = True
            if kind == "kill":
                self._kill_session(comp.popen.pid, grace=0)
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(comp.popen.pid, signal.SIGTERM)
            self.restarts.append(rec)
            self.deploy_step = {"rec": rec, "comp": comp, "phase": "stopping", "since": now}
            log(f"deploy: {'SIGKILL (session)' if kind == 'kill' else 'SIGTERM (warm shutdown)'} {comp.name}")
            return
        comp, rec = step["comp"], step["rec"]
        if step["phase"] == "stopping":
            if comp.popen.poll() is None:
                if now - step["since"] < self.args.warm_grace:
                    return
                rec["grace_exceeded"] = True
            rec["shutdown_s"] = round(now - step["since"], 1)
            self._kill_session(comp.popen.pid, grace=0)  # what is left in the worker's session
            with contextlib.suppress(subprocess.TimeoutExpired):
                comp.popen.wait(timeout=10)
            rec["rc"] = comp.popen.returncode
            self.start(comp.name)
            step.update(phase="starting", since=time.monotonic())
            return
        ready = b" ready." in comp.log_path.read_bytes()[comp.log_offset :]
        if not ready and comp.popen.poll() is None and now - step["since"] < 120:
            return
        rec["ready_s"] = round(now - step["since"], 1) if ready else None
        self.deploy_step = None
        if not self.deploy:
            self.next_deploy = now + self.rng.uniform(*self.args.deploy_pause)

    # ---------------------------------------------------------------- scheduler heartbeats
    def sample_heartbeats(self) -> None:
        """
        Every second: ``job.latest_heartbeat`` of the running scheduler jobs. The largest step between
        two consecutive heartbeats of a job is the largest heartbeat age it had (a dead job's last,
        never-renewed age does not count).
        """
        now = time.monotonic()
        if now < self.next_sample:
            return
        self.next_sample = now + 1.0
        from sqlalchemy import text
        from sqlalchemy.exc import SQLAlchemyError

        query = "SELECT id, latest_heartbeat FROM job WHERE job_type = 'SchedulerJob' AND state = 'running'"
        try:
            with self.engine.connect() as c:
                rows = c.execute(text(query)).all()
        except SQLAlchemyError as e:  # a sample less, not a failed soak
            log(f"heartbeat sample failed: {type(e).__name__}")
            return
        self.heartbeat_samples += 1
        for job_id, hb in rows:
            if hb is None:
                continue
            if hb.tzinfo is None:
                hb = hb.replace(tzinfo=datetime.timezone.utc)
            key = str(job_id)
            prev = self.heartbeat_last.get(key)
            if prev is not None and hb > prev:
                self.heartbeat_max[key] = max(self.heartbeat_max.get(key, 0.0), (hb - prev).total_seconds())
            self.heartbeat_last[key] = hb

    # ---------------------------------------------------------------- run / stop
    def run(self) -> None:
        self.t_launch = time.monotonic()
        self.start_all()
        # Start-up takes 20 s on an idle machine and much longer on a busy one: the clock of the
        # soak starts when the first task process of ours is running.
        warm_deadline = time.monotonic() + self.args.warmup_timeout
        while not self.own_task_procs():  # a task process of ours whose TI is running
            if time.monotonic() > warm_deadline:
                raise SoakError(
                    f"no task process of ours after {self.args.warmup_timeout:.0f}s; see {self.home}/logs"
                )
            self.check_components()
            self.sample_heartbeats()  # from the start: a slow start-up can leave a scheduler's job stale too
            time.sleep(1)
        self.t_start = time.monotonic()
        self.load_start = loadavg()
        self.warmup_s = self.t_start - self.t_launch
        log(
            f"first task process running after {self.warmup_s:.0f}s; soak clock starts ({self.args.duration:.0f}s)"
        )
        deadline = self.t_start + self.args.duration
        next_chaos = time.monotonic() + self.rng.uniform(*self.args.interval)
        self.next_deploy = time.monotonic() + self.rng.uniform(*self.args.deploy_pause)
        while time.monotonic() < deadline:
            self.check_components()
            self.resume_due()
            self.sample_heartbeats()
            if self.celery and not self.args.no_chaos:
                self.deploy_tick()
            if not self.args.no_chaos and time.monotonic() >= next_chaos:
                before = len(self.actions)
                self.chaos_tick()
                if len(self.actions) > before:
                    next_chaos = time.monotonic() + self.rng.uniform(*self.args.interval)
                else:
                    next_chaos = time.monotonic() + 1.0
            time.sleep(0.5)
        self.t_chaos_end = time.monotonic()
        self.load_end = loadavg()
        log(f"soak window over; draining {self.args.drain:.0f}s (components keep running, no faults)")
        self.resume_due(force=True)
        drain_end = time.monotonic() + self.args.drain
        self.deploy = []  # a worker being restarted comes back; no new restarts
        while time.monotonic() < drain_end or self.deploy_step is not None:
            self.check_components()
            self.sample_heartbeats()
            self.deploy_tick(new_waves=False)
            if time.monotonic() > drain_end + 150:
                break
            time.sleep(0.5)
        self.t_end = time.monotonic()

    def log_text(self, name: str) -> str:
        """A component's log up to the shutdown (what came after is shutdown noise)."""
        comp = self.components.get(name)
        if comp is None or not comp.log_path.exists():
            return ""
        raw = comp.log_path.read_bytes()
        return raw[: self.log_sizes_at_stop.get(name, len(raw))].decode(errors="replace")

    def _session_members(self, sid: int) -> list[Proc]:
        out = []
        for p in all_procs().values():
            # zombies (exited, not yet reaped by their parent) are not running: not waited for
            if p.sid == sid and p.pid != os.getpid() and p.state not in ("Z", "X"):
                out.append(p)
        return out

    def _kill_session(self, sid: int, grace: float = 20) -> None:
        members = self._session_members(sid)
        for p in members:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGCONT)
        if grace > 0:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(sid, signal.SIGTERM)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and any(same_process(p) for p in self._session_members(sid)):
                time.sleep(0.5)
        for p in self._session_members(sid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)

    def _stop(self, names: list[str]) -> None:
        sids = []
        for name in names:
            comp = self.components.get(name)
            if comp is None or comp.popen is None:
                continue
            sid = comp.popen.pid
            sids.append(sid)
            for p in self._session_members(sid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
            if comp.popen.poll() is None:
                log(f"stopping {name} (pid {sid})")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(sid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(self._session_members(sid) for sid in sids):
            time.sleep(0.5)
        for sid in sids:
            self._kill_session(sid, grace=0)
        for name in names:
            comp = self.components.get(name)
            if comp is not None and comp.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    comp.popen.wait(timeout=10)

    def stop_all(self) -> None:
        # the analysis reads the logs up to here: shutdown noise (tasks losing the api-server) is not a finding
        for name, comp in self.components.items():
            if comp.log_path.exists():
                self.log_sizes_at_stop.setdefault(name, comp.log_path.stat().st_size)
        self.resume_due(force=True)
        # SIGTERM every component's process group at once, wait up to 15 s in total, then SIGKILL
        # whatever is left in their sessions; the broker (redis) last.
        for names in ([n for n in self.components if n != "redis"], ["redis"]):
            self._stop(names)
        if self.blackhole is not None:
            self.blackhole.close()
            for _, conn in self.blackhole_conns:
                conn.close()
        # orphan check: anything still carrying our AIRFLOW_HOME (e.g. reparented task runners)
        for attempt in range(2):
            leftover = [
                p
                for p in all_procs().values()
                if p.pid != os.getpid()
                and (
                    (p.sid in self.session_ids and ("airflow" in p.title or "redis-server" in p.title))
                    or proc_env_home(p.pid) == str(self.home)
                )
            ]
            if not leftover:
                break
            recs = [{"pid": p.pid, "ppid": p.ppid, "title": p.title[:120]} for p in leftover]
            if attempt == 0:
                self.orphans = recs
                log(f"orphans found after shutdown, killing: {recs}")
                for p in leftover:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, signal.SIGCONT)
                        os.kill(p.pid, signal.SIGKILL)
                time.sleep(1)
            else:
                self.orphans_left = recs
        log(
            "all soak processes stopped"
            + (" (orphans remain!)" if self.orphans_left else "; no orphans left")
        )


def norm_uuid(v: Any) -> str:
    try:
        return str(uuid.UUID(str(v)))
    except ValueError:
        return str(v)


# --------------------------------------------------------------------------------------------------
# Analysis
# --------------------------------------------------------------------------------------------------
def analyse(soak: Soak) -> dict[str, Any]:
    """
    Findings of a finished soak.

    Task instances are keyed by (dag_id, run_id, task_id, map_index): in Airflow 3 a retried TI
    may get a new ``id``, and the previous try moves to ``task_instance_history`` under its old id.
    """
    from sqlalchemy import text

    args = soak.args
    tis: dict[tuple, dict[str, Any]] = {}
    tih: dict[tuple, dict[int, str]] = collections.defaultdict(dict)
    id_to_key: dict[str, tuple] = {}
    with soak.engine.connect() as c:
        for r in c.execute(
            text(
                "SELECT id, dag_id, run_id, task_id, map_index, try_number, max_tries, state, operator"
                " FROM task_instance"
            )
        ):
            key = (r.dag_id, r.run_id, r.task_id, r.map_index)
            tis[key] = dict(r._mapping)
            id_to_key[norm_uuid(r.id)] = key
        for r in c.execute(
            text(
                "SELECT task_instance_id, dag_id, run_id, task_id, map_index, try_number, state"
                " FROM task_instance_history"
            )
        ):
            key = (r.dag_id, r.run_id, r.task_id, r.map_index)
            tih[key][r.try_number] = r.state
            id_to_key.setdefault(norm_uuid(r.task_instance_id), key)
        audit_rows = [
            dict(r._mapping)
            for r in c.execute(
                text("SELECT seq, id, type, data, created_at FROM soak_callback_audit ORDER BY seq")
            )
        ]
        reschedules = c.execute(text("SELECT count(*) FROM task_reschedule")).scalar()
        # the scheduler's "state mismatch" audit-log rows carry the try (executor-event failures)
        mismatch_rows = [
            dict(r._mapping)
            for r in c.execute(
                text(
                    "SELECT dttm, dag_id, task_id, run_id, map_index, try_number, extra FROM log"
                    " WHERE event = 'state mismatch'"
                )
            )
        ]

    def label(key: tuple) -> str:
        return f"{key[0]}.{key[2]} {key[1]}" + (f"[{key[3]}]" if key[3] not in (-1, None) else "")

    def ti_key(d: dict[str, Any]) -> tuple:
        return (d.get("dag_id"), d.get("run_id"), d.get("task_id"), d.get("map_index", -1))

    # -- callbacks from the file (what actually ran)
    file_cbs: dict[tuple, list] = collections.defaultdict(list)
    for line in soak.callback_file.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError, KeyError):
            rec = json.loads(line)
            file_cbs[(ti_key(rec), rec["try_number"])].append(rec)
    # -- callback requests from the audit table (what was requested)
    audit_cbs: dict[tuple, list] = collections.defaultdict(list)
    audit_other: collections.Counter[str] = collections.Counter()
    for row in audit_rows:
        try:
            data = row["data"] if isinstance(row["data"], dict) else json.loads(row["data"])
            if isinstance(data, str):
                data = json.loads(data)
            if isinstance(data, dict) and "__var" in data:  # ExtendedJSON envelope
                data = data["__var"]
            if isinstance(data, dict) and "req_class" not in data:  # 3.1.x `callback_request` row
                data = {"req_class": row["type"], "req_data": data}
            req = data.get("req_data")
            req = json.loads(req) if isinstance(req, str) else (req or {})
        except (ValueError, TypeError, AttributeError):
            audit_other["unparsable"] += 1
            continue
        if data.get("req_class") != "TaskCallbackRequest":
            audit_other[data.get("req_class") or row["type"]] += 1
            continue
        ti = req.get("ti") or {}
        id_to_key.setdefault(norm_uuid(ti.get("id")), ti_key(ti))
        audit_cbs[(ti_key(ti), ti.get("try_number"))].append(
            {
                "ti_id": norm_uuid(ti.get("id")),
                "type": str(req.get("task_callback_type")),
                "msg": (req.get("msg") or "")[:300],
                "created_at": str(row["created_at"]),
            }
        )

    dup_keys = sorted(
        {k for k, v in file_cbs.items() if len(v) > 1} | {k for k, v in audit_cbs.items() if len(v) > 1},
        key=str,
    )
    duplicate_tries = [
        {
            "ti": label(k[0]),
            "try_number": k[1],
            "ran (file)": [f"{r['kind']}@{proc_role(r.get('proc', ''))}" for r in file_cbs.get(k, [])],
            "requested (audit)": [
                a["type"]
                + (" [state mismatch]" if "but the task instance's state attribute" in a["msg"] else "")
                for a in audit_cbs.get(k, [])
            ],
        }
        for k in dup_keys
    ]
    failed_tries = set(file_cbs) | set(audit_cbs)

    def try_state(key: tuple, n: int) -> str | None:
        ti = tis.get(key)
        if ti is not None and ti["try_number"] == n:
            return ti["state"]
        return tih.get(key, {}).get(n)

    success_after_cb = []
    for k in sorted(failed_tries, key=str):
        if k[1] is None:
            continue
        if try_state(k[0], int(k[1])) == "success":
            success_after_cb.append(
                {
                    "ti": label(k[0]),
                    "try_number": k[1],
                    "callbacks": [r["kind"] for r in file_cbs.get(k, [])]
                    + [a["type"] for a in audit_cbs.get(k, [])],
                }
            )

    # -- tries without a try-history row (every try before the current one must have one)
    missing_history = []
    for key, ti in tis.items():
        for n in range(1, (ti["try_number"] or 0)):
            if n not in tih.get(key, {}):
                missing_history.append(
                    {"ti": label(key), "try_number": n, "had_callback": (key, n) in failed_tries}
                )
    for k in sorted(failed_tries, key=str):
        ti = tis.get(k[0])
        if ti and k[1] is not None and int(k[1]) > (ti["try_number"] or 0):
            missing_history.append(
                {
                    "ti": label(k[0]),
                    "try_number": k[1],
                    "had_callback": True,
                    "note": "callback for a try beyond the TI's try_number",
                }
            )

    too_many_tries = [
        {"ti": label(key), "try_number": t["try_number"], "max_tries": t["max_tries"], "state": t["state"]}
        for key, t in tis.items()
        if (t["try_number"] or 0) > (t["max_tries"] or 0) + 1
    ]

    # -- scheduler logs: stale executor events, other exceptions
    text_log = "".join(soak.log_text(name) for name in soak.scheduler_names())
    # The scheduler logs each state mismatch twice (its own error line, then handle_failure's):
    # count one event per (TI, executor state, second).
    stale_lines = collections.defaultdict(list)
    mismatch_other: collections.Counter[str] = collections.Counter()
    seen_events = set()
    for line in text_log.splitlines():
        m = STATE_MISMATCH_RE.search(line)
        if not m:
            continue
        ids = UUID_RE.findall(line)
        ts = LOG_TS_RE.match(line)
        key = (ids[0] if ids else "", m.group(1), ts.group(1) if ts else line)
        if key in seen_events:
            continue
        seen_events.add(key)
        if m.group(1) == "success" and ids:
            stale_lines[ids[0]].append(m.group(2))
        else:
            mismatch_other[f"executor {m.group(1)} / TI {m.group(2)}"] += 1
    # group by task instance (a retried TI may get a new id)
    stale_by_key: dict[Any, list[tuple[str, str]]] = collections.defaultdict(list)
    for ti_id, states in stale_lines.items():
        stale_by_key[id_to_key.get(ti_id, ti_id)].extend((ti_id, st) for st in states)
    stale_failed = []
    for key, events in stale_by_key.items():
        ids = {i for i, _ in events}
        ti = tis.get(key) if isinstance(key, tuple) else None
        # A try whose own process was killed or stopped by a fault (or ran on a worker that was
        # restarted) ends for that reason: an executor SUCCESS event for it is not stale (e.g. Celery
        # reports SUCCESS for a workload whose task runner was SIGKILLed before the supervisor's
        # failed state reached the API). Those tries are listed apart.
        by_stale, after_fault = set(), set()
        for k, v in audit_cbs.items():
            for a in v:
                if a["ti_id"] in ids and "finished with state success" in a["msg"]:
                    (after_fault if a["ti_id"] in soak.faulted_ti_ids else by_stale).add(k[1])
        stale_failed.append(
            {
                "ti": label(key) if isinstance(key, tuple) else key,
                "operator": ti["operator"] if ti else None,
                "stale_events": len(events),
                "ti_states_seen": sorted({st for _, st in events}),
                "tries_failed_by_stale_event": sorted(by_stale, key=lambda n: (n is None, n)),
                "tries_failed_after_a_fault_on_them": sorted(after_fault, key=lambda n: (n is None, n)),
            }
        )
    sensors_failed_by_stale = [
        s
        for s in stale_failed
        if s["tries_failed_by_stale_event"] and (s["operator"] or "").endswith("Sensor")
    ]
    failed_after_fault = [
        {k: s[k] for k in ("ti", "operator", "tries_failed_after_a_fault_on_them")}
        for s in stale_failed
        if s["tries_failed_after_a_fault_on_them"]
    ]
    stale_failed = [s for s in stale_failed if s["tries_failed_by_stale_event"]]

    exc_counter: collections.Counter[str] = collections.Counter()
    exc_example: dict[str, str] = {}
    for line in text_log.splitlines():
        s = line.strip()
        if s.startswith(("File ", "raise ", "During handling", "The above exception")):
            continue
        m = re.match(r"^((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Violation))(?::\s*(.*))?$", s)
        if not m:
            continue
        key = m.group(1) + ": " + re.sub(r"\d+|'[^']*'", "#", (m.group(2) or ""))[:120]
        exc_counter[key] += 1
        exc_example.setdefault(key, s[:400])
    other_exceptions = [
        {"exception": k, "count": n, "example": exc_example[k]} for k, n in exc_counter.most_common()
    ]

    extra = analyse_tries_and_services(soak, tis, tih, file_cbs, text_log)
    sent_file = soak.duplicate_dir / "sent.jsonl"
    extra.update(
        analyse_duplicates(
            requested=sum(1 for a in soak.actions if a["kind"] == "duplicate_dispatch"),
            sent_lines=sent_file.read_text(errors="replace").splitlines() if sent_file.exists() else [],
            faulted_ti_ids=soak.faulted_ti_ids,
            mismatch_rows=mismatch_rows,
            try_state=try_state,
            api_log=soak.log_text("api-server"),
        )
    )
    extra["duplicate_dispatch"]["enabled"] = soak.duplicates

    kinds = collections.Counter(a["kind"] for a in soak.actions)
    sched_exits = [e.__dict__ for e in soak.exits if e.component.startswith("scheduler")]
    comp_exits = [e.__dict__ for e in soak.exits if not e.component.startswith("scheduler")]
    series_exits = [e for e in sched_exits if e["category"] == "series"]
    outside_exits = [e for e in sched_exits if e["category"] != "series"]
    ti_states = collections.Counter(t["state"] for t in tis.values())
    listener_calls = len(soak.listener_file.read_text().splitlines()) if soak.listener_file.exists() else 0
    failures_run = sum(len(v) for v in file_cbs.values())

    series_fail = bool(series_exits or duplicate_tries or extra["healthy_tries_failed_by_another_process"])
    strict_fail = bool(success_after_cb or sensors_failed_by_stale or missing_history or too_many_tries)
    if series_fail or (args.strict and strict_fail):
        verdict, code = "FAIL (series areas)", 1
    elif not ti_states.get("success"):
        verdict, code = "SOAK ERROR (no task instance succeeded: the deployment did not work)", 2
    elif soak.orphans_left:
        verdict, code = "SOAK ERROR (orphans left)", 2
    elif outside_exits or comp_exits:
        verdict, code = "NOT A PASS (exits outside the series' areas)", 3
    else:
        verdict, code = "PASS", 0
    if code == 1:  # what the series finding would otherwise hide
        also = [
            f"{len(outside_exits)} scheduler exit(s) outside the series' areas" if outside_exits else "",
            f"{len(comp_exits)} other component exit(s)" if comp_exits else "",
            "no task instance succeeded" if not ti_states.get("success") else "",
            "orphans left" if soak.orphans_left else "",
        ]
        if also := [a for a in also if a]:
            verdict += f"; also {', '.join(also)}"

    if soak.interrupted:
        verdict, code = f"INTERRUPTED (incomplete; findings so far: {verdict})", max(code, 2)

    return {
        "label": args.label,
        "backend": args.backend,
        "seed": args.seed,
        "airflow": airflow_version(),
        "home": str(soak.home),
        "duration_requested_s": args.duration,
        "warmup_s": round(soak.warmup_s, 1),
        "duration_s": round((soak.t_chaos_end or soak.t_end) - soak.t_start, 1) if soak.t_start else 0,
        "drain_s": round(soak.t_end - soak.t_chaos_end, 1) if soak.t_chaos_end else 0,
        "chaos": not args.no_chaos,
        "chaos_interval_s": list(args.interval),
        "listener_sleep_s": args.listener_sleep,
        "interrupted": soak.interrupted,
        "actions_by_kind": dict(sorted(kinds.items())),
        "actions": soak.actions,
        "scheduler_exits": sched_exits,
        "scheduler_exits_series": len(series_exits),
        "scheduler_exits_outside": len(outside_exits),
        "other_component_exits": comp_exits,
        "ti_states": dict(ti_states),
        "task_instances": len(tis),
        "task_reschedule_rows": reschedules,
        "callbacks_run": failures_run,
        "tries_with_callbacks": len(failed_tries),
        "callback_requests_audited": sum(len(v) for v in audit_cbs.values()),
        "other_callback_requests": dict(audit_other),
        "listener_failed_calls": listener_calls,
        "duplicate_callback_tries": duplicate_tries,
        "success_after_failure_callback": success_after_cb,
        "stale_success_events": sum(len(v) for v in stale_lines.values()),
        "sensors_failed_by_stale_event": sensors_failed_by_stale,
        "other_state_mismatch_events": dict(mismatch_other),
        "loadavg_start": soak.load_start,
        "loadavg_end": soak.load_end,
        "tis_failed_after_stale_event": stale_failed,
        "state_mismatch_failures_after_a_fault": failed_after_fault,
        "tries_without_history": missing_history,
        "tis_over_max_tries": too_many_tries,
        "other_exceptions": other_exceptions,
        "orphans_killed_at_end": soak.orphans,
        "orphans_left": soak.orphans_left,
        **extra,
        "verdict": verdict,
        "exit_code": code,
    }


def exit_status(report: dict[str, Any], expect_races: bool) -> tuple[int, str]:
    """The runner's exit status for ``report`` and a line saying why.

    ``expect_races`` (the pristine release, ``--expect-races``): a finding in the series' areas is the
    expected outcome, exit 0, but only if nothing else went wrong: every scheduler exit in the series'
    areas, no other component exit, a task instance succeeded, no orphan left, not interrupted.
    """
    code, verdict = report["exit_code"], report["verdict"]
    exits = len(report["scheduler_exits"])
    counts = (
        f"scheduler exits {exits} (series' areas {report['scheduler_exits_series']}, outside "
        f"{report['scheduler_exits_outside']}), other component exits {len(report['other_component_exits'])}"
    )
    clean = not (
        report["scheduler_exits_outside"]
        or report["other_component_exits"]
        or not report["ti_states"].get("success")
        or report["orphans_left"]
        or report["interrupted"]
    )
    if expect_races and code == 1 and clean:
        return 0, f"exit 0 (--expect-races): {verdict}, as expected of the pristine release; {counts}"
    return code, f"exit {code}: {verdict}; {counts}"


def parse_log_ts(line: str) -> float | None:
    """Epoch seconds of a log line's leading ISO timestamp (UTC when it carries no offset)."""
    m = LOG_ISO_RE.match(line)
    if not m:
        return None
    ts = m.group(1) + (m.group(2) or "+00:00").replace("Z", "+00:00")
    with contextlib.suppress(ValueError):
        return datetime.datetime.fromisoformat(ts).timestamp()
    return None


def histogram(counts: list[int]) -> dict[str, int]:
    return {"0": counts.count(0), "1": counts.count(1), "more": sum(1 for n in counts if n > 1)}


def analyse_tries_and_services(
    soak: Soak, tis: dict, tih: dict, file_cbs: dict, text_log: str
) -> dict[str, Any]:
    """
    Per failed try: failure/retry callbacks run and on_task_instance_failed calls (0 / 1 / more), by
    which process and which scheduler; failure handling time per executor FAILED event; scheduler
    heartbeat gaps; execution-API 5xx by route; worker restarts.

    A failed try is one whose recorded state is ``failed`` or ``up_for_retry`` (task_instance for the
    current try, task_instance_history for earlier ones).
    """
    failed: set[tuple] = set()
    for key, ti in tis.items():
        if ti["state"] in ("failed", "up_for_retry") and ti["try_number"]:
            failed.add((key, int(ti["try_number"])))
    for key, tries in tih.items():
        failed.update((key, int(n)) for n, st in tries.items() if st in ("failed", "up_for_retry"))

    sched_pid = {
        pid: c.name for c in soak.components.values() if c.name.startswith("scheduler") for pid in c.pids
    }
    calls: dict[tuple, list[dict[str, Any]]] = collections.defaultdict(list)
    for line in soak.listener_file.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            rec = json.loads(line)
            key = (rec["dag_id"], rec["run_id"], rec["task_id"], rec.get("map_index", -1))
            rec["side"] = sched_pid.get(rec["pid"], "task process")
            calls[(key, int(rec["try_number"]))].append(rec)

    def name(k: tuple) -> str:
        return f"{k[0][0]}.{k[0][2]} {k[0][1]} try {k[1]}"

    cb_counts = [len(file_cbs.get((k[0], k[1]), [])) for k in failed]
    listener_counts = [len(calls.get(k, [])) for k in failed]
    sides = collections.Counter(r["side"].split("-")[0] for k in failed for r in calls.get(k, []))
    more_listener = [
        {"try": name(k), "calls": [r["side"] for r in calls[k]]}
        for k in sorted(failed, key=str)
        if len(calls.get(k, [])) > 1
    ]
    no_callback = [
        {
            "try": name(k),
            "state": tis[k[0]]["state"]
            if k[0] in tis and tis[k[0]]["try_number"] == k[1]
            else tih.get(k[0], {}).get(k[1]),
        }
        for k in sorted(failed, key=str)
        if not file_cbs.get((k[0], k[1]))
    ]
    across = [
        {"try": name(k), "schedulers": sorted({r["side"] for r in v if r["side"].startswith("scheduler")})}
        for k, v in sorted(calls.items(), key=str)
        if len({r["side"] for r in v if r["side"].startswith("scheduler")}) > 1
    ]

    # Failure handling per executor FAILED event: from the scheduler's "Received executor event with
    # state failed" line to the end of the on_task_instance_failed listeners (the soak's recorder runs
    # last) in the same scheduler process for the same try.
    event_ts: dict[tuple, float] = {}
    for line in text_log.splitlines():
        m = EVENT_RE.search(line)
        ts = parse_log_ts(line) if m else None
        if m and ts is not None:
            k = ((m.group(1), m.group(3), m.group(2), int(m.group(5))), int(m.group(4)))
            event_ts.setdefault(k, ts)
    listener_s = sorted(
        round(r["ts_end"] - r["ts_first"], 2)
        for v in calls.values()
        for r in v
        if r["side"].startswith("scheduler") and "ts_first" in r
    )
    handling = sorted(
        round(r["ts_end"] - event_ts[k], 2)
        for k, v in calls.items()
        if k in event_ts
        for r in v
        if r["side"].startswith("scheduler") and "ts_end" in r and r["ts_end"] >= event_ts[k]
    )

    api_5xx: collections.Counter[str] = collections.Counter()
    api_requests = 0
    for line in soak.log_text("api-server").splitlines():
        m = access_match(line)
        if not m:
            continue
        api_requests += 1
        if int(m.group(3)) >= 500:
            api_5xx[f"{m.group(1)} {UUID_RE.sub('{id}', m.group(2))}"] += 1

    worker_lost = sum(soak.log_text(n).count("WorkerLostError") for n in soak.worker_names())
    # HA: a scheduler whose heartbeat is older than scheduler_health_check_threshold (30 s) is taken
    # for dead by the other one, which marks its job failed and adopts its tasks.
    jobs_marked_failed = sum(
        int(n) for n in re.findall(r"Marked (\d+) SchedulerJob instances as failed", text_log)
    )
    adopted = sum(int(n) for n in re.findall(r"Adopted the following (\d+) tasks", text_log))
    return {
        "executor": soak.args.executor,
        "schedulers": soak.args.schedulers,
        "workers": soak.args.workers if soak.celery else 0,
        "worker_concurrency": soak.args.worker_concurrency if soak.celery else 0,
        "listener": soak.args.listener,
        "failed_tries": len(failed),
        "callbacks_per_failed_try": histogram(cb_counts),
        "listener_calls_per_failed_try": histogram(listener_counts),
        "listener_calls_by_side": dict(sides),
        "tries_with_more_than_one_listener_call": more_listener,
        "failed_tries_without_callback": no_callback,
        "tries_handled_by_two_schedulers": across,
        "scheduler_listener_s": {
            "calls": len(listener_s),
            "median": listener_s[len(listener_s) // 2] if listener_s else None,
            "max": listener_s[-1] if listener_s else None,
            "total": round(sum(listener_s), 1),
        },
        "failure_handling_s": {
            "events": len(handling),
            "median": handling[len(handling) // 2] if handling else None,
            "max": handling[-1] if handling else None,
        },
        "scheduler_heartbeat_gap_max_s": {k: round(v, 1) for k, v in sorted(soak.heartbeat_max.items())},
        "heartbeat_samples": soak.heartbeat_samples,
        "api_requests": api_requests,
        "api_5xx_by_route": dict(api_5xx.most_common()),
        "worker_restarts": soak.restarts,
        "worker_lost_errors": worker_lost,
        "scheduler_jobs_marked_failed": jobs_marked_failed,
        "tasks_adopted": adopted,
        "openlineage_connections": soak.blackhole_accepted,
    }


def epoch(v: Any) -> float | None:
    """Epoch seconds of a datetime from the database (naive = UTC, as Airflow stores it) or a log line."""
    if isinstance(v, str):
        return parse_log_ts(v)
    if isinstance(v, datetime.datetime):
        return (v if v.tzinfo else v.replace(tzinfo=datetime.timezone.utc)).timestamp()
    return None


def analyse_duplicates(
    *,
    requested: int,
    sent_lines: list[str],
    faulted_ti_ids: set[str],
    mismatch_rows: list[dict[str, Any]],
    try_state: Any,
    api_log: str,
) -> dict[str, Any]:
    """
    The duplicate_dispatch fault: what the scheduler sent and which healthy tries the copies failed.

    ``sent_lines``: the plugin's ``sent.jsonl`` (one line per request it handled: the try's key, when,
    whether the copy went onto the activity queue). A **healthy try failed by an executor event of another
    process**: a try whose workload was sent a second time, that no other fault hit (its own processes
    were neither killed nor stopped, so they ran and heartbeat), which the scheduler failed through the
    executor-event path after the copy was sent (a ``state mismatch`` log row for that try: "finished with
    state failed, but the task instance's state attribute is running") and whose recorded state is
    failed / up_for_retry. ``heartbeats_after_failure``: the first copy's heartbeat requests of that TI
    after the failure (api-server access log; 409 once the try is no longer running), evidence that the
    process the failure was about was alive.
    """
    # ts None: an access line without a timestamp (3.1.x); counted for the 409 of a copy's ti_run
    # regardless of time (a try's id has one first ti_run), left out of heartbeats_after_failure.
    access: list[tuple[float | None, str, str, int]] = []
    for line in api_log.splitlines():
        m = access_match(line)
        if m:
            access.append((parse_log_ts(line), m.group(1), m.group(2), int(m.group(3))))
    sent, not_sent, refused, healthy = [], [], 0, []
    for line in sent_lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        (sent if rec.get("sent") else not_sent).append(rec)
    for rec in sent:
        ti_id = norm_uuid(rec["ti_id"])
        run_path = f"/execution/task-instances/{ti_id}/run"
        refused += any(
            (ts is None or ts >= rec["ts"] - 1) and method == "PATCH" and path == run_path and status == 409
            for ts, method, path, status in access
        )
        if ti_id in faulted_ti_ids:
            continue
        key = (rec["dag_id"], rec["run_id"], rec["task_id"], rec.get("map_index", -1))
        failed_at = [
            epoch(r["dttm"])
            for r in mismatch_rows
            if (r["dag_id"], r["run_id"], r["task_id"], r["map_index"]) == key
            and r["try_number"] == rec["try_number"]
            and "finished with state failed, but the task instance's state attribute is running"
            in (r["extra"] or "")
            and (epoch(r["dttm"]) or 0) >= rec["ts"] - 1
        ]
        state = try_state(key, int(rec["try_number"]))
        if not failed_at or state not in ("failed", "up_for_retry"):
            continue
        beat_path = f"/execution/task-instances/{ti_id}/heartbeat"
        beats = [
            status
            for ts, _, path, status in access
            if path == beat_path and ts is not None and ts > min(failed_at)
        ]
        healthy.append(
            {
                "try": f"{key[0]}.{key[2]} {key[1]} try {rec['try_number']}",
                "ti_id": ti_id,
                "state": state,
                "failed_s_after_dispatch": round(min(failed_at) - rec["ts"], 1),
                "heartbeats_after_failure": dict(collections.Counter(beats)),
            }
        )
    return {
        "duplicate_dispatch": {
            "requested": requested,
            "sent": len(sent),
            "not_sent": len(not_sent),
            "copies_refused_by_ti_run_409": refused,
        },
        "healthy_tries_failed_by_another_process": healthy,
    }


def proc_role(title: str) -> str:
    if "dag-processor" in title or "dag_processor" in title:
        return "dag-processor"
    if "airflow worker" in title:
        return "task"
    if "scheduler" in title:
        return "scheduler"
    return title[:30] or "?"


def airflow_version() -> str:
    try:
        from importlib.metadata import version

        return version("apache-airflow-core")
    except Exception:
        return "?"


def to_markdown(r: dict[str, Any]) -> str:
    L = []
    L.append(f"# Chaos soak: {r['label']} on {r['backend']} (seed {r['seed']})\n")
    L.append(f"**Verdict: {r['verdict']}** (exit {r['exit_code']})\n")
    L.append("| | |\n|---|---|")
    restarts = collections.Counter(x["kind"] for x in r["worker_restarts"])
    shutdowns = [x["shutdown_s"] for x in r["worker_restarts"] if x["kind"] == "warm" and "shutdown_s" in x]
    fh = r["failure_handling_s"]
    dd = r["duplicate_dispatch"]
    rows = [
        ("apache-airflow-core", r["airflow"]),
        (
            "deployment",
            f"{r['executor']} executor"
            + (f" ({r['workers']} workers x concurrency {r['worker_concurrency']})" if r["workers"] else "")
            + f", {r['schedulers']} scheduler(s), listener {r['listener']}",
        ),
        (
            "machine load (1/5/15 min) at start / end",
            f"{r['loadavg_start']} / {r['loadavg_end']} on {os.cpu_count()} CPUs",
        ),
        (
            "duration",
            f"{r['duration_s']} s (requested {r['duration_requested_s']} s) after {r['warmup_s']} s start-up, then {r['drain_s']} s drain",
        ),
        (
            "chaos",
            f"{'on, a fault every ' + str(r['chaos_interval_s'][0]) + '-' + str(r['chaos_interval_s'][1]) + ' s' if r['chaos'] else 'OFF (slow listener only)'}",
        ),
        ("faults by kind", ", ".join(f"{k} {v}" for k, v in r["actions_by_kind"].items()) or "none"),
        (
            "listener sleep",
            f"{r['listener_sleep_s']} s; on_task_instance_failed calls: {r['listener_failed_calls']}",
        ),
        (
            "scheduler exits",
            f"{len(r['scheduler_exits'])} (series areas {r['scheduler_exits_series']}, outside {r['scheduler_exits_outside']})",
        ),
        (
            "task instances",
            f"{r['task_instances']} ({', '.join(f'{k} {v}' for k, v in sorted(r['ti_states'].items(), key=str))}); task_reschedule rows {r['task_reschedule_rows']}",
        ),
        (
            "failure/retry callbacks run (file)",
            f"{r['callbacks_run']} over {r['tries_with_callbacks']} tries; requests audited {r['callback_requests_audited']}",
        ),
        (
            "tries with >1 failure/retry callback",
            f"{len(r['duplicate_callback_tries'])} of {r['tries_with_callbacks']} tries with a callback",
        ),
        (
            "TIs SUCCESS after a failure/retry callback for the same try",
            len(r["success_after_failure_callback"]),
        ),
        ("stale executor SUCCESS events (log lines)", r["stale_success_events"]),
        (
            "sensors failed by a stale executor event (tries no fault hit)",
            f"{len(r['sensors_failed_by_stale_event'])} TIs, "
            f"{sum(len(x['tries_failed_by_stale_event']) for x in r['sensors_failed_by_stale_event'])} tries",
        ),
        (
            "state-mismatch failures of tries a fault hit (SIGSTOP, kill or worker restart at any time of the try)",
            f"{len(r['state_mismatch_failures_after_a_fault'])} TIs, "
            f"{sum(len(x['tries_failed_after_a_fault_on_them']) for x in r['state_mismatch_failures_after_a_fault'])} tries",
        ),
        (
            "other executor/TI state mismatches",
            ", ".join(f"{k}: {v}" for k, v in r["other_state_mismatch_events"].items()) or "0",
        ),
        ("tries without a try-history row", len(r["tries_without_history"])),
        (
            "failed tries (failed/up_for_retry): failure/retry callbacks run 0 / 1 / more",
            f"{r['failed_tries']}: " + " / ".join(str(v) for v in r["callbacks_per_failed_try"].values()),
        ),
        (
            "failed tries: on_task_instance_failed calls 0 / 1 / more",
            " / ".join(str(v) for v in r["listener_calls_per_failed_try"].values())
            + f" (calls by process: {', '.join(f'{k} {v}' for k, v in r['listener_calls_by_side'].items()) or 'none'})",
        ),
        ("tries whose failure two schedulers handled", len(r["tries_handled_by_two_schedulers"])),
        (
            "duplicate dispatches: requested / sent by the scheduler / copies refused by ti_run (409)",
            " / ".join(str(dd[k]) for k in ("requested", "sent", "copies_refused_by_ti_run_409"))
            if dd["enabled"]
            else "off",
        ),
        (
            "healthy tries failed by an executor event of another process (a duplicate's FAILED; no fault on the try)",
            len(r["healthy_tries_failed_by_another_process"]) if dd["enabled"] else "n/a",
        ),
        (
            "on_task_instance_failed listeners in the schedulers: time per call (all listeners)",
            f"{r['scheduler_listener_s']['calls']} calls, median {r['scheduler_listener_s']['median']} s,"
            f" max {r['scheduler_listener_s']['max']} s, total {r['scheduler_listener_s']['total']} s",
        ),
        (
            "failure handling per executor FAILED event (event line to end of listeners)",
            f"{fh['events']} events, median {fh['median']} s, max {fh['max']} s",
        ),
        (
            "scheduler heartbeat: largest gap per job (sampled every 1 s)",
            ", ".join(f"job {k}: {v} s" for k, v in r["scheduler_heartbeat_gap_max_s"].items()) or "none",
        ),
        (
            "scheduler jobs marked failed by the other scheduler / tasks adopted",
            f"{r['scheduler_jobs_marked_failed']} / {r['tasks_adopted']}",
        ),
        (
            "execution/API 5xx by route",
            (", ".join(f"{k}: {v}" for k, v in r["api_5xx_by_route"].items()) or "0")
            + f" (of {r['api_requests']} requests)",
        ),
        (
            "worker restarts (warm SIGTERM / SIGKILL)",
            f"{restarts.get('warm', 0)} / {restarts.get('kill', 0)}"
            + (f"; warm shutdown took max {max(shutdowns)} s" if shutdowns else "")
            + f"; WorkerLostError lines {r['worker_lost_errors']}"
            if r["workers"]
            else "n/a (LocalExecutor)",
        ),
        (
            "OpenLineage endpoint connections (never answered)",
            r["openlineage_connections"] if r["listener"] == "openlineage" else "n/a",
        ),
        ("TIs with more tries than max_tries+1", len(r["tis_over_max_tries"])),
        ("orphans killed at end / left", f"{len(r['orphans_killed_at_end'])} / {len(r['orphans_left'])}"),
    ]
    for k, v in rows:
        L.append(f"| {k} | {v} |")
    L.append("")
    if r["scheduler_exits"]:
        L.append("## Scheduler exits\n")
        L.append("| t (s) | rc | area | cause | last error line |\n|---|---|---|---|---|")
        for e in r["scheduler_exits"]:
            L.append(
                f"| {e['at']:.0f} | {e['returncode']} | {e['category']} | {e['cause']} | `{md_cell(e['error_line'])}` |"
            )
        L.append("")
    if r["other_component_exits"]:
        L.append("## Other component exits\n")
        for e in r["other_component_exits"]:
            L.append(
                f"- {e['component']} at {e['at']:.0f}s rc={e['returncode']} [{e['category']}: {e['cause']}]: `{md_cell(e['error_line'])}`"
            )
        L.append("")
    sections = [
        ("Tries with more than one failure/retry callback", "duplicate_callback_tries"),
        ("SUCCESS after a failure/retry callback for the same try", "success_after_failure_callback"),
        ("Sensors failed by a stale executor event", "sensors_failed_by_stale_event"),
        ("Tries without a try-history row", "tries_without_history"),
        (
            "Failed tries with more than one on_task_instance_failed call",
            "tries_with_more_than_one_listener_call",
        ),
        ("Tries whose failure two schedulers handled", "tries_handled_by_two_schedulers"),
        (
            "Healthy tries failed by an executor event of another process",
            "healthy_tries_failed_by_another_process",
        ),
        ("Failed tries without a failure/retry callback", "failed_tries_without_callback"),
        ("Worker restarts", "worker_restarts"),
        ("TIs with more tries than max_tries+1", "tis_over_max_tries"),
    ]
    for title, key in sections:
        items = r[key]
        if not items:
            continue
        L.append(f"## {title} ({len(items)})\n")
        for it in items[:30]:
            L.append("- " + ", ".join(f"{k}={md_cell(str(v))}" for k, v in it.items() if k != "ti_id"))
        if len(items) > 30:
            L.append(f"- ... {len(items) - 30} more (see JSON)")
        L.append("")
    if r["other_exceptions"]:
        L.append("## Exceptions in the scheduler log (until shutdown)\n")
        L.append("| count | exception |\n|---|---|")
        for e in r["other_exceptions"][:25]:
            L.append(f"| {e['count']} | `{md_cell(e['example'][:200])}` |")
        L.append("")
    L.append(
        f"Logs: `{r['home']}/logs/` (one file per component); callbacks: `{r['home']}/callbacks.jsonl`.\n"
    )
    return "\n".join(L)


def md_cell(s: str) -> str:
    return s.replace("|", "\\|").replace("`", "'").replace("\n", " ")


# --------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--backend", required=True, choices=["postgres", "mysql", "sqlite"])
    p.add_argument(
        "--duration", type=float, default=360, help="seconds the components run under chaos (default 360)"
    )
    p.add_argument(
        "--drain", type=float, default=15, help="seconds without faults before shutdown (default 15)"
    )
    p.add_argument("--seed", type=int, default=42)
    p.add_argument(
        "--report", required=True, help="report path; writes PATH.md and PATH.json (suffix stripped)"
    )
    p.add_argument("--label", default="series", help="base|series (goes into the report)")
    p.add_argument(
        "--expect-races",
        action="store_true",
        help="the tree is the pristine release: exit 0 on findings in the series' areas if nothing else went"
        " wrong (any other exit, orphans, no success: the usual non-zero status)",
    )
    p.add_argument(
        "--interval",
        type=float,
        nargs=2,
        default=(3.0, 8.0),
        metavar=("MIN", "MAX"),
        help="seconds between faults",
    )
    p.add_argument(
        "--stop-seconds",
        type=float,
        nargs=2,
        default=(10.0, 40.0),
        metavar=("MIN", "MAX"),
        help="how long a SIGSTOPped process stays stopped",
    )
    p.add_argument(
        "--listener-sleep",
        type=float,
        help="seconds the soak's recording listener sleeps in on_task_instance_failed (default: 5 with"
        " --listener slow, 0 with --listener openlineage)",
    )
    p.add_argument(
        "--listener",
        choices=["slow", "openlineage"],
        default="slow",
        help="slow: the soak's sleeping listener; openlineage: the OpenLineage provider's listener with its"
        " HTTP transport pointed at a loopback endpoint that never answers (needs the provider)",
    )
    p.add_argument("--executor", choices=["local", "celery"], default="local")
    p.add_argument("--schedulers", type=int, default=1, help="schedulers on the same database (default 1)")
    p.add_argument("--workers", type=int, default=3, help="Celery workers (default 3)")
    p.add_argument("--worker-concurrency", type=int, default=2, help="Celery worker concurrency (default 2)")
    p.add_argument(
        "--deploy-pause",
        type=float,
        nargs=2,
        default=(30.0, 60.0),
        metavar=("MIN", "MAX"),
        help="seconds between two rolling restarts of all Celery workers (default 30 60)",
    )
    p.add_argument(
        "--kill-share",
        type=float,
        default=0.3,
        help="share of worker restarts done by SIGKILL of the worker's session instead of SIGTERM (default 0.3)",
    )
    p.add_argument(
        "--warm-grace",
        type=float,
        default=60,
        help="seconds a worker gets for its warm shutdown before its session is SIGKILLed (default 60)",
    )
    p.add_argument("--no-chaos", action="store_true", help="inject no fault (slow listener only)")
    p.add_argument(
        "--no-duplicate-dispatch",
        action="store_true",
        help="leave out the duplicate_dispatch fault (LocalExecutor only, on by default: the scheduler sends a"
        " running try's workload a second time; the copy's ti_run is refused and its worker reports FAILED"
        " for the same key); without it the fault mix is the one of the runs before this fault was added",
    )
    p.add_argument(
        "--strict",
        action="store_true",
        help="also fail on stale-event failures, missing history, excess tries, success after failure callback",
    )
    p.add_argument(
        "--warmup-timeout", type=float, default=300, help="max seconds until the first task process runs"
    )
    p.add_argument(
        "--installed",
        metavar="WHEEL",
        help="soak an installation made as an operator makes it: a new venv (removed at the end) with the released"
        " apache-airflow of WHEEL's base and --installed-with from the package index, then `pip install --no-deps"
        " WHEEL` (nox -s build makes it); not this Python's tree",
    )
    p.add_argument("--installed-with", action="append", default=[], metavar="REQ", help="see --installed")
    p.add_argument("--home", help="AIRFLOW_HOME to use (default: a new temp dir)")
    p.add_argument("--keep-home", action="store_true", help="keep the AIRFLOW_HOME (always kept on failure)")
    args = p.parse_args(argv)
    # The DSN comes from the environment, never argv (nox echoes argv, ps shows it; it may hold a password).
    args.dsn = os.environ.get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN") or p.error(
        "set AIRFLOW__DATABASE__SQL_ALCHEMY_CONN to the SQLAlchemy URL of a database the soak may WIPE"
    )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report_base = Path(args.report)
    if report_base.suffix in (".md", ".json"):
        report_base = report_base.with_suffix("")
    # not with_suffix(): a name like "3.1.8-postgres-series-..." has dots of its own
    reports = (
        report_base.with_name(report_base.name + ".md"),
        report_base.with_name(report_base.name + ".json"),
    )
    if existing := [str(f) for f in reports if f.exists()]:
        print(
            f"soak: {' and '.join(existing)} exists: not overwritten; give another --report", file=sys.stderr
        )
        return 2
    if args.installed:
        return run_installed(args, sys.argv[1:] if argv is None else argv)
    if args.listener_sleep is None:
        args.listener_sleep = 5.0 if args.listener == "slow" else 0.0
    needs = {"celery": args.executor == "celery", "openlineage": args.listener == "openlineage"}
    import importlib.util

    for provider, needed in needs.items():
        if needed and importlib.util.find_spec(f"airflow.providers.{provider}") is None:
            print(
                f"soak: apache-airflow-providers-{provider} is not installed in {sys.prefix}", file=sys.stderr
            )
            return 2
    if args.executor == "celery" and not Path(REDIS_SERVER).exists():
        print(f"soak: --executor celery needs redis-server ({REDIS_SERVER} not found)", file=sys.stderr)
        return 2
    if args.schedulers < 1 or args.workers < 1 or args.worker_concurrency < 1:
        print("soak: --schedulers, --workers and --worker-concurrency must be at least 1", file=sys.stderr)
        return 2
    if args.backend == "sqlite" or args.dsn.startswith("sqlite"):
        print(
            "soak: sqlite is excluded: scheduler, api-server, dag-processor and task processes write "
            "concurrently; Airflow documents SQLite as a development backend without concurrent writers, "
            "so a soak there would measure SQLite locking, not the series.",
            file=sys.stderr,
        )
        return 2
    if not AIRFLOW.exists():
        print(f"soak: {AIRFLOW} not found; run with the python of the venv under test", file=sys.stderr)
        return 2
    # Airflow 3 also opens an async engine on the metadata DB (asyncpg / aiomysql).
    async_driver = {"postgres": "asyncpg", "mysql": "aiomysql"}[args.backend]
    if importlib.util.find_spec(async_driver) is None:
        print(
            f"soak: {async_driver} is not installed in {sys.prefix}; Airflow's api-server/CLI need it",
            file=sys.stderr,
        )
        return 2
    if os.environ.get("SOAK_DETACHED") != "1":
        return run_detached(sys.argv[1:] if argv is None else argv)
    if venv := os.environ.get("SOAK_INSTALLED_VENV"):  # --installed: the venv this process runs from
        import atexit

        atexit.register(shutil.rmtree, venv, ignore_errors=True)
    soak = Soak(args)

    def on_signal(signum, frame):
        # Interrupted once: the shutdown that follows is not interrupted again (nox's SIGTERM after
        # SIGINT, repeated Ctrl-C); every process the soak started is stopped before it exits.
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)  # also when started in the background (SIGINT ignored)
    signal.signal(signal.SIGHUP, on_signal)  # the terminal went away: stop everything all the same
    code = 2
    try:
        soak.setup()
        log(f"running {args.duration:.0f}s, seed {args.seed}, chaos {'off' if args.no_chaos else 'on'}")
        soak.run()
    except KeyboardInterrupt as e:
        soak.interrupted = True
        soak.t_end = time.monotonic()
        log(f"interrupted ({e or 'Ctrl-C'}); stopping everything")
    except SoakError as e:
        log(f"SOAK ERROR: {e}")
        soak.stop_all()
        return 2
    except BaseException:
        soak.stop_all()
        raise
    try:
        soak.stop_all()
    except KeyboardInterrupt:
        soak.stop_all()
    if soak.t_launch == 0:
        return 2
    try:
        report = analyse(soak)
    except Exception as e:
        if not soak.interrupted:
            raise
        # e.g. the caller's throwaway database is already gone
        log(f"no report: the analysis of the interrupted soak failed ({type(e).__name__}: {e})")
        return 2
    md = to_markdown(report)
    report_base.parent.mkdir(parents=True, exist_ok=True)
    try:  # "x": a report that appeared while the soak ran (another run, same --report) is kept
        with reports[0].open("x") as f:
            f.write(md)
        with reports[1].open("x") as f:
            f.write(json.dumps(report, indent=2, default=str))
    except FileExistsError as e:
        print(md, flush=True)
        log(f"{e.filename} appeared while the soak ran: not overwritten; the report is printed above only")
        return max(report["exit_code"], 2)
    with contextlib.suppress(OSError):
        print(md, flush=True)
    log(f"report: {reports[0]} / .json")
    code, why = exit_status(report, args.expect_races)
    log(why)
    if report["exit_code"] == 0 and not args.keep_home and not args.home:
        shutil.rmtree(soak.home, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
