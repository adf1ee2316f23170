# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
Stuck-in-queued handling must re-check the task instance under its row lock before it writes.

Upstream https://github.com/apache/airflow/issues/65248 (priority high; PRs #65970, #68820 open):
``_handle_tasks_stuck_in_queued`` selects task instances queued for longer than
``task_queued_timeout`` without a lock and then revokes, reschedules (``UPDATE ... SET
state='scheduled'`` with no state condition) or fails them. A worker that starts the task between
the selection and the write has it reset to ``scheduled`` (a duplicate run; a deferred sensor
resumes and succeeds prematurely) or failed.

The interleaving is deterministic: the worker's commit (a second, independent connection:
``other_session``) happens right after the handler's selection, inside the handler's own call to
``_executor_to_workloads``, before anything is revoked or written.
"""

from __future__ import annotations

import os
import socket
import threading
from datetime import timedelta

import pytest
from sqlalchemy import func, select, update

from airflow._shared.timezones import timezone
from airflow.callbacks.callback_requests import TaskCallbackRequest
from airflow.models.log import Log
from airflow.models.taskinstance import TaskInstance
from airflow.models.trigger import Trigger
from airflow.utils.state import TaskInstanceState
from tests.unit.harness import series
from tests.unit.jobs.test_scheduler_heartbeat_timeout import lock_wait_timeout
from tests.unit.jobs.test_scheduler_stale_executor_events import _make_deferrable, _queue, _reload, _schedule
from tests.unit.ti_race import WAIT, lock_waiters, wait_until

PATCH = "Re-check-task-instances-stuck-in-queued-under-the-row-lock.patch"

pytestmark = pytest.mark.db_test

STUCK_EVENTS = ("stuck in queued reschedule", "stuck in queued tries exceeded")


@pytest.fixture
def stuck_ti(dag_maker, session, scheduler_job_runner, monkeypatch):
    """A deferrable task's try 1, queued by this scheduler longer than task_queued_timeout ago."""
    runner = scheduler_job_runner
    dag_run, (ti,) = _make_deferrable(dag_maker, session, dag_id="stuck_in_queued")
    _schedule(session, dag_run, [ti])
    _queue(session, runner, [ti])
    session.execute(
        update(TaskInstance)
        .where(TaskInstance.id == ti.id)
        .values(queued_dttm=timezone.utcnow() - timedelta(seconds=runner._task_queued_timeout + 60))
    )
    session.commit()
    revoked: list = []
    # RecordingExecutor is a BaseExecutor, whose revoke_task raises NotImplementedError (the
    # handler then skips the executor): record the revocations instead, as CeleryExecutor would.
    monkeypatch.setattr(runner.executor, "revoke_task", lambda *, ti: revoked.append(ti.key))
    runner.executor.revoked = revoked
    return _reload(session, ti)


def _worker_moves_after_selection(runner, monkeypatch, move) -> list[list]:
    """Run ``move`` (another connection's commit) right after the handler selected its rows."""
    # The handler groups its selection by executor right after reading it (compat 3.1.x: _executor_to_tis).
    grouping = "_executor_to_workloads" if hasattr(runner, "_executor_to_workloads") else "_executor_to_tis"
    original = getattr(runner, grouping)
    selections: list[list] = []

    def selected_then_worker_moves(workloads, *args, **kwargs):
        workloads = list(workloads)  # the handler's selection, read before the worker's commit
        selections.append([(w.id, w.state) for w in workloads])
        move()
        return original(workloads, *args, **kwargs)

    monkeypatch.setattr(runner, grouping, selected_then_worker_moves)
    return selections


def _start(other_session, ti_id) -> None:
    """What the execution API's ``PATCH /run`` commits for a queued task instance."""
    now = timezone.utcnow()
    other_session.execute(
        update(TaskInstance)
        .where(TaskInstance.id == ti_id, TaskInstance.state == TaskInstanceState.QUEUED)
        .values(
            state=TaskInstanceState.RUNNING,
            hostname=socket.gethostname(),
            unixname="airflow",
            pid=os.getpid(),
            start_date=now,
            last_heartbeat_at=now,
        )
    )
    other_session.commit()


def _defer(other_session, ti_id) -> None:
    """What the execution API's ``PATCH /state`` (deferred) commits: a trigger and the TI deferred."""
    trigger = Trigger(
        classpath="airflow.providers.standard.triggers.temporal.DateTimeTrigger",
        kwargs={"moment": timezone.utcnow() + timedelta(hours=1)},
    )
    other_session.add(trigger)
    other_session.flush()
    other_session.execute(
        update(TaskInstance)
        .where(TaskInstance.id == ti_id, TaskInstance.state == TaskInstanceState.RUNNING)
        .values(
            state=TaskInstanceState.DEFERRED,
            trigger_id=trigger.id,
            next_method="execute_complete",
            next_kwargs={},
        )
    )
    other_session.commit()


def _stuck_logs(session) -> int:
    return session.scalar(select(func.count()).select_from(Log).where(Log.event.in_(STUCK_EVENTS)))


@pytest.mark.proves(PATCH)
@pytest.mark.parametrize("path", ["reschedule", "fail"])
@pytest.mark.parametrize("moved_to", [TaskInstanceState.RUNNING, TaskInstanceState.DEFERRED], ids=str)
def test_task_instance_that_left_queued_after_selection_is_left_alone(
    session, other_session, scheduler_job_runner, stuck_ti, monkeypatch, path, moved_to
):
    runner = scheduler_job_runner
    if path == "fail":
        runner._num_stuck_queued_retries = 0  # [scheduler] num_stuck_in_queued_retries = 0

    def move():
        _start(other_session, stuck_ti.id)
        if moved_to == TaskInstanceState.DEFERRED:
            _defer(other_session, stuck_ti.id)

    selections = _worker_moves_after_selection(runner, monkeypatch, move)

    runner._handle_tasks_stuck_in_queued(session=session)
    session.commit()

    assert selections == [[(stuck_ti.id, TaskInstanceState.QUEUED)]], "the handler must have selected it"
    after = _reload(session, stuck_ti)
    assert after.state == moved_to, f"the {moved_to} try was overwritten by stuck-in-queued handling"
    assert after.try_number == 1
    assert runner.executor.revoked == [], "a running/deferred try was revoked from the executor"
    assert runner.executor.callbacks_sent == []
    assert runner.executor.state_changes == []
    assert _stuck_logs(session) == 0


@pytest.mark.proves(PATCH)
@pytest.mark.parametrize("path", ["reschedule", "fail"])
@pytest.mark.parametrize("change", ["adopted", "queued_again"])
def test_task_instance_queued_anew_after_selection_is_left_alone(
    session, other_session, scheduler_job_runner, stuck_ti, monkeypatch, path, change
):
    """Still queued, but adopted by another scheduler or queued again since the selection: not stuck."""
    runner = scheduler_job_runner
    if path == "fail":
        runner._num_stuck_queued_retries = 0
    values = (
        {"queued_by_job_id": runner.job.id + 1000}
        if change == "adopted"
        else {"queued_dttm": timezone.utcnow()}
    )

    def move():
        other_session.execute(update(TaskInstance).where(TaskInstance.id == stuck_ti.id).values(**values))
        other_session.commit()

    _worker_moves_after_selection(runner, monkeypatch, move)

    runner._handle_tasks_stuck_in_queued(session=session)
    session.commit()

    after = _reload(session, stuck_ti)
    assert after.state == TaskInstanceState.QUEUED
    assert {key: getattr(after, key) for key in values} == values
    assert runner.executor.revoked == []
    assert runner.executor.callbacks_sent == []
    assert runner.executor.state_changes == []
    assert _stuck_logs(session) == 0


@pytest.mark.guard
def test_task_instance_still_stuck_is_rescheduled(session, scheduler_job_runner, stuck_ti):
    """Guard: a task instance that really is stuck is revoked and set back to scheduled."""
    runner = scheduler_job_runner
    runner._handle_tasks_stuck_in_queued(session=session)
    session.commit()

    after = _reload(session, stuck_ti)
    assert after.state == TaskInstanceState.SCHEDULED
    assert runner.executor.revoked == [stuck_ti.key]
    assert _stuck_logs(session) == 1


@pytest.mark.proves(PATCH)
def test_task_instance_still_stuck_is_failed_with_a_failure_callback_type(
    session, scheduler_job_runner, stuck_ti
):
    """Past the requeue limit the try is failed; its callback says FAILED, as failure handling's does."""
    runner = scheduler_job_runner
    runner._num_stuck_queued_retries = 0
    runner._handle_tasks_stuck_in_queued(session=session)
    session.commit()

    after = _reload(session, stuck_ti)
    assert after.state == TaskInstanceState.FAILED
    assert runner.executor.revoked == [stuck_ti.key]
    callbacks = [c for c in runner.executor.callbacks_sent if isinstance(c, TaskCallbackRequest)]
    assert len(callbacks) == 1
    assert callbacks[0].task_callback_type == TaskInstanceState.FAILED
    assert callbacks[0].is_failure_callback


@pytest.mark.backend("postgres", "mysql")
@pytest.mark.proves(PATCH)
def test_worker_start_after_the_recheck_waits_and_finds_the_try_rescheduled(
    session, other_session, scheduler_job_runner, stuck_ti, monkeypatch
):
    """
    The worker's ``PATCH /run`` comes after the re-check: it waits for the handler's row lock.

    The worker (second connection) locks the TI row as the execution API's ``ti_run`` does and
    starts the try only if it is still queued. It is started while the handler is between its
    re-check and its write (in ``revoke_task``); the handler goes on once the worker is seen
    waiting for the row lock (or has finished: 3.3.2 takes no lock, so the worker starts the
    try and the handler then resets it to scheduled: a duplicate run).
    """
    from tests.unit.harness.db import dialect_locks_rows, no_row_locks_reason

    if not dialect_locks_rows(session):  # the re-check locks the row with with_row_locks
        pytest.skip(no_row_locks_reason(session))
    runner = scheduler_job_runner
    lock_wait_timeout(other_session, int(WAIT))
    result: dict = {}
    done = threading.Event()

    def worker() -> None:
        try:
            other_session.execute(
                select(TaskInstance.id).where(TaskInstance.id == stuck_ti.id).with_for_update()
            )
            result["started"] = other_session.execute(
                update(TaskInstance)
                .where(TaskInstance.id == stuck_ti.id, TaskInstance.state == TaskInstanceState.QUEUED)
                .values(state=TaskInstanceState.RUNNING, start_date=timezone.utcnow())
            ).rowcount
            other_session.commit()
        except Exception as error:  # reported below, in the test's thread
            result["error"] = error
        finally:
            done.set()

    worker_thread = threading.Thread(target=worker, name="worker-patch-run")
    record_revoke = runner.executor.revoke_task

    def revoke_while_the_worker_starts(*, ti):
        worker_thread.start()
        wait_until(
            lambda: done.is_set() or lock_waiters() >= 1,
            "the worker waits for the task instance's row lock (or has finished)",
        )
        record_revoke(ti=ti)

    monkeypatch.setattr(runner.executor, "revoke_task", revoke_while_the_worker_starts)
    runner._handle_tasks_stuck_in_queued(session=session)
    session.commit()
    assert done.wait(WAIT), "the worker never finished"
    worker_thread.join(WAIT)

    assert "error" not in result, result
    after = _reload(session, stuck_ti)
    assert (result["started"], after.state) == (0, TaskInstanceState.SCHEDULED), (
        "the worker started a try that stuck-in-queued handling then reset to scheduled"
    )
    assert runner.executor.revoked == [stuck_ti.key]


@pytest.mark.skipif(
    not series.V3,
    reason="the v2 queues' re-check keeps the row lock of a task instance its executor cannot revoke until "
    "the pass commits (series v3 only)",
)
@pytest.mark.backend("postgres", "mysql")
@pytest.mark.guard  # v3 before the re-check takes no lock to release: it holds at every step
def test_row_lock_is_released_when_the_executor_cannot_revoke(
    session, other_session, scheduler_job_runner, stuck_ti, monkeypatch
):
    """An executor without revoke_task (NotImplementedError): the re-check's row lock is not kept."""
    from tests.unit.callbacks.test_database_callback_sink_transaction import _row_locked
    from tests.unit.harness.db import dialect_locks_rows, no_row_locks_reason

    if not dialect_locks_rows(session):
        pytest.skip(no_row_locks_reason(session))
    runner = scheduler_job_runner

    def revoke_task(*, ti):
        raise NotImplementedError

    monkeypatch.setattr(runner.executor, "revoke_task", revoke_task)
    runner._handle_tasks_stuck_in_queued(session=session)

    assert not _row_locked(other_session, stuck_ti.id), "the handler still holds the row lock"
    session.commit()
    assert _reload(session, stuck_ti).state == TaskInstanceState.QUEUED
