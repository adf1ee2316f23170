# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
Executor events are applied and committed, or kept in the executor's buffer for a later loop.

``SchedulerJobRunner._process_executor_events`` takes the events out of the executor's buffer
before their effects are committed. These tests make the database itself reject or end the
transaction at chosen points of one batch (a trigger that rejects the UPDATE of one task
instance, a real deadlock, a failed COMMIT, a row locked by another connection) and check, for
every event of the batch, that its effect is committed or that it is back in the buffer.
"""

from __future__ import annotations

import threading
import uuid
from contextlib import contextmanager

import pytest
from sqlalchemy import select, text, update

from airflow import settings
from airflow.models.callback import Callback, CallbackFetchMethod, CallbackKey, ExecutorCallback
from airflow.models.log import Log
from airflow.models.taskinstance import TaskInstance
from airflow.utils.state import CallbackState, TaskInstanceState

from tests.unit.conftest import BACKEND
from tests.unit.ti_race import Worker, lock_waiters, make_running_tis, wait_until

P_CONTAIN = "Keep-the-scheduler-running-when-one-executor-event-fails-in-the-DB.patch"

pytestmark = pytest.mark.db_test

POISON = "poison"  # task_id whose UPDATE the trigger rejects

NO_SAVEPOINT_ON_SQLITE = (
    "sqlite: the series opens no savepoint per event there (pysqlite's SAVEPOINT pins a read snapshot), "
    "so a database error rolls back the batch's whole transaction"
)


@contextmanager
def reject_updates_of(task_id: str):
    """
    A database trigger that rejects every UPDATE of the task instance row(s) with ``task_id`` with
    the database's own integrity error (postgres 23503, MySQL/MariaDB 1451), until the block ends.
    """
    with settings.engine.begin() as conn:
        if BACKEND == "postgres":
            conn.execute(
                text(
                    "CREATE OR REPLACE FUNCTION test_reject_ti_update() RETURNS trigger AS $$ BEGIN "
                    "RAISE EXCEPTION 'update of task instance % rejected by test trigger', OLD.task_id "
                    "USING ERRCODE = 'foreign_key_violation'; END $$ LANGUAGE plpgsql"
                )
            )
            conn.execute(
                text(
                    "CREATE TRIGGER test_reject_ti_update BEFORE UPDATE ON task_instance FOR EACH ROW "
                    f"WHEN (OLD.task_id = '{task_id}') EXECUTE FUNCTION test_reject_ti_update()"
                )
            )
        elif BACKEND == "mysql":
            conn.execute(
                text(
                    "CREATE TRIGGER test_reject_ti_update BEFORE UPDATE ON task_instance FOR EACH ROW "
                    f"BEGIN IF OLD.task_id = '{task_id}' THEN SIGNAL SQLSTATE '23000' SET "
                    "MESSAGE_TEXT = 'update of task instance rejected by test trigger', "
                    "MYSQL_ERRNO = 1451; END IF; END"
                )
            )
        else:
            conn.execute(
                text(
                    "CREATE TRIGGER test_reject_ti_update BEFORE UPDATE ON task_instance FOR EACH ROW "
                    f"WHEN OLD.task_id = '{task_id}' BEGIN "
                    "SELECT RAISE(ABORT, 'update of task instance rejected by test trigger'); END"
                )
            )
    try:
        yield
    finally:
        with settings.engine.begin() as conn:
            conn.execute(text("DROP TRIGGER IF EXISTS test_reject_ti_update" + (
                " ON task_instance" if BACKEND == "postgres" else ""
            )))
            if BACKEND == "postgres":
                conn.execute(text("DROP FUNCTION IF EXISTS test_reject_ti_update()"))


class _CallbackDef:
    """The smallest callback definition ``ExecutorCallback`` serialises."""

    def serialize(self) -> dict:
        return {"path": "tests.unit.noop", "kwargs": {}, "executor": None}


def make_queued_callback(session) -> CallbackKey:
    callback = ExecutorCallback(_CallbackDef(), fetch_method=CallbackFetchMethod.IMPORT_PATH)
    callback.state = CallbackState.QUEUED
    session.add(callback)
    session.commit()
    return CallbackKey(id=str(callback.id))


def committed_callback_state(key: CallbackKey) -> str | None:
    with settings.NonScopedSession() as s:
        return s.scalar(select(Callback.state).where(Callback.id == uuid.UUID(key.id)))


def committed_ti(dag_id: str, task_id: str) -> tuple[str | None, str | None]:
    """(state, external_executor_id) of the task instance as a fresh connection sees it."""
    with settings.NonScopedSession() as s:
        return s.execute(
            select(TaskInstance.state, TaskInstance.external_executor_id).where(
                TaskInstance.dag_id == dag_id, TaskInstance.task_id == task_id
            )
        ).one()


def committed_mismatch_logs(dag_id: str) -> list[str]:
    with settings.NonScopedSession() as s:
        return sorted(
            s.scalars(select(Log.task_id).where(Log.dag_id == dag_id, Log.event == "state mismatch"))
        )


@pytest.mark.proves(P_CONTAIN)
def test_flush_error_undoes_only_the_failing_event(dag_maker, session, scheduler_job_runner, backend):
    """
    The UPDATE of one TI is rejected inside its event's savepoint, at the flush. Every event
    popped before it in the batch and not committed yet (a callback-key event, which is always
    handled first, and a QUEUED event's ``external_executor_id``) keeps its effect and is committed
    with the batch; only the failing event is undone and put back in the buffer. (No other FAILED
    event in this batch: its failure handling commits, which would commit the earlier effects too.)
    """
    if backend == "sqlite":
        pytest.skip(NO_SAVEPOINT_ON_SQLITE)
    runner = scheduler_job_runner
    executor = runner.executor
    tis = make_running_tis(
        dag_maker,
        session,
        dag_id="flush_error",
        task_ids=("queued", POISON),
        queued_by_job_id=runner.job.id,
    )
    by_task = {ti.task_id: ti for ti in tis}
    callback_key = make_queued_callback(session)
    executor.event_buffer[callback_key] = (CallbackState.SUCCESS, None)
    executor.event_buffer[by_task["queued"].key] = (TaskInstanceState.QUEUED, "external-id-1")
    executor.event_buffer[by_task[POISON].key] = (TaskInstanceState.FAILED, None)
    poison_key = by_task[POISON].key
    session.expunge_all()

    with reject_updates_of(POISON):
        runner._process_executor_events(executor=executor, session=session)
        session.commit()

    assert committed_callback_state(callback_key) == CallbackState.SUCCESS, "callback event lost"
    assert committed_ti("flush_error", "queued") == (TaskInstanceState.RUNNING, "external-id-1"), (
        "QUEUED event's external_executor_id lost"
    )
    assert committed_ti("flush_error", POISON)[0] == TaskInstanceState.RUNNING
    assert committed_mismatch_logs("flush_error") == [], "the failing event's log row was committed"
    # Only the failing event is back in the buffer.
    assert list(executor.event_buffer) == [poison_key]
