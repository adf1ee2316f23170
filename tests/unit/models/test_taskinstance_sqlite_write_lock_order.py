# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
The lock is held when failure handling's read of the task instance row runs, not taken after it.

Patch 19's tests pause failure handling after its read (retry preparation's read of the try history)
and count the reads; a tree that takes SQLite's write lock right after the read (``BEGIN IMMEDIATE``
after the ``SELECT``) passes both, yet another connection can commit between that read and the lock,
and the read is then remembered as locked. Here another connection tries to take the lock right when
the read statement has run, in the purge's revalidation: it must not get it.
"""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import event

from airflow import settings
from airflow.utils.state import TaskInstanceState

from tests.unit.jobs import test_scheduler_heartbeat_timeout as heartbeat_tests
from tests.unit.jobs.test_scheduler_heartbeat_timeout import on_failure, purge
from tests.unit.models.test_taskinstance_retry_race import _row_lock_free
from tests.unit.models.test_taskinstance_sqlite_write_lock import READS_TI_BY_ID
from tests.unit.ti_race import read_rows

PATCH = "Read-a-failing-task-instance-under-SQLite-s-write-lock.patch"

pytestmark = pytest.mark.db_test

clock = heartbeat_tests.clock
timed_out_ti = heartbeat_tests.timed_out_ti


@pytest.mark.proves(PATCH, base_ok_on=("postgres", "mysql"))
def test_row_is_locked_when_failure_handlings_read_has_run(
    dag_maker, session, scheduler_job_runner, clock, timed_out_ti
):
    dr, _ = timed_out_ti("lock_before_read", on_failure_callback=on_failure, retries=1)
    key = (dr.dag_id, "t", dr.run_id, -1)
    me = threading.current_thread()
    free_after_read: list[bool] = []

    def _after(conn, cursor, statement, parameters, context, executemany) -> None:
        if threading.current_thread() is me and READS_TI_BY_ID.search(statement):
            free_after_read.append(_row_lock_free(key))

    event.listen(settings.engine, "after_cursor_execute", _after)
    try:
        purge(scheduler_job_runner)
    finally:
        event.remove(settings.engine, "after_cursor_execute", _after)
    assert free_after_read, "failure handling never read the task instance row"
    assert free_after_read[0] is False, (
        "another connection could take the lock right after failure handling's read of the row "
        f"(free after each read: {free_after_read})"
    )
    assert read_rows(*key).state == TaskInstanceState.UP_FOR_RETRY


@pytest.mark.backend("sqlite")
def test_purge_fails_a_timed_out_try_after_one_whose_revalidation_declined(
    dag_maker, session, scheduler_job_runner, clock, monkeypatch
):
    """
    Two tries found by one scan; the first heartbeats right after the scan, so its revalidation
    declines and the pass goes on in the same transaction, which holds what that revalidation locked
    (on SQLite the write lock: ``BEGIN IMMEDIATE`` once, no second ``BEGIN`` in the open transaction,
    "cannot start a transaction within a transaction"). The second try is failed in the same pass.
    SQLite only: elsewhere the scan's FOR UPDATE makes the worker's heartbeat below wait for this thread.
    """
    from sqlalchemy import update

    from airflow._shared.timezones import timezone as tz
    from airflow.models.taskinstance import TaskInstance
    from airflow.providers.standard.operators.empty import EmptyOperator

    from tests.unit.jobs.test_scheduler_heartbeat_timeout import past_timeout, start_ti

    runner = scheduler_job_runner
    with dag_maker("declined_then_failed", session=session):
        EmptyOperator(task_id="a", retries=1, on_failure_callback=on_failure)
        EmptyOperator(task_id="b", retries=1, on_failure_callback=on_failure)
    dr = dag_maker.create_dagrun()
    for task_id in ("a", "b"):
        start_ti(session, dr, runner, task_id)
    session.close()
    past_timeout(clock, runner)
    scan = runner._find_task_instances_without_heartbeats

    def scan_then_a_heartbeats(*, session, **kwargs):
        found = sorted(scan(session=session, **kwargs), key=lambda ti: ti.task_id)
        assert [ti.task_id for ti in found] == ["a", "b"], found
        with settings.NonScopedSession() as other:  # the worker of "a" heartbeats (execution API)
            other.execute(
                update(TaskInstance)
                .where(TaskInstance.id == found[0].id)
                .values(last_heartbeat_at=tz.utcnow())
            )
            other.commit()
        return found

    monkeypatch.setattr(runner, "_find_task_instances_without_heartbeats", scan_then_a_heartbeats)
    purge(runner)
    assert [read_rows(dr.dag_id, t, dr.run_id).state for t in ("a", "b")] == [
        TaskInstanceState.RUNNING,
        TaskInstanceState.UP_FOR_RETRY,
    ]
