# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
Failure handling reads a task instance under a lock on SQLite too: the database's write lock.

PostgreSQL, MySQL and MariaDB lock the task instance row when failure handling reads it (``SELECT ...
FOR UPDATE``): another writer, such as the execution API's reschedule, waits until the failure is
committed, and failure handling reads the row once. SQLite has no row locks and its reads take no write
lock: on 3.3.2 + patches 1-18 another connection could commit between failure handling's read and its
first write (the retry then overwrote a reschedule the API had answered 204 for), and failure handling
read the row again at each of its checks (three reads per timed-out task instance in the heartbeat
purge). With the patch, the read takes SQLite's write lock first (``BEGIN IMMEDIATE``).
"""

from __future__ import annotations

import re
import threading

import pytest
from sqlalchemy import event

import airflow

from airflow import settings
from airflow.utils.state import TaskInstanceState

from tests.unit.jobs import test_scheduler_heartbeat_timeout as heartbeat_tests
from tests.unit.jobs.test_scheduler_heartbeat_timeout import on_failure, purge
from tests.unit.models.test_taskinstance_retry_race import (
    READS_TRY_HISTORY,
    _key,
    _row_lock_free,
    handle_failure_of,
    pauses,  # noqa: F401 (fixture)
    run_in_scheduler_thread,
)
from tests.unit.ti_race import WAIT, StatementLog, lock_waiters, make_running_tis, read_rows, wait_until

PATCH = "Read-a-failing-task-instance-under-SQLite-s-write-lock.patch"

pytestmark = pytest.mark.db_test

clock = heartbeat_tests.clock
timed_out_ti = heartbeat_tests.timed_out_ti

# Failure handling's read of the whole task instance row by its id (``TaskInstance._lock_and_read_row``).
READS_TI_BY_ID = re.compile(
    r"^\s*SELECT task_instance\.id, task_instance\.task_id\b.*\bFROM task_instance\s+WHERE task_instance\.id = ",
    re.IGNORECASE | re.DOTALL,
)
API_UPDATES_TI = re.compile(r"^\s*UPDATE task_instance SET\b", re.IGNORECASE)


@pytest.mark.proves(PATCH, base_ok_on=("postgres", "mysql"))
@pytest.mark.skipif(
    airflow.__version__.startswith("3.1."),
    reason="the 3.1.8 queue carries the row-lock patch in its shape before the issue-17 amendment: a locking "
    "read of the row at each check, nothing remembered per transaction (on every backend)",
)
def test_purge_reads_a_timed_out_task_instance_once(
    dag_maker, session, scheduler_job_runner, clock, timed_out_ti
):
    """
    One heartbeat-timeout pass fails one timed-out task instance (a retry left): failure handling reads
    its row by id once, at revalidation, and nothing else reads it before the commit. On PostgreSQL and
    MariaDB that read is the row lock (patch 7). On SQLite, 3.3.2 + patches 1-18 read it three times
    (revalidation, ``handle_failure``'s check, ``fetch_handle_failure_context``'s check).
    """
    runner = scheduler_job_runner
    dr, ti_id = timed_out_ti("sqlite_one_read", on_failure_callback=on_failure, retries=1)
    statements = StatementLog()
    try:
        purge(runner)
    finally:
        statements.remove()
    rows = read_rows(dr.dag_id, "t", dr.run_id)
    assert rows.state == TaskInstanceState.UP_FOR_RETRY, rows
    reads = sum(1 for statement in statements.statements if READS_TI_BY_ID.search(statement))
    assert reads == 1, f"the pass read the task instance row by id {reads} times"


@pytest.mark.proves(PATCH, base_ok_on=("postgres", "mysql"))
def test_no_commit_between_failure_handlings_read_and_its_commit(
    dag_maker,
    session,
    listener_manager,
    api,
    pauses,  # noqa: F811 (fixture)
):
    """
    Failure handling read the task instance (``handle_failure``) and has not written yet: it is paused
    at retry preparation's read of the try history. No other connection can take the lock that serialises
    writers of the row (PostgreSQL/MariaDB: ``FOR UPDATE NOWAIT`` of the row; SQLite: ``BEGIN IMMEDIATE``
    with no busy timeout). The execution API's reschedule of the try, sent then, waits for the failure's
    commit and answers 404; the retry stands: new id, ``up_for_retry``, one try-history row, no
    ``task_reschedule`` row.

    On SQLite with 3.3.2 + patches 1-18 the database is free at that point: the reschedule committed
    (204) and the retry then overwrote it (up_for_retry, its ``task_reschedule`` row deleted).
    """
    (ti,) = make_running_tis(dag_maker, session, dag_id="sqlite_write_lock")
    old_id, key = ti.id, _key(ti)
    failure = run_in_scheduler_thread(handle_failure_of(key, ti.task))
    paused = pauses(READS_TRY_HISTORY, thread=failure)
    api_updates = threading.Event()

    def _before(conn, cursor, statement, parameters, context, executemany) -> None:
        if threading.current_thread() is not failure and API_UPDATES_TI.search(statement):
            api_updates.set()

    event.listen(settings.engine, "before_cursor_execute", _before)
    try:
        failure.start()
        assert paused.reached.wait(WAIT), "failure handling never reached retry preparation"
        assert not _row_lock_free(key), (
            "another connection can take the lock between failure handling's read and its commit"
        )
        api_call = api.reschedule_in_thread(old_id)
        # PostgreSQL/MariaDB: the route's locking read waits. SQLite: its UPDATE waits for the write lock.
        wait_until(
            lambda: api_call.done.is_set() or lock_waiters() > 0 or api_updates.is_set(),
            "the API's reschedule ended or waits for the lock",
        )
        paused.release()
        failure.join_or_fail()
        status = api_call.join_or_fail()
    finally:
        event.remove(settings.engine, "before_cursor_execute", _before)

    assert failure.error is None, f"failure handling raised {failure.error!r}"
    assert api_call.error is None, f"the reschedule raised {api_call.error!r}"
    rows = read_rows(*key)
    assert status == 404, f"the reschedule sent during failure handling answered {status}: {rows}"
    assert (rows.state, rows.ti_id != old_id, rows.reschedule_ti_ids, rows.history_tries) == (
        TaskInstanceState.UP_FOR_RETRY,
        True,
        [],
        [1],
    ), rows
