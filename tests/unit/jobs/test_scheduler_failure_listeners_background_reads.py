# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
What a failure listener relied on before the background listener thread (patch 13 on 3.3.2), found by a review.

The relationships OpenLineage reads stay readable (a guard: it passes at step 12 and failed with the first
version of patch 13); a listener's SystemExit does not end the thread; the order of the task's and the run's
failure calls behind a slow call is a known limitation (xfail, strict). A listener's forked child that returns
instead of exiting makes none of the scheduler's queued calls (a guard: it passes at step 12 and failed with the
patch as it was until 2026-12-06 evening). Without a failure listener the thread
reads nothing (a guard: it passes at step 12 and failed with the patch as it was until 2026-12-06, which loaded
what listeners read for every failure: 5 statements a failed task instance in the purge benchmark).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from functools import partial

import pytest
from sqlalchemy import event, select
from sqlalchemy.orm.exc import DetachedInstanceError

from airflow.jobs import scheduler_job_runner
from airflow import settings
from airflow.listeners import hookimpl
from airflow.models.dagrun import DagRun
from airflow.models.taskinstance import TaskInstance as TI
from airflow.utils.state import TaskInstanceState

from tests.unit.jobs.test_scheduler_failure_listeners_background import in_background, made
from tests.unit.ti_race import make_running_tis

pytestmark = pytest.mark.db_test

_HAS_THREAD = hasattr(scheduler_job_runner, "FailureListenerThread")
# The tests drive the executor-event step as the executor-event patch (6 on 3.3.2) shapes it.
_HAS_STEP = hasattr(scheduler_job_runner.SchedulerJobRunner, "_process_events_of_executors")

FAILED = TaskInstanceState.FAILED
BLOCK = 3  # seconds a blocked listener waits for its release before giving up


# What listeners in the wild read besides dag_run: OpenLineage 2.15 reads dag_run.dag_versions, dag_run.note
# and dag_run.deadlines through safe_getattr (DetachedInstanceError -> None: facets silently empty).
READS = {
    "ti.dag_model": lambda ti: ti.dag_model.dag_id,
    "ti.dag_version": lambda ti: ti.dag_version.version_number,
    "ti.note": lambda ti: ti.note,
    "dag_run.dag_versions": lambda ti: [v.version_number for v in ti.dag_run.dag_versions],
    "dag_run.dag_model": lambda ti: ti.dag_run.dag_model.dag_id,
    "dag_run.note": lambda ti: ti.dag_run.note,
}


class ReadingListener:
    def __init__(self) -> None:
        self.errors: dict[str, str] = {}
        self.called = threading.Event()

    @hookimpl
    def on_task_instance_failed(self, previous_state, task_instance, error):
        for name, read in READS.items():
            try:
                read(task_instance)
            except DetachedInstanceError as e:
                self.errors[name] = type(e).__name__
            except Exception as e:  # recorded too: the hook's caller only logs what a listener raises
                self.errors[name] = f"{type(e).__name__}: {e}"
        self.called.set()


@pytest.mark.guard
@pytest.mark.skipif(not _HAS_STEP, reason="the executor-event step comes with the executor-event patch")
def test_listener_reads_relationships_besides_dag_run(
    dag_maker, session, scheduler_job_runner, listener_manager
):
    listener = ReadingListener()
    listener_manager(listener)
    runner = scheduler_job_runner
    (ti,) = make_running_tis(dag_maker, session, dag_id="brk_reads", queued_by_job_id=runner.job.id)
    runner.executor.event_buffer[ti.key] = (FAILED, None)
    session.commit()
    session.close()
    in_background(runner)
    runner._process_events_of_executors()
    made(runner)
    assert listener.called.is_set()
    assert listener.errors == {}


@pytest.mark.guard
@pytest.mark.skipif(not _HAS_STEP, reason="the executor-event step comes with the executor-event patch")
def test_without_a_failure_listener_the_listener_thread_reads_nothing(
    dag_maker, session, scheduler_job_runner, listener_manager
):
    runner = scheduler_job_runner  # listener_manager: no listener registered
    (ti,) = make_running_tis(dag_maker, session, dag_id="brk_no_listener", queued_by_job_id=runner.job.id)
    runner.executor.event_buffer[ti.key] = (FAILED, None)
    session.commit()
    session.close()
    statements: list[str] = []

    def record(conn, cursor, statement, *args) -> None:
        if threading.current_thread().name == "on_task_instance_failed":
            statements.append(statement)

    event.listen(settings.engine, "before_cursor_execute", record)
    try:
        in_background(runner)
        runner._process_events_of_executors()
        made(runner)
    finally:
        event.remove(settings.engine, "before_cursor_execute", record)
    assert session.scalar(select(TI.state).where(TI.dag_id == "brk_no_listener")) == "up_for_retry"
    assert statements == []


class OrderListener:
    """Records hook calls in the order they start; the call for ``brk_slow`` blocks until released."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[tuple[str, str]] = []
        self.blocked = threading.Event()
        self.release = threading.Event()

    @hookimpl
    def on_task_instance_failed(self, previous_state, task_instance, error):
        with self.lock:
            self.events.append(("ti_failed", task_instance.dag_id))
        if task_instance.dag_id == "brk_slow":
            self.blocked.set()
            self.release.wait(30)  # released by the test's finally; the bound only ends a broken test


@pytest.mark.skipif(not _HAS_THREAD, reason="no background listener thread before patch 13")
@pytest.mark.xfail(
    strict=True,
    reason="known limitation of the background-listener patch (13 on 3.3.2, 12 on 3.2.2 and 3.1.8): "
    "on_task_instance_failed is queued behind a slow call while the "
    "scheduler's thread goes on and calls on_dag_run_failed for the same run first (OpenLineage: dag run FAIL "
    "before the task's FAIL); before, the task's call was made before the next scheduling step",
)
def test_task_failed_listener_comes_before_dag_run_failed(
    dag_maker, session, scheduler_job_runner, listener_manager
):
    listener = OrderListener()
    listener_manager(listener)
    runner = scheduler_job_runner
    (slow,) = make_running_tis(dag_maker, session, dag_id="brk_slow", queued_by_job_id=runner.job.id)
    (ti,) = make_running_tis(
        dag_maker, session, dag_id="brk_order", retries=0, queued_by_job_id=runner.job.id
    )
    serialized = dag_maker.serialized_dag
    runner.executor.event_buffer[slow.key] = (FAILED, None)
    session.commit()
    session.close()
    in_background(runner)
    try:
        runner._process_events_of_executors()
        assert listener.blocked.wait(30), "the slow listener call did not start"
        # the slow call runs (blocked); the task's failure is committed and its call queued behind it
        runner.executor.event_buffer[ti.key] = (FAILED, None)
        runner._process_events_of_executors()
        # the scheduler's next step: the dag run of the failed task instance is failed on its thread
        dr = session.scalars(select(DagRun).where(DagRun.dag_id == "brk_order")).one()
        dr.dag = serialized
        dr.update_state(session=session)
        session.commit()
    finally:
        listener.release.set()
    made(runner)
    order = [e for e in listener.events if e[1] == "brk_order"]
    assert order == [("ti_failed", "brk_order"), ("dag_run_failed", "brk_order")]


@pytest.mark.skipif(not _HAS_THREAD, reason="no background listener thread before patch 13")
def test_a_listener_raising_system_exit_does_not_stop_later_calls():
    thread = scheduler_job_runner.FailureListenerThread()
    later = threading.Event()

    def exits() -> None:
        raise SystemExit(1)

    thread._queue.put_nowait(exits)
    thread._queue.put_nowait(later.set)
    assert later.wait(BLOCK), "the call queued after the one that raised SystemExit was not made"


@pytest.mark.guard
@pytest.mark.skipif(not _HAS_THREAD, reason="no background listener thread before patch 13")
def test_a_listeners_child_that_returns_makes_none_of_the_queued_calls(tmp_path):
    """
    OpenLineage's listener does its work in a forked child that ends with ``os._exit(0)``, unless the work
    raises (at OpenLineage's timeout the parent sends SIGTERM, and the scheduler's handler, inherited by the
    child, raises SystemExit): then the exception goes up the child's copy of the listener thread. That
    child must not go on with the calls still queued in the scheduler's copy of the queue (a Celery and
    OpenLineage soak saw a failed try get a second listener call from such a child).
    """
    thread = scheduler_job_runner.FailureListenerThread()
    record = tmp_path / "calls"
    queued = threading.Event()

    def call(name: str) -> None:
        with open(record, "a") as f:
            f.write(f"{os.getpid()} {name}\n")

    def forks_and_fails() -> None:
        call("first")
        assert queued.wait(BLOCK), "the second call was not queued"
        pid = os.fork()
        if pid == 0:
            raise RuntimeError("the child's work failed")
        deadline = time.monotonic() + BLOCK  # the parent waits for its child as OpenLineage's does
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.01)  # polls the child's exit, bounded by the deadline

    thread._queue.put_nowait(forks_and_fails)
    thread._queue.put_nowait(partial(call, "second"))
    queued.set()
    assert thread.wait(3 * BLOCK), "the queued calls were not made"
    assert record.read_text().splitlines() == [f"{os.getpid()} first", f"{os.getpid()} second"]
