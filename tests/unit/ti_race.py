# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
Helpers for the task-instance retry-preparation race tests (upstream #71923).

Everything here drives real code against the real test database:

* :class:`ExecutionApi` is Airflow's own execution API application, run in-process with
  ``airflow.api_fastapi.execution_api.app.InProcessExecutionAPI`` (its FastAPI app behind a WSGI
  transport; only JWT authentication is overridden, by Airflow itself). Its route
  ``ti_update_state`` runs on its own session from ``SessionDep``, i.e. its own connection.
* :class:`Pause` stops one thread right after it executed a chosen SQL statement (SQLAlchemy
  ``after_cursor_execute`` on the engine, filtered by thread), inside that thread's open
  transaction, until the test releases it.
* :func:`lock_waiters` reads the server's own lock-wait bookkeeping (``pg_blocking_pids`` on
  PostgreSQL, ``information_schema.INNODB_TRX`` on MySQL/MariaDB), so "the API is waiting for the
  row lock" is observed, not assumed.

Every wait has a timeout; nothing sleeps to synchronise.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy import event, select, text

from airflow import settings
from airflow._shared.timezones.timezone import utcnow

WAIT = 30.0  # seconds; upper bound of every wait in these tests
POLL = 0.02  # seconds between two looks at the server's lock tables


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    """Poll ``predicate`` (an observation of the database or of a thread) until true, or fail."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting until {what}")
        pause.wait(POLL)


def lock_waiters() -> int:
    """
    Number of connections to the test database that are waiting for a row lock right now.

    PostgreSQL: backends of this database with a non-empty ``pg_blocking_pids``. MySQL/MariaDB:
    InnoDB transactions in ``LOCK WAIT`` whose connection uses this database. SQLite has no row
    locks and no such view: always 0.
    """
    with settings.engine.connect() as conn:
        name = conn.dialect.name
        if name == "postgresql":
            return conn.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND cardinality(pg_blocking_pids(pid)) > 0"
                )
            ).scalar_one()
        if name == "mysql":
            # SHOW ENGINE INNODB STATUS, not information_schema.INNODB_TRX: MariaDB 10.11 leaves a
            # transaction whose first statement waits for a row lock (e.g. a const lookup of a
            # locking read, still in the optimizer's "Statistics" stage) out of INNODB_TRX, while the
            # status lists it with "LOCK WAIT" and its thread id.
            ours = set(
                conn.execute(
                    text("SELECT ID FROM information_schema.PROCESSLIST WHERE DB = DATABASE()")
                ).scalars()
            )
            status = conn.execute(text("SHOW ENGINE INNODB STATUS")).one()[-1]
            waiting = 0
            for trx in status.split("---TRANSACTION ")[1:]:
                thread = re.search(r"(?:MySQL|MariaDB) thread id (\d+)", trx)
                if "\nLOCK WAIT " in trx and thread and int(thread.group(1)) in ours:
                    waiting += 1
            return waiting
        return 0


@dataclass
class Pause:
    """
    Stop ``thread`` right after it executed a statement matching ``pattern`` (its n-th match).

    The thread then waits (at most ``WAIT``) until :meth:`release`; ``reached`` is set when it
    stops. Installed on ``settings.engine`` (the engine of ``settings.Session`` and of the execution
    API's sessions) and on any extra ``engines``; remove with :meth:`remove`.
    """

    pattern: str
    thread: threading.Thread | None = None
    not_thread: threading.Thread | None = None
    occurrence: int = 1
    engines: tuple[Any, ...] = ()
    reached: threading.Event = field(default_factory=threading.Event)
    go: threading.Event = field(default_factory=threading.Event)
    _seen: int = 0

    def __post_init__(self) -> None:
        self._regex = re.compile(self.pattern, re.IGNORECASE | re.DOTALL)
        self._targets = (settings.engine, *self.engines)
        for engine in self._targets:
            event.listen(engine, "after_cursor_execute", self._after)

    def _after(self, conn, cursor, statement, parameters, context, executemany) -> None:
        if self.thread is not None and threading.current_thread() is not self.thread:
            return
        if self.not_thread is not None and threading.current_thread() is self.not_thread:
            return
        if not self._regex.search(statement):
            return
        self._seen += 1
        if self._seen != self.occurrence:
            return
        self.reached.set()
        if not self.go.wait(WAIT):
            raise AssertionError(f"paused after {self.pattern!r} and never released")

    def release(self) -> None:
        self.go.set()

    def remove(self) -> None:
        self.go.set()
        for engine in self._targets:
            if event.contains(engine, "after_cursor_execute", self._after):
                event.remove(engine, "after_cursor_execute", self._after)


class StatementLog:
    """Record the SQL statements a given thread executes on ``settings.engine``."""

    def __init__(self, thread: threading.Thread | None = None) -> None:
        self.thread = thread or threading.current_thread()
        self.statements: list[str] = []
        event.listen(settings.engine, "before_cursor_execute", self._before)

    def _before(self, conn, cursor, statement, parameters, context, executemany) -> None:
        if threading.current_thread() is self.thread:
            self.statements.append(" ".join(statement.split()))

    def remove(self) -> None:
        event.remove(settings.engine, "before_cursor_execute", self._before)


def handle_executor_events(runner: Any, session: Any) -> Callable[[], None]:
    """The scheduler's executor-event step on ``session``, committed (rolled back on an error): a ``Worker`` body."""

    def handle() -> None:
        try:
            runner._process_executor_events(executor=runner.executor, session=session)
            session.commit()
        except BaseException:
            session.rollback()
            raise

    return handle


def executor_events_step(runner: Any) -> int:
    """
    The scheduler loop's executor-event step, in a transaction of its own that it commits.

    Where the scheduler owns that transaction (``_process_events_of_executors``: listener calls and
    callbacks committed on their own come after its commit), that step; on an older tree, what the loop
    did there: ``_process_executor_events`` in ``create_session()``.
    """
    if hasattr(runner, "_process_events_of_executors"):
        return runner._process_events_of_executors()
    from airflow.utils.session import create_session

    with create_session() as session:
        return runner._process_executor_events(executor=runner.executor, session=session)


class Worker(threading.Thread):
    """Run ``fn`` in a thread, keep its result or exception; ``join_or_fail`` bounds the wait."""

    def __init__(self, fn: Callable[[], Any], name: str) -> None:
        super().__init__(name=name, daemon=True)
        self._fn = fn
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            self.result = self._fn()
        except BaseException as e:
            self.error = e
        finally:
            self.done.set()

    def join_or_fail(self, timeout: float = WAIT) -> Any:
        if not self.done.wait(timeout):
            raise AssertionError(f"{self.name} did not finish within {timeout}s")
        self.join(timeout)
        return self.result


class ExecutionApi:
    """Airflow's execution API, in-process (``InProcessExecutionAPI``); one client per call."""

    def __init__(self) -> None:
        from airflow.api_fastapi.execution_api.app import InProcessExecutionAPI

        self._api = InProcessExecutionAPI()
        self._transport = self._api.transport

    def client(self) -> Any:
        """A client of the app: httpx's, or httpx2's where the transport is httpx2's (3.4)."""
        import importlib

        httpx = importlib.import_module(type(self._transport).__module__.split(".")[0])
        return httpx.Client(transport=self._transport, base_url="http://in-process.invalid./")

    def warm_up(self) -> None:
        """
        First request: Cadwyn builds the versioned routers of the app then (tens of seconds on a
        small machine), which must not count against the waits of a test.
        """

        with self.client() as client:
            client.get("/health").raise_for_status()

    def reschedule(self, ti_id) -> int:
        """``PATCH /task-instances/{id}/state`` with a ``TIRescheduleStatePayload``; the status code."""

        from airflow.api_fastapi.execution_api.datamodels.taskinstance import TIRescheduleStatePayload

        now = utcnow()
        payload = TIRescheduleStatePayload(
            state="up_for_reschedule", reschedule_date=now + timedelta(minutes=5), end_date=now
        )
        with self.client() as client:
            response = client.patch(
                f"/task-instances/{ti_id}/state",
                content=payload.model_dump_json(),
                headers={"Content-Type": "application/json", "Authorization": "Bearer in-process"},
            )
        return response.status_code

    def heartbeat(self, ti_id, *, hostname: str, pid: int) -> int:
        """``PUT /task-instances/{id}/heartbeat`` (``TIHeartbeatInfo``); the status code."""

        with self.client() as client:
            response = client.put(
                f"/task-instances/{ti_id}/heartbeat",
                json={"hostname": hostname, "pid": pid},
                headers={"Authorization": "Bearer in-process"},
            )
        return response.status_code

    def reschedule_in_thread(self, ti_id) -> Worker:
        worker = Worker(lambda: self.reschedule(ti_id), name="execution-api")
        worker.start()
        return worker


@dataclass
class Rows:
    """What a fresh connection sees of one task instance (by dag_id, task_id, run_id, map_index)."""

    ti_id: Any
    state: str | None
    reschedule_ti_ids: list[Any]
    history_tries: list[int]


def history_of(s, dag_id: str, task_id: str, run_id: str, map_index: int | None = None) -> list[Any]:
    """
    The history rows of a task (``try_number``, ``state``, ``task_instance_id``), by try number.

    ``task_instance_history`` rows; 3.4 has no such table: a try is a ``task_instance`` row of its own and
    the earlier ones are archived in place (``working_set`` NULL, migrations 0138/0142), keeping their id.
    """
    from types import SimpleNamespace

    from airflow.models.taskinstance import TaskInstance as TI

    try:
        from airflow.models.taskinstancehistory import TaskInstanceHistory as TIH
    except ImportError:  # 3.4
        where = [TI.dag_id == dag_id, TI.task_id == task_id, TI.run_id == run_id, TI.working_set.is_(None)]
        where += [] if map_index is None else [TI.map_index == map_index]
        stmt = select(TI).where(*where).order_by(TI.try_number).execution_options(include_all_attempts=True)
        return [
            SimpleNamespace(try_number=t.try_number, state=t.state, task_instance_id=t.id)
            for t in s.scalars(stmt)
        ]
    where = [TIH.dag_id == dag_id, TIH.task_id == task_id, TIH.run_id == run_id]
    where += [] if map_index is None else [TIH.map_index == map_index]
    return list(s.scalars(select(TIH).where(*where).order_by(TIH.try_number)))


def read_rows(dag_id: str, task_id: str, run_id: str, map_index: int = -1) -> Rows:
    from airflow.models.taskinstance import TaskInstance as TI
    from airflow.models.taskreschedule import TaskReschedule

    with settings.NonScopedSession() as s:
        ti_id, state = s.execute(
            select(TI.id, TI.state).where(
                TI.dag_id == dag_id, TI.task_id == task_id, TI.run_id == run_id, TI.map_index == map_index
            )
        ).one()
        reschedules = list(s.scalars(select(TaskReschedule.ti_id)))
        history = history_of(s, dag_id, task_id, run_id, map_index)
        tries = [row.try_number for row in history]
        if hasattr(TI, "working_set"):  # 3.4: an archived try keeps its task_reschedule rows, as history
            reschedules = [r for r in reschedules if r not in {row.task_instance_id for row in history}]
        s.rollback()
    return Rows(ti_id=ti_id, state=state, reschedule_ti_ids=reschedules, history_tries=tries)


def make_running_tis(
    dag_maker,
    session,
    *,
    dag_id: str,
    task_ids: tuple[str, ...] = ("sensor",),
    retries: int = 1,
    queued_by_job_id: int | None = None,
    **task_kwargs,
):
    """
    Running tries of reschedule-mode-like tasks: the DAG in the DB (``dag_maker``), a dag run, its
    TIs RUNNING with ``try_number`` 1 and ``retries`` retries, committed. Returns the ORM TIs in
    ``task_ids`` order, attached to ``session``, with ``task`` set (the scheduler-side task).
    """
    from airflow.models.taskinstance import TaskInstance
    from airflow.providers.standard.operators.empty import EmptyOperator
    from airflow.utils.state import TaskInstanceState

    with dag_maker(dag_id, schedule=None, session=session):
        for task_id in task_ids:
            EmptyOperator(task_id=task_id, retries=retries, retry_delay=timedelta(seconds=1), **task_kwargs)
    dag_run = dag_maker.create_dagrun()
    by_task = {
        ti.task_id: ti
        for ti in session.scalars(
            select(TaskInstance).where(TaskInstance.dag_id == dag_id, TaskInstance.run_id == dag_run.run_id)
        )
    }
    now = utcnow()
    for ti in by_task.values():
        ti.state = TaskInstanceState.RUNNING
        ti.try_number = 1
        ti.hostname = "worker-1"
        ti.start_date = now
        ti.queued_by_job_id = queued_by_job_id
    session.commit()
    tis = [by_task[task_id] for task_id in task_ids]
    for ti in tis:
        ti.task = dag_maker.serialized_dag.get_task(ti.task_id)
    return tis
