# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
One failure or retry callback request per try, whoever records the failure (upstream #60858).

The task process runs ``on_failure_callback`` / ``on_retry_callback`` itself, after it reported its
state to the supervisor. A task process killed by a signal (an OOM kill) never does: on its last
try the supervisor reports ``failed`` through the execution API (``ti_update_state``), the scheduler's
executor event then finds the state already set and nothing "killed externally", and no callback
runs at all. On an earlier try the supervisor reports nothing, and the executor event fails the
running try with a retry callback.

The rule: the writer that moves a try out of RUNNING (or QUEUED) requests its callback, in the
transaction of that state change, under the task instance's row lock:

* the task process itself when it reported the state (no request from the server);
* the execution API when the supervisor reports a state the process did not report: not with task-sdk
  1.3.2, whose report does not say so; instead the scheduler, when LocalExecutor's event says a signal
  killed the runner (``tests/unit/jobs/test_scheduler_killed_task_runner_callback.py``); an executor
  event without the exit code (CeleryExecutor) still leaves such a try without a callback (below), and
  so does a runner that gave up at start-up (DAG or task not found: exit code 1, on every executor;
  ``tests/unit/jobs/test_task_runner_startup_failure_real_supervisor.py``);
* the executor event of a try still running or queued ("killed externally");
* the heartbeat-timeout purge;
* the stuck-in-queued handler (failure callback);
* a user marking a task instance failed: no callback, as upstream documents.

Everything runs on the real test database; the execution API is Airflow's app in-process, its route
on its own session (:class:`tests.unit.ti_race.ExecutionApi`). Callback requests are counted from
the ``callback_request`` table the DAG processor reads.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
import time_machine
from sqlalchemy import select

from airflow import settings
from airflow._shared.timezones import timezone as tz
from airflow.callbacks.callback_requests import TaskCallbackRequest
from airflow.models.db_callback_request import DbCallbackRequest
from airflow.models.taskinstance import TaskInstance as TI
from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.utils.state import TaskInstanceState

from tests.unit.harness.scheduler import process_events_of_dead_process
from tests.unit.ti_race import ExecutionApi

pytestmark = pytest.mark.db_test

P_FAIL_SAME_PASS = "Fail-heartbeat-timed-out-tries-in-the-same-pass.patch"

RUNNING = TaskInstanceState.RUNNING
QUEUED = TaskInstanceState.QUEUED
FAILED = TaskInstanceState.FAILED
SUCCESS = TaskInstanceState.SUCCESS
UP_FOR_RETRY = TaskInstanceState.UP_FOR_RETRY

T0 = datetime(2026, 3, 2, 12, 0, 0, tzinfo=timezone.utc)


def on_failure(context):  # pragma: no cover - only its presence on the task matters
    """A task failure callback."""


def on_retry(context):  # pragma: no cover - only its presence on the task matters
    """A task retry callback."""


BOTH_CALLBACKS = {"on_failure_callback": on_failure, "on_retry_callback": on_retry}


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------
def report(api: ExecutionApi, ti_id, state: str, **fields) -> int:
    """
    ``PATCH /task-instances/{id}/state`` as the supervisor sends it at the end of a try.

    ``failed`` goes as a ``TITerminalStatePayload`` (the supervisor's ``finish()``), ``up_for_retry``
    as a ``TIRetryStatePayload``. Returns the status code.
    """

    body = {"state": state, "end_date": tz.utcnow().isoformat(), **fields}
    with api.client() as client:
        response = client.patch(
            f"/task-instances/{ti_id}/state", json=body, headers={"Authorization": "Bearer in-process"}
        )
    return response.status_code


def running_try(
    dag_maker,
    session,
    dag_id: str,
    *,
    retries: int,
    try_number: int,
    state: TaskInstanceState = RUNNING,
    queued_by_job_id: int | None = None,
    **task_kwargs,
) -> TI:
    """Task ``t`` of a new DAG run in ``state`` at ``try_number`` (heartbeat now), committed."""
    with dag_maker(dag_id, session=session):
        EmptyOperator(task_id="t", retries=retries, retry_delay=timedelta(seconds=1), **task_kwargs)
    dag_run = dag_maker.create_dagrun()
    ti = dag_run.get_task_instance("t", session=session)
    ti.state = state
    ti.try_number = try_number
    ti.queued_by_job_id = queued_by_job_id
    ti.hostname = "worker-1"
    ti.pid = 4242
    ti.start_date = tz.utcnow()
    ti.queued_dttm = tz.utcnow()
    ti.last_heartbeat_at = tz.utcnow()
    session.commit()
    return ti


def callbacks_of_try(ti: TI) -> list[TaskInstanceState]:
    """
    The callback each committed TaskCallbackRequest for the try ``ti`` is at makes the DAG processor
    run: ``UP_FOR_RETRY`` (on_retry_callback) or ``FAILED`` (on_failure_callback, also for a request
    without ``task_callback_type``, as the stuck-in-queued handler sends it).
    """
    with settings.NonScopedSession() as s:
        requests = [row.get_callback_request() for row in s.scalars(select(DbCallbackRequest))]
    return [
        UP_FOR_RETRY if r.task_callback_type == UP_FOR_RETRY else FAILED
        for r in requests
        if isinstance(r, TaskCallbackRequest)
        and (r.ti.dag_id, r.ti.task_id, r.ti.run_id, r.ti.map_index, r.ti.try_number)
        == (ti.dag_id, ti.task_id, ti.run_id, ti.map_index, ti.try_number)
    ]


def committed_state(ti: TI) -> str | None:
    with settings.NonScopedSession() as s:
        return s.scalar(
            select(TI.state).where(
                TI.dag_id == ti.dag_id, TI.task_id == ti.task_id, TI.run_id == ti.run_id, TI.map_index == -1
            )
        )


def executor_event(runner, ti: TI, state: TaskInstanceState) -> None:
    """
    The executor's event for ``ti``'s try, whose process ended (no heartbeat follows), processed as
    the scheduler loop does, committed (see ``process_events_of_dead_process``).
    """
    runner.executor.event_buffer[ti.key] = (state, None)
    with settings.NonScopedSession() as s:
        process_events_of_dead_process(runner, s)
        s.commit()


def purge(runner) -> None:
    """One pass of the heartbeat-timeout scan, as the scheduler loop's timer runs it."""
    runner._find_and_purge_task_instances_without_heartbeats()


# ----------------------------------------------------------------------------------------------
# The supervisor's report through the execution API
# ----------------------------------------------------------------------------------------------
@pytest.mark.guard
@pytest.mark.parametrize(
    ("state", "retries", "try_number"), [("failed", 1, 2), ("up_for_retry", 1, 1)], ids=["failed", "retry"]
)
def test_state_reported_by_task_process_gets_no_second_callback(
    dag_maker, session, api, state, retries, try_number
):
    """
    The task process reported the state itself (and then ran its callback): the supervisor's
    report leaves the try ``failed`` / ``up_for_retry`` (the retry with a new id) and the server
    requests no callback of its own.
    """
    ti = running_try(
        dag_maker, session, f"reported_{state}", retries=retries, try_number=try_number, **BOTH_CALLBACKS
    )

    assert report(api, ti.id, state) == 204

    assert committed_state(ti) == state
    assert callbacks_of_try(ti) == []


@pytest.mark.guard
def test_killed_process_reported_by_sdk_1_3_2_still_gets_no_callback(
    dag_maker, session, api, scheduler_job_runner
):
    """
    Known limitation, documented: task-sdk 1.3.2's supervisor reports the SIGKILLed last try as
    ``failed`` -- the same request as for a task process that failed and ran its callback -- and an
    executor that does not send the runner's exit code (CeleryExecutor: its Celery task returns
    nothing, the result is SUCCESS) reports ``success`` for the try. The server cannot tell the two
    apart: no callback (upstream #60858). LocalExecutor sends the exit code: see
    ``tests/unit/jobs/test_scheduler_killed_task_runner_callback.py``.
    """
    runner = scheduler_job_runner
    ti = running_try(
        dag_maker, session, "sdk_1_3_2_kill", retries=1, try_number=2,
        queued_by_job_id=runner.job.id, **BOTH_CALLBACKS,
    )  # fmt: skip

    assert report(api, ti.id, "failed") == 204
    executor_event(runner, ti, SUCCESS)

    assert committed_state(ti) == FAILED
    assert callbacks_of_try(ti) == []


# ----------------------------------------------------------------------------------------------
# The scheduler's own paths: one callback each
# ----------------------------------------------------------------------------------------------
@pytest.mark.guard
@pytest.mark.parametrize(
    ("retries", "try_number", "expected"), [(1, 1, UP_FOR_RETRY), (1, 2, FAILED)], ids=["earlier", "last"]
)
@pytest.mark.parametrize("event", [SUCCESS, FAILED], ids=["event-success", "event-failed"])
def test_executor_event_of_running_try_one_callback(
    dag_maker, session, scheduler_job_runner, retries, try_number, expected, event
):
    """
    A killed process the supervisor did not report (task-sdk <= 1.3.2 on an earlier try: it leaves
    UP_FOR_RETRY to the scheduler): the executor event finds the try running and fails it with one
    callback of the matching type; a second event of the same try adds none.
    """
    runner = scheduler_job_runner
    ti = running_try(
        dag_maker, session, f"event_{try_number}_{event}", retries=retries, try_number=try_number,
        queued_by_job_id=runner.job.id, **BOTH_CALLBACKS,
    )  # fmt: skip

    executor_event(runner, ti, event)
    executor_event(runner, ti, event)

    assert callbacks_of_try(ti) == [expected]


@pytest.mark.parametrize(
    "order",
    [
        # Before "Fail heartbeat-timed-out tries in the same pass" the purge left the try RUNNING and
        # the executor event then sent a second callback (#42553).
        pytest.param("purge-first", marks=pytest.mark.proves(P_FAIL_SAME_PASS)),
        pytest.param("event-first", marks=pytest.mark.guard),
    ],
)
def test_executor_event_and_heartbeat_purge_one_callback(dag_maker, session, scheduler_job_runner, order):
    """The chaos-run combination: the purge and the executor event of the same try, in either order."""
    runner = scheduler_job_runner
    with time_machine.travel(T0, tick=False) as clock:
        ti = running_try(
            dag_maker, session, f"event_and_purge_{order.split('-')[0]}", retries=0, try_number=1,
            queued_by_job_id=runner.job.id, **BOTH_CALLBACKS,
        )  # fmt: skip
        session.close()
        clock.shift(timedelta(seconds=runner._task_instance_heartbeat_timeout_secs + 60))
        if order == "purge-first":
            purge(runner)
            executor_event(runner, ti, FAILED)
        else:
            executor_event(runner, ti, FAILED)
            purge(runner)

    assert committed_state(ti) == FAILED
    assert callbacks_of_try(ti) == [FAILED]


@pytest.mark.guard
@pytest.mark.parametrize("retries", [0, 1], ids=["no-retries", "retries-left"])
def test_stuck_in_queued_one_failure_callback(dag_maker, session, scheduler_job_runner, retries):
    """
    Requeue attempts exhausted: the handler fails the try with one failure callback (upstream PR
    #53435, "Allow failure callbacks for stuck in queued TIs that fail"), also with retries left: it
    sets FAILED without a retry (upstream PR #43520), so the callback is the failure one, not the retry
    one. The executor's FAILED event for it (``executor.fail``) adds none.
    """
    runner = scheduler_job_runner
    runner._num_stuck_queued_retries = 0
    ti = running_try(
        dag_maker, session, f"stuck_in_queued_{retries}", retries=retries, try_number=1, state=QUEUED,
        queued_by_job_id=runner.job.id, **BOTH_CALLBACKS,
    )  # fmt: skip
    ti = session.get(TI, ti.id)

    runner._maybe_requeue_stuck_ti(ti=ti, session=session, executor=runner.executor)
    session.commit()
    executor_event(runner, ti, FAILED)

    assert committed_state(ti) == FAILED
    assert callbacks_of_try(ti) == [FAILED]


@pytest.mark.guard
def test_user_marked_failed_gets_no_server_callback(dag_maker, session, scheduler_job_runner):
    """
    A user marks a running try failed: no callback, as upstream documents for manual state changes.
    The supervisor then stops the process on its next heartbeat (409) and reports nothing; the
    executor event finds the try already failed.
    """
    runner = scheduler_job_runner
    ti = running_try(
        dag_maker, session, "user_marked_failed", retries=1, try_number=1,
        queued_by_job_id=runner.job.id, **BOTH_CALLBACKS,
    )  # fmt: skip

    dag_maker.serialized_dag.set_task_instance_state(
        task_id="t", run_id=ti.run_id, state=FAILED, session=session
    )
    session.commit()
    executor_event(runner, ti, SUCCESS)

    assert committed_state(ti) == FAILED
    assert callbacks_of_try(ti) == []
