# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
Failure handling declines a try another writer has already dealt with, and then writes nothing.

``TaskInstance._lock_for_failure_handling`` locks the task instance row by its ``id`` and
compares it with what the caller saw (upstream #71923, #42553). These tests drive the scheduler's
two failure paths (``_process_executor_events`` and the heartbeat-timeout purge) while another
connection changes the row at a chosen point:

* the task instance is deleted (its DAG run deleted by a user) after the batch or scan read it:
  nothing is written for it and the scheduler goes on (before: ``StaleDataError``, the scheduler
  loop exits);
* the worker commits SUCCESS after the purge revalidated the row (no row lock there: SQLite,
  MariaDB): no callback, email request, log row or executor FAILED for a try that did not fail;
* the try moved on (retried and running again, same state, new id and try number): the event
  of the old try does not fail the new one;
* the batch's ``set_state`` calls use the batch's session and do not commit it.

The other connection writes from a SQLAlchemy ``after_commit`` hook of the scheduler's session
(after the first event's failure handling committed, so the batch's row locks are released) or
from an ``after_cursor_execute`` hook on a chosen statement; nothing sleeps.
"""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import delete, event, func, select, update

from airflow import settings
from airflow._shared.timezones import timezone
from airflow.models.dagrun import DagRun
from airflow.models.log import Log
from airflow.models.serialized_dag import SerializedDagModel
from airflow.models.taskinstance import TaskInstance as TI, clear_task_instances
from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.utils.state import TaskInstanceState

from tests.unit.harness import env, series
from tests.unit.jobs import test_scheduler_heartbeat_timeout as heartbeat_tests
from tests.unit.jobs.test_scheduler_heartbeat_timeout import (
    EMAIL_KWARGS,
    RUNNING,
    committed_requests,
    committed_state,
    email_requests,
    failed_keys,
    on_failure,
    purge,
    task_callbacks,
)
from tests.unit.ti_race import WAIT, Pause, Worker, lock_waiters, make_running_tis, wait_until

PATCH = "Serialise-TI-failure-handling-with-the-execution-API-via-the-row-lock.patch"
# v3 takes no row lock on SQLite and MariaDB (``with_row_locks`` emits none there): there the executor-event patch
# (one transaction for the step, a savepoint per event) is what makes the batch tests pass (verify-series, 2026-12-05).
EVENTS_PATCH = (
    PATCH
    if env.BACKEND == "postgres" or not series.V3
    else "Keep-executor-events-until-their-effects-are-committed.patch"
)
# 3.4 (SQLite, MariaDB; PostgreSQL skips them): the batch tests of a try deleted or declined after the batch's read pass
# on the queue without the executor-events patch (verify-series, 2026-12-06): not vulnerable there.
EVENTS_BASE_OK = ("sqlite", "mysql") if hasattr(TI, "working_set") else ()

pytestmark = pytest.mark.db_test

# Fixtures shared with the heartbeat-timeout tests: frozen clock, a timed-out TI factory.
clock = heartbeat_tests.clock
timed_out_ti = heartbeat_tests.timed_out_ti

FAILED = TaskInstanceState.FAILED
SUCCESS = TaskInstanceState.SUCCESS
UP_FOR_RETRY = TaskInstanceState.UP_FOR_RETRY
# 3.4: a try failed for retry is archived; the current row, which rows() reads, is the next try (try 2, up_for_retry).
RETRIED = [(UP_FOR_RETRY, 2 if hasattr(TI, "working_set") else 1)]
RESTARTING = TaskInstanceState.RESTARTING

# The heartbeat purge's revalidation read (``_revalidate_task_instance_without_heartbeat``): before
# the row-lock patch, state, try number, heartbeat and job; with it, the whole row by id (the lock
# failure handling uses, taken once).
REVALIDATION = (
    r"SELECT task_instance\.state, task_instance\.try_number, task_instance\.last_heartbeat_at"
    r"|^\s*SELECT task_instance\.id, task_instance\.task_id\b.*\bFROM task_instance\s+WHERE task_instance\.id = "
)


def _on_retry(context):  # pragma: no cover - only its presence on the task matters
    pass


class AfterStatement:
    """Run ``action`` once, on this thread, right after its first statement matching ``pattern``."""

    def __init__(self, pattern: str, action) -> None:
        import re

        self.regex = re.compile(pattern, re.IGNORECASE | re.DOTALL)
        self.action = action
        self.thread = threading.current_thread()
        self.fired = False
        event.listen(settings.engine, "after_cursor_execute", self._after)

    def _after(self, conn, cursor, statement, parameters, context, executemany) -> None:
        if self.fired or threading.current_thread() is not self.thread or not self.regex.search(statement):
            return
        self.fired = True
        self.action()

    def remove(self) -> None:
        event.remove(settings.engine, "after_cursor_execute", self._after)


def two_failed_events(dag_maker, session, runner, prefix: str) -> dict[str, TI]:
    """Two running TIs in two DAG runs (two DAGs), a FAILED executor event for each; by dag_id."""
    tis = {}
    for name in ("a", "b"):
        (ti,) = make_running_tis(
            dag_maker,
            session,
            dag_id=f"{prefix}_{name}",
            queued_by_job_id=runner.job.id,
            on_retry_callback=_on_retry,
        )
        runner.executor.event_buffer[ti.key] = (FAILED, None)
        tis[ti.dag_id] = ti
    session.expunge_all()
    return tis


class OnFirstCommit:
    """Run ``action()`` (on its own connection) once, right after ``session``'s first commit."""

    def __init__(self, session, action) -> None:
        self.session = session
        self.action = action
        self.fired = False
        event.listen(session, "after_commit", self._after_commit)

    def _after_commit(self, session) -> None:
        # SQLAlchemy also fires after_commit when a savepoint is released: only a real commit counts.
        if not self.fired and session.get_nested_transaction() is None:
            self.fired = True
            self.action()

    def remove(self) -> None:
        event.remove(self.session, "after_commit", self._after_commit)


def mid_batch(session, action):
    """
    Run ``action`` (another connection's write) once, in the middle of the scheduler's executor-event batch.

    v2 queues: right after the first event's failure handling committed (which released the batch's row
    locks). Series v3 commits nothing before the batch ends: right after the batch's read, where that read
    locks no row (with_row_locks takes none on SQLite and MariaDB); on PostgreSQL the rows stay locked
    until the batch commits, so no other writer gets in and there is nothing to test.
    """
    if not series.V3:
        return OnFirstCommit(session, action)
    if env.BACKEND == "postgres":
        pytest.skip("series v3: the batch's locked read holds its rows until the batch commits (no window)")
    return AfterStatement(r"^\s*SELECT\b.*\bFROM task_instance\b", action)


def rows(dag_id: str) -> list:
    with settings.NonScopedSession() as s:
        return s.execute(select(TI.id, TI.state, TI.try_number).where(TI.dag_id == dag_id)).all()


def callbacks_of(dag_id: str) -> list:
    return [r for r in committed_requests() if getattr(r, "ti", None) and r.ti.dag_id == dag_id]


def running_dag_ids(dag_ids) -> list[str]:
    with settings.NonScopedSession() as s:
        return list(s.scalars(select(TI.dag_id).where(TI.dag_id.in_(dag_ids), TI.state == RUNNING)))


@pytest.mark.proves(EVENTS_PATCH, base_ok_on=EVENTS_BASE_OK)
def test_task_instance_deleted_mid_batch_is_skipped(dag_maker, session, scheduler_job_runner):
    """
    The DAG run of the second TI of an executor-event batch is deleted once the first event's
    failure handling committed. The second event finds no row: nothing is written for it, no
    callback is sent, the batch goes on. Before: ``refresh_from_db`` set ``state=None`` on the
    object and the next flush updated a missing row: ``StaleDataError``, out of the scheduler loop.
    """
    runner = scheduler_job_runner
    tis = two_failed_events(dag_maker, session, runner, "deleted_mid_batch")
    deleted: list[str] = []

    def delete_the_other() -> None:
        victim = sorted(running_dag_ids(tis))[-1]  # v3: both still running
        with settings.NonScopedSession() as s:
            s.execute(delete(TI).where(TI.dag_id == victim))
            s.execute(delete(DagRun).where(DagRun.dag_id == victim))
            s.commit()
        deleted.append(victim)

    hook = mid_batch(session, delete_the_other)
    try:
        runner._process_executor_events(executor=runner.executor, session=session)
        session.commit()
    finally:
        hook.remove()
    assert hook.fired and deleted, "the other write never ran in the batch"
    (victim,) = deleted
    (survivor,) = set(tis) - {victim}
    assert rows(victim) == []
    assert [(r.state, r.try_number) for r in rows(survivor)] == RETRIED
    assert callbacks_of(victim) == []
    assert len(callbacks_of(survivor)) == 1
    assert runner.executor.event_buffer == {}


@pytest.mark.skipif(
    hasattr(TI, "working_set"),
    reason="3.4: not adapted (retry preparation returns the next try as a row of its own; the test moves the "
    "archived one); a batch's stale read of an archived try is the row-lock patch's (declines it)",
)
@pytest.mark.proves(EVENTS_PATCH)
def test_event_of_a_try_that_moved_on_does_not_fail_the_new_try(dag_maker, session, scheduler_job_runner):
    """
    The second TI of the batch is retried and running again (new id, try 2, RUNNING: the state
    the batch saw) once the first event's failure handling committed. The FAILED event of try 1
    must not fail try 2. Before: the decline compared the state only, and ``refresh_from_db``
    (by dag/task/run/map index) re-read the new try: try 2 was failed and got a callback.
    """
    runner = scheduler_job_runner
    tis = two_failed_events(dag_maker, session, runner, "moved_on")
    moved: list[str] = []

    def retry_and_restart_the_other() -> None:
        victim = sorted(running_dag_ids(tis))[-1]  # v3: both still running
        with settings.NonScopedSession() as s:
            ti = s.scalars(select(TI).where(TI.dag_id == victim)).one()
            ti.prepare_db_for_next_try(s)
            ti.try_number = 2
            ti.state = RUNNING
            s.commit()
        moved.append(victim)

    hook = mid_batch(session, retry_and_restart_the_other)
    try:
        runner._process_executor_events(executor=runner.executor, session=session)
        session.commit()
    finally:
        hook.remove()
    assert hook.fired and moved
    (victim,) = moved
    (survivor,) = set(tis) - {victim}
    assert [(r.state, r.try_number) for r in rows(victim)] == [(RUNNING, 2)]
    assert callbacks_of(victim) == []
    assert [(r.state, r.try_number) for r in rows(survivor)] == RETRIED
    assert len(callbacks_of(survivor)) == 1


class CommitCounter:
    def __init__(self, session) -> None:
        self.session = session
        self.commits = 0
        event.listen(session, "after_commit", self._count)

    def _count(self, session) -> None:
        # SQLAlchemy also fires after_commit when a savepoint is released: only a real commit counts.
        if session.get_nested_transaction() is None:
            self.commits += 1

    def remove(self) -> None:
        event.remove(self.session, "after_commit", self._count)


# Series v3: the batch's set_state gets the session in the executor-event patch.
@pytest.mark.proves(
    "Keep-executor-events-until-the-scheduler-s-transaction-commits-them.patch" if series.V3 else PATCH
)
@pytest.mark.parametrize("case", ["restarting_success", "dag_not_found"])
def test_executor_event_set_state_does_not_commit_the_batch(dag_maker, session, scheduler_job_runner, case):
    """
    ``_process_executor_events`` sets the state of a cleared TI whose process ended (RESTARTING +
    SUCCESS) and of a TI whose DAG is gone (marked with the event's state) with ``set_state``.
    Given the batch's session, that is a flush: the batch's transaction (and the row lock taken
    for the event) is not committed, and the session is not closed. Before: ``set_state`` without
    ``session`` committed and closed the thread's scoped session, the batch's own.
    """
    if case == "restarting_success" and hasattr(TI, "working_set"):
        pytest.skip(
            "3.4: a cleared try whose process ended is released by complete_restart, which flushes only"
        )
    runner = scheduler_job_runner
    (ti,) = make_running_tis(dag_maker, session, dag_id=f"set_state_{case}", queued_by_job_id=runner.job.id)
    if case == "restarting_success":
        ti.state = RESTARTING
        session.commit()
        runner.executor.event_buffer[ti.key] = (SUCCESS, None)
        expected = None
    else:
        runner.executor.event_buffer[ti.key] = (FAILED, None)
        expected = FAILED
        with settings.NonScopedSession() as s:
            s.execute(delete(SerializedDagModel).where(SerializedDagModel.dag_id == ti.dag_id))
            s.commit()
    dag_id = ti.dag_id
    session.expunge_all()
    other = session.scalars(
        select(DagRun).where(DagRun.dag_id == dag_id)
    ).one()  # held by the batch's session

    counter = CommitCounter(session)
    try:
        runner._process_executor_events(executor=runner.executor, session=session)
    finally:
        counter.remove()
    assert counter.commits == 0, "the batch's session was committed by set_state"
    assert other in session, "the batch's session was closed"
    session.commit()
    assert [r.state for r in rows(dag_id)] == [expected]


# ---------------------------------------------------------------------------------------------
# The heartbeat-timeout purge
# ---------------------------------------------------------------------------------------------
def skip_where_the_scan_locks(session) -> None:
    if env.BACKEND != "sqlite":
        pytest.skip(
            "revalidation's FOR UPDATE SKIP LOCKED (a real lock on MariaDB too, not with_row_locks) "
            "holds the row until the purge commits: another writer waits, there is no window "
            "(tests of the row-lock patch)"
        )
    if _sqlite_write_lock_at("revalidation"):
        pytest.skip(
            "sqlite: revalidation takes the database's write lock (BEGIN IMMEDIATE, "
            "Read-a-failing-task-instance-under-SQLite-s-write-lock.patch) and holds it until the purge "
            "commits: another writer waits, there is no window"
        )


def _sqlite_write_lock_at(where: str) -> bool:
    """
    Whether the tree under test takes SQLite's write lock at failure handling's check (patch 19), and, for
    ``where="revalidation"``, already at the purge's revalidation (its 3.3.2 / 3.2.2 shape, which reads the
    row through ``TaskInstance._lock_and_read_row``; the 3.1.8 queue's revalidation reads without it).
    """
    from airflow.models import taskinstance

    if not hasattr(taskinstance, "_lock_sqlite_database"):
        return False
    return where != "revalidation" or hasattr(TI, "_lock_and_read_row")


# SQLite only (skip_where_the_scan_locks): on v3 the purge patch brings the re-read that declines the row.
@pytest.mark.proves("Fail-heartbeat-timed-out-tries-in-the-same-pass.patch" if series.V3 else PATCH)
def test_heartbeat_purge_skips_task_instance_deleted_after_revalidation(
    dag_maker, session, scheduler_job_runner, clock, timed_out_ti
):
    """
    Where the purge takes no row lock before failing a TI (SQLite; on MariaDB revalidation locks
    the row too), the TI's DAG run is deleted after revalidation read it. Nothing is written or sent for it and the purge ends
    normally. Before: failure handling's ``refresh_from_db`` set ``state=None`` and the commit
    flushed an UPDATE of the missing row: ``StaleDataError`` out of the scheduler loop.
    """
    skip_where_the_scan_locks(session)
    runner = scheduler_job_runner
    dr, ti_id = timed_out_ti("hb_deleted", on_failure_callback=on_failure, retries=1, **EMAIL_KWARGS)

    def delete_run() -> None:
        with settings.NonScopedSession() as s:
            s.execute(delete(TI).where(TI.id == ti_id))
            s.execute(delete(DagRun).where(DagRun.id == dr.id))
            s.commit()

    hook = AfterStatement(REVALIDATION, delete_run)
    try:
        purge(runner)
    finally:
        hook.remove()
    assert hook.fired
    assert rows("hb_deleted") == []
    assert callbacks_of("hb_deleted") == []
    assert failed_keys(runner) == []


def heartbeat_logs(dag_id: str) -> int:
    with settings.NonScopedSession() as s:
        return s.scalar(
            select(func.count())
            .select_from(Log)
            .where(Log.dag_id == dag_id, Log.event == "heartbeat timeout")
        )


@pytest.mark.skipif(
    series.V3 and env.BACKEND == "sqlite",
    reason="series v3 has no SQLite write-lock patch: on SQLite the window between failure handling's re-read and its write stays open (README, known limitations)",
)
@pytest.mark.proves(PATCH)
def test_heartbeat_purge_writes_nothing_for_a_try_that_succeeded_after_revalidation(
    dag_maker, session, scheduler_job_runner, clock, timed_out_ti
):
    """
    Where revalidation is a plain read (SQLite), the worker commits SUCCESS right after
    it. The try did not fail: no callback, no email request, no "heartbeat timeout" log row, the
    executor is not told FAILED, the TI stays SUCCESS. Before: the callback, email request and
    log row were added, ``handle_failure`` declined and committed them (and the purge told the
    executor FAILED).
    """
    skip_where_the_scan_locks(session)
    runner = scheduler_job_runner
    dr, ti_id = timed_out_ti("hb_succeeded", on_failure_callback=on_failure, retries=1, **EMAIL_KWARGS)

    def worker_succeeds() -> None:
        with settings.NonScopedSession() as s:
            s.execute(update(TI).where(TI.id == ti_id).values(state=SUCCESS, end_date=timezone.utcnow()))
            s.commit()

    hook = AfterStatement(REVALIDATION, worker_succeeds)
    try:
        purge(runner)
    finally:
        hook.remove()
    assert hook.fired
    assert committed_state(dr, "t") == SUCCESS
    assert task_callbacks("t") == []
    assert email_requests("t") == []
    assert heartbeat_logs("hb_succeeded") == 0
    assert failed_keys(runner) == []


@pytest.mark.skipif(
    series.V3 and env.BACKEND == "sqlite",
    reason="series v3 has no SQLite write-lock patch: on SQLite the window between failure handling's re-read and its write stays open (README, known limitations)",
)
@pytest.mark.proves(PATCH)
@pytest.mark.backend("sqlite")
def test_heartbeat_purge_rolls_back_when_failure_handling_declines(
    dag_maker, session, scheduler_job_runner, clock, timed_out_ti
):
    """
    SQLite has no row locks: the worker can still commit SUCCESS between the purge's own check of
    the row and failure handling's check, after the callback, email request and log row were
    added. ``handle_failure`` then declines without committing, and the purge rolls back what it
    added for the TI: nothing is committed, the executor is not told FAILED.
    """
    if _sqlite_write_lock_at("check"):
        pytest.skip(
            "sqlite: failure handling's check takes the database's write lock (BEGIN IMMEDIATE, "
            "Read-a-failing-task-instance-under-SQLite-s-write-lock.patch) and holds it until the purge "
            "commits: the worker's commit after it waits, there is no window"
        )
    runner = scheduler_job_runner
    dr, ti_id = timed_out_ti("hb_declined", on_failure_callback=on_failure, retries=1, **EMAIL_KWARGS)

    def worker_succeeds() -> None:
        with settings.NonScopedSession() as s:
            s.execute(update(TI).where(TI.id == ti_id).values(state=SUCCESS, end_date=timezone.utcnow()))
            s.commit()

    # The purge's check of the row (_lock_for_failure_handling): the whole row, by id.
    hook = AfterStatement(
        r"^\s*SELECT task_instance\.id, task_instance\.task_id\b.*\bFROM task_instance\s+WHERE task_instance\.id = ",
        worker_succeeds,
    )
    try:
        purge(runner)
    finally:
        hook.remove()
    assert hook.fired, "the purge did not check the row before failing it"
    assert committed_state(dr, "t") == SUCCESS
    assert task_callbacks("t") == []
    assert email_requests("t") == []
    assert heartbeat_logs("hb_declined") == 0
    assert failed_keys(runner) == []


# ---------------------------------------------------------------------------------------------
# Concurrent clears of overlapping sets
# ---------------------------------------------------------------------------------------------
def _two_clears_in_opposite_orders_finish(dag_maker, session, dag_id: str) -> None:
    """Clear a and b, and b and a, at once (the first paused at its first row lock); both must finish."""
    with dag_maker(dag_id, session=session):
        EmptyOperator(task_id="a")
        EmptyOperator(task_id="b")
    dr = dag_maker.create_dagrun()
    for ti in dr.get_task_instances(session=session):
        ti.state = SUCCESS
    session.commit()
    run_id = dr.run_id

    def clear(order):
        def fn():
            s = settings.Session()
            try:
                by_task = {
                    ti.task_id: ti
                    for ti in s.scalars(select(TI).where(TI.dag_id == dag_id, TI.run_id == run_id))
                }
                clear_task_instances([by_task[t] for t in order], s)
                s.commit()
            finally:
                s.rollback()
                settings.Session.remove()

        return fn

    first = Worker(clear(["a", "b"]), name="clear-a-b")
    second = Worker(clear(["b", "a"]), name="clear-b-a")
    paused = Pause(r"\bFOR UPDATE\b", thread=first)
    try:
        first.start()
        assert paused.reached.wait(WAIT), "the first clear took no row lock"
        second.start()
        wait_until(
            lambda: second.done.is_set() or lock_waiters() > 0,
            "the second clear waits for a row lock or ends",
        )
        paused.release()
        first.join_or_fail()
        second.join_or_fail()
    finally:
        paused.release()
        paused.remove()
    assert first.error is None, f"the first clear raised {first.error!r}"
    assert second.error is None, f"the second clear raised {second.error!r}"
    with settings.NonScopedSession() as s:
        states = s.execute(select(TI.task_id, TI.state).where(TI.dag_id == dag_id)).all()
    assert sorted(states) == [("a", None), ("b", None)]


@pytest.mark.proves("Lock-task-instance-rows-before-clearing-them.patch" if series.V3 else PATCH)
@pytest.mark.backend("postgres", "mysql")
def test_concurrent_clears_of_overlapping_sets_finish(dag_maker, session, backend):
    """
    Two clears of the same two task instances, given in opposite orders. The first clear stops
    right after its first row lock; the second then starts and waits for a row lock. Both must
    finish without error. Before: retry preparation locked the rows in list order (first clear
    holds a, waits for b; second holds b, waits for a): a deadlock, one clear fails
    (PostgreSQL ``DeadlockDetected``, MariaDB 1213).
    """
    if backend == "mysql" and hasattr(TI, "working_set"):
        pytest.skip(
            "MariaDB, 3.4: with_row_locks takes no row lock there, so the clears still deadlock (1213, 3 of 3 "
            "runs on 2026-12-06) at archive()'s FOR UPDATE, taken in the order of each clear's list; in key "
            "order the second clear re-reads the first's try unlocked and fails (archived already)"
        )
    if backend == "mysql":
        pytest.skip(
            "MariaDB: the clears still deadlock now and then (1213 in the second clear, 1 of 5 full "
            "tests-mysql runs on 2026-12-01, after the ordered FOR UPDATE; cause not found; not checked "
            "on MySQL 8): see README, Known limitations"
        )
    _two_clears_in_opposite_orders_finish(dag_maker, session, "concurrent_clears")


@pytest.mark.backend("postgres")
@pytest.mark.skipif(not hasattr(TI, "working_set"), reason="3.4 only: the clear lock of the 3.4 queue")
@pytest.mark.xfail(
    strict=True,
    reason="Lock-task-instance-rows-before-clearing-them.patch (3.4): the clear's key-order lock is taken "
    "with with_row_locks, so [scheduler] use_row_level_locking = False drops it, while archive()'s "
    "FOR UPDATE (with_for_update) still locks in each caller's list order: the concurrent clears deadlock",
)
def test_concurrent_clears_finish_without_scheduler_row_level_locking(dag_maker, session, monkeypatch):
    """
    As test_concurrent_clears_of_overlapping_sets_finish, with ``[scheduler] use_row_level_locking =
    False`` (read once at import into ``airflow.utils.sqlalchemy.USE_ROW_LEVEL_LOCKING``). The setting
    is the scheduler's (one scheduler, no HA), yet clears come from the API and CLI whatever it is.
    """
    import airflow.utils.sqlalchemy as sqla_utils

    monkeypatch.setattr(sqla_utils, "USE_ROW_LEVEL_LOCKING", False)
    _two_clears_in_opposite_orders_finish(dag_maker, session, "concurrent_clears_no_rll")


@pytest.mark.proves(
    "Keep-executor-events-until-the-scheduler-s-transaction-commits-them.patch", base_ok_on=EVENTS_BASE_OK
)
@pytest.mark.parametrize("kind", [TaskInstanceState.QUEUED, RUNNING, SUCCESS, FAILED])
def test_a_deleted_task_instance_under_any_event_kind_does_not_end_the_loop(
    dag_maker, session, scheduler_job_runner, kind
):
    """
    Issue 30, defect 2: the DAG run of the second TI of the batch is deleted after the batch read it, and
    that TI's executor event is of any kind (QUEUED/RUNNING set ``external_executor_id``, a write of its own).
    No step of the scheduler loop raises; within two steps the other TI is failed once with one callback,
    nothing is written for the deleted one and no event is left. Before the executor-event patch the
    flush of the missing row raised ``StaleDataError`` out of the step (the scheduler exits).
    """
    from tests.unit.ti_race import executor_events_step

    runner = scheduler_job_runner
    tis = two_failed_events(dag_maker, session, runner, f"deleted_{kind.value}")
    victim = sorted(tis)[-1]
    (survivor,) = set(tis) - {victim}
    key = next(k for k in runner.executor.event_buffer if k.dag_id == victim)
    runner.executor.event_buffer[key] = (
        kind,
        "external-id" if kind in (TaskInstanceState.QUEUED, RUNNING) else None,
    )
    deleted: list[str] = []

    def delete_the_victim() -> None:
        with settings.NonScopedSession() as s:
            s.execute(delete(TI).where(TI.dag_id == victim))
            s.execute(delete(DagRun).where(DagRun.dag_id == victim))
            s.commit()
        deleted.append(victim)

    hook = mid_batch(session, delete_the_victim)
    try:
        for _ in range(2):
            executor_events_step(runner)
    finally:
        hook.remove()
    assert deleted == [victim], "the other write never ran in the batch"
    assert rows(victim) == []
    assert [(r.state, r.try_number) for r in rows(survivor)] == RETRIED
    assert callbacks_of(victim) == []
    assert len(callbacks_of(survivor)) == 1
    assert runner.executor.event_buffer == {}


# The 3.4 queue's patch 8: failure handling declines a try another writer ended or moved on from after the caller's
# unlocked read (no row lock on SQLite and MariaDB), and then nothing is sent for it.
ROW_LOCK_PATCH = "Lock-the-task-instance-row-when-handling-its-failure.patch"
# The executor-event batch's read of its task instances (the whole rows, joined with their DAG runs, by id).
BATCH_READ = r"^\s*SELECT task_instance\.id, task_instance\.task_id\b.*\bFROM task_instance\b.*\btask_instance\.id IN\b"


def _with_a_commit_after(statement, step, ti_id, **values) -> None:
    """
    Run ``step()`` while another connection commits ``values`` on the try right after the step's
    ``statement`` (no row lock on SQLite and MariaDB), before failure handling.
    """

    def commit() -> None:
        with settings.NonScopedSession() as s:
            s.execute(update(TI).where(TI.id == ti_id).values(**values))
            s.commit()

    hook = AfterStatement(statement, commit)
    try:
        step()
    finally:
        hook.remove()
    assert hook.fired, "the step did not send the statement the commit follows"


def _event_step_with_a_commit_after_the_batch_read(runner, ti_id, **values) -> None:
    """The executor-event step, with ``values`` committed on the try right after the batch's read."""
    from tests.unit.ti_race import executor_events_step

    _with_a_commit_after(BATCH_READ, lambda: executor_events_step(runner), ti_id, **values)


def _running_try_with_a_failed_event(dag_maker, session, runner, dag_id: str, **task_kwargs):
    """A running try (no heartbeat) with a failure callback and a FAILED executor event; its id."""
    (ti,) = make_running_tis(
        dag_maker,
        session,
        dag_id=dag_id,
        queued_by_job_id=runner.job.id,
        on_failure_callback=on_failure,
        **task_kwargs,
    )
    runner.executor.event_buffer[ti.key] = (FAILED, None)
    ti_id = ti.id
    session.expunge_all()
    return ti_id


def current_tries(dag_id: str) -> list:
    with settings.NonScopedSession() as s:
        return s.execute(select(TI.id, TI.state).where(TI.dag_id == dag_id, TI.working_set.is_(True))).all()


@pytest.mark.proves(ROW_LOCK_PATCH)
@pytest.mark.backend("sqlite", "mysql")
@pytest.mark.skipif(
    not hasattr(TI, "working_set"), reason="3.4 only: complete_restart releases a cleared try"
)
def test_executor_event_leaves_a_try_cleared_after_the_batch_read_to_its_restart(
    dag_maker, session, scheduler_job_runner
):
    """
    A FAILED executor event of a running try (no heartbeat); after the batch read it, a clear of the
    running try commits ``restarting``. 3.4 releases a restarting try with ``complete_restart`` (the
    purge and the event loop do so when they read it restarting, the execution API when its process
    reports): failure handling must leave it so, not fail it for retry. Before: the row lock patch
    accepted a row now restarting (kept from 3.3.2): an up_for_retry successor, a failure callback.
    """

    runner, dag_id = scheduler_job_runner, "restart_after_batch_read"
    ti_id = _running_try_with_a_failed_event(dag_maker, session, runner, dag_id)

    _event_step_with_a_commit_after_the_batch_read(runner, ti_id, state=RESTARTING)  # a clear
    assert current_tries(dag_id) == [(ti_id, RESTARTING)]
    assert task_callbacks("sensor") == []


@pytest.mark.proves(ROW_LOCK_PATCH)
@pytest.mark.backend("sqlite", "mysql")
@pytest.mark.skipif(not hasattr(TI, "working_set"), reason="3.4 queue: handle_failure declines there")
def test_executor_event_sends_no_failure_callback_for_a_try_that_succeeded_after_the_batch_read(
    dag_maker, session, scheduler_job_runner
):
    """
    A FAILED executor event of a running try (no heartbeat) of a task with a failure callback and
    failure emails; after the batch read it, the worker commits SUCCESS. Failure handling declines
    (the row is no longer running): no failure callback or email request may be committed for the try.
    Before: the event loop sent both before failure handling declined (before the row lock patch,
    failure handling overwrote the success).
    """

    runner = scheduler_job_runner
    ti_id = _running_try_with_a_failed_event(
        dag_maker, session, runner, "success_after_batch_read", **EMAIL_KWARGS
    )

    _event_step_with_a_commit_after_the_batch_read(runner, ti_id, state=SUCCESS, end_date=timezone.utcnow())
    with settings.NonScopedSession() as s:
        assert s.scalar(select(TI.state).where(TI.id == ti_id)) == SUCCESS
    assert task_callbacks("sensor") == []
    assert email_requests("sensor") == []


@pytest.mark.proves(ROW_LOCK_PATCH)
@pytest.mark.backend("sqlite", "mysql")
@pytest.mark.skipif(
    not hasattr(TI, "working_set"), reason="3.4 queue: the purge's revalidation is a plain read"
)
@pytest.mark.parametrize("ended", [SUCCESS, RESTARTING], ids=["worker-success", "cleared"])
def test_heartbeat_purge_sends_nothing_for_a_try_that_moved_on_after_revalidation(
    dag_maker, session, scheduler_job_runner, clock, timed_out_ti, ended
):
    """
    3.4's heartbeat-timeout scan and revalidation lock no row on SQLite and MariaDB. Right after
    revalidation read the timed-out try running, the worker commits SUCCESS, or a clear commits
    ``restarting``. Failure handling declines: no callback, email request, "heartbeat timeout" log row
    or executor FAILED for the try, which keeps the committed state. A cleared try is then released by
    the next pass, as 3.4 purges a restarting try (``complete_restart``: a successor to be scheduled).
    Before: the purge sent all of these before failure handling declined (a success) or failed the
    cleared try for retry.
    """
    runner = scheduler_job_runner
    dag_id = f"hb_{ended.value}_after_revalidation"
    dr, ti_id = timed_out_ti(dag_id, on_failure_callback=on_failure, retries=1, **EMAIL_KWARGS)

    _with_a_commit_after(REVALIDATION, lambda: purge(runner), ti_id, state=ended)
    assert current_tries(dag_id) == [(ti_id, ended)]
    assert task_callbacks("t") == []
    assert email_requests("t") == []
    assert heartbeat_logs(dag_id) == 0
    assert failed_keys(runner) == []
    if ended == RESTARTING:
        purge(runner)
        [(successor_id, state)] = current_tries(dag_id)
        assert (successor_id != ti_id, state) == (True, None)
        assert len(failed_keys(runner)) == 1
