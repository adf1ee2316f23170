# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
SQLite: failure handling's ``BEGIN IMMEDIATE`` (patch 19) times out while another connection holds the
database's write lock (the API server, the dag processor, another scheduler mid-transaction).

The patch message promises: "a busy timeout raises OperationalError ("database is locked"), which both
failure paths already contain per task instance". These tests hold the write lock on another connection
for the whole pass (no sleep: the pass itself waits the connection's busy timeout) and check that each
failure path contains the error, leaves the task instance for the next pass, and handles it once the
lock is free.
"""

from __future__ import annotations

import pytest

from airflow import settings
from airflow.utils.state import TaskInstanceState

from tests.unit.jobs import test_scheduler_heartbeat_timeout as heartbeat_tests
from tests.unit.jobs.test_scheduler_heartbeat_timeout import on_failure, purge
from tests.unit.jobs.test_scheduler_stuck_in_queued_recheck import (
    _reload,
    _start,
    _worker_moves_after_selection,
    stuck_ti,  # noqa: F401 (fixture)
)
from tests.unit.ti_race import make_running_tis, read_rows

pytestmark = [
    pytest.mark.db_test,
    pytest.mark.backend("sqlite", reason="the database-wide write lock is SQLite's"),
]

clock = heartbeat_tests.clock
timed_out_ti = heartbeat_tests.timed_out_ti


class WriteLockHeld:
    """Another connection holds SQLite's write lock (``BEGIN IMMEDIATE``) until the block ends."""

    def __enter__(self):
        self.conn = settings.engine.raw_connection()
        self.conn.cursor().execute("BEGIN IMMEDIATE")
        return self

    def __exit__(self, *exc):
        self.conn.rollback()
        self.conn.close()


def test_purge_contains_a_busy_write_lock(dag_maker, session, scheduler_job_runner, clock, timed_out_ti):
    """
    The heartbeat purge's pass, while another connection holds the write lock, must not raise out of
    the timer (the scheduler loop calls it without ``non_fatal``: an exception ends the scheduler).
    The try stays RUNNING for the next scan, which fails it once the lock is free.
    """
    runner = scheduler_job_runner
    dr, _ = timed_out_ti("sqlite_busy_purge", on_failure_callback=on_failure, retries=1)
    with WriteLockHeld():
        try:
            purge(runner)
        except Exception as error:  # noqa: BLE001
            pytest.fail(f"the heartbeat purge raised out of the scheduler's timer: {error!r}")
    assert read_rows(dr.dag_id, "t", dr.run_id).state == TaskInstanceState.RUNNING
    purge(runner)
    assert read_rows(dr.dag_id, "t", dr.run_id).state == TaskInstanceState.UP_FOR_RETRY


def test_executor_event_kept_when_the_write_lock_is_busy(dag_maker, session, scheduler_job_runner):
    """
    A FAILED executor event of a RUNNING try, handled while another connection holds the write lock:
    the batch does not raise, the event is kept in the buffer, the try stays RUNNING; the next batch,
    with the lock free, fails it.
    """
    runner = scheduler_job_runner
    executor = runner.executor
    (ti,) = make_running_tis(
        dag_maker, session, dag_id="sqlite_busy_event", task_ids=("t",), queued_by_job_id=runner.job.id
    )
    key = ti.key
    executor.event_buffer[key] = (TaskInstanceState.FAILED, None)
    session.expunge_all()
    session.close()
    with WriteLockHeld():
        with settings.NonScopedSession() as s:
            try:
                runner._process_executor_events(executor=executor, session=s)
                s.commit()
            except Exception as error:  # noqa: BLE001
                pytest.fail(f"the executor-event batch raised: {error!r}")
    assert key in executor.event_buffer, "the event was lost"
    assert read_rows("sqlite_busy_event", "t", key.run_id).state == TaskInstanceState.RUNNING
    with settings.NonScopedSession() as s:
        runner._process_executor_events(executor=executor, session=s)
        s.commit()
    assert executor.event_buffer == {}
    assert read_rows("sqlite_busy_event", "t", key.run_id).state == TaskInstanceState.UP_FOR_RETRY


def test_stuck_in_queued_recheck_that_declines_contains_a_busy_write_lock(
    session,
    other_session,
    scheduler_job_runner,
    stuck_ti,  # noqa: F811 (fixture)
    monkeypatch,
):
    """
    Stuck-in-queued handling selected a queued try; its worker then started it (committed RUNNING), and
    another connection holds the write lock (the worker's next API call in flight). The recheck must
    leave the running try alone without raising out of the handler (a timer of the scheduler loop
    without ``non_fatal``). At 3.3.2 + patches 1-18 the recheck's plain read saw RUNNING and declined;
    with patch 19 its BEGIN IMMEDIATE times out.
    """
    runner = scheduler_job_runner
    lock = WriteLockHeld()

    def move():
        _start(other_session, stuck_ti.id)
        lock.__enter__()

    _worker_moves_after_selection(runner, monkeypatch, move)
    try:
        try:
            runner._handle_tasks_stuck_in_queued(session=session)
            session.commit()
        except Exception as error:  # noqa: BLE001
            pytest.fail(f"stuck-in-queued handling raised out of the scheduler's timer: {error!r}")
    finally:
        if hasattr(lock, "conn"):
            lock.__exit__(None, None, None)
    session.rollback()
    assert _reload(session, stuck_ti).state == TaskInstanceState.RUNNING
    assert runner.executor.revoked == []
