# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
A try that fails from QUEUED or SCHEDULED is recorded in the history and the next try gets a new id.

Backport of upstream PR https://github.com/apache/airflow/pull/67372 (issues #67238, #65366): on
3.3.2 ``fetch_handle_failure_context`` called ``prepare_db_for_next_try`` only for a RUNNING task
instance, so a try the executor failed while it was still queued (worker or pod killed before the
task started) left no ``task_instance_history`` row, and the task instance kept its ``id`` and the
try's ``task_reschedule`` rows into the next try.

The second test shows why it matters to this series: the stale-event rule (patch
``Ignore-stale-executor-events-from-an-earlier-process-of-the-live-try``) reads ``task_reschedule``
rows of the current ``id`` as proof that an earlier poke of the *current* try ended. With rows
inherited from the previous try, a state-mismatch SUCCESS event of the next try's first poke (its
process died before it reported) was ignored as stale instead of failing the try.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from sqlalchemy import func, select

from airflow.callbacks.callback_requests import TaskCallbackRequest
from airflow.models.taskreschedule import TaskReschedule
from airflow.utils.state import TaskInstanceState
from tests.unit.jobs.test_scheduler_stale_executor_events import (
    _first_poke_rescheduled,
    _make_sensors,
    _mismatch_logs,
    _process_events,
    _queue,
    _reload,
    _schedule,
    _second_poke_reaches,
)
from tests.unit.ti_race import history_of

PATCH = "Record-TaskInstanceHistory-when-a-task-fails-from-a-non-running-state.patch"

pytestmark = pytest.mark.db_test


@pytest.fixture
def execution_api(api) -> Iterator[httpx.Client]:
    """A client of the run's execution API app (the harness's ``api``)."""
    with api.client() as client:
        yield client


def _history(session, ti) -> list[tuple[int, str, str]]:
    return [
        (row.try_number, row.state, row.task_instance_id)
        for row in history_of(session, ti.dag_id, ti.task_id, ti.run_id)
    ]


def _reschedule_rows(session, ti_id) -> int:
    return session.scalar(
        select(func.count()).select_from(TaskReschedule).where(TaskReschedule.ti_id == ti_id)
    )


@pytest.mark.proves(PATCH)
@pytest.mark.parametrize(
    "live_state", [TaskInstanceState.SCHEDULED, TaskInstanceState.QUEUED], ids=lambda s: s.value
)
def test_executor_failure_from_non_running_state_records_history_and_rotates_id(
    dag_maker, session, scheduler_job_runner, execution_api, live_state
):
    """Poke 2 of try 1 is scheduled/queued when the executor reports FAILED for the try."""
    runner = scheduler_job_runner
    dag_run, (ti,) = _make_sensors(dag_maker, session, dag_id="fail_from_queued")
    _first_poke_rescheduled(session, runner, execution_api, dag_run, [ti])
    _second_poke_reaches(session, runner, execution_api, dag_run, [ti], live_state)
    before = _reload(session, ti)
    # What _executable_task_instances_to_queued would have written for a scheduled TI too: the
    # executor event path only fails a scheduled/queued TI this scheduler queued.
    before.queued_by_job_id = runner.job.id
    session.commit()
    assert (before.state, before.try_number) == (live_state, 1)
    try_1_id = before.id  # the ORM object is the session's: it will carry the new id afterwards
    assert _reschedule_rows(session, try_1_id) == 1

    runner.executor.fail(before.key)  # the workload died before the task started
    _process_events(runner, session)

    after = _reload(session, ti)
    assert after.state == TaskInstanceState.UP_FOR_RETRY
    assert _history(session, ti) == [(1, TaskInstanceState.FAILED, try_1_id)], "no history row for try 1"
    assert after.id != try_1_id, "the next try must not keep the failed try's id"
    assert _reschedule_rows(session, try_1_id) == 0, "the failed try's task_reschedule rows remain"


@pytest.mark.guard
def test_restarting_task_failure_records_no_second_history_row(dag_maker, session, scheduler_job_runner):
    """Guard (upstream's reason to exclude RESTARTING): a cleared try is not archived twice."""
    from airflow.models.taskinstance import TaskInstance, clear_task_instances

    runner = scheduler_job_runner
    dag_run, (ti,) = _make_sensors(dag_maker, session, dag_id="fail_restarting")
    _schedule(session, dag_run, [ti])
    _queue(session, runner, [ti])
    running = _reload(session, ti)
    running.state = TaskInstanceState.RUNNING
    session.commit()
    clear_task_instances([_reload(session, ti)], session)  # RUNNING -> RESTARTING, history recorded
    session.commit()
    restarting = _reload(session, ti)
    assert restarting.state == TaskInstanceState.RESTARTING
    assert len(_history(session, ti)) == 1
    restarting.task = dag_run.dag.get_task(ti.task_id)

    TaskInstance.fetch_handle_failure_context(restarting, error=None, session=session)
    session.commit()

    assert _reload(session, ti).id == restarting.id
    assert len(_history(session, ti)) == 1


@pytest.mark.proves(PATCH)
def test_next_try_does_not_inherit_reschedule_rows_so_stale_rule_does_not_misfire(
    dag_maker, session, scheduler_job_runner, execution_api
):
    """
    Try 1 fails while poke 2 is queued; try 2's first poke dies before reporting: it must be failed.

    Before the backport, try 2 kept try 1's id and its task_reschedule row, and the stale-event rule
    took try 2's SUCCESS event (a state mismatch: the TI is still queued) for the late exit of an
    earlier poke of try 2, so the dead attempt was left QUEUED with no callback.
    """
    runner = scheduler_job_runner
    dag_run, (ti,) = _make_sensors(dag_maker, session, dag_id="no_inherited_reschedules")
    _first_poke_rescheduled(session, runner, execution_api, dag_run, [ti])
    _second_poke_reaches(session, runner, execution_api, dag_run, [ti], TaskInstanceState.QUEUED)
    runner.executor.fail(_reload(session, ti).key)
    _process_events(runner, session)
    assert _reload(session, ti).state == TaskInstanceState.UP_FOR_RETRY
    runner.executor.callbacks_sent.clear()

    # Try 2: scheduled (try_number 2) and queued; its first poke's process dies, the executor
    # reports SUCCESS (exit 0 without the state reaching the API) while the TI is still queued.
    _schedule(session, dag_run, [_reload(session, ti)])
    _queue(session, runner, [ti])
    queued = _reload(session, ti)
    assert (queued.state, queued.try_number) == (TaskInstanceState.QUEUED, 2)
    try_2_id = queued.id
    mismatch_logs_before = _mismatch_logs(session)

    runner.executor.success(queued.key)
    _process_events(runner, session)

    after = _reload(session, ti)
    assert after.state == TaskInstanceState.FAILED, "try 2's dead first poke was ignored as stale"
    callbacks = [c for c in runner.executor.callbacks_sent if isinstance(c, TaskCallbackRequest)]
    assert len(callbacks) == 1
    assert callbacks[0].task_callback_type == TaskInstanceState.FAILED
    assert _mismatch_logs(session) == mismatch_logs_before + 1
    assert [try_number for try_number, _, _ in _history(session, ti)] == [1]
    assert _reschedule_rows(session, try_2_id) == 0, "try 2 inherited try 1's task_reschedule rows"
