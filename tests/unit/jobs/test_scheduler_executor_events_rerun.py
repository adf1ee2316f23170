# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
A database error the scheduler's own code swallows, or one in a callback's state update, holds back no other event.

Found by the review of the 3.4 queue's executor-events patch (docs/3.4.md, "A maintainer-style review of patches 3
and 8"), when it ran each event in a savepoint: (1) a database error inside the Dag lookup of an event (or of the
heartbeat-timeout purge) is swallowed by its ``except Exception``, the session then raises ``PendingRollbackError``
(not a ``DBAPIError``), and the scheduler exited; (2) a callback's state update, which ran outside the per-event
savepoints, rolled back the whole step every loop; (4) ``dag.test()``'s call of ``process_executor_events`` put back
an event whose savepoint rolled back, so it was retried forever instead of raising. The executor-events patch now
rolls back the step (or pass) and handles each event (or task instance) again in a transaction of its own.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import time_machine
from sqlalchemy import select

import airflow
from airflow import settings
from airflow._shared.timezones import timezone as tz
from airflow.models.taskinstance import TaskInstance
from airflow.utils.state import TaskInstanceState

from tests.unit.harness.compat import HAS_CALLBACK_EVENTS, put_back_key
from tests.unit.harness.env import BACKEND
from tests.unit.jobs.test_scheduler_executor_events_kept import (
    POISON,
    reject_updates,
    committed_callback_state,
    committed_ti,
    make_queued_callback,
    reject_updates_of,
)
from tests.unit.ti_race import ExecutionApi, executor_events_step, make_running_tis

P_KEEP = "Keep-executor-events-until-the-scheduler-s-transaction-commits-them.patch"
# 3.4's queue tells the executor of a try fail_fast stopped in a patch of its own (3.4's purge is #68008's).
P_FAIL_FAST_RELEASE = (
    "Tell-the-executor-of-a-timed-out-try-that-fail_fast-stopped-in-the-pass.patch"
    if airflow.__version__.startswith("3.4.")
    else P_KEEP
)

pytestmark = pytest.mark.db_test


def record_incr(monkeypatch) -> list[str]:
    """
    The counters the scheduler increments from now on, each name once per unit (``incr(name, 2)``: twice); the
    real ``stats.incr`` still runs.
    """
    from airflow.jobs import scheduler_job_runner as module

    names: list[str] = []
    stats = getattr(module, "stats", None) or module.Stats  # 3.2.x / 3.1.x: Stats
    real = stats.incr

    def incr(name, count=1, *args, **kwargs):
        names.extend([name] * count)
        return real(name, count, *args, **kwargs)

    monkeypatch.setattr(stats, "incr", incr)
    return names


def report_failed(api: ExecutionApi, ti_id) -> int:
    """``PATCH /task-instances/{id}/state`` ``failed``, as the supervisor's ``finish()`` sends it."""
    body = {"state": "failed", "end_date": tz.utcnow().isoformat()}
    with api.client() as client:
        response = client.patch(
            f"/task-instances/{ti_id}/state", json=body, headers={"Authorization": "Bearer in-process"}
        )
    return response.status_code


def failing_dag_lookup(monkeypatch, runner, dag_id: str) -> None:
    """
    The scheduler's Dag lookup for a run of ``dag_id`` hits a database error that it swallows: it writes a NULL into
    a NOT NULL column of the run and flushes, so the session's transaction is rolled back and its next use raises
    ``PendingRollbackError`` (as after a lost connection, or a log row autoflushed in the lookup).
    """
    real = runner.scheduler_dag_bag.get_dag_for_run

    def lookup(dag_run, session, **kwargs):
        if dag_run.dag_id == dag_id:
            dag_run.run_type = None
            session.flush()
        return real(dag_run=dag_run, session=session, **kwargs)

    monkeypatch.setattr(runner.scheduler_dag_bag, "get_dag_for_run", lookup)


def committed_states(key, *dag_ids: str) -> dict:
    """The committed state of each task instance of ``dag_ids``, by ``key`` (a ``TaskInstance`` column)."""
    with settings.NonScopedSession() as s:
        return dict(s.execute(select(key, TaskInstance.state).where(TaskInstance.dag_id.in_(dag_ids))).all())


@pytest.mark.proves(P_KEEP)
def test_db_error_swallowed_in_the_dag_lookup_holds_back_only_its_event(
    dag_maker, session, scheduler_job_runner, monkeypatch
):
    """
    Review finding 1: the FAILED event's Dag lookup fails in the database every time and the error is swallowed.
    The step does not raise (the scheduler would exit), the other event of the step is committed, and the
    failing one is back in the buffer (under the try's id on 3.4), its task instance still running.
    """
    runner = scheduler_job_runner
    executor = runner.executor
    queued, poison = make_running_tis(
        dag_maker, session, dag_id="lookup_error", task_ids=("queued", POISON), queued_by_job_id=runner.job.id
    )
    executor.event_buffer[queued.key] = (TaskInstanceState.QUEUED, "external-id-1")
    executor.event_buffer[poison.key] = (TaskInstanceState.FAILED, None)
    poison_key = put_back_key(poison.key, poison.id)
    session.expunge_all()
    failing_dag_lookup(monkeypatch, runner, "lookup_error")

    try:
        executor_events_step(runner)
    except Exception as e:
        pytest.fail(f"the executor-event step raised {e!r}: the scheduler would exit")

    assert committed_ti("lookup_error", "queued") == (TaskInstanceState.RUNNING, "external-id-1")
    assert committed_ti("lookup_error", POISON)[0] == TaskInstanceState.RUNNING
    assert list(executor.event_buffer) == [poison_key]


@pytest.mark.proves(P_KEEP)
def test_db_error_swallowed_in_the_purge_dag_lookup_holds_back_only_its_task_instance(
    dag_maker, session, scheduler_job_runner, monkeypatch
):
    """
    Review finding 1, the heartbeat-timeout purge: the Dag lookup of one of two timed-out task instances fails in
    the database every time and the error is swallowed. The pass does not raise, the other task instance is
    failed (for retry), and the failing one is still running, for a later pass.
    """
    runner = scheduler_job_runner
    with time_machine.travel(tz.utcnow(), tick=False) as clock:
        (ok,) = make_running_tis(dag_maker, session, dag_id="purge_ok", task_ids=("t",))
        (bad,) = make_running_tis(dag_maker, session, dag_id="purge_lookup_error", task_ids=("t",))
        for ti in (ok, bad):
            ti.queued_by_job_id = runner.job.id
            ti.last_heartbeat_at = tz.utcnow()
        session.commit()
        session.expunge_all()
        clock.shift(timedelta(seconds=runner._task_instance_heartbeat_timeout_secs + 60))
        failing_dag_lookup(monkeypatch, runner, "purge_lookup_error")

        try:
            runner._find_and_purge_task_instances_without_heartbeats()
        except Exception as e:
            pytest.fail(f"the heartbeat-timeout pass raised {e!r}: the scheduler would exit")

    assert committed_states(TaskInstance.dag_id, "purge_ok", "purge_lookup_error") == {
        "purge_ok": TaskInstanceState.UP_FOR_RETRY,
        "purge_lookup_error": TaskInstanceState.RUNNING,
    }


@pytest.mark.proves(P_FAIL_FAST_RELEASE)
def test_fail_fast_sibling_stopped_in_a_rerun_pass_is_released_by_the_executor(
    dag_maker, session, scheduler_job_runner
):
    """
    A fail_fast Dag's running ``t1`` and ``t3`` both timed out (their workers are gone), and a timed-out task instance
    of another Dag whose UPDATE the database rejects makes the heartbeat-timeout pass fail: it is rolled back and
    redone one task instance per pass. The pass of the first of ``t1`` / ``t3`` stops the other (fail_fast), and the
    other's pass still tells the executor, as the single pass does
    (``test_fail_fast_in_the_pass_releases_the_other_timed_out_try``); else the executor counts a try whose worker is
    gone as running until the scheduler restarts (a parallelism slot lost).
    """
    from airflow.providers.standard.operators.empty import EmptyOperator

    runner = scheduler_job_runner
    with time_machine.travel(tz.utcnow(), tick=False) as clock:
        with dag_maker("rerun_fail_fast", schedule=None, session=session, fail_fast=True):
            t1 = EmptyOperator(task_id="t1", retries=0)
            t1 >> EmptyOperator(task_id="t2", retries=0)
            EmptyOperator(task_id="t3", retries=0)
        dag_run = dag_maker.create_dagrun()
        siblings = [dag_run.get_task_instance(t, session=session) for t in ("t1", "t3")]
        (poison,) = make_running_tis(dag_maker, session, dag_id="rerun_fail_fast_other", task_ids=(POISON,))
        for ti in (*siblings, poison):
            ti.state = TaskInstanceState.RUNNING
            ti.try_number = 1
            ti.hostname = "worker-1"
            ti.start_date = ti.last_heartbeat_at = tz.utcnow()
            ti.queued_by_job_id = runner.job.id
        session.commit()
        keys = {ti.task_id: ti.key for ti in siblings}
        runner.executor.running.update([*keys.values(), poison.key])
        session.expunge_all()
        clock.shift(timedelta(seconds=runner._task_instance_heartbeat_timeout_secs + 60))
        with reject_updates_of(POISON):
            runner._find_and_purge_task_instances_without_heartbeats()

    assert committed_states(TaskInstance.task_id, "rerun_fail_fast", "rerun_fail_fast_other") == {
        "t1": TaskInstanceState.FAILED,
        "t2": TaskInstanceState.SKIPPED,
        "t3": TaskInstanceState.FAILED,
        POISON: TaskInstanceState.RUNNING,
    }
    leaked = sorted(task_id for task_id, key in keys.items() if key in runner.executor.running)
    assert not leaked, f"the executor still counts the stopped try of {leaked} as running"


# Without the executor-events patch the pass raises (no re-run); its re-run must not find the try (every base).
@pytest.mark.proves(P_KEEP)
def test_try_its_worker_failed_before_its_rerun_pass_is_not_handled_as_timed_out(
    api, dag_maker, session, scheduler_job_runner, monkeypatch
):
    """
    Review 2026-12-07 of the fail_fast fix above (its re-run scan also found FAILED tries). Two timed-out running tries; the pass fails on POISON's UPDATE and is rolled back. Before the re-runs, ``t``'s
    worker reports ``failed`` through the execution API (204). A pass that started now would not find ``t`` (not
    running): the re-run must not either. It tells the executor ``FAILED`` for ``t`` (LocalExecutor / Celery stop
    counting / tracking a workload whose process reports itself) and counts it as killed by the heartbeat timeout.
    """
    runner = scheduler_job_runner
    with time_machine.travel(tz.utcnow(), tick=False) as clock:
        (victim,) = make_running_tis(
            dag_maker, session, dag_id="rerun_worker_failed", task_ids=("t",), retries=0
        )
        (poison,) = make_running_tis(
            dag_maker, session, dag_id="rerun_worker_failed_other", task_ids=(POISON,)
        )
        for ti in (victim, poison):
            ti.queued_by_job_id = runner.job.id
            ti.last_heartbeat_at = tz.utcnow()
        session.commit()
        victim_id = victim.id
        runner.executor.running.update([victim.key, poison.key])
        session.expunge_all()
        clock.shift(timedelta(seconds=runner._task_instance_heartbeat_timeout_secs + 60))

        real = runner._find_and_purge_task_instances_without_heartbeats
        reported: list[int] = []

        def worker_fails_before_the_reruns(ti_ids=None):
            if ti_ids is None:  # the first pass (a base without re-runs has no ti_ids)
                return real()
            if not reported:
                reported.append(report_failed(api, victim_id))
                counters.clear()  # what the re-runs count, only
            return real(ti_ids=ti_ids)

        counters = record_incr(monkeypatch)
        monkeypatch.setattr(
            runner, "_find_and_purge_task_instances_without_heartbeats", worker_fails_before_the_reruns
        )
        with reject_updates_of(POISON):
            runner._find_and_purge_task_instances_without_heartbeats()

    assert reported == [204], "the worker's report"
    with settings.NonScopedSession() as s:
        states = dict(
            s.execute(
                select(TaskInstance.task_id, TaskInstance.state).where(
                    TaskInstance.dag_id.in_(("rerun_worker_failed", "rerun_worker_failed_other"))
                )
            ).all()
        )
    assert states == {"t": TaskInstanceState.FAILED, POISON: TaskInstanceState.RUNNING}
    told = [(key.task_id, state) for key, state, _ in runner.executor.state_changes]
    killed = counters.count("task_instances_without_heartbeats_killed")
    assert (told, killed) == ([], 0), "the re-runs handled the try its worker failed as a timed-out one"


@pytest.mark.skipif(
    not hasattr(TaskInstance, "complete_restart"),
    reason="3.4's purge notifies the listeners of a restarting try itself; before 3.4 handle_failure does, after the commit",
)
@pytest.mark.proves(P_KEEP)
def test_restarting_try_of_a_rerun_pass_is_notified_once(
    dag_maker, session, scheduler_job_runner, listener_manager
):
    """
    Two timed-out tries that a clear set restarting, one whose UPDATE the database rejects: the heartbeat-timeout
    pass is rolled back and redone one task instance per pass. The listeners hear of the one whose restart is
    committed, once, and never of the one whose restart was rolled back (the 3.4 purge notified them inline,
    before the commit: once per pass that ran it, committed or not).
    """
    from airflow.listeners import hookimpl

    class Recorder:
        def __init__(self):
            self.task_ids: list[str] = []

        @hookimpl
        def on_task_instance_failed(self, previous_state, task_instance, error):
            self.task_ids.append(task_instance.task_id)

    recorder = Recorder()
    listener_manager(recorder)
    runner = scheduler_job_runner
    with time_machine.travel(tz.utcnow(), tick=False) as clock:
        tis = make_running_tis(dag_maker, session, dag_id="rerun_restarting", task_ids=("ok", POISON))
        for ti in tis:
            ti.state = TaskInstanceState.RESTARTING
            ti.queued_by_job_id = runner.job.id
            ti.last_heartbeat_at = tz.utcnow()
        session.commit()
        session.expunge_all()
        clock.shift(timedelta(seconds=runner._task_instance_heartbeat_timeout_secs + 60))
        with reject_updates_of(POISON):
            runner._find_and_purge_task_instances_without_heartbeats()

    assert recorder.task_ids == ["ok"]


@pytest.mark.skipif(not HAS_CALLBACK_EVENTS, reason="no callback events on this base")
@pytest.mark.skipif(
    airflow.__version__.startswith("3.2.") and BACKEND == "sqlite",
    reason="3.2.x on SQLite cannot apply a callback's executor event (a StatementError in SQLAlchemy's Uuid "
    "bind of its str key; fixed upstream in 3.3), with or without the series",
)
@pytest.mark.proves(P_KEEP)
def test_callback_state_update_failing_every_loop_holds_back_no_other_event(
    dag_maker, session, scheduler_job_runner
):
    """
    Review finding 2: the database rejects a callback's state update every time. The step does not raise, the
    task instance's event of the same step is committed, and only the callback's event is back in the buffer.
    """
    from airflow.utils.state import CallbackState

    runner = scheduler_job_runner
    executor = runner.executor
    (ti,) = make_running_tis(
        dag_maker, session, dag_id="callback_error", task_ids=("queued",), queued_by_job_id=runner.job.id
    )
    callback_key = make_queued_callback(session)
    executor.event_buffer[callback_key] = (CallbackState.SUCCESS, None)
    executor.event_buffer[ti.key] = (TaskInstanceState.QUEUED, "external-id-1")
    session.expunge_all()

    with reject_updates("callback"):
        try:
            executor_events_step(runner)
        except Exception as e:
            pytest.fail(f"the executor-event step raised {e!r}: the scheduler would exit")

    assert committed_ti("callback_error", "queued") == (TaskInstanceState.RUNNING, "external-id-1")
    assert committed_callback_state(callback_key) == CallbackState.QUEUED
    assert list(executor.event_buffer) == [callback_key]


@pytest.mark.guard
def test_dag_test_event_processing_raises_a_database_error(dag_maker, session, scheduler_job_runner):
    """
    Review finding 4: ``dag.test()`` processes its executor's events with ``process_executor_events`` in its own
    session, with no scheduler loop to put events back for. A database error there raises (as on the release)
    instead of putting the event back, which ``dag.test()`` would retry forever.
    """
    from airflow.jobs.scheduler_job_runner import SchedulerJobRunner
    from airflow.models.dagbag import DBDagBag

    executor = scheduler_job_runner.executor
    (ti,) = make_running_tis(dag_maker, session, dag_id="dag_test_error", task_ids=(POISON,))
    executor.event_buffer[ti.key] = (TaskInstanceState.FAILED, None)
    session.expunge_all()

    with reject_updates_of(POISON):
        try:
            with pytest.raises(Exception, match="rejected by test trigger"):
                SchedulerJobRunner.process_executor_events(
                    executor=executor, job_id=None, scheduler_dag_bag=DBDagBag(), session=session
                )
        finally:
            session.rollback()  # its row locks, before the trigger is dropped
    assert executor.event_buffer == {}, "the event was put back: dag.test() would retry it forever"
