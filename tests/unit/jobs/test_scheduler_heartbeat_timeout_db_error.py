# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
A database error while the heartbeat-timeout purge fails one TI does not stop the pass (guard).

Since ``Fail-heartbeat-timed-out-tries-in-the-same-pass.patch`` the purge runs ``ti.handle_failure``
(retry preparation, id rotation, fail_fast) for each timed-out TI; since the executor-event patch a
database error there is logged, the pass is rolled back and redone one TI per transaction, so only
that TI's work is lost and the other timed-out TIs of the pass are handled (the error would otherwise leave the
scheduler loop's timer).

The error is a real one from the database, injected exactly like the project's own survival test
(``ForeignKeyViolationOnce``: a task_reschedule row for the old id inserted right before the
UPDATE that rotates the id). Realistic triggers in production are deadlocks / lock-wait timeouts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import datetime, timedelta

import pytest
import time_machine
from sqlalchemy import select

from airflow import settings
from airflow._shared.timezones import timezone
from airflow.callbacks.callback_requests import TaskCallbackRequest
from airflow.models.db_callback_request import DbCallbackRequest
from airflow.models.taskinstance import TaskInstance
from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.utils.state import TaskInstanceState

from tests.unit.jobs.test_scheduler_survives_failure_handling import ForeignKeyViolationOnce

pytestmark = pytest.mark.db_test

T0 = datetime(2026, 3, 2, 12, 0, 0, tzinfo=timezone.utc)


# Series v3 (every queue): the purge contains a database error per task instance from the executor-event patch on.
@pytest.mark.proves("Keep-executor-events-until-the-scheduler-s-transaction-commits-them.patch")
def test_purge_survives_db_error_of_one_ti(dag_maker, session, scheduler_job_runner):
    runner = scheduler_job_runner
    with time_machine.travel(T0, tick=False) as clock:
        with dag_maker("hb_db_error", session=session):
            EmptyOperator(task_id="t1", retries=1)
            EmptyOperator(task_id="t2", retries=1)
        dag_run = dag_maker.create_dagrun()
        ids = []
        for ti in dag_run.get_task_instances(session=session):
            ti.state = TaskInstanceState.RUNNING
            ti.try_number = 1
            ti.queued_by_job_id = runner.job.id
            ti.hostname = "worker-1"
            ti.start_date = timezone.utcnow()
            ti.last_heartbeat_at = timezone.utcnow()
            ids.append(ti.id)
        session.commit()
        session.close()
        clock.shift(timedelta(seconds=runner._task_instance_heartbeat_timeout_secs + 60))

        injected = ForeignKeyViolationOnce(ids)
        try:
            try:
                runner._find_and_purge_task_instances_without_heartbeats()
            except Exception as e:
                pytest.fail(
                    f"the heartbeat purge raised {type(e).__name__}: the scheduler loop would exit "
                    f"(injected DB error fired: {injected.fired})"
                )
        finally:
            injected.remove()

    with settings.NonScopedSession() as s:
        sent = [
            r.ti.task_id
            for r in (row.get_callback_request() for row in s.scalars(select(DbCallbackRequest)))
            if isinstance(r, TaskCallbackRequest)
        ]
    # At least the TI whose handling did not fail must have been purged in this pass.
    assert sent, "no timed-out TI was handled in this pass"


# A BEFORE INSERT trigger on ``log`` that raises for the purge's "heartbeat timeout" row: a real database error
# when the task instance's savepoint is released (or, on SQLite, when the pass commits), after failure handling,
# the callback request and the executor's bookkeeping were done in Python.
_FAILING_LOG_TRIGGER = {
    "postgresql": (
        "CREATE FUNCTION series_test_fail_log() RETURNS trigger AS $$ BEGIN "
        "IF NEW.event = 'heartbeat timeout' THEN RAISE EXCEPTION 'injected by the test'; END IF; "
        "RETURN NEW; END $$ LANGUAGE plpgsql",
        "CREATE TRIGGER series_test_fail_log BEFORE INSERT ON log FOR EACH ROW "
        "EXECUTE FUNCTION series_test_fail_log()",
    ),
    "mysql": (
        "CREATE TRIGGER series_test_fail_log BEFORE INSERT ON log FOR EACH ROW BEGIN "
        "IF NEW.event = 'heartbeat timeout' THEN "
        "SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'injected by the test'; END IF; END",
    ),
    "sqlite": (
        "CREATE TRIGGER series_test_fail_log BEFORE INSERT ON log FOR EACH ROW "
        "WHEN NEW.event = 'heartbeat timeout' BEGIN SELECT RAISE(ABORT, 'injected by the test'); END",
    ),
}
_DROP_FAILING_LOG_TRIGGER = {
    "postgresql": (
        "DROP TRIGGER IF EXISTS series_test_fail_log ON log",
        "DROP FUNCTION IF EXISTS series_test_fail_log()",
    ),
    "mysql": ("DROP TRIGGER IF EXISTS series_test_fail_log",),
    "sqlite": ("DROP TRIGGER IF EXISTS series_test_fail_log",),
}


@contextlib.contextmanager
def failing_heartbeat_timeout_log(dialect: str) -> Iterator[None]:
    """While inside, inserting the purge's "heartbeat timeout" ``log`` row raises a database error."""
    with settings.engine.begin() as conn:
        for statement in _FAILING_LOG_TRIGGER[dialect]:
            conn.exec_driver_sql(statement)
    try:
        yield
    finally:
        with settings.engine.begin() as conn:
            for statement in _DROP_FAILING_LOG_TRIGGER[dialect]:
                conn.exec_driver_sql(statement)


@pytest.mark.proves("Keep-executor-events-until-the-scheduler-s-transaction-commits-them.patch")
def test_purge_rolled_back_does_not_tell_the_executor(dag_maker, session, scheduler_job_runner):
    """
    The heartbeat-timeout purge of a try whose writes are rolled back (a database error when they are flushed)
    leaves the executor as it was: the try stays in its running set, and no FAILED event is buffered for it.
    Telling the executor of a failure that was not written makes it drop a running try from its bookkeeping
    (parallelism, adoption) while the next pass finds the try running again.
    """
    runner = scheduler_job_runner
    dialect = session.get_bind().dialect.name
    with time_machine.travel(T0, tick=False) as clock:
        with dag_maker("hb_rolled_back_executor", session=session):
            EmptyOperator(task_id="t", retries=1)
        (ti,) = dag_maker.create_dagrun().get_task_instances(session=session)
        ti.state = TaskInstanceState.RUNNING
        ti.try_number = 1
        ti.queued_by_job_id = runner.job.id
        ti.hostname = "worker-1"
        ti.start_date = timezone.utcnow()
        ti.last_heartbeat_at = timezone.utcnow()
        key = ti.key
        session.commit()
        session.close()
        runner.executor.running.add(key)
        clock.shift(timedelta(seconds=runner._task_instance_heartbeat_timeout_secs + 60))

        with failing_heartbeat_timeout_log(dialect):
            runner._find_and_purge_task_instances_without_heartbeats()

    with settings.NonScopedSession() as s:
        assert (
            s.scalar(select(TaskInstance.state).where(TaskInstance.id == ti.id)) == TaskInstanceState.RUNNING
        )
    assert key in runner.executor.running, "the executor was told of a failure that was rolled back"
    assert key not in runner.executor.event_buffer
