# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
Defects of the re-run design of the executor-events patch (no savepoints; a failed transaction is rolled back
and its work redone one event, or one timed-out task instance, per transaction), found by a review that tried
to break it (2026-12-07; its fail_fast finding is fixed: ``test_scheduler_executor_events_rerun.py``). Each test fails on the series as it is (a strict xfail: a known limit, not fixed; see
docs/series-v3.md) and would pass once its defect is fixed. 3.3.2's queue only (the review's base).

The database errors are real ones, raised by the database at a chosen point: a ``task_reschedule`` row for the
failing try's old id inserted right before its first UPDATE (``ForeignKeyViolationOnce``), a trigger
that rejects the UPDATE of one task instance (``reject_updates_of``).
"""

from __future__ import annotations

import threading
from datetime import datetime, timedelta

import pytest
import time_machine
from sqlalchemy import event, select

import airflow
from airflow import settings
from airflow.jobs import scheduler_job_runner as sjr
from airflow._shared.timezones import timezone
from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.utils.state import TaskInstanceState

from tests.unit.harness.compat import metrics_of
from tests.unit.jobs.test_scheduler_executor_events_kept import (
    POISON,
    committed_ti,
    reject_updates_of,
)
from tests.unit.jobs.test_scheduler_survives_failure_handling import ForeignKeyViolationOnce
from tests.unit.ti_race import executor_events_step, make_running_tis, read_rows

pytestmark = [
    pytest.mark.db_test,
    pytest.mark.skipif(
        not airflow.__version__.startswith("3.3.")
        or not hasattr(sjr, "FailureListenerThread")
        or not hasattr(sjr.SchedulerJobRunner, "_process_events_in_one_transaction"),
        reason="a review of the 3.3.2 queue's executor-events patch (its re-run design), at the full queue",
    ),
]


T0 = datetime(2026, 3, 2, 12, 0, 0, tzinfo=timezone.utc)
RUNNING = TaskInstanceState.RUNNING
FAILED = TaskInstanceState.FAILED
UP_FOR_RETRY = TaskInstanceState.UP_FOR_RETRY


def start_running(session, dag_run, runner, task_id: str):
    """The task instance as its worker leaves it while it runs (heartbeat now), committed."""
    ti = dag_run.get_task_instance(task_id, session=session)
    ti.state = RUNNING
    ti.try_number = 1
    ti.queued_by_job_id = runner.job.id
    ti.hostname = "worker-1"
    ti.start_date = timezone.utcnow()
    ti.last_heartbeat_at = timezone.utcnow()
    session.commit()
    return ti


def committed_states(dag_id: str) -> dict[str, str | None]:
    from airflow.models.taskinstance import TaskInstance as TI

    with settings.NonScopedSession() as s:
        return dict(s.execute(select(TI.task_id, TI.state).where(TI.dag_id == dag_id)).all())


@pytest.fixture
def counted(monkeypatch):
    """``(name, tags)`` of every metric the scheduler and failure handling count (the real ``incr`` still runs)."""
    from airflow.jobs import scheduler_job_runner as sjr

    calls: list[tuple[str, dict]] = []
    metrics = metrics_of(sjr)
    real_incr = metrics.incr

    def incr(name, *args, **kwargs):
        calls.append((name, dict(kwargs.get("tags") or {})))
        return real_incr(name, *args, **kwargs)

    monkeypatch.setattr(metrics, "incr", incr)
    return calls


def counts_of(calls, name: str) -> dict[str, int]:
    by_task: dict[str, int] = {}
    for metric, tags in calls:
        if metric == name:
            by_task[tags.get("task_id")] = by_task.get(tags.get("task_id"), 0) + 1
    return by_task


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="known limit: metrics (killed_externally, ti_failures, operator_failures) are counted inside the transaction, so a rolled-back attempt and its re-run both count (as a rolled-back savepoint did before)",
)
def test_failure_handled_again_after_a_rollback_is_counted_once(
    dag_maker, session, scheduler_job_runner, counted
):
    """
    The FAILED event of a try whose process died; its failure handling fails once (a database error at the
    UPDATE that gives the next try its id), so the step rolls back and handles the event again, which commits
    one failure. The metrics of that failure (``scheduler.tasks.killed_externally``, ``ti_failures``,
    ``operator_failures``) were already counted by the rolled-back attempt and are counted again: dashboards and
    alerts on them see two failures for one (every failure of a batch rolled back by a deadlock, twice).
    """
    runner = scheduler_job_runner
    (ti,) = make_running_tis(
        dag_maker, session, dag_id="counted_once", task_ids=("t",), queued_by_job_id=runner.job.id
    )
    runner.executor.event_buffer[ti.key] = (FAILED, None)
    old_id = ti.id
    session.expunge_all()

    injected = ForeignKeyViolationOnce([old_id])
    try:
        executor_events_step(runner)
    finally:
        injected.remove()
    assert injected.fired, "the failure handling did not fail"
    row = read_rows("counted_once", "t", ti.run_id)
    assert row.state == UP_FOR_RETRY and row.history_tries == [1], row  # one failure, committed

    for name in ("scheduler.tasks.killed_externally", "ti_failures", "operator_failures"):
        assert counts_of(counted, name) == {"t": 1}, f"{name} counted for a rolled-back attempt"


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="known limit: ti_failures is counted inside the heartbeat-timeout pass's transaction, so a rolled-back pass and its re-run both count",
)
def test_heartbeat_timeout_redone_after_a_rollback_is_counted_once(
    dag_maker, session, scheduler_job_runner, counted
):
    """
    Two timed-out tries in one heartbeat-timeout pass; the failure handling of the first fails once (a database
    error at its id rotation): the pass is rolled back and redone one task instance per pass, which commits one
    failure each. ``ti_failures`` of the first was counted by the rolled-back pass and is counted again.
    """
    runner = scheduler_job_runner
    with time_machine.travel(T0, tick=False) as clock:
        with dag_maker("hb_counted_once", session=session):
            EmptyOperator(task_id="a", retries=1)
            EmptyOperator(task_id="b", retries=1)
        dr = dag_maker.create_dagrun()
        ids = [start_running(session, dr, runner, t).id for t in ("a", "b")]
        session.close()
        clock.shift(timedelta(seconds=runner._task_instance_heartbeat_timeout_secs + 60))

        injected = ForeignKeyViolationOnce(ids)  # fires at the first UPDATE: a try's id rotation
        try:
            runner._find_and_purge_task_instances_without_heartbeats()
        finally:
            injected.remove()
    assert injected.fired, "the pass did not fail"
    assert committed_states("hb_counted_once") == {"a": UP_FOR_RETRY, "b": UP_FOR_RETRY}

    assert counts_of(counted, "ti_failures") == {"a": 1, "b": 1}, "ti_failures counted for a rolled-back pass"


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="known limit (cost): while an event fails the same way every loop, every loop's step rolls back once and redoes its events one per transaction",
)
def test_a_known_poison_event_does_not_split_every_later_batch(dag_maker, session, scheduler_job_runner):
    """
    An event whose handling the database rejects every time (a trigger rejects its task instance's UPDATE) is
    put back and handled again every loop. From then on every loop's batch fails on it, is rolled back, and all
    of that loop's events are handled again one per transaction: a loop of N events costs N + 1 transactions
    and repeats their statements, for as long as the poison event stays. An event that already failed alone
    can be handled on its own, and the others in one transaction: two transactions per loop.
    """
    runner = scheduler_job_runner
    executor = runner.executor
    tis = make_running_tis(
        dag_maker,
        session,
        dag_id="poison_cost",
        task_ids=(POISON, "q1", "q2", "q3", "q4"),
        queued_by_job_id=runner.job.id,
    )
    by_task = {ti.task_id: ti for ti in tis}
    executor.event_buffer[by_task[POISON].key] = (FAILED, None)
    executor.event_buffer[by_task["q1"].key] = (TaskInstanceState.QUEUED, "external-q1")
    session.expunge_all()
    session.close()

    thread = threading.current_thread()
    begun: list[int] = []
    statements: list[str] = []

    def on_begin(conn):
        if threading.current_thread() is thread:
            begun.append(1)

    def on_statement(conn, cursor, statement, parameters, context, executemany):
        if threading.current_thread() is thread:
            statements.append(statement)

    with reject_updates_of(POISON):
        executor_events_step(runner)  # loop 1: the poison event fails, alone too; q1 is committed
        assert list(executor.event_buffer) == [by_task[POISON].key]
        for t in ("q2", "q3", "q4"):
            executor.event_buffer[by_task[t].key] = (TaskInstanceState.QUEUED, f"external-{t}")
        event.listen(settings.engine, "begin", on_begin)
        event.listen(settings.engine, "before_cursor_execute", on_statement)
        try:
            executor_events_step(runner)  # loop 2
        finally:
            event.remove(settings.engine, "begin", on_begin)
            event.remove(settings.engine, "before_cursor_execute", on_statement)

    for t in ("q1", "q2", "q3", "q4"):
        assert committed_ti("poison_cost", t) == (RUNNING, f"external-{t}")
    assert list(executor.event_buffer) == [by_task[POISON].key]
    assert len(begun) <= 2, (
        f"loop 2 with a known poison event and 3 other events: {len(begun)} transactions, "
        f"{len(statements)} statements"
    )
