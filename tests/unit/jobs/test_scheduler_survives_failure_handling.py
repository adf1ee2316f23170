# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
The scheduler survives a database error in the failure handling of one executor event (#71923).

On 3.3.2 an exception from ``TaskInstance.handle_failure`` inside
``SchedulerJobRunner._process_executor_events`` leaves the scheduler loop and the scheduler
process exits; the other events of the batch, already taken out of the executor's buffer, are
lost. The error here is a real one from the database: right before the UPDATE that gives the
first failed TI its new id, a ``task_reschedule`` row for its old id is inserted on the same
connection (what the execution API's reschedule did in #71923), so the UPDATE fails with the
database's own foreign-key IntegrityError (postgres ForeignKeyViolation, MariaDB 1451, SQLite
"FOREIGN KEY constraint failed").
"""

from __future__ import annotations

import logging
import re
import threading
import uuid

import pytest
from sqlalchemy import event, insert

from airflow import settings
from airflow._shared.timezones import timezone
from airflow.listeners import hookimpl
from airflow.models.taskinstance import TaskInstance
from airflow.models.taskreschedule import TaskReschedule
from airflow.utils.state import TaskInstanceState

from tests.unit.ti_race import executor_events_step, make_running_tis, read_rows

P4 = "Keep-the-scheduler-running-when-one-executor-event-fails-in-the-DB.patch"

pytestmark = pytest.mark.db_test

UPDATE_OF_TI_ID = re.compile(r"^\s*UPDATE task_instance SET .*\bid\s*=", re.IGNORECASE | re.DOTALL)
# 3.4 never updates task_instance.id: retry preparation archives the try in place (working_set) and inserts the next.
ON_3_4 = hasattr(TaskInstance, "working_set")
UPDATE_OF_TI = re.compile(r"^\s*UPDATE task_instance SET ", re.IGNORECASE)


class RecordingListener:
    def __init__(self):
        self.failed: list[str] = []

    @hookimpl
    def on_task_instance_failed(self, previous_state, task_instance, error):
        self.failed.append(task_instance.task_id)


@pytest.fixture
def listener(listener_manager):
    recording = RecordingListener()
    listener_manager(recording)
    return recording


class ForeignKeyViolationOnce:
    """
    Before the first UPDATE of a task instance id on this thread, insert ``task_reschedule`` rows
    for ``ti_ids`` on the same connection, in the same transaction: the UPDATE then fails with the
    database's foreign-key error. Fires once.

    Adapted for 3.4, which issues no UPDATE of an id: before the first UPDATE of a task instance, the
    inserted ``task_reschedule`` row names a try that does not exist, so that INSERT fails with the
    database's foreign-key error, in the same transaction, at the same point of failure handling.
    """

    def __init__(self, ti_ids):
        self.ti_ids = list(ti_ids)
        self.thread = threading.current_thread()
        self.fired = False
        event.listen(settings.engine, "before_cursor_execute", self._before)

    def _before(self, conn, cursor, statement, parameters, context, executemany):
        if (
            self.fired
            or threading.current_thread() is not self.thread
            or not (UPDATE_OF_TI if ON_3_4 else UPDATE_OF_TI_ID).match(statement)
        ):
            return
        self.fired = True
        now = timezone.utcnow()
        if ON_3_4:
            self.ti_ids = [uuid.uuid4()]  # a try that does not exist
        conn.execute(
            insert(TaskReschedule.__table__),
            [
                {"ti_id": ti_id, "start_date": now, "end_date": now, "duration": 0, "reschedule_date": now}
                for ti_id in self.ti_ids
            ],
        )

    def remove(self):
        event.remove(settings.engine, "before_cursor_execute", self._before)


@pytest.mark.skipif(
    ON_3_4,
    reason="3.4: its premise is gone (retry preparation keeps the try's id and task_reschedule rows); the "
    "containment of one event's database error: test_a_data_error_in_one_event_does_not_hold_back_the_others, "
    "test_legacy_callback_path_sends_one_request_when_the_event_is_handled_again",
)
@pytest.mark.proves(P4)
def test_integrity_error_in_failure_handling_does_not_stop_the_scheduler(
    dag_maker, session, scheduler_job_runner, listener, caplog, capsys
):
    runner = scheduler_job_runner
    executor = runner.executor
    tis = make_running_tis(
        dag_maker, session, dag_id="survive", task_ids=("first", "second"), queued_by_job_id=runner.job.id
    )
    keys = {ti.task_id: (ti.dag_id, ti.task_id, ti.run_id, ti.map_index) for ti in tis}
    old_ids = {ti.task_id: ti.id for ti in tis}
    for ti in tis:
        executor.event_buffer[ti.key] = (TaskInstanceState.FAILED, None)
    session.expunge_all()

    injected = ForeignKeyViolationOnce(old_ids.values())
    try:
        with caplog.at_level(logging.ERROR):
            try:
                executor_events_step(runner)
            except Exception as e:
                pytest.fail(f"the executor-event step raised {e!r}: the scheduler loop would exit")
    finally:
        injected.remove()
    assert injected.fired, "no UPDATE of a task instance id was seen"

    # The failed attempt is rolled back entirely and both events are handled again, each in a
    # transaction of its own: one retry each (new id, one history row), one listener call each.
    for task_id, key in keys.items():
        row = read_rows(*key)
        assert row.state == TaskInstanceState.UP_FOR_RETRY, row
        assert row.ti_id != old_ids[task_id] and row.history_tries == [1], row
    assert sorted(listener.failed) == sorted(keys), "listener called for a failure that was rolled back"
    logged = caplog.text + "".join(capsys.readouterr())  # stdlib logging or Airflow's structlog output
    assert "Executor events rolled back" in logged, "the database error was not logged"
    assert "IntegrityError" in logged, "the database error was not logged with its exception"
    assert executor.event_buffer == {}
