# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
Regression tests for the heartbeat-timeout purge of the scheduler (upstream #42553, issue 3).

``SchedulerJobRunner._find_and_purge_task_instances_without_heartbeats`` on apache-airflow-core
3.3.2 sends a callback for a timed-out try but leaves the task instance RUNNING, so the next scan
and the executor event of that try fail it again; its scan takes no row lock; and its callback type
is decided without the task. Each test names the one patch of the series it proves; ``guard``
tests hold before and after every patch.

Everything runs on the real test database. The clock is moved past
``[scheduler] task_instance_heartbeat_timeout`` with time-machine. Concurrency tests use a second
real connection (``other_session``), interleave with ``threading.Event`` and lock waits, never
sleep, and bound every wait.
"""

from __future__ import annotations

import threading
from datetime import datetime, timedelta

import pytest
import time_machine
from sqlalchemy import select, text, update

import airflow
from airflow import settings
from airflow._shared.timezones import timezone
from airflow.callbacks.callback_requests import EmailRequest, TaskCallbackRequest
from airflow.models.db_callback_request import DbCallbackRequest
from airflow.models.taskinstance import TaskInstance as TI
from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.utils.state import TaskInstanceState
from tests.unit.harness import db, env, scheduler

pytestmark = pytest.mark.db_test

P_ROW_LOCK = "Row-lock-the-heartbeat-timeout-scan.patch"
P_REVALIDATE = "Revalidate-heartbeat-timeouts-under-the-row-lock.patch"
P_CALLBACK_TYPE = "Derive-heartbeat-timeout-callback-type-from-the-task.patch"
P_FAIL_SAME_PASS = "Fail-heartbeat-timed-out-tries-in-the-same-pass.patch"
# 3.4 has the rest of it (#68008); its queue's patch that tells the executor of a try fail_fast stopped in the pass.
P_FAIL_FAST_RELEASE = (
    "Tell-the-executor-of-a-timed-out-try-that-fail_fast-stopped-in-the-pass.patch"
    if airflow.__version__.startswith("3.4.")
    else P_FAIL_SAME_PASS
)


# Frozen "now" when the task instances last heartbeat; the tests then move past the timeout.
T0 = datetime(2026, 3, 2, 12, 0, 0, tzinfo=timezone.utc)
# Upper bound of every wait on another thread / connection (seconds). Never reached when correct.
WAIT = 30

RUNNING = TaskInstanceState.RUNNING
RESTARTING = TaskInstanceState.RESTARTING
UP_FOR_RETRY = TaskInstanceState.UP_FOR_RETRY
FAILED = TaskInstanceState.FAILED
SUCCESS = TaskInstanceState.SUCCESS

EMAIL_KWARGS = {"email": ["ops@example.com"], "email_on_failure": True, "email_on_retry": True}


def on_failure(context):  # pragma: no cover - only its presence on the task matters
    """Task failure callback: makes the executor-event path send a TaskCallbackRequest."""


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------
@pytest.fixture
def clock():
    """Frozen clock at T0; ``clock.shift(...)`` moves it (all threads see it)."""
    with time_machine.travel(T0, tick=False) as traveller:
        yield traveller


def past_timeout(clock, runner) -> None:
    """Move the clock one minute past the runner's heartbeat timeout."""
    clock.shift(timedelta(seconds=runner._task_instance_heartbeat_timeout_secs + 60))


def start_ti(
    session,
    dag_run,
    runner,
    task_id: str,
    *,
    map_index: int = -1,
    state: TaskInstanceState = RUNNING,
    try_number: int = 1,
    max_tries: int | None = None,
    queued_by_job_id: int | None = None,
) -> TI:
    """Put a TI in the state a worker leaves it in when it runs (heartbeat = now), committed."""
    ti = dag_run.get_task_instance(task_id, map_index=map_index, session=session)
    ti.state = state
    ti.try_number = try_number
    if max_tries is not None:
        ti.max_tries = max_tries
    ti.queued_by_job_id = queued_by_job_id if queued_by_job_id is not None else runner.job.id
    ti.hostname = "worker-1"
    ti.pid = 4242
    ti.start_date = timezone.utcnow()
    ti.last_heartbeat_at = timezone.utcnow()
    session.commit()
    return ti


@pytest.fixture
def timed_out_ti(dag_maker, session, scheduler_job_runner, clock):
    """
    Factory ``timed_out_ti(dag_id, **task_kwargs) -> (dag_run, TI id)``: one task ``t`` (an
    EmptyOperator with ``task_kwargs``) running in a new DAG run, queued by the runner's job, and
    the clock moved past its heartbeat timeout.
    """

    def make(dag_id: str, **task_kwargs) -> tuple:
        with dag_maker(dag_id, session=session):
            EmptyOperator(task_id="t", **task_kwargs)
        dr = dag_maker.create_dagrun()
        ti_id = start_ti(session, dr, scheduler_job_runner, "t").id
        session.close()
        past_timeout(clock, scheduler_job_runner)
        return dr, ti_id

    return make


def purge(runner) -> None:
    """One pass of the heartbeat-timeout scan, exactly as the scheduler loop's timer runs it."""
    runner._find_and_purge_task_instances_without_heartbeats()


def process_executor_events(runner) -> None:
    """One batch of executor events, as the scheduler loop runs it, committed."""
    with settings.NonScopedSession() as s:
        runner._process_executor_events(executor=runner.executor, session=s)
        s.commit()


def committed_requests() -> list:
    """All callback requests durably written for the DAG processor (``callback`` table)."""
    with settings.NonScopedSession() as s:
        return [row.get_callback_request() for row in s.scalars(select(DbCallbackRequest))]


def task_callbacks(task_id: str, try_number: int = 1, map_index: int = -1) -> list[TaskCallbackRequest]:
    return [
        r
        for r in committed_requests()
        if isinstance(r, TaskCallbackRequest)
        and (r.ti.task_id, r.ti.try_number, r.ti.map_index) == (task_id, try_number, map_index)
    ]


def email_requests(task_id: str, map_index: int = -1) -> list[EmailRequest]:
    return [
        r
        for r in committed_requests()
        if isinstance(r, EmailRequest) and (r.ti.task_id, r.ti.map_index) == (task_id, map_index)
    ]


def committed_state(dag_run, task_id: str, map_index: int = -1) -> TaskInstanceState | None:
    with settings.NonScopedSession() as s:
        return s.scalar(
            select(TI.state).where(
                TI.dag_id == dag_run.dag_id,
                TI.run_id == dag_run.run_id,
                TI.task_id == task_id,
                TI.map_index == map_index,
            )
        )


def fail_fast_dag(dag_maker, session, dag_id: str) -> None:
    """A ``fail_fast`` DAG: ``t1 >> t2`` and an independent ``t3``, no retries."""
    with dag_maker(dag_id, session=session, fail_fast=True):
        t1 = EmptyOperator(task_id="t1", retries=0)
        t2 = EmptyOperator(task_id="t2", retries=0)
        EmptyOperator(task_id="t3", retries=0)
        t1 >> t2


def failed_keys(runner) -> list:
    return [key for key, state, _ in runner.executor.state_changes if state == FAILED]


def skip_unless_row_locks(session) -> None:
    if not db.dialect_locks_rows(session):
        pytest.skip(db.no_row_locks_reason(session))


def lock_wait_timeout(conn_session, seconds: int) -> None:
    """Bound this connection's row-lock waits (server side), so no test can hang on a lock."""
    name = conn_session.get_bind().dialect.name
    if name == "postgresql":
        conn_session.execute(text(f"SET lock_timeout = '{seconds}s'"))
    elif name == "mysql":
        conn_session.execute(text(f"SET SESSION innodb_lock_wait_timeout = {seconds}"))


def connection_id(conn_session) -> int:
    name = conn_session.get_bind().dialect.name
    if name == "postgresql":
        return conn_session.execute(text("SELECT pg_backend_pid()")).scalar_one()
    return conn_session.execute(text("SELECT CONNECTION_ID()")).scalar_one()


def wait_until_blocked_on_lock(observer, conn_id: int, gave_up: threading.Event) -> None:
    """Return once connection ``conn_id`` waits for a row lock; fail after WAIT seconds."""
    name = observer.get_bind().dialect.name
    if name == "postgresql":
        query = text("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = :id")
    else:
        query = text(
            "SELECT trx_state = 'LOCK WAIT' FROM information_schema.innodb_trx "
            "WHERE trx_mysql_thread_id = :id"
        )
    deadline = threading.Event()
    timer = threading.Timer(WAIT, deadline.set)
    timer.start()
    try:
        while not deadline.is_set():
            if observer.execute(query, {"id": conn_id}).scalar():
                return
            observer.rollback()  # fresh snapshot of the statistics views
            if gave_up.wait(0.02):  # the waiting thread ended instead of blocking
                pytest.fail("the worker connection finished instead of waiting for the row lock")
        pytest.fail(f"the worker connection did not block on the row lock within {WAIT}s")
    finally:
        timer.cancel()


# ----------------------------------------------------------------------------------------------
# 1. Row-locked scan
# ----------------------------------------------------------------------------------------------
@pytest.mark.backend("postgres", "mysql")
@pytest.mark.proves(P_ROW_LOCK)
def test_scan_skips_ti_row_locked_by_worker_state_update(
    dag_maker, session, other_session, scheduler_job_runner, clock, timed_out_ti
):
    """
    Concurrent completion (a): a worker's state update holds the TI row lock (the execution API
    does ``SELECT ... FOR UPDATE`` on the TI before changing its state) while the scan runs, then
    sets SUCCESS and commits. The row-locked scan skips that row: the TI ends SUCCESS and nothing
    is sent. On the base the scan reads the row anyway and sends a failure callback for a task
    that succeeded.
    """
    skip_unless_row_locks(session)
    runner = scheduler_job_runner
    dr, ti_id = timed_out_ti("hb_locked_by_worker", on_failure_callback=on_failure)

    locked, scanned, worker_done = threading.Event(), threading.Event(), threading.Event()
    worker_saw: list = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            lock_wait_timeout(other_session, WAIT)
            state = other_session.execute(select(TI.state).where(TI.id == ti_id).with_for_update()).scalar()
            worker_saw.append(state)
            locked.set()
            if not scanned.wait(WAIT):
                raise TimeoutError("scan did not finish")
            other_session.execute(
                update(TI).where(TI.id == ti_id).values(state=SUCCESS, end_date=timezone.utcnow())
            )
            other_session.commit()
        except BaseException as e:
            errors.append(e)
            other_session.rollback()
        finally:
            locked.set()
            worker_done.set()

    thread = threading.Thread(target=worker, name="worker-state-update")
    thread.start()
    try:
        assert locked.wait(WAIT), "worker did not lock the TI row"
        assert not errors, errors
        purge(runner)
    finally:
        scanned.set()
        thread.join(WAIT)
    assert not thread.is_alive(), "worker did not finish"
    assert not errors, errors
    assert worker_saw == [RUNNING]

    assert committed_state(dr, "t") == SUCCESS
    assert task_callbacks("t") == []
    assert runner.executor.callbacks_sent == []
    assert runner.executor.state_changes == []


# ----------------------------------------------------------------------------------------------
# 2. Revalidation
# ----------------------------------------------------------------------------------------------
@pytest.mark.proves(P_REVALIDATE)
def test_worker_success_committed_between_scan_and_failure_is_kept(
    dag_maker, session, other_session, scheduler_job_runner, clock, timed_out_ti
):
    """
    Concurrent completion (b), where with_row_locks takes no lock (SQLite, MariaDB): the worker
    commits SUCCESS after the scan selected the TI but before the purge fails it. Revalidation
    reads the committed row again and skips it: the TI ends SUCCESS and nothing is sent (no
    callback, no email, no executor change). On the base the purge fails the try from what the
    scan read. Where the scan row-locks the TI the worker cannot commit in that window; that
    case is ``test_worker_state_update_waits_for_purge_and_finds_ti_failed``.
    """
    if db.dialect_locks_rows(session):
        pytest.skip(
            f"with_row_locks row-locks the TI on {env.BACKEND}: a worker cannot "
            "commit between the scan and the failure (see the lock-wait test)"
        )
    runner = scheduler_job_runner
    dr, ti_id = timed_out_ti("hb_success_between", on_failure_callback=on_failure, **EMAIL_KWARGS)

    scan = runner._find_task_instances_without_heartbeats
    found: list[str] = []

    def scan_then_worker_commits_success(*, session, **kwargs):
        tis = scan(session=session, **kwargs)
        found.extend(ti.task_id for ti in tis)
        # The worker's state update (execution API): lock (a no-op here), check, set, commit --
        # on its own connection, after the scan read the row and before the purge uses it.
        state = other_session.execute(select(TI.state).where(TI.id == ti_id).with_for_update()).scalar()
        assert state == RUNNING
        other_session.execute(
            update(TI).where(TI.id == ti_id).values(state=SUCCESS, end_date=timezone.utcnow())
        )
        other_session.commit()
        return tis

    runner._find_task_instances_without_heartbeats = scan_then_worker_commits_success
    purge(runner)

    assert found == ["t"], "the scan must have selected the TI before the worker committed"
    assert committed_state(dr, "t") == SUCCESS
    assert task_callbacks("t") == []
    assert email_requests("t") == []
    assert runner.executor.callbacks_sent == []
    assert runner.executor.state_changes == []


# ----------------------------------------------------------------------------------------------
# 3. Callback type from retry eligibility
# ----------------------------------------------------------------------------------------------
@pytest.mark.proves(P_CALLBACK_TYPE)
def test_callback_type_restarting_with_max_tries_0_is_up_for_retry(
    dag_maker, session, scheduler_job_runner, clock
):
    """
    A TI cleared while running (RESTARTING) whose task has retries=0 (max_tries=0): failure
    handling retries it (RESTARTING is always retry-eligible, handle_failure persists
    UP_FOR_RETRY), so its callback must be UP_FOR_RETRY. The base's
    ``max_tries > 0 and is_eligible_to_retry()`` sends FAILED.
    """
    runner = scheduler_job_runner
    with dag_maker("hb_restarting", session=session):
        EmptyOperator(task_id="t", retries=0)
    dr = dag_maker.create_dagrun()
    start_ti(session, dr, runner, "t", state=RESTARTING, max_tries=0)
    session.close()
    past_timeout(clock, runner)

    purge(runner)

    callbacks = task_callbacks("t")
    assert [c.task_callback_type for c in callbacks] == [UP_FOR_RETRY]
    if committed_state(dr, "t") != RESTARTING:  # once the purge also fails the try (later patch)
        assert committed_state(dr, "t") == UP_FOR_RETRY


@pytest.mark.proves(P_CALLBACK_TYPE)
def test_callback_type_follows_task_retries_not_stale_max_tries(
    dag_maker, session, scheduler_job_runner, clock
):
    """
    The DAG was redeployed with retries=0 while a run created with retries=2 (max_tries=2) is
    running. Failure handling, which loads the task, persists FAILED; the base decides from
    ``max_tries`` alone and sends an UP_FOR_RETRY callback for a task that will not be retried.
    """
    runner = scheduler_job_runner
    with dag_maker("hb_redeployed", session=session) as dag:
        EmptyOperator(task_id="t", retries=2)
    dr = dag_maker.create_dagrun()
    start_ti(session, dr, runner, "t")
    past_timeout(clock, runner)  # also past [core] min_serialized_dag_update_interval
    dag.task_dict["t"].retries = 0
    dag_maker.sync_dag_to_db()  # the redeployed DAG: a new latest version, retries=0
    assert dag_maker.serialized_dag.get_task("t").retries == 0
    session.close()

    purge(runner)

    assert [c.task_callback_type for c in task_callbacks("t")] == [FAILED]
    if committed_state(dr, "t") != RUNNING:  # once the purge also fails the try (later patch)
        assert committed_state(dr, "t") == FAILED


# ----------------------------------------------------------------------------------------------
# 4. Failure in the same pass
# ----------------------------------------------------------------------------------------------
@pytest.mark.proves(P_FAIL_SAME_PASS)
@pytest.mark.parametrize("retries", [0, 2])
def test_two_consecutive_scans_send_one_callback(
    dag_maker, session, scheduler_job_runner, clock, retries, timed_out_ti
):
    """Two scans of one timed-out try: one TaskCallbackRequest; the TI left RUNNING after the first."""
    runner = scheduler_job_runner
    dr, _ = timed_out_ti(f"hb_two_scans_{retries}", retries=retries, on_failure_callback=on_failure)

    purge(runner)
    state_after_first_scan = committed_state(dr, "t")
    clock.shift(timedelta(seconds=10))  # the scan's default period
    purge(runner)

    assert len(task_callbacks("t")) == 1
    assert state_after_first_scan == (UP_FOR_RETRY if retries else FAILED)
    assert committed_state(dr, "t") == state_after_first_scan
    assert len(failed_keys(runner)) == 1


@pytest.mark.proves(P_FAIL_SAME_PASS)
@pytest.mark.parametrize("retries", [0, 2])
def test_scan_then_its_executor_event_send_one_callback(
    dag_maker, session, scheduler_job_runner, clock, retries, timed_out_ti
):
    """
    The FAILED executor event the scan produced (``change_state(key, FAILED)``) is processed next:
    the try already failed, so the event path sends nothing and changes nothing. On the base the
    TI is still RUNNING, the event is handled as an externally killed task, and a second callback
    (and the state change) follow.
    """
    runner = scheduler_job_runner
    dr, _ = timed_out_ti(f"hb_scan_event_{retries}", retries=retries, on_failure_callback=on_failure)

    purge(runner)
    assert committed_state(dr, "t") != RUNNING
    state_after_scan = committed_state(dr, "t")
    assert len(runner.executor.event_buffer) == 1  # the FAILED event the scan produced
    process_executor_events(runner)

    assert len(task_callbacks("t")) == 1
    assert committed_state(dr, "t") == state_after_scan == (UP_FOR_RETRY if retries else FAILED)
    assert len(failed_keys(runner)) == 1


def _expand_source():
    return [1, 2]


@pytest.mark.proves(P_FAIL_SAME_PASS)
@pytest.mark.parametrize(
    ("case", "retries", "try_number", "ti_state", "max_tries", "expected"),
    [
        pytest.param("retries0", 0, 1, RUNNING, None, FAILED, id="retries=0"),
        pytest.param("first_try", 2, 1, RUNNING, None, UP_FOR_RETRY, id="retries=2-first-try"),
        pytest.param("last_try", 2, 3, RUNNING, None, FAILED, id="retries=2-last-try-exhausted"),
        pytest.param("restarting", 0, 1, RESTARTING, 0, UP_FOR_RETRY, id="restarting-max_tries=0"),
        pytest.param("mapped", 1, 1, RUNNING, None, UP_FOR_RETRY, id="mapped-ti"),
    ],
)
def test_callback_email_and_state_agree(
    dag_maker, session, scheduler_job_runner, clock, case, retries, try_number, ti_state, max_tries, expected
):
    """
    Callback type, email type and the state the TI ends in after one scan agree, for each row of
    the table. On the base the TI stays RUNNING/RESTARTING and no email is requested by the scan.
    """
    runner = scheduler_job_runner
    with dag_maker(f"hb_table_{case}", session=session):
        if case == "mapped":
            EmptyOperator.partial(task_id="t", retries=retries, **EMAIL_KWARGS).expand(doc=["one", "two"])
        else:
            EmptyOperator(task_id="t", retries=retries, **EMAIL_KWARGS)
    dr = dag_maker.create_dagrun()
    map_index = 1 if case == "mapped" else -1
    start_ti(
        session,
        dr,
        runner,
        "t",
        map_index=map_index,
        state=ti_state,
        try_number=try_number,
        max_tries=max_tries,
    )
    session.close()
    past_timeout(clock, runner)

    purge(runner)

    callbacks = task_callbacks("t", try_number=try_number, map_index=map_index)
    emails = email_requests("t", map_index=map_index)
    final = committed_state(dr, "t", map_index=map_index)
    assert [c.task_callback_type for c in callbacks] == [expected]
    assert [e.email_type for e in emails] == ["retry" if expected == UP_FOR_RETRY else "failure"]
    assert final == expected
    if case == "mapped":
        assert committed_state(dr, "t", map_index=0) is None  # the other mapped TI is untouched


@pytest.mark.proves(P_FAIL_SAME_PASS)
@pytest.mark.parametrize("retries", [0, 1])
def test_email_requested_once_with_the_failure(
    dag_maker, session, scheduler_job_runner, clock, retries, timed_out_ti
):
    """
    Email configured: exactly one EmailRequest of the right type for the try, written with the
    failure by the scan (the executor event for that try must not add another). On the base the
    scan requests none; only the later executor event does, if it is ever processed.
    """
    runner = scheduler_job_runner
    dr, _ = timed_out_ti(f"hb_email_{retries}", retries=retries, **EMAIL_KWARGS)
    expected_type = "retry" if retries else "failure"

    purge(runner)
    assert [e.email_type for e in email_requests("t")] == [expected_type]
    process_executor_events(runner)
    clock.shift(timedelta(seconds=10))
    purge(runner)

    assert [e.email_type for e in email_requests("t")] == [expected_type]


@pytest.mark.guard
def test_no_email_request_without_email(dag_maker, session, scheduler_job_runner, clock, timed_out_ti):
    """Guard (holds before and after; not a regression test): no email configured, none requested."""
    runner = scheduler_job_runner
    dr, _ = timed_out_ti("hb_no_email", retries=0, on_failure_callback=on_failure)

    purge(runner)
    process_executor_events(runner)

    assert email_requests("t") == []
    assert committed_state(dr, "t") == FAILED


@pytest.mark.proves(P_FAIL_SAME_PASS)
def test_fail_fast_stops_remaining_tasks_like_executor_event_path(
    dag_maker, session, scheduler_job_runner, clock
):
    """
    fail_fast DAG: when the scan fails ``t1``, the run's remaining tasks end as the executor-event
    path leaves them for the same failure (oracle: a second run of the same DAG whose ``t1`` is
    failed through ``_process_executor_events``): running ``t3`` FAILED, not-started ``t2`` SKIPPED.
    On the base the scan leaves all of them as they were.
    """
    runner = scheduler_job_runner
    fail_fast_dag(dag_maker, session, "hb_fail_fast")
    by_scan = dag_maker.create_dagrun(run_id="by_scan")
    by_event = dag_maker.create_dagrun(run_id="by_event", logical_date=T0)
    start_ti(session, by_scan, runner, "t1")
    session.close()
    past_timeout(clock, runner)
    start_ti(session, by_scan, runner, "t3")  # fresh heartbeat
    ev_t1 = start_ti(session, by_event, runner, "t1")  # fresh heartbeat
    start_ti(session, by_event, runner, "t3")
    ev_key = ev_t1.key
    session.close()

    purge(runner)
    by_scan_states = {t: committed_state(by_scan, t) for t in ("t1", "t2", "t3")}

    runner.executor.change_state(ev_key, FAILED, remove_running=True)  # the worker died: executor event
    with settings.NonScopedSession() as s:
        scheduler.process_events_of_dead_process(runner, s)  # no heartbeat of t1 follows
        s.commit()
    by_event_states = {t: committed_state(by_event, t) for t in ("t1", "t2", "t3")}

    assert by_event_states == {"t1": FAILED, "t2": TaskInstanceState.SKIPPED, "t3": FAILED}
    assert by_scan_states == by_event_states


@pytest.mark.proves(P_FAIL_FAST_RELEASE)
def test_fail_fast_in_the_pass_releases_the_other_timed_out_try(
    dag_maker, session, scheduler_job_runner, clock
):
    """
    fail_fast DAG whose running ``t1`` and ``t3`` both timed out and are found by the same scan.
    Failing the first one stops the other (FAILED by fail_fast, as on the executor-event path,
    where fail_fast sends no callback for the tasks it stops). The purge then must not fail that
    try again, but must still tell the executor, or the executor counts a try whose worker is
    gone as running for ever (a lost parallelism slot). Before this patch revalidation skipped it
    entirely (so does 3.4's purge, #68008); on the base nothing was failed in the pass.
    """
    runner = scheduler_job_runner
    fail_fast_dag(dag_maker, session, "hb_fail_fast_two")
    dr = dag_maker.create_dagrun()
    keys = {t: start_ti(session, dr, runner, t).key for t in ("t1", "t3")}
    runner.executor.running.update(keys.values())
    session.close()
    past_timeout(clock, runner)

    purge(runner)

    states = {t: committed_state(dr, t) for t in ("t1", "t2", "t3")}
    assert states == {"t1": FAILED, "t2": TaskInstanceState.SKIPPED, "t3": FAILED}
    assert len(task_callbacks("t1")) + len(task_callbacks("t3")) == 1
    assert sorted(failed_keys(runner)) == sorted(keys.values())
    assert not runner.executor.running & set(keys.values()), "a stopped try is still counted as running"


@pytest.mark.backend("postgres", "mysql")
@pytest.mark.proves(P_FAIL_SAME_PASS)
def test_worker_state_update_waits_for_purge_and_finds_ti_failed(
    dag_maker, session, other_session, scheduler_job_runner, clock, timed_out_ti
):
    """
    Concurrent completion (b) where the scan row-locks the TI: the worker's state update starts
    after the scan selected the TI; its ``SELECT ... FOR UPDATE`` waits (bounded) for the purge's
    transaction, then finds the TI no longer RUNNING (FAILED), so it does not overwrite it; one
    callback was sent, no deadlock. Before the purge fails the try in the same pass, the worker
    finds RUNNING and sets SUCCESS on a try a failure callback was already sent for.
    """
    skip_unless_row_locks(session)
    runner = scheduler_job_runner
    dr, ti_id = timed_out_ti("hb_worker_waits", retries=0, on_failure_callback=on_failure)

    worker_saw: list = []
    errors: list[BaseException] = []
    worker_done = threading.Event()
    lock_wait_timeout(other_session, WAIT)
    worker_conn = connection_id(other_session)
    other_session.commit()

    def worker() -> None:
        try:
            state = other_session.execute(select(TI.state).where(TI.id == ti_id).with_for_update()).scalar()
            worker_saw.append(state)
            if state == RUNNING:
                other_session.execute(
                    update(TI).where(TI.id == ti_id).values(state=SUCCESS, end_date=timezone.utcnow())
                )
                other_session.commit()
            else:
                other_session.rollback()  # the execution API answers 409: TI not running
        except BaseException as e:
            errors.append(e)
            other_session.rollback()
        finally:
            worker_done.set()

    thread = threading.Thread(target=worker, name="worker-state-update")
    scan = runner._find_task_instances_without_heartbeats
    observer_engine = db.make_engine()

    def scan_then_worker_blocks(*, session, **kwargs):
        tis = scan(session=session, **kwargs)
        thread.start()
        with db.make_session_factory(observer_engine)() as observer:
            wait_until_blocked_on_lock(observer, worker_conn, worker_done)
        return tis

    runner._find_task_instances_without_heartbeats = scan_then_worker_blocks
    try:
        purge(runner)
    finally:
        if thread.is_alive() or thread.ident is not None:
            thread.join(WAIT)
        observer_engine.dispose()
    assert not thread.is_alive(), "worker still waiting for the row lock"
    assert not errors, errors

    assert worker_saw == [FAILED]
    assert committed_state(dr, "t") == FAILED
    assert len(task_callbacks("t")) == 1


# ----------------------------------------------------------------------------------------------
# Guards (hold before and after every patch; not regression tests)
# ----------------------------------------------------------------------------------------------
@pytest.mark.guard
def test_ti_queued_by_another_scheduler_is_not_touched(dag_maker, session, scheduler_job_runner, clock):
    """Guard: a timed-out TI queued by another scheduler's job is left to that scheduler."""
    from airflow.jobs.job import Job

    runner = scheduler_job_runner
    other_job = Job(job_type="SchedulerJob")
    with settings.NonScopedSession() as s:
        other_job.prepare_for_execution(session=s)
    with dag_maker("hb_other_scheduler", session=session):
        EmptyOperator(task_id="t", on_failure_callback=on_failure, **EMAIL_KWARGS)
    dr = dag_maker.create_dagrun()
    start_ti(session, dr, runner, "t", queued_by_job_id=other_job.id)
    session.close()
    past_timeout(clock, runner)

    purge(runner)

    assert committed_state(dr, "t") == RUNNING
    assert committed_requests() == []
    assert runner.executor.callbacks_sent == []
    assert runner.executor.state_changes == []


@pytest.mark.guard
def test_ti_with_fresh_heartbeat_is_not_touched(dag_maker, session, scheduler_job_runner, clock):
    """Guard: a TI whose heartbeat is within the timeout is left running."""
    runner = scheduler_job_runner
    with dag_maker("hb_fresh", session=session):
        EmptyOperator(task_id="t", on_failure_callback=on_failure, **EMAIL_KWARGS)
    dr = dag_maker.create_dagrun()
    start_ti(session, dr, runner, "t")
    session.close()
    clock.shift(timedelta(seconds=runner._task_instance_heartbeat_timeout_secs - 1))

    purge(runner)

    assert committed_state(dr, "t") == RUNNING
    assert committed_requests() == []
    assert runner.executor.callbacks_sent == []
    assert runner.executor.state_changes == []
