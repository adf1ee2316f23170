# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
A try whose task runner a signal killed gets exactly one callback of its state (upstream #60858).

On the last try task-sdk 1.3.2's supervisor reports such a try ``failed`` through the execution API,
as it reports a runner that failed and ran its callback; LocalExecutor then sends its event with the
runner's exit code (``TaskRunnerExit``). The scheduler requests the failure callback once, unless the
try's audit-log rows show that another path already requested one or that the supervisor did not
report the state. On an earlier try the supervisor reports nothing (the executor event fails the
running try with its retry callback); ``up_for_retry`` comes only from the runner itself. What a real
supervisor sends: ``tests/unit/jobs/test_killed_task_runner_real_supervisor.py``.

Real test database; the execution API is Airflow's app in-process (``tests.unit.ti_race``), the
supervisor's reports are the requests task-sdk 1.3.2 sends. Callback requests are counted from the
``callback_request`` table the DAG processor reads.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import time_machine

from airflow import settings
from airflow.executors import base_executor
from airflow.utils.state import TaskInstanceState

from tests.unit.api_fastapi.execution_api.versions.head.test_task_instances_unreported_exit import (
    BOTH_CALLBACKS,
    FAILED,
    SUCCESS,
    T0,
    UP_FOR_RETRY,
    callbacks_of_try,
    committed_state,
    purge,
    report,
    running_try,
)
from tests.unit.harness.compat import duplicate_report_statuses
from tests.unit.harness.scheduler import process_events_of_dead_process

pytestmark = pytest.mark.db_test

P_KILLED = "Request-the-failure-callback-of-a-last-try-whose-task-runner-was-killed.patch"

SIGKILL_EXIT = -9
SIGTERM_EXIT = -15


def runner_exit(exit_code: int):
    """The event ``info`` LocalExecutor sends for a task runner that exited with ``exit_code``.

    Before the patch there is no ``TaskRunnerExit``: the bare exit code stands in for it (3.3.2's
    LocalExecutor sends no info at all), so the tests fail on their assertions, not on an import.
    """
    cls = getattr(base_executor, "TaskRunnerExit", None)
    return cls(exit_code) if cls is not None else exit_code


def executor_event(runner, ti, state: TaskInstanceState, info) -> None:
    """The executor's event for ``ti``'s try with ``info``, processed as the scheduler loop does.

    The try's process has ended: on series v3 the event of a try still running is handled once its
    heartbeat timed out (``process_events_of_dead_process``).
    """
    runner.executor.event_buffer[ti.key] = (state, info)
    with settings.NonScopedSession() as s:
        process_events_of_dead_process(runner, s)
        s.commit()


@pytest.mark.proves(P_KILLED)
def test_killed_runner_reported_by_supervisor_one_callback(dag_maker, session, api, scheduler_job_runner):
    """
    SIGKILL (OOM) of the runner on the last try: the supervisor reports ``failed``, LocalExecutor's
    event carries the exit code -9: exactly one failure callback; a repeated event adds none.
    """
    runner = scheduler_job_runner
    ti = running_try(
        dag_maker, session, "killed_failed", retries=1, try_number=2,
        queued_by_job_id=runner.job.id, **BOTH_CALLBACKS,
    )  # fmt: skip

    assert report(api, ti.id, "failed") == 204
    executor_event(runner, ti, SUCCESS, runner_exit(SIGKILL_EXIT))
    executor_event(runner, ti, SUCCESS, runner_exit(SIGKILL_EXIT))

    assert committed_state(ti) == FAILED
    assert callbacks_of_try(ti) == [FAILED]


@pytest.mark.guard
def test_runner_killed_after_it_reported_up_for_retry_gets_no_second_callback(
    dag_maker, session, api, scheduler_job_runner
):
    """
    ``up_for_retry`` reaches the server only from the runner itself (``RetryTask``; task-sdk 1.3.2's
    supervisor never sends it, ``tests/unit/jobs/test_killed_task_runner_real_supervisor.py``), which
    then runs ``on_retry_callback``: a runner killed after that (exit code -9) gets no second one.
    """
    runner = scheduler_job_runner
    ti = running_try(
        dag_maker, session, "killed_after_retry", retries=1, try_number=1,
        queued_by_job_id=runner.job.id, **BOTH_CALLBACKS,
    )  # fmt: skip

    assert report(api, ti.id, "up_for_retry") == 204
    executor_event(runner, ti, SUCCESS, runner_exit(SIGKILL_EXIT))

    assert committed_state(ti) == UP_FOR_RETRY
    assert callbacks_of_try(ti) == []


@pytest.mark.guard
@pytest.mark.parametrize("info", [None, 1], ids=["exit-0", "exit-1"])
def test_runner_that_reported_itself_gets_no_second_callback(
    dag_maker, session, api, scheduler_job_runner, info
):
    """
    The runner reported ``failed`` and ran its own callback: it exits 0 (no info), or 1 when it could
    not deliver the state to its supervisor after its callback ran (task-sdk's fail-closed exit). The
    supervisor reports ``failed``: no callback from the scheduler.
    """
    runner = scheduler_job_runner
    ti = running_try(
        dag_maker, session, f"self_reported_{info}", retries=1, try_number=2,
        queued_by_job_id=runner.job.id, **BOTH_CALLBACKS,
    )  # fmt: skip

    assert report(api, ti.id, "failed") == 204
    executor_event(runner, ti, SUCCESS, None if info is None else runner_exit(info))

    assert committed_state(ti) == FAILED
    assert callbacks_of_try(ti) == []


@pytest.mark.guard
def test_heartbeat_purge_then_killed_runner_event_one_callback(dag_maker, session, api, scheduler_job_runner):
    """
    The chaos-run combination: the purge requests the timed-out try's callback (and fails it, since
    "Fail heartbeat-timed-out tries in the same pass"); a late report of the state by the supervisor is
    then a duplicate the API accepts without writing (200; 204 before that patch; 3.2.x refuses it,
    409); the executor event with exit code -15 adds no second callback.
    """
    runner = scheduler_job_runner
    with time_machine.travel(T0, tick=False) as clock:
        ti = running_try(
            dag_maker, session, "purge_then_killed", retries=0, try_number=1,
            queued_by_job_id=runner.job.id, **BOTH_CALLBACKS,
        )  # fmt: skip
        session.close()
        clock.shift(timedelta(seconds=runner._task_instance_heartbeat_timeout_secs + 60))
        purge(runner)
        assert report(api, ti.id, "failed") in (204, *duplicate_report_statuses(200))
        executor_event(runner, ti, SUCCESS, runner_exit(SIGTERM_EXIT))

    assert committed_state(ti) == FAILED
    assert callbacks_of_try(ti) == [FAILED]


@pytest.mark.guard
@pytest.mark.parametrize(
    ("retries", "expected", "statuses"),
    [(0, FAILED, duplicate_report_statuses(200)), (1, UP_FOR_RETRY, (404,))],
    ids=["last", "earlier"],
)
def test_event_of_running_try_then_report_one_callback(
    dag_maker, session, api, scheduler_job_runner, retries, expected, statuses
):
    """
    The executor event of the killed runner is handled while the try is still running (a task killed
    externally: one callback); the supervisor's report then changes nothing (a duplicate of the
    state, 200 (409 on 3.2.x), or the retried try's id is gone, 404); the same event again adds none.
    """
    runner = scheduler_job_runner
    ti = running_try(
        dag_maker, session, f"event_then_report_{retries}", retries=retries, try_number=1,
        queued_by_job_id=runner.job.id, **BOTH_CALLBACKS,
    )  # fmt: skip

    executor_event(runner, ti, FAILED, runner_exit(SIGKILL_EXIT))
    assert report(api, ti.id, expected) in statuses
    executor_event(runner, ti, SUCCESS, runner_exit(SIGKILL_EXIT))

    assert committed_state(ti) == expected
    assert callbacks_of_try(ti) == [expected]


@pytest.mark.guard
def test_user_marked_failed_then_runner_stopped_no_callback(dag_maker, session, scheduler_job_runner):
    """
    A user marks the running try failed (no callback, as upstream documents); the supervisor's next
    heartbeat gets 409, it stops the runner with SIGTERM and reports nothing; the event's exit code
    -15 does not make the scheduler request a callback.
    """
    runner = scheduler_job_runner
    ti = running_try(
        dag_maker, session, "user_marked_then_stopped", retries=1, try_number=1,
        queued_by_job_id=runner.job.id, **BOTH_CALLBACKS,
    )  # fmt: skip

    dag_maker.serialized_dag.set_task_instance_state(
        task_id="t", run_id=ti.run_id, state=FAILED, session=session
    )
    session.commit()
    executor_event(runner, ti, SUCCESS, runner_exit(SIGTERM_EXIT))

    assert committed_state(ti) == FAILED
    assert callbacks_of_try(ti) == []


@pytest.mark.proves(P_KILLED)
def test_killed_runner_without_callbacks_requests_none_and_a_later_one_is_not_doubled(
    dag_maker, session, api, scheduler_job_runner
):
    """A task without callbacks gets no request; the log row records that the try was handled."""
    from sqlalchemy import select

    from airflow.models import Log

    runner = scheduler_job_runner
    ti = running_try(
        dag_maker, session, "killed_no_callbacks", retries=0, try_number=1, queued_by_job_id=runner.job.id
    )

    assert report(api, ti.id, "failed") == 204
    executor_event(runner, ti, SUCCESS, runner_exit(SIGKILL_EXIT))

    assert callbacks_of_try(ti) == []
    with settings.NonScopedSession() as s:
        events = s.scalars(
            select(Log.event).where(Log.dag_id == ti.dag_id, Log.try_number == ti.try_number)
        ).all()
    assert "task runner killed" in events


@pytest.mark.guard
def test_stuck_in_queued_then_killed_runner_one_failure_callback(dag_maker, session, scheduler_job_runner):
    """
    The stuck-in-queued handler fails the try with its failure callback; a worker that picks the
    workload up afterwards is refused by the API and its supervisor kills the runner (SIGKILL): the
    event with exit code -9 adds no second callback.
    """
    from airflow.models.taskinstance import TaskInstance as TI

    runner = scheduler_job_runner
    runner._num_stuck_queued_retries = 0
    ti = running_try(
        dag_maker, session, "stuck_then_killed", retries=0, try_number=1, state=TaskInstanceState.QUEUED,
        queued_by_job_id=runner.job.id, **BOTH_CALLBACKS,
    )  # fmt: skip
    ti = session.get(TI, ti.id)

    runner._maybe_requeue_stuck_ti(ti=ti, session=session, executor=runner.executor)
    session.commit()
    executor_event(runner, ti, SUCCESS, runner_exit(SIGKILL_EXIT))

    assert committed_state(ti) == FAILED
    assert callbacks_of_try(ti) == [FAILED]


@pytest.mark.proves(P_KILLED)
def test_killed_runner_event_of_a_row_another_transaction_holds_waits_for_no_lock(
    dag_maker, session, other_session, api, scheduler_job_runner, backend
):
    """
    Another transaction holds the killed try's row: the executor-event step does not wait for its lock
    (v2's patch waited in the batch, on SQLite for the busy timeout, and gave the event up) but skips the
    row with the batch's read and keeps the event; the next step, once the lock is gone, requests the
    failure callback. A lock wait in the step would fail on the lock timeout set here (5 s).
    """
    from sqlalchemy import select, text

    from airflow.models.taskinstance import TaskInstance as TI

    from tests.unit.harness.db import dialect_locks_rows, no_row_locks_reason

    if not dialect_locks_rows(session):
        pytest.skip(no_row_locks_reason(session))
    runner = scheduler_job_runner
    ti = running_try(
        dag_maker, session, "killed_locked", retries=0, try_number=1,
        queued_by_job_id=runner.job.id, **BOTH_CALLBACKS,
    )  # fmt: skip
    assert report(api, ti.id, "failed") == 204
    runner.executor.event_buffer[ti.key] = (SUCCESS, runner_exit(SIGKILL_EXIT))
    session.expunge_all()

    other_session.execute(select(TI.id).where(TI.id == ti.id).with_for_update())
    with settings.NonScopedSession() as s:
        if backend == "postgres":
            s.execute(text("SET LOCAL lock_timeout = '5s'"))
        else:
            s.execute(text("SET SESSION innodb_lock_wait_timeout = 5"))
        runner._process_executor_events(executor=runner.executor, session=s)
        s.commit()
    assert list(runner.executor.event_buffer) == [ti.key]
    assert callbacks_of_try(ti) == []

    other_session.rollback()
    executor_event(runner, ti, SUCCESS, runner_exit(SIGKILL_EXIT))
    assert callbacks_of_try(ti) == [FAILED]


P_KILLED_RUNNING = "Fail-a-running-try-at-the-event-of-its-killed-task-runner.patch"


def _rescheduled_once(session, ti) -> None:
    """An earlier poke of ``ti``'s try recorded UP_FOR_RESCHEDULE: a ``task_reschedule`` row of the try."""
    from airflow._shared.timezones import timezone as tz
    from airflow.models.taskreschedule import TaskReschedule

    now = tz.utcnow()
    session.add(
        TaskReschedule(
            ti.id,
            start_date=now - timedelta(seconds=10),
            end_date=now - timedelta(seconds=9),
            reschedule_date=now - timedelta(seconds=5),
        )
    )
    session.commit()


@pytest.mark.proves(P_KILLED_RUNNING)
@pytest.mark.parametrize("poked", [False, True], ids=["task", "later-poke"])
def test_runner_killed_on_an_earlier_try_fails_the_try_at_its_event(
    dag_maker, session, scheduler_job_runner, poked
):
    """
    Review defect 6: a signal kills the task runner of a try with a retry left (an OOM kill). task-sdk's
    supervisor reports nothing for it (``tests/unit/jobs/test_killed_task_runner_real_supervisor.py``),
    so the try is running, its heartbeat seconds old, when LocalExecutor's event (``success``, exit code
    -9) arrives. The event fails the try with its retry callback at once: for a plain task (the event of
    a running try that heartbeats was left to the heartbeat-timeout check, 300 s by default) and for a
    reschedule sensor's later poke (the try's ``task_reschedule`` row made the event stale). In the same
    step the event of another such try whose runner exited 0 or 1 (an earlier poke, another process)
    still leaves that try running.
    """
    runner = scheduler_job_runner
    name = "poke" if poked else "task"
    killed, other_0, other_1 = (
        running_try(
            dag_maker,
            session,
            f"{what}_{name}",
            retries=1,
            try_number=1,
            queued_by_job_id=runner.job.id,
            **BOTH_CALLBACKS,
        )  # fmt: skip
        for what in ("killed", "exit_0", "exit_1")
    )
    if poked:
        for ti in (killed, other_0, other_1):
            _rescheduled_once(session, ti)
    runner.executor.event_buffer[killed.key] = (SUCCESS, runner_exit(SIGKILL_EXIT))
    runner.executor.event_buffer[other_0.key] = (SUCCESS, None)
    runner.executor.event_buffer[other_1.key] = (SUCCESS, runner_exit(1))

    with settings.NonScopedSession() as s:  # at once: every try's heartbeat is fresh
        runner._process_executor_events(executor=runner.executor, session=s)
        s.commit()

    assert [committed_state(ti) for ti in (killed, other_0, other_1)] == [
        UP_FOR_RETRY,
        TaskInstanceState.RUNNING,
        TaskInstanceState.RUNNING,
    ]
    assert [callbacks_of_try(ti) for ti in (killed, other_0, other_1)] == [[UP_FOR_RETRY], [], []]
