# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
A FAILED executor event from another process of a running try must not fail it (duplicate dispatch).

Every process of a try reports under the same executor key. When a try is dispatched twice (a Celery
broker redelivery, upstream #58441; SQS at-least-once delivery, #65708; PR #69336), the copy that
loses the race is refused by the execution API (``PATCH /run``: 409, the try is already running), its
supervisor raises ``TaskAlreadyRunningError`` and its executor reports ``FAILED`` for the key, while
the process that won runs on and heartbeats. 3.3.2 handles that event as a task killed externally and
fails the healthy try (failure/retry callback, ``handle_failure``).

The series holds such an event while the try heartbeats: dropped when the try's process heartbeats
after it arrived, applied (one callback, as before) when no heartbeat comes within
``([workers] max_failed_heartbeats + 1) * [workers] min_heartbeat_interval`` seconds. A process that
died with its last heartbeat still in flight is failed by the heartbeat-timeout purge.

Real test database; the worker side is Airflow's execution API in-process (``PATCH /run``,
``PUT /heartbeat``, ``PATCH /state`` as task-sdk 1.3.2's supervisor sends them), the executor is a real
``BaseExecutor`` (its ``fail()``), the scheduler side is ``SchedulerJobRunner._process_executor_events``
and ``_find_and_purge_task_instances_without_heartbeats`` on the scheduler loop's cadence, in simulated
time (time-machine). Callback requests are counted from the ``callback_request`` table.
"""

from __future__ import annotations

from datetime import timedelta

import httpx
import pytest
import time_machine
from sqlalchemy import func, select

from airflow import settings
from airflow._shared.timezones import timezone as tz
from airflow.configuration import conf
from airflow.models.log import Log
from airflow.models.taskinstance import TaskInstance as TI
from airflow.providers.standard.operators.empty import EmptyOperator

from tests.unit.api_fastapi.execution_api.versions.head.test_task_instances_unreported_exit import (
    BOTH_CALLBACKS,
    RUNNING,
    SUCCESS,
    T0,
    UP_FOR_RETRY,
    callbacks_of_try,
    committed_state,
    report,
)
from tests.unit.harness.series import carries
from tests.unit.harness.db import dialect_locks_rows
from tests.unit.harness.scheduler import failed_event_hold
from tests.unit.ti_race import ExecutionApi

pytestmark = pytest.mark.db_test

PATCH = "Hold-a-failed-executor-event-until-the-running-try-s-heartbeat-decides.patch"

WINNER = {"hostname": "worker-a", "pid": 1001}
LOSER = {"hostname": "worker-b", "pid": 2002}

# The scheduler loop's cadence in the simulation: executor events every second, the heartbeat-timeout
# scan every [scheduler] task_instance_heartbeat_timeout_detection_interval seconds.
LOOP = timedelta(seconds=1)


def heartbeat_timeout() -> timedelta:
    return timedelta(seconds=conf.getint("scheduler", "task_instance_heartbeat_timeout"))


def detection_interval() -> timedelta:
    return timedelta(
        seconds=conf.getfloat(
            "scheduler", "task_instance_heartbeat_timeout_detection_interval", fallback=10.0
        )
    )


def hold_limit() -> timedelta:
    """How long the patch holds the event without a heartbeat (its documented rule; defaults: 20 s)."""
    return failed_event_hold()


def start(api: ExecutionApi, ti_id, *, hostname: str, pid: int) -> httpx.Response:
    """``PATCH /task-instances/{id}/run`` as a supervisor sends it when its task runner starts."""
    body = {
        "state": "running",
        "hostname": hostname,
        "unixname": "airflow",
        "pid": pid,
        "start_date": tz.utcnow().isoformat(),
    }
    with api.client() as client:
        return client.patch(
            f"/task-instances/{ti_id}/run", json=body, headers={"Authorization": "Bearer in-process"}
        )


def queued_try(dag_maker, session, runner, dag_id: str, *, try_number: int = 1) -> TI:
    """Try ``try_number`` of task ``t`` (callbacks, a retry left) queued by this scheduler and taken by its executor."""
    with dag_maker(dag_id, session=session):
        EmptyOperator(task_id="t", retries=try_number, retry_delay=timedelta(seconds=1), **BOTH_CALLBACKS)
    dag_run = dag_maker.create_dagrun()
    ti = dag_run.get_task_instance("t", session=session)
    # What _executable_task_instances_to_queued writes, and the executor taking the workload.
    ti.state = "queued"
    ti.try_number = try_number
    ti.queued_by_job_id = runner.job.id
    ti.queued_dttm = tz.utcnow()
    session.commit()
    # The scheduler's create_session() shares this thread's scoped session: leave it no stale objects.
    session.close()
    runner.executor.running.add(ti.key)
    return ti


def scheduler_pass(runner, *, purge: bool = False) -> None:
    """One scheduler loop: the executor events (committed), and the heartbeat-timeout scan if due."""
    with settings.NonScopedSession() as s:
        runner._process_executor_events(executor=runner.executor, session=s)
        s.commit()
    if purge:
        runner._find_and_purge_task_instances_without_heartbeats()


def run_loop(runner, clock, ti: TI, *, until: timedelta) -> timedelta | None:
    """
    Run the scheduler loop second by second for ``until``; the time the try left RUNNING, or None.

    The heartbeat-timeout scan runs every detection interval, as the loop's timer runs it.
    """
    elapsed = timedelta()
    since_scan = timedelta()
    while elapsed < until:
        clock.shift(LOOP)
        elapsed += LOOP
        since_scan += LOOP
        scan = since_scan >= detection_interval()
        if scan:
            since_scan = timedelta()
        scheduler_pass(runner, purge=scan)
        if committed_state(ti) != RUNNING:
            return elapsed
    return None


def mismatch_logs(ti: TI) -> int:
    with settings.NonScopedSession() as s:
        return s.scalar(
            select(func.count())
            .select_from(Log)
            .where(Log.event == "state mismatch", Log.dag_id == ti.dag_id, Log.try_number == ti.try_number)
        )


def buffered(runner, ti: TI) -> bool:
    return ti.key in runner.executor.event_buffer


@pytest.mark.proves(PATCH)
def test_failed_event_of_duplicate_dispatch_does_not_fail_heartbeating_try(
    dag_maker, session, api, scheduler_job_runner
):
    """
    The try is dispatched twice: the winner starts and heartbeats, the loser is refused (409) and its
    executor reports FAILED. The event is held, then dropped when the winner heartbeats after it
    arrived; the try stays RUNNING, no callback; the winner later succeeds; the event is gone.
    """
    runner = scheduler_job_runner
    with time_machine.travel(T0, tick=False) as clock:
        ti = queued_try(dag_maker, session, runner, "duplicate_dispatch")
        assert start(api, ti.id, **WINNER).status_code == 200
        clock.shift(timedelta(seconds=2))
        loser = start(api, ti.id, **LOSER)
        # What task-sdk turns into TaskAlreadyRunningError: the loser never runs the task.
        assert loser.status_code == 409, loser.text
        assert loser.json()["detail"]["previous_state"] == "running"
        runner.executor.fail(ti.key)  # the loser's workload ended: its executor reports FAILED

        scheduler_pass(runner)  # the event arrives
        assert committed_state(ti) == RUNNING, "the duplicate's FAILED event failed the healthy try"
        assert buffered(runner, ti), "the event must be held until the try's heartbeat decides"

        clock.shift(timedelta(seconds=3))
        assert api.heartbeat(ti.id, **WINNER) == 204  # the winner heartbeats after the event arrived
        clock.shift(LOOP)
        scheduler_pass(runner)

        assert committed_state(ti) == RUNNING
        assert not buffered(runner, ti), "the event must be dropped once the live process heartbeated"
        # Nothing comes back later: no event, no failure, whatever time passes with heartbeats.
        for _ in range(3):
            clock.shift(hold_limit())
            assert api.heartbeat(ti.id, **WINNER) == 204
            scheduler_pass(runner, purge=True)
        assert committed_state(ti) == RUNNING
        assert report(api, ti.id, "success") == 204  # task-sdk's succeed() at the winner's end

    assert committed_state(ti) == SUCCESS
    assert callbacks_of_try(ti) == []
    assert mismatch_logs(ti) == 0
    assert runner.executor.event_buffer == {}


@pytest.mark.proves(PATCH)
def test_failed_event_of_dead_process_fails_try_once_after_hold(
    dag_maker, session, api, scheduler_job_runner
):
    """
    The try's only process dies (its supervisor killed: nothing reports the state) and its executor
    reports FAILED while the try's last heartbeat is recent. No heartbeat follows: the event is applied
    after the hold, with exactly one retry callback request (the task killed externally); the
    heartbeat-timeout scan later adds none. The delay is printed.
    """
    runner = scheduler_job_runner
    with time_machine.travel(T0, tick=False) as clock:
        ti = queued_try(dag_maker, session, runner, "dead_process")
        assert start(api, ti.id, **WINNER).status_code == 200
        clock.shift(timedelta(seconds=4))
        assert api.heartbeat(ti.id, **WINNER) == 204
        last_heartbeat = tz.utcnow()
        clock.shift(timedelta(seconds=3))  # the process dies; its executor reports it
        runner.executor.fail(ti.key)
        arrived = tz.utcnow()
        scheduler_pass(runner)
        assert committed_state(ti) == RUNNING, "held: the try heartbeated 3 s before the event"
        assert buffered(runner, ti)

        failed_after = run_loop(runner, clock, ti, until=heartbeat_timeout() + detection_interval())
        assert failed_after is not None, "the try whose process died was never failed"
        delay_from_arrival = tz.utcnow() - arrived
        delay_from_heartbeat = tz.utcnow() - last_heartbeat
        print(
            f"\nprocess died: failed {delay_from_arrival.total_seconds():.0f} s after its FAILED event "
            f"arrived, {delay_from_heartbeat.total_seconds():.0f} s after its last heartbeat (hold "
            f"{hold_limit().total_seconds():.0f} s, loop {LOOP.total_seconds():.0f} s; bound: heartbeat "
            f"timeout {heartbeat_timeout().total_seconds():.0f} s + detection interval "
            f"{detection_interval().total_seconds():.0f} s)"
        )
        assert hold_limit() <= delay_from_arrival <= hold_limit() + LOOP
        assert delay_from_heartbeat <= heartbeat_timeout() + detection_interval()

        # The heartbeat-timeout scan, long after: the try is no longer running, no second callback.
        clock.shift(heartbeat_timeout() + detection_interval())
        scheduler_pass(runner, purge=True)

    assert committed_state(ti) == UP_FOR_RETRY
    assert callbacks_of_try(ti) == [UP_FOR_RETRY]
    assert mismatch_logs(ti) == 1
    assert runner.executor.event_buffer == {}


@pytest.mark.proves(PATCH)
def test_last_heartbeat_in_flight_when_process_died_is_failed_by_heartbeat_timeout(
    dag_maker, session, api, scheduler_job_runner
):
    """
    The dying process's last heartbeat commits just after its FAILED event arrived (the request was in
    flight): the event is dropped as if another process reported it. Nothing heartbeats any more: the
    heartbeat-timeout scan fails the try with exactly one callback request, within the heartbeat timeout
    plus the detection interval of that last heartbeat. The delay is printed.
    """
    runner = scheduler_job_runner
    with time_machine.travel(T0, tick=False) as clock:
        ti = queued_try(dag_maker, session, runner, "in_flight_heartbeat")
        assert start(api, ti.id, **WINNER).status_code == 200
        clock.shift(timedelta(seconds=4))
        runner.executor.fail(ti.key)
        arrived = tz.utcnow()
        scheduler_pass(runner)
        assert committed_state(ti) == RUNNING
        clock.shift(LOOP)
        assert api.heartbeat(ti.id, **WINNER) == 204  # committed after the event arrived
        last_heartbeat = tz.utcnow()
        clock.shift(LOOP)
        scheduler_pass(runner)
        assert not buffered(runner, ti)
        assert committed_state(ti) == RUNNING

        failed_after = run_loop(runner, clock, ti, until=heartbeat_timeout() + 2 * detection_interval())
        assert failed_after is not None, "the try whose process died was never failed"
        delay_from_heartbeat = tz.utcnow() - last_heartbeat
        print(
            f"\nlast heartbeat in flight: failed by the heartbeat-timeout scan "
            f"{(tz.utcnow() - arrived).total_seconds():.0f} s after the FAILED event arrived, "
            f"{delay_from_heartbeat.total_seconds():.0f} s after the last heartbeat (bound: "
            f"{(heartbeat_timeout() + detection_interval()).total_seconds():.0f} s)"
        )
        assert delay_from_heartbeat <= heartbeat_timeout() + detection_interval()

    assert committed_state(ti) == UP_FOR_RETRY
    assert callbacks_of_try(ti) == [UP_FOR_RETRY]
    assert mismatch_logs(ti) == 0


@pytest.mark.proves(PATCH)
def test_heartbeat_between_batch_read_and_failure_lock_drops_the_event(
    dag_maker, session, api, scheduler_job_runner, monkeypatch
):
    """
    The hold ended without a heartbeat in the batch's read, but the live process heartbeats before the
    failure handling takes the try's row lock: the re-read under that lock sees the heartbeat and drops
    the event; nothing is written, no callback.
    """
    if dialect_locks_rows(session):
        pytest.skip(
            "the batch's FOR UPDATE SKIP LOCKED holds the try's row from the batch read to the failure "
            "handling's lock here, so a heartbeat cannot commit in between (it can where the batch read "
            "locks nothing: MariaDB, SQLite; or after an earlier event of the batch committed)"
        )
    runner = scheduler_job_runner
    with time_machine.travel(T0, tick=False) as clock:
        ti = queued_try(dag_maker, session, runner, "heartbeat_before_lock")
        assert start(api, ti.id, **WINNER).status_code == 200
        clock.shift(timedelta(seconds=2))
        runner.executor.fail(ti.key)
        scheduler_pass(runner)
        assert buffered(runner, ti)
        clock.shift(hold_limit() + LOOP)  # no heartbeat during the hold: the batch read finds none

        lock = TI._lock_for_failure_handling
        heartbeats: list[int] = []

        def heartbeat_then_lock(cls, ti_, *, session, **kwargs):
            if not heartbeats:  # the live process heartbeats after the batch read, before the lock
                heartbeats.append(api.heartbeat(ti_.id, **WINNER))
            return lock(ti_, session=session, **kwargs)

        monkeypatch.setattr(TI, "_lock_for_failure_handling", classmethod(heartbeat_then_lock))
        scheduler_pass(runner)

    assert heartbeats == [204]
    assert committed_state(ti) == RUNNING, "the try was failed although it heartbeated before the lock"
    assert not buffered(runner, ti)
    assert callbacks_of_try(ti) == []
    assert mismatch_logs(ti) == 0


@pytest.mark.proves(PATCH)
def test_held_event_of_try_whose_heartbeat_times_out_is_failed_by_the_scan_once(
    dag_maker, session, api, scheduler_job_runner
):
    """
    The event arrives when the try's last heartbeat is almost timed out: it is held, and the
    heartbeat-timeout scan fails the try before the hold ends, within the heartbeat timeout plus the
    detection interval of that heartbeat and with exactly one callback request; the held event then
    finds the try no longer running and sends nothing. The hold never delays a failure past the scan.
    """
    runner = scheduler_job_runner
    with time_machine.travel(T0, tick=False) as clock:
        ti = queued_try(dag_maker, session, runner, "held_then_timed_out")
        assert start(api, ti.id, **WINNER).status_code == 200
        last_heartbeat = tz.utcnow()
        clock.shift(heartbeat_timeout() - timedelta(seconds=5))
        runner.executor.fail(ti.key)
        arrived = tz.utcnow()
        scheduler_pass(runner)
        assert committed_state(ti) == RUNNING, "held: the try's last heartbeat is within the timeout"
        assert buffered(runner, ti)

        failed_after = run_loop(runner, clock, ti, until=hold_limit())
        assert failed_after is not None and failed_after < hold_limit(), "not failed before the hold ended"
        delay_from_heartbeat = tz.utcnow() - last_heartbeat
        print(
            f"\nheld, then timed out: failed by the heartbeat-timeout scan "
            f"{(tz.utcnow() - arrived).total_seconds():.0f} s after the FAILED event arrived, "
            f"{delay_from_heartbeat.total_seconds():.0f} s after the last heartbeat (bound: "
            f"{(heartbeat_timeout() + detection_interval()).total_seconds():.0f} s)"
        )
        assert delay_from_heartbeat <= heartbeat_timeout() + detection_interval()
        clock.shift(LOOP)
        scheduler_pass(runner)  # the held event: the try is no longer running

    assert committed_state(ti) == UP_FOR_RETRY
    assert callbacks_of_try(ti) == [UP_FOR_RETRY]
    assert mismatch_logs(ti) == 0
    assert runner.executor.event_buffer == {}


@pytest.mark.guard
@pytest.mark.skipif(not carries(PATCH), reason=f"{PATCH} is not in this base's queue (run where it is)")
def test_held_event_survives_a_late_event_of_an_earlier_try(dag_maker, session, api, scheduler_job_runner):
    """
    Try 2's only process dies; its FAILED event arrives while its last heartbeat is recent (held with
    this patch). During the hold the executor reports the exit of try 1's process (a late event of an
    earlier try of the same task instance). A pass picks one try number per task instance (the last in
    the buffer): the held event must come back in a later pass, not be discarded with the pass's buffer,
    so the dead try is still failed once within the hold (3.3.2 fails it in the pass the event arrives).
    Found by the session's breaker review.
    """
    runner = scheduler_job_runner
    with time_machine.travel(T0, tick=False) as clock:
        ti = queued_try(dag_maker, session, runner, "held_then_earlier_try_event", try_number=2)
        assert start(api, ti.id, **WINNER).status_code == 200
        clock.shift(timedelta(seconds=3))
        runner.executor.fail(ti.key)  # try 2's process died
        arrived = tz.utcnow()
        scheduler_pass(runner)

        clock.shift(LOOP)
        runner.executor.success(ti.key.with_try_number(1))  # try 1's late exit event
        scheduler_pass(runner)

        while tz.utcnow() - arrived <= hold_limit() + LOOP and committed_state(ti) == RUNNING:
            clock.shift(LOOP)
            scheduler_pass(runner)
        state = committed_state(ti)
        assert state == UP_FOR_RETRY, (
            f"try 2's FAILED event was lost during its hold: {hold_limit() + LOOP} after it arrived the "
            f"dead try is still {state} (buffer {runner.executor.event_buffer})"
        )
    assert callbacks_of_try(ti) == [UP_FOR_RETRY]


@pytest.mark.proves(PATCH)
def test_held_event_of_a_try_that_then_reschedules_leaves_the_buffer_without_failing_it(
    dag_maker, session, api, scheduler_job_runner
):
    """
    The case benchmark 3 (``--stale-heartbeats``, sqlite) left in the buffer after its 3 passes per
    batch (counted ``899/900`` there): the try's heartbeat is fresh when its FAILED event arrives (held),
    then the try reschedules. The next pass takes the event out of the buffer; it does not fail the
    rescheduled try, and no callback is requested: the event is applied once, as for any event of a
    task instance that is no longer running.
    """
    runner = scheduler_job_runner
    with time_machine.travel(T0, tick=False) as clock:
        ti = queued_try(dag_maker, session, runner, "held_then_rescheduled")
        assert start(api, ti.id, **WINNER).status_code == 200
        clock.shift(timedelta(seconds=2))
        assert api.heartbeat(ti.id, **WINNER) == 204
        runner.executor.fail(ti.key)
        scheduler_pass(runner)
        assert committed_state(ti) == RUNNING
        assert buffered(runner, ti), "held: the try heartbeated right before the event"

        clock.shift(LOOP)
        reschedule_date = (tz.utcnow() + timedelta(minutes=5)).isoformat()
        assert report(api, ti.id, "up_for_reschedule", reschedule_date=reschedule_date) == 204
        clock.shift(LOOP)
        scheduler_pass(runner)

        assert not buffered(runner, ti), "the held event must leave the buffer once the try rescheduled"
        assert committed_state(ti) == "up_for_reschedule"
        for _ in range(2):
            clock.shift(hold_limit())
            scheduler_pass(runner, purge=True)
        assert committed_state(ti) == "up_for_reschedule"
    assert callbacks_of_try(ti) == []
    assert runner.executor.event_buffer == {}


# Series v3 (core): the scheduler-side rule of upstream PR #69336 instead of v2's hold. An event for a running
# try whose last heartbeat is within the heartbeat timeout is dropped; the heartbeat-timeout check fails a
# try whose process died.
V3_PATCH = "Do-not-fail-a-running-try-that-still-heartbeats-on-an-executor-event.patch"


@pytest.mark.proves(V3_PATCH)
def test_event_of_a_refused_duplicate_leaves_the_heartbeating_try_running(
    dag_maker, session, api, scheduler_job_runner
):
    """
    The try is dispatched twice: the winner starts and heartbeats, the loser is refused (409) and its
    executor reports FAILED. The event is dropped: the try stays RUNNING through later passes and
    heartbeat-timeout scans while it heartbeats, and succeeds with no callback and no state-mismatch log.
    """
    runner = scheduler_job_runner
    with time_machine.travel(T0, tick=False) as clock:
        ti = queued_try(dag_maker, session, runner, "refused_duplicate")
        assert start(api, ti.id, **WINNER).status_code == 200
        clock.shift(timedelta(seconds=2))
        assert api.heartbeat(ti.id, **WINNER) == 204
        loser = start(api, ti.id, **LOSER)
        assert loser.status_code == 409, loser.text
        runner.executor.fail(ti.key)  # the loser's workload ended: its executor reports FAILED

        scheduler_pass(runner)
        assert committed_state(ti) == RUNNING, "the duplicate's FAILED event failed the healthy try"
        assert not buffered(runner, ti)
        for _ in range(3):
            clock.shift(detection_interval())
            assert api.heartbeat(ti.id, **WINNER) == 204
            scheduler_pass(runner, purge=True)
        assert committed_state(ti) == RUNNING
        assert report(api, ti.id, "success") == 204

    assert committed_state(ti) == SUCCESS
    assert callbacks_of_try(ti) == []
    assert mismatch_logs(ti) == 0
    assert runner.executor.event_buffer == {}


@pytest.mark.guard
@pytest.mark.skipif(not carries(V3_PATCH), reason=f"{V3_PATCH} is not in this base's queue (run where it is)")
def test_event_of_a_dead_process_is_left_to_the_heartbeat_timeout_check(
    dag_maker, session, api, scheduler_job_runner
):
    """
    The try's only process dies (nothing reports its state) 3 s after its last heartbeat and its executor
    reports FAILED. The try is failed once, with one retry callback request, by the heartbeat-timeout
    check within the heartbeat timeout plus the detection interval of that heartbeat (3.3.2 fails it in
    the pass the event arrives; what the rule costs is printed).
    """
    runner = scheduler_job_runner
    with time_machine.travel(T0, tick=False) as clock:
        ti = queued_try(dag_maker, session, runner, "dead_process_left_to_the_check")
        assert start(api, ti.id, **WINNER).status_code == 200
        clock.shift(timedelta(seconds=4))
        assert api.heartbeat(ti.id, **WINNER) == 204
        last_heartbeat = tz.utcnow()
        clock.shift(timedelta(seconds=3))
        runner.executor.fail(ti.key)
        failed_after = run_loop(runner, clock, ti, until=heartbeat_timeout() + 2 * detection_interval())
        assert failed_after is not None, "the try whose process died was never failed"
        delay = tz.utcnow() - last_heartbeat
        print(
            f"\nprocess died: failed {delay.total_seconds():.0f} s after its last heartbeat (bound: heartbeat "
            f"timeout {heartbeat_timeout().total_seconds():.0f} s + detection interval "
            f"{detection_interval().total_seconds():.0f} s)"
        )
        assert delay <= heartbeat_timeout() + detection_interval()
        clock.shift(heartbeat_timeout() + detection_interval())
        scheduler_pass(runner, purge=True)

    assert committed_state(ti) == UP_FOR_RETRY
    assert callbacks_of_try(ti) == [UP_FOR_RETRY]
    assert runner.executor.event_buffer == {}


@pytest.mark.guard
def test_event_of_a_try_whose_heartbeat_timed_out_fails_it_at_once(
    dag_maker, session, api, scheduler_job_runner
):
    """A FAILED event for a running try whose last heartbeat is older than the timeout fails it in that pass."""
    runner = scheduler_job_runner
    with time_machine.travel(T0, tick=False) as clock:
        ti = queued_try(dag_maker, session, runner, "heartbeat_timed_out_event")
        assert start(api, ti.id, **WINNER).status_code == 200
        clock.shift(heartbeat_timeout() + timedelta(seconds=1))
        runner.executor.fail(ti.key)
        scheduler_pass(runner)

    assert committed_state(ti) == UP_FOR_RETRY
    assert callbacks_of_try(ti) == [UP_FOR_RETRY]
    assert mismatch_logs(ti) == 1
