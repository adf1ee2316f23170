# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
Review of the operator tail's "Fail a running try at the event of its killed task runner" (2026-12-06).

The patch takes LocalExecutor's event of a running try whose task runner a signal killed
(``TaskRunnerExit`` with a negative exit code) as the live process's death. The event carries no pid and
no time, so the scheduler cannot tell the live process's runner from an earlier process of the same try
(same executor key). The xfail tests are what the patch gets wrong or leaves out; the other tests are the
scenarios the review tried and could not break.

Worker side: the real execution API in process (``PATCH /task-instances/{id}/run`` and ``/state``), as in
``test_scheduler_stale_executor_events``; the event is LocalExecutor's ``change_state`` with the runner's
exit code, as its ``_read_results`` passes it.
"""

from __future__ import annotations

import pytest
from sqlalchemy import select

from airflow.models.log import Log
from airflow.models.taskinstance import TaskInstance, clear_task_instances
from airflow.utils.state import TaskInstanceState

from tests.unit.api_fastapi.execution_api.versions.head.test_task_instances_unreported_exit import (
    BOTH_CALLBACKS,
    callbacks_of_try,
    committed_state,
    running_try,
)
from tests.unit.jobs.test_scheduler_killed_task_runner_callback import runner_exit
from tests.unit.jobs.test_scheduler_stale_executor_events import (
    _db_callbacks,
    _deferred_and_resumed,
    _first_poke_rescheduled,
    _make_deferrable,
    _make_sensors,
    _process_events,
    _reload,
    _second_poke_reaches,
)

pytestmark = pytest.mark.db_test


@pytest.fixture
def execution_api(api):
    """A client of the execution API app (the harness's ``api``), as the stale-event tests use it."""
    with api.client() as client:
        yield client


P_KILLED_RUNNING = "Fail-a-running-try-at-the-event-of-its-killed-task-runner.patch"

RUNNING = TaskInstanceState.RUNNING
SUCCESS = TaskInstanceState.SUCCESS
FAILED = TaskInstanceState.FAILED
UP_FOR_RETRY = TaskInstanceState.UP_FOR_RETRY

SIGKILL_EXIT = -9


def _killed_runner_event(runner, key) -> None:
    """LocalExecutor's event of a workload whose task runner SIGKILL ended (``_read_results``)."""
    runner.executor.change_state(key, SUCCESS, runner_exit(SIGKILL_EXIT))


def _state_mismatch_logs(session, ti) -> int:
    return len(
        session.scalars(select(Log.id).where(Log.dag_id == ti.dag_id, Log.event == "state mismatch")).all()
    )


@pytest.mark.xfail(
    strict=True,
    reason="patch 14 (admitted in its commit message): poke 1 of a reschedule sensor recorded its "
    "reschedule and its runner lingered (task-sdk 1.3.2's supervisor neither heartbeats nor applies "
    "task_success_overtime after RescheduleTask; LocalExecutor dispatches poke 2 of the same key while "
    "poke 1's workload runs); a signal then kills poke 1's runner: its event (-9) fails the live poke 2 "
    "(UP_FOR_RETRY, retry callback). Before the patch the event was stale by the task_reschedule row",
)
def test_earlier_poke_killed_after_its_reschedule_does_not_fail_the_running_poke(
    dag_maker, session, scheduler_job_runner, execution_api
):
    runner = scheduler_job_runner
    dag_run, (ti,) = _make_sensors(dag_maker, session, dag_id="review_poke_killed_late")
    _first_poke_rescheduled(session, runner, execution_api, dag_run, [ti])
    _second_poke_reaches(session, runner, execution_api, dag_run, [ti], RUNNING)
    live = _reload(session, ti)
    assert (live.state, live.try_number) == (RUNNING, 1)

    _killed_runner_event(runner, live.key)  # poke 1's runner, not poke 2's
    _process_events(runner, session)

    after = _reload(session, ti)
    assert (after.state, after.id) == (RUNNING, live.id), "the live poke was failed by poke 1's event"
    assert _db_callbacks(session) == 0


@pytest.mark.xfail(
    strict=True,
    reason="patch 14 leaves it out (said in its commit message, not shown by its test): the resumed attempt "
    "of a deferred try (next_method set) whose runner a signal killed still has its event taken as stale "
    "(the exit after defer()), so the try waits for the heartbeat timeout as before; the same evidence (an "
    "earlier process exits 0) that the patch accepts for a reschedule sensor's later poke",
)
def test_resumed_deferred_try_whose_runner_was_killed_fails_at_its_event(
    dag_maker, session, scheduler_job_runner, execution_api
):
    runner = scheduler_job_runner
    dag_run, (ti,) = _make_deferrable(dag_maker, session, dag_id="review_resumed_killed")
    _deferred_and_resumed(session, runner, execution_api, dag_run, [ti], RUNNING)
    live = _reload(session, ti)
    assert (live.state, live.next_method) == (RUNNING, "execute_complete")

    _killed_runner_event(runner, live.key)
    _process_events(runner, session)

    assert _reload(session, ti).state == UP_FOR_RETRY
    assert callbacks_of_try(live) == [UP_FOR_RETRY]


# ----------------------------------------------------------------------------------------------
# Scenarios tried that the patch handles (guards: they hold before and after it).
# ----------------------------------------------------------------------------------------------
@pytest.mark.guard
def test_killed_runner_event_of_an_earlier_try_leaves_the_running_try(
    dag_maker, session, scheduler_job_runner
):
    """Try 2 runs; the event of try 1's killed runner (same primary key) does not touch it."""
    runner = scheduler_job_runner
    ti = running_try(
        dag_maker, session, "review_try_mismatch", retries=2, try_number=2,
        queued_by_job_id=runner.job.id, **BOTH_CALLBACKS,
    )  # fmt: skip
    _killed_runner_event(runner, ti.key.with_try_number(1))
    _process_events(runner, session)

    assert committed_state(ti) == RUNNING
    assert callbacks_of_try(ti) == []


# The heartbeat rule's (patch 11's) behaviour, which patch 14 must keep for events without a TaskRunnerExit.
@pytest.mark.proves("Do-not-fail-a-running-try-that-still-heartbeats-on-an-executor-event.patch")
@pytest.mark.parametrize(
    "info", [SIGKILL_EXIT, "celery-task-id", None], ids=["bare-int", "celery-str", "none"]
)
def test_event_without_task_runner_exit_leaves_a_heartbeating_try(
    dag_maker, session, scheduler_job_runner, info
):
    """CeleryExecutor-style events (no ``TaskRunnerExit``; even a bare negative int): the heartbeat rule."""
    runner = scheduler_job_runner
    ti = running_try(
        dag_maker, session, f"review_celery_{info}", retries=1, try_number=1,
        queued_by_job_id=runner.job.id, **BOTH_CALLBACKS,
    )  # fmt: skip
    runner.executor.change_state(ti.key, SUCCESS, info)
    _process_events(runner, session)

    assert committed_state(ti) == RUNNING
    assert callbacks_of_try(ti) == []


@pytest.mark.guard
def test_killed_runner_of_a_cleared_running_try_resets_it_once(dag_maker, session, scheduler_job_runner):
    """
    A user clears the running try: it is RESTARTING under a new id, same try number; its supervisor's next
    heartbeat (old id) gets 404 and it kills the runner (SIGTERM, then SIGKILL: the runner's SIGTERM handler
    only calls on_kill). The event takes the release's RESTARTING path (reset for the next try), not the
    patch's: RESTARTING is not RUNNING.
    """
    runner = scheduler_job_runner
    ti = running_try(
        dag_maker, session, "review_cleared", retries=1, try_number=1,
        queued_by_job_id=runner.job.id, **BOTH_CALLBACKS,
    )  # fmt: skip
    clear_task_instances([session.get(TaskInstance, ti.id)], session)
    session.commit()
    cleared = _reload(session, ti)
    assert (cleared.state, cleared.try_number) == (TaskInstanceState.RESTARTING, 1)

    _killed_runner_event(runner, cleared.key)
    _process_events(runner, session)

    assert _reload(session, ti).state is None
    assert _state_mismatch_logs(session, ti) == 1


@pytest.mark.proves(P_KILLED_RUNNING)
@pytest.mark.parametrize(("retries", "expected"), [(1, UP_FOR_RETRY), (0, FAILED)], ids=["earlier", "last"])
def test_second_event_of_the_killed_try_adds_no_callback(
    dag_maker, session, scheduler_job_runner, retries, expected
):
    """
    The killed runner's event fails the running try once (on the last try: the supervisor's report of
    ``failed`` did not arrive); the same event again (a repeated drain) adds no second callback: neither the
    state-mismatch path (the try is no longer running) nor the killed-runner callback request of the first
    tail patch (the try's "state mismatch" log row).
    """
    runner = scheduler_job_runner
    ti = running_try(
        dag_maker, session, f"review_second_event_{retries}", retries=retries, try_number=1,
        queued_by_job_id=runner.job.id, **BOTH_CALLBACKS,
    )  # fmt: skip
    for _ in range(2):
        _killed_runner_event(runner, ti.key)
        _process_events(runner, session)

    assert committed_state(ti) == expected
    assert callbacks_of_try(ti) == [expected]
    assert _state_mismatch_logs(session, ti) == 1
