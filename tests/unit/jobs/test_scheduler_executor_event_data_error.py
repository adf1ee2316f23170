# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
A database error other than IntegrityError / OperationalError in one executor event (a ``DataError``: PostgreSQL
22001, MySQL 1406 "Data too long") is contained: the step's transaction is rolled back and its events handled
again one per transaction, so the other events are committed and the failing one is put back. Found by review
of series v3 (before: the error was not caught and the scheduler loop rolled back every event of the step, in
every loop).
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
from sqlalchemy import text

from airflow import settings
from airflow.utils.state import TaskInstanceState

from tests.unit.harness import env
from tests.unit.harness.compat import put_back_key
from tests.unit.jobs.test_scheduler_executor_events_kept import committed_ti
from tests.unit.ti_race import executor_events_step, make_running_tis

pytestmark = pytest.mark.db_test

PATCH = "Keep-executor-events-until-the-scheduler-s-transaction-commits-them.patch"


@contextmanager
def reject_updates_with_a_data_error(task_id: str):
    """A trigger that rejects every UPDATE of one task instance with a data error (PostgreSQL / MySQL)."""
    with settings.engine.begin() as conn:
        if env.BACKEND == "postgres":
            conn.execute(
                text(
                    "CREATE OR REPLACE FUNCTION test_data_error() RETURNS trigger AS $$ BEGIN RAISE EXCEPTION "
                    "'value too long (test)' USING ERRCODE = 'string_data_right_truncation'; END $$ LANGUAGE plpgsql"
                )
            )
            conn.execute(
                text(
                    "CREATE TRIGGER test_data_error BEFORE UPDATE ON task_instance FOR EACH ROW "
                    f"WHEN (OLD.task_id = '{task_id}') EXECUTE FUNCTION test_data_error()"
                )
            )
        else:
            conn.execute(
                text(
                    "CREATE TRIGGER test_data_error BEFORE UPDATE ON task_instance FOR EACH ROW "
                    f"BEGIN IF OLD.task_id = '{task_id}' THEN SIGNAL SQLSTATE '22001' SET "
                    "MESSAGE_TEXT = 'Data too long (test)', MYSQL_ERRNO = 1406; END IF; END"
                )
            )
    try:
        yield
    finally:
        with settings.engine.begin() as conn:
            on = " ON task_instance" if env.BACKEND == "postgres" else ""
            conn.execute(text(f"DROP TRIGGER IF EXISTS test_data_error{on}"))
            if env.BACKEND == "postgres":
                conn.execute(text("DROP FUNCTION IF EXISTS test_data_error()"))


@pytest.mark.backend(
    "postgres",
    "mysql",
    reason="the DataError is raised by a PostgreSQL function / MySQL trigger; on SQLite the same containment is "
    "shown by test_flush_error_undoes_only_the_failing_event",
)
@pytest.mark.proves(PATCH)
def test_a_data_error_in_one_event_does_not_hold_back_the_others(dag_maker, session, scheduler_job_runner):
    runner = scheduler_job_runner
    executor = runner.executor
    good, poison = make_running_tis(
        dag_maker, session, dag_id="data_error", task_ids=("good", "poison"), queued_by_job_id=runner.job.id
    )
    executor.event_buffer.update(
        {
            good.key: (TaskInstanceState.QUEUED, "external-good"),
            poison.key: (
                TaskInstanceState.FAILED,
                None,
            ),  # killed externally: failure handling UPDATEs the row
        }
    )
    poison_put_back = put_back_key(poison.key, poison.id)  # 3.4: under the try's id
    session.expunge_all()
    session.close()
    with reject_updates_with_a_data_error("poison"):
        for _ in range(2):
            executor_events_step(runner)
    assert committed_ti("data_error", "good") == (TaskInstanceState.RUNNING, "external-good")
    assert committed_ti("data_error", "poison")[0] == TaskInstanceState.RUNNING
    assert list(executor.event_buffer) == [poison_put_back]
