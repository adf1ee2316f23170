# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
Shared helpers of the benchmark worker (``worker.py``): environment, DAG/run factories, SQL counters.

The pieces that mirror the test harness are small copies of ``tests/unit/harness/`` (``make_engine``,
``clear_db``, ``RecordingExecutor``, ``DagMaker.sync_to_db``/``create_dagrun``, the ``scheduler_job_runner``
fixture): importing those modules would pull in pytest and the unit-test environment (``harness/env.py``),
and benchmarks are not tests. Keep them in step with the harness if it changes.

:func:`setup_env` must run before anything imports airflow (airflow reads its config at import).
"""

from __future__ import annotations

import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

DEFAULT_DATE = datetime(2016, 1, 1, tzinfo=timezone.utc)
BUNDLE = "bench"


def setup_env() -> Path:
    """Set the Airflow environment (like the harness's env.py, no unit-test mode); return AIRFLOW_HOME."""
    if not os.environ.get("AIRFLOW_HOME"):
        os.environ["AIRFLOW_HOME"] = tempfile.mkdtemp(prefix="airflow-bench-home-")
    home = Path(os.environ["AIRFLOW_HOME"])
    (home / "dags").mkdir(parents=True, exist_ok=True)
    if not os.environ.get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"):
        os.environ["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = f"sqlite:///{home / 'bench.db'}"
    env = {
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_FOLDER": str(home / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(home / "plugins"),
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
        "AIRFLOW__DATABASE__LOAD_DEFAULT_CONNECTIONS": "False",
        "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(home / "logs"),
        "AIRFLOW__LOGGING__LOGGING_LEVEL": os.environ.get("BENCH_LOG_LEVEL", "CRITICAL"),
        "AIRFLOW__METRICS__STATSD_ON": "False",
    }
    os.environ.update(env)
    os.environ.setdefault("AIRFLOW__CORE__FERNET_KEY", "Y2FjYTJhZWQ4ZjFmMzY1NTQ5ZTMxNDM2NjljNGQ4YmQ=")
    os.environ.setdefault("AIRFLOW__API_AUTH__JWT_SECRET", "airflow-patch-series-bench-not-a-secret")
    return home


# ---------------------------------------------------------------------------------------------
# Database (copies of tests/unit/harness/db.py helpers)
# ---------------------------------------------------------------------------------------------
def make_engine():
    """A new, independent Engine on the same DSN, built like ``airflow.settings.configure_orm``."""
    from airflow import settings
    from airflow.utils.orm_event_handlers import setup_event_handlers

    connect_args = dict(settings._get_connect_args("sync"))
    if settings.SQL_ALCHEMY_CONN.startswith("sqlite"):
        connect_args["check_same_thread"] = False
    engine = settings.create_metadata_engine(
        settings.SQL_ALCHEMY_CONN, engine_args=settings.prepare_engine_args(), connect_args=connect_args
    )
    setup_event_handlers(engine)
    return engine


def make_session_factory(engine):
    from sqlalchemy.orm import sessionmaker

    return sessionmaker(bind=engine, autoflush=False, expire_on_commit=False)


def reset_schema() -> None:
    """Drop and recreate the schema with Airflow's own code (``airflow db reset``).

    A database holding Airflow data (rows in ``dag``, ``connection``, ...) is refused unless ``DB_RESET=true``,
    the rule of the test sessions: the DSN comes from the environment, where an operator's Airflow may have
    put it. ``run.py`` sets it for its later workers (the database is then the benchmark's own).
    """
    import sys

    from airflow import settings
    from airflow.models import import_all_models
    from airflow.utils import db

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "ci"))
    import dbserver

    with settings.engine.connect() as conn:
        held = dbserver.airflow_data(conn)
    if held and os.environ.get("DB_RESET", "").lower() != "true":
        dsn = dbserver.masked(settings.SQL_ALCHEMY_CONN)
        raise SystemExit(f"benchmark: {dsn}: {dbserver.refusal(held)}; nothing was changed")
    import_all_models()
    db.resetdb()
    settings.Session.remove()


def clear_db() -> None:
    """Empty every Airflow table but ``alembic_version``/``log_template`` (default pool kept)."""
    from sqlalchemy import delete

    from airflow import settings
    from airflow.models.base import Base
    from airflow.models.pool import Pool

    settings.Session.remove()
    with settings.NonScopedSession() as session:
        for table in reversed(Base.metadata.sorted_tables):
            if table.name in ("alembic_version", "log_template"):
                continue
            if table.name == Pool.__tablename__:
                session.execute(delete(table).where(table.c.pool != Pool.DEFAULT_POOL_NAME))
            else:
                session.execute(delete(table))
        session.commit()


def server_version(conn) -> str:
    from sqlalchemy import text

    name = conn.dialect.name
    if name == "sqlite":
        return "SQLite " + conn.execute(text("select sqlite_version()")).scalar_one()
    version = conn.execute(text("select version()")).scalar_one()
    if name == "mysql":
        return ("MariaDB " if "mariadb" in version.lower() else "MySQL ") + version
    return version


def dialect_locks_rows(session) -> bool:
    """Whether Airflow's ``with_row_locks`` emits a row lock on this dialect (not sqlite / MariaDB)."""
    from sqlalchemy import select

    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.sqlalchemy import with_row_locks

    sql = str(
        with_row_locks(select(TaskInstance.id), session=session).compile(dialect=session.get_bind().dialect)
    )
    return "FOR UPDATE" in sql.upper() or "FOR NO KEY UPDATE" in sql.upper()


# ---------------------------------------------------------------------------------------------
# SQL counters
# ---------------------------------------------------------------------------------------------
LOCKING = ("FOR UPDATE", "FOR NO KEY UPDATE", "FOR SHARE", "FOR KEY SHARE", "LOCK IN SHARE MODE")


@dataclass
class SqlCounter:
    """
    Counts what one engine sends, via SQLAlchemy events (``before/after_cursor_execute``,
    ``begin``/``commit``/``rollback``). Only the threads in ``threads`` (None: all) are counted.

    ``locked_rows`` sums the rows returned by row-locking SELECTs (``FOR UPDATE`` & co.), i.e. the
    rows those statements locked; ``lock_wait_s`` sums the time of locking statements slower than
    ``wait_threshold_s`` (the statement waited for somebody else's lock); ``lock_spans`` are
    (first locking statement -> next commit/rollback) intervals in perf_counter seconds.
    """

    engine: Any
    threads: set[int] | None = None
    wait_threshold_s: float = 0.005
    statements: int = 0
    commits: int = 0
    rollbacks: int = 0
    lock_statements: int = 0
    locked_rows: int = 0
    lock_waits: int = 0
    lock_wait_s: float = 0.0
    lock_spans: list[tuple[float, float]] = field(default_factory=list)
    exec_s: float = 0.0  # wall time inside the driver's execute (before -> after_cursor_execute)
    exec_cpu_s: float = 0.0  # this thread's CPU time inside it
    txn_spans: list[tuple[float, float]] = field(default_factory=list)
    first_lock_at: float | None = None
    _lock_open: float | None = None
    _txn_open: float | None = None
    _t0: dict = field(default_factory=dict)
    _c0: dict = field(default_factory=dict)
    on_lock: Any = None

    def _mine(self) -> bool:
        return self.threads is None or threading.get_ident() in self.threads

    def _before(self, conn, cursor, statement, parameters, context, executemany):
        if self._mine():
            self.statements += 1
            self._t0[id(cursor)] = time.perf_counter()
            self._c0[id(cursor)] = time.thread_time()

    def _after(self, conn, cursor, statement, parameters, context, executemany):
        if not self._mine():
            return
        t0 = self._t0.pop(id(cursor), None)
        c0 = self._c0.pop(id(cursor), None)
        if t0 is not None:
            self.exec_s += time.perf_counter() - t0
            self.exec_cpu_s += time.thread_time() - c0
        up = statement.upper()
        if up.lstrip().startswith("SELECT") and any(k in up for k in LOCKING):
            now = time.perf_counter()
            self.lock_statements += 1
            if cursor.rowcount is not None and cursor.rowcount > 0:
                self.locked_rows += cursor.rowcount
            if t0 is not None and now - t0 > self.wait_threshold_s:
                self.lock_waits += 1
                self.lock_wait_s += now - t0
            if self._lock_open is None:
                self._lock_open = now
            if self.first_lock_at is None:
                self.first_lock_at = now
                if self.on_lock:
                    self.on_lock()

    def _begin(self, conn):
        if self._mine():
            self._txn_open = time.perf_counter()

    def _end(self, kind):
        def handler(conn):
            if not self._mine():
                return
            now = time.perf_counter()
            if kind == "commit":
                self.commits += 1
            else:
                self.rollbacks += 1
            if self._lock_open is not None:
                self.lock_spans.append((self._lock_open, now))
                self._lock_open = None
            if self._txn_open is not None:
                self.txn_spans.append((self._txn_open, now))
                self._txn_open = None

        return handler

    def __enter__(self) -> SqlCounter:
        from sqlalchemy import event

        self._handlers = [
            ("before_cursor_execute", self._before),
            ("after_cursor_execute", self._after),
            ("begin", self._begin),
            ("commit", self._end("commit")),
            ("rollback", self._end("rollback")),
        ]
        for name, fn in self._handlers:
            event.listen(self.engine, name, fn)
        return self

    def __exit__(self, *exc) -> None:
        from sqlalchemy import event

        for name, fn in self._handlers:
            event.remove(self.engine, name, fn)


class PhaseMeter:
    """
    Wall and CPU time of one phase of this process (``getrusage``: user + sys of all its threads,
    voluntary context switches = the process blocked, e.g. on fsync or I/O; involuntary ones = it was
    preempted by other processes), plus the time spent in the DBAPI connection's ``commit`` (the
    dialect's ``do_commit``, wrapped while the phase runs: wall and this thread's CPU).
    """

    def __init__(self, engine):
        self.engine = engine
        self.commit_s = 0.0
        self.commit_cpu_s = 0.0
        self.commit_calls = 0

    def __enter__(self) -> PhaseMeter:
        import resource

        dialect = self.engine.dialect
        orig = type(dialect).do_commit

        def do_commit(dbapi_connection, _orig=orig, _dialect=dialect):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return _orig(_dialect, dbapi_connection)
            finally:
                self.commit_s += time.perf_counter() - t0
                self.commit_cpu_s += time.thread_time() - c0
                self.commit_calls += 1

        dialect.do_commit = do_commit  # instance attribute: shadows the class's method while the phase runs
        self._r0 = resource.getrusage(resource.RUSAGE_SELF)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        import resource

        self.wall_s = time.perf_counter() - self._t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        del self.engine.dialect.do_commit
        self.user_s = r1.ru_utime - self._r0.ru_utime
        self.sys_s = r1.ru_stime - self._r0.ru_stime
        self.vcsw = r1.ru_nvcsw - self._r0.ru_nvcsw
        self.ivcsw = r1.ru_nivcsw - self._r0.ru_nivcsw
        self.oublock = r1.ru_oublock - self._r0.ru_oublock

    def figures(self, counter: SqlCounter | None = None) -> dict:
        out = {
            "wall_s": self.wall_s,
            "cpu_user_s": self.user_s,
            "cpu_sys_s": self.sys_s,
            "vol_ctx_switches": self.vcsw,
            "invol_ctx_switches": self.ivcsw,
            "fs_out_blocks": self.oublock,
            "commit_s": self.commit_s,
            "commit_cpu_s": self.commit_cpu_s,
            "commit_calls": self.commit_calls,
        }
        if counter is not None:
            out["exec_s"] = counter.exec_s
            out["exec_cpu_s"] = counter.exec_cpu_s
        return out


class StatementRecorder:
    """
    The statements and commits one thread (default: the caller's) sends through ``engine``, for the
    trace scripts: whitespace collapsed, the first select list shortened to ``SELECT … FROM``, cut
    at ``width`` characters. With ``commit_marker`` a commit is also recorded in ``statements``.
    """

    def __init__(self, engine, *, width: int, commit_marker: str | None = None, thread: int | None = None):
        self.engine, self.width, self.commit_marker = engine, width, commit_marker
        self.thread = threading.get_ident() if thread is None else thread
        self.statements: list[str] = []
        self.commits = 0

    def clear(self) -> None:
        self.statements.clear()
        self.commits = 0

    def _before(self, conn, cursor, statement, parameters, context, executemany):
        if threading.get_ident() == self.thread:
            s = " ".join(statement.split())
            s = re.sub(r"SELECT .*? FROM", "SELECT … FROM", s, count=1)
            self.statements.append(s[: self.width])

    def _commit(self, conn):
        if threading.get_ident() == self.thread:
            self.commits += 1
            if self.commit_marker:
                self.statements.append(self.commit_marker)

    def __enter__(self) -> StatementRecorder:
        from sqlalchemy import event

        event.listen(self.engine, "before_cursor_execute", self._before)
        event.listen(self.engine, "commit", self._commit)
        return self

    def __exit__(self, *exc) -> None:
        from sqlalchemy import event

        event.remove(self.engine, "before_cursor_execute", self._before)
        event.remove(self.engine, "commit", self._commit)


# ---------------------------------------------------------------------------------------------
# Scheduler runner with a recording executor (copy of the tests/unit/harness/scheduler.py fixture)
# ---------------------------------------------------------------------------------------------
def recording_executor_class():
    from airflow.executors.base_executor import BaseExecutor

    class RecordingExecutor(BaseExecutor):
        """A real ``BaseExecutor`` that executes nothing; records callbacks and state changes."""

        supports_callbacks = True

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.callbacks_sent: list = []
            self.state_changes: list = []

        def send_callback(self, request, **kwargs) -> None:
            # **kwargs: the series passes the caller's session (BaseExecutor.send_callback), as to
            # every executor that does not override send_callback; the base passes none.
            self.callbacks_sent.append(request)
            super().send_callback(request, **kwargs)

        def change_state(self, key, state, info=None, remove_running=True) -> None:
            self.state_changes.append((key, state, remove_running))
            super().change_state(key, state, info, remove_running=remove_running)

        def _process_workloads(self, workloads) -> None:
            pass

        def sync(self) -> None:
            pass

        def end(self) -> None:
            pass

        def terminate(self) -> None:
            pass

    return RecordingExecutor


def make_runner():
    """A real ``SchedulerJobRunner`` on a persisted ``Job``; its executor is a RecordingExecutor."""
    from airflow import settings
    from airflow.callbacks.database_callback_sink import DatabaseCallbackSink
    from airflow.executors.executor_utils import ExecutorName
    from airflow.jobs.job import Job
    from airflow.jobs.scheduler_job_runner import SchedulerJobRunner

    executor = recording_executor_class()()
    executor.name = ExecutorName(module_path=f"{__name__}.RecordingExecutor", alias="RecordingExecutor")
    job = Job()
    runner = SchedulerJobRunner(job=job, executors=[executor])
    with settings.NonScopedSession() as s:
        job.prepare_for_execution(session=s)
    for ex in runner.executors:
        ex.job_id = job.id
        ex.callback_sink = DatabaseCallbackSink()
        ex.start()
    return runner


def process_executor_events(runner) -> None:
    """One executor-event step as the scheduler loop runs it.

    Series v3 has ``_process_events_of_executors()``: one transaction, committed there, the listener
    calls made after the commit (on ``runner.failure_listener_thread`` where set). Older trees (the
    base): ``_process_executor_events`` inside ``create_session()``, as their loop runs it.
    """
    step = getattr(runner, "_process_events_of_executors", None)
    if step is not None:
        step()
        return
    from airflow.utils.session import create_session

    with create_session() as session:
        runner._process_executor_events(runner.executor, session)


def start_failure_listener_thread(runner):
    """Give ``runner`` the listener thread that ``SchedulerJobRunner._execute`` gives it (series v3's
    operator tail, ``FailureListenerThread``); None where the tree has none."""
    from airflow.jobs import scheduler_job_runner

    cls = getattr(scheduler_job_runner, "FailureListenerThread", None)
    if cls is None or not hasattr(runner, "failure_listener_thread"):
        return None
    runner.failure_listener_thread = cls()
    return runner.failure_listener_thread


def reset_executor(executor) -> None:
    executor.callbacks_sent.clear()
    executor.state_changes.clear()
    executor.event_buffer.clear()
    executor.running.clear()


# ---------------------------------------------------------------------------------------------
# DAGs and runs (copy of DagMaker.sync_to_db / create_dagrun)
# ---------------------------------------------------------------------------------------------
def on_failure_cb(context) -> None:  # never called: the flag alone makes the scheduler send a callback
    pass


def write_dag(dag_id: str, n_tasks: int, *, retries: int, callbacks: bool = False, session):
    """Write a DAG of ``n_tasks`` EmptyOperators like the dag-processor; return its SerializedDAG."""
    from airflow.dag_processing.collection import update_dag_parsing_results_in_db
    from airflow.models.dagbundle import DagBundleModel
    from airflow.models.serialized_dag import SerializedDagModel
    from airflow.providers.standard.operators.empty import EmptyOperator
    from airflow.sdk import DAG
    from airflow.serialization.serialized_objects import LazyDeserializedDAG

    home = Path(os.environ["AIRFLOW_HOME"])
    cb = {"on_failure_callback": on_failure_cb, "on_retry_callback": on_failure_cb} if callbacks else {}
    with DAG(dag_id, start_date=DEFAULT_DATE, schedule=None) as dag:
        for i in range(n_tasks):
            EmptyOperator(task_id=f"t{i:03d}", retries=retries, **cb)
    dag.fileloc = str(home / "dags" / f"{dag_id}.py")
    dag.relative_fileloc = f"{dag_id}.py"
    Path(dag.fileloc).write_text(
        f"# DAG {dag_id!r}: written by benchmarks/_harness.py (DagCode reads this file)\n"
    )
    if session.get(DagBundleModel, BUNDLE) is None:
        session.add(DagBundleModel(name=BUNDLE))
        session.flush()
    errors: dict = {}
    update_dag_parsing_results_in_db(
        bundle_name=BUNDLE,
        bundle_version=None,
        dags=[LazyDeserializedDAG.from_dag(dag)],
        import_errors=errors,
        parse_duration=None,
        warnings=set(),
        session=session,
    )
    if errors:
        raise RuntimeError(f"writing {dag_id!r} failed: {errors}")
    session.commit()
    return SerializedDagModel.get(dag_id, session=session).dag


def create_runs(serialized_dag, count: int, *, session, start: int = 0) -> list:
    """``count`` manual DagRuns (RUNNING) through ``SerializedDAG.create_dagrun``; committed."""
    from airflow._shared.timezones import timezone as tz
    from airflow.models.dagrun import DagRun
    from airflow.utils.state import DagRunState
    from airflow.utils.types import DagRunTriggeredByType, DagRunType

    runs = []
    for i in range(start, start + count):
        logical_date = DEFAULT_DATE + timedelta(hours=i)
        runs.append(
            serialized_dag.create_dagrun(
                run_id=DagRun.generate_run_id(
                    run_type=DagRunType.MANUAL, logical_date=logical_date, run_after=logical_date
                ),
                run_type=DagRunType.MANUAL,
                logical_date=logical_date,
                run_after=logical_date,
                data_interval=serialized_dag.timetable.infer_manual_data_interval(run_after=logical_date),
                state=DagRunState.RUNNING,
                start_date=tz.utcnow(),
                triggered_by=DagRunTriggeredByType.TEST,
                session=session,
            )
        )
    session.commit()
    return runs


def set_running(session, where, *, job_id: int, heartbeat_age_s: float) -> int:
    """
    Put the selected TIs in the state a worker leaves them in while it runs (try 1, RUNNING, host/pid,
    heartbeat ``heartbeat_age_s`` ago), queued by ``job_id``. Returns the number of TIs; committed.
    """
    from sqlalchemy import update

    from airflow._shared.timezones import timezone as tz
    from airflow.models.taskinstance import TaskInstance as TI
    from airflow.utils.state import TaskInstanceState

    now = tz.utcnow()
    res = session.execute(
        update(TI)
        .where(*where)
        .values(
            state=TaskInstanceState.RUNNING,
            try_number=1,
            queued_by_job_id=job_id,
            hostname="bench-worker",
            pid=4242,
            start_date=now - timedelta(seconds=heartbeat_age_s + 60),
            end_date=None,
            duration=None,
            last_heartbeat_at=now - timedelta(seconds=heartbeat_age_s),
            next_method=None,
            next_kwargs=None,
        )
        .execution_options(synchronize_session=False)
    )
    session.commit()
    return res.rowcount
