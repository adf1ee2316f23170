# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
SQLite, patch 19: ``skip_locked`` as ``BEGIN IMMEDIATE`` with the busy timeout set to 0 for that statement.

The patch message: "With skip_locked ... the lock is not waited for (BEGIN IMMEDIATE with the busy
timeout set to 0 for that statement): the row is reported as held by another transaction", and "The
stuck-in-queued re-check asks for that on SQLite: a busy database leaves the task instance for the next
check". The busy-lock tests of test_taskinstance_sqlite_write_lock_busy.py pass as well when the lock is
waited for (the busy timeout, 5 s) and its OperationalError is contained, or when the OperationalError is
taken for "locked" and the row is read and written anyway; and their stuck-in-queued case is a try the
worker started, which the re-read declines whatever the lock did. These tests pin what the message says:
the statement is sent with busy timeout 0, the timeout is restored, the session is usable afterwards,
nothing is written or revoked for a still-queued try, and only "database is locked" is taken as "held".
"""

from __future__ import annotations

import re
import sqlite3
import threading

import pytest
from sqlalchemy import event, select, text

from airflow import settings
from airflow.models.taskinstance import TaskInstance
from airflow.utils.state import TaskInstanceState

try:
    from airflow.models.taskinstance import _lock_sqlite_database
except ImportError:  # a tree before patch 19 (verify-series' earlier steps): nothing here applies
    pytest.skip(
        "needs Read-a-failing-task-instance-under-SQLite-s-write-lock.patch (_lock_sqlite_database)",
        allow_module_level=True,
    )

from tests.unit.harness import series
from tests.unit.jobs import test_scheduler_heartbeat_timeout as heartbeat_tests
from tests.unit.jobs.test_scheduler_heartbeat_timeout import on_failure, purge
from tests.unit.jobs.test_scheduler_stuck_in_queued_recheck import (
    _reload,
    _stuck_logs,
    _worker_moves_after_selection,
    stuck_ti,  # noqa: F401 (fixture)
)
from tests.unit.models.test_taskinstance_sqlite_write_lock_busy import WriteLockHeld
from tests.unit.ti_race import make_running_tis, read_rows

pytestmark = [
    pytest.mark.db_test,
    pytest.mark.backend("sqlite", reason="the database-wide write lock is SQLite's"),
]

clock = heartbeat_tests.clock
timed_out_ti = heartbeat_tests.timed_out_ti

WRITES_TI = re.compile(r"^\s*(UPDATE|DELETE FROM|INSERT INTO) task_instance\b", re.IGNORECASE)


class SentByThisThread:
    """This thread's statements on ``settings.engine``, with the busy timeout in force when each was sent."""

    def __init__(self) -> None:
        self.thread = threading.current_thread()
        self.sent: list[tuple[str, int]] = []
        event.listen(settings.engine, "before_cursor_execute", self._before)

    def _before(self, conn, cursor, statement, parameters, context, executemany) -> None:
        if threading.current_thread() is self.thread:
            busy = conn.connection.dbapi_connection.execute("PRAGMA busy_timeout").fetchone()[0]
            self.sent.append((statement, busy))

    def begins(self) -> list[int]:
        """The busy timeout of each ``BEGIN IMMEDIATE`` sent."""
        return [busy for statement, busy in self.sent if statement.strip().upper() == "BEGIN IMMEDIATE"]

    def ti_writes(self) -> list[str]:
        return [statement for statement, _ in self.sent if WRITES_TI.search(statement)]

    def remove(self) -> None:
        event.remove(settings.engine, "before_cursor_execute", self._before)


def _sqlite_holds_write_lock(session) -> bool:
    """Whether the session's SQLite connection is in a transaction (3.1.8 has no such helper)."""
    return session.connection().connection.dbapi_connection.in_transaction


def _busy_timeout(session) -> int:
    return session.connection().connection.dbapi_connection.execute("PRAGMA busy_timeout").fetchone()[0]


def test_skipped_lock_leaves_the_session_usable_and_the_busy_timeout_restored(session):
    """
    ``_lock_sqlite_database(skip_locked=True)`` on a busy database: False at once, the busy timeout as it
    was, the connection valid and in its (SQLAlchemy) transaction, no SQLite transaction open; the same
    session reads on, and takes the lock in the same transaction once the other writer is done.
    """
    session.execute(text("SELECT 1"))
    before = _busy_timeout(session)
    assert before > 0
    sent = SentByThisThread()
    try:
        with WriteLockHeld():
            assert _lock_sqlite_database(session, skip_locked=True) is False
            connection = session.connection()
            assert not connection.invalidated
            assert connection.in_transaction() and session.get_transaction().is_active
            assert not _sqlite_holds_write_lock(session)
            assert _busy_timeout(session) == before
            assert session.scalar(select(TaskInstance.id).limit(1)) is None  # the next statement runs
        assert sent.begins() == [0], "BEGIN IMMEDIATE with skip_locked was sent with a busy timeout"
        assert _lock_sqlite_database(session, skip_locked=True) is True
        assert _sqlite_holds_write_lock(session)
        assert _busy_timeout(session) == before
    finally:
        sent.remove()
    session.rollback()
    assert not _sqlite_holds_write_lock(session)


@pytest.mark.parametrize("path", ["reschedule", "fail"])
def test_stuck_in_queued_leaves_a_still_queued_try_alone_on_a_busy_database(
    session,
    scheduler_job_runner,
    stuck_ti,  # noqa: F811 (fixture)
    monkeypatch,
    path,
):
    """
    A try still queued (nobody started it), selected as stuck; then another connection holds the write
    lock. The re-check must not wait for it (busy timeout 0) and must leave the try for the next check:
    not revoked, nothing written for it, no exception out of the scheduler's timer. With the lock free,
    the next check handles it.
    """
    runner = scheduler_job_runner
    if path == "fail":
        runner._num_stuck_queued_retries = 0
    lock = WriteLockHeld()
    moves = [lock.__enter__]  # after the first selection only
    _worker_moves_after_selection(runner, monkeypatch, lambda: moves and moves.pop()())
    sent = SentByThisThread()
    try:
        runner._handle_tasks_stuck_in_queued(session=session)
        session.commit()
    finally:
        sent.remove()
        if hasattr(lock, "conn"):
            lock.__exit__(None, None, None)
    assert sent.begins() == [0], f"the re-check's BEGIN IMMEDIATE busy timeouts: {sent.begins()}"
    assert runner.executor.revoked == [], "a try left for the next check was revoked"
    assert sent.ti_writes() == []
    assert _reload(session, stuck_ti).state == TaskInstanceState.QUEUED
    assert _stuck_logs(session) == 0
    runner._handle_tasks_stuck_in_queued(session=session)
    session.commit()
    assert runner.executor.revoked == [stuck_ti.key]
    expected = TaskInstanceState.SCHEDULED if path == "reschedule" else TaskInstanceState.FAILED
    assert _reload(session, stuck_ti).state == expected


@pytest.mark.skipif(
    series._release(series.BASE_VERSION) < (3, 2),
    reason="3.1.8: the purge takes the write lock without skip_locked (waits the busy timeout; README, per base)",
)
def test_purge_neither_waits_nor_writes_on_a_busy_database(
    dag_maker, session, scheduler_job_runner, clock, timed_out_ti
):
    """
    The heartbeat purge's revalidation on a busy database: ``BEGIN IMMEDIATE`` with busy timeout 0, the try
    reported as held and skipped, so no write to it is even attempted (not a write that times out after the
    busy timeout and is then contained).
    """
    runner = scheduler_job_runner
    dr, _ = timed_out_ti("sqlite_skip_purge", on_failure_callback=on_failure, retries=1)
    sent = SentByThisThread()
    try:
        with WriteLockHeld():
            purge(runner)
    finally:
        sent.remove()
    assert sent.begins() and set(sent.begins()) == {0}, sent.begins()
    assert sent.ti_writes() == [], sent.ti_writes()
    assert read_rows(dr.dag_id, "t", dr.run_id).state == TaskInstanceState.RUNNING


class _RaiseOnBegin:
    """The engine's ``do_execute`` raises ``error`` for ``BEGIN IMMEDIATE`` (as if raised by the driver)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __enter__(self):
        event.listen(settings.engine, "do_execute", self._do_execute)
        return self

    def _do_execute(self, cursor, statement, parameters, context):
        if statement.strip().upper() == "BEGIN IMMEDIATE":
            raise self.error

    def __exit__(self, *exc):
        event.remove(settings.engine, "do_execute", self._do_execute)


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_during_the_skip_locked_begin_is_not_masked(session, interrupt):
    """
    Ctrl-C (KeyboardInterrupt), or the scheduler's SIGTERM handler (sys.exit: SystemExit), while the
    skip_locked ``BEGIN IMMEDIATE`` runs must reach the caller as itself, not as an ``Exception`` that
    an ``except Exception`` around one task instance would contain.
    """
    session.execute(text("SELECT 1"))
    with _RaiseOnBegin(interrupt()), pytest.raises(interrupt):
        _lock_sqlite_database(session, skip_locked=True)


def test_only_a_busy_database_is_reported_as_held(session):
    """
    Another error of ``BEGIN IMMEDIATE`` (disk I/O error, disk full, ...) is not "another connection holds
    the lock": returning False would skip the task instance at every check, silently, for as long as the
    error lasts. It must raise, as the statement does without skip_locked.
    """
    session.execute(text("SELECT 1"))
    error = sqlite3.OperationalError("disk I/O error")
    with _RaiseOnBegin(error), pytest.raises(Exception, match="disk I/O error"):
        _lock_sqlite_database(session, skip_locked=True)


@pytest.mark.skipif(
    series._release(series.BASE_VERSION) < (3, 2),
    reason="3.1.8: the executor-event path takes the write lock without skip_locked (README, per base)",
)
def test_executor_event_path_neither_waits_nor_writes_on_a_busy_database(
    dag_maker, session, scheduler_job_runner
):
    """
    A FAILED executor event of a RUNNING try on a busy database: the lock is not waited for (busy timeout
    0), the row is reported as held and no write to it is attempted; the event stays in the buffer.
    """
    runner = scheduler_job_runner
    executor = runner.executor
    (ti,) = make_running_tis(
        dag_maker, session, dag_id="sqlite_skip_event", task_ids=("t",), queued_by_job_id=runner.job.id
    )
    key = ti.key
    executor.event_buffer[key] = (TaskInstanceState.FAILED, None)
    session.expunge_all()
    session.close()
    sent = SentByThisThread()
    try:
        with WriteLockHeld(), settings.NonScopedSession() as s:
            runner._process_executor_events(executor=executor, session=s)
            s.commit()
    finally:
        sent.remove()
    assert sent.begins() and set(sent.begins()) == {0}, sent.begins()
    assert sent.ti_writes() == [], sent.ti_writes()
    assert key in executor.event_buffer
    assert read_rows("sqlite_skip_event", "t", key.run_id).state == TaskInstanceState.RUNNING
