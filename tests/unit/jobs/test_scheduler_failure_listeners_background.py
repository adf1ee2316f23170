# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
A hung ``on_task_instance_failed`` listener must neither stall the scheduler loop nor keep a pooled
database connection (review of the v2 series, defect 1; upstream #71923).

With the series' failure-handling patch the scheduler makes the listener calls after its commit, on
its own thread: a listener that hangs hangs the loop. ``SchedulerJobRunner._execute`` now hands them
to one background thread (``runner.failure_listener_thread``, set here as ``_execute`` sets it); each
call gets a copy of the task instance whose ``dag_run`` is loaded through a short session of its own,
closed before the listener runs.

The listeners block on a ``threading.Event`` (never a sleep) that the test sets; every wait has a
timeout. Before the patch the scheduler's step waits for each blocked call until it gives up.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from sqlalchemy import select
from sqlalchemy.orm.exc import DetachedInstanceError
from sqlalchemy.pool import QueuePool

from airflow import settings
from airflow._shared.timezones import timezone
from airflow.listeners import hookimpl
from airflow.models.taskinstance import TaskInstance as TI
from airflow.utils.session import create_session
from airflow.utils.state import TaskInstanceState

from tests.unit.ti_race import make_running_tis

P_BACKGROUND = "Call-on_task_instance_failed-listeners-in-a-background-thread.patch"

pytestmark = pytest.mark.db_test

FAILED = TaskInstanceState.FAILED
UP_FOR_RETRY = TaskInstanceState.UP_FOR_RETRY
WAIT = 30  # seconds: an upper bound for waits that should end at once
BLOCK = 3  # seconds a blocked listener waits for its release before giving up (never in a pass)


class BlockingListener:
    """Records what each call reads (``dag_run`` first), then blocks until ``release`` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.calls: list[dict] = []
        self.started = threading.Event()
        self.gave_up = 0

    @hookimpl
    def on_task_instance_failed(self, previous_state, task_instance, error):
        call = {
            "thread": threading.get_ident(),
            "run_id": task_instance.dag_run.run_id,
            "dag_id": task_instance.dag_id,
            "state": task_instance.state,
            "try_number": task_instance.try_number,
            "ti_id": task_instance.id,
            "has_task": task_instance.__dict__.get("task") is not None,
        }
        with create_session() as s:  # a listener may still use a session of its own
            call["db_state"] = s.scalar(select(TI.state).where(TI.id == task_instance.id))
        try:  # a relationship not loaded: through a session, its connection would be kept while hung
            call["queued_by_job"] = task_instance.queued_by_job.id
        except DetachedInstanceError:
            call["queued_by_job"] = "detached"
        with self.lock:
            self.calls.append(call)
        self.started.set()
        if not self.release.wait(BLOCK):
            with self.lock:
                self.gave_up += 1


@pytest.fixture
def listener(listener_manager):
    blocking = BlockingListener()
    listener_manager(blocking)
    yield blocking
    blocking.release.set()


def in_background(runner) -> None:
    """What ``_execute`` does before its loop; before the patch there is no such thread."""
    from airflow.jobs import scheduler_job_runner

    if hasattr(scheduler_job_runner, "FailureListenerThread"):
        runner.failure_listener_thread = scheduler_job_runner.FailureListenerThread()


def made(runner) -> None:
    """Wait for the queued listener calls (made at once before the patch)."""
    thread = getattr(runner, "failure_listener_thread", None)
    assert thread is None or thread.wait(WAIT), "the queued listener calls were not made"


@pytest.fixture
def one_connection_pool(monkeypatch):
    """The ORM reconfigured with pool_size=1, max_overflow=0; restored afterwards."""
    monkeypatch.setenv("AIRFLOW__DATABASE__SQL_ALCHEMY_POOL_SIZE", "1")
    monkeypatch.setenv("AIRFLOW__DATABASE__SQL_ALCHEMY_MAX_OVERFLOW", "0")
    settings.reconfigure_orm()
    try:
        if not isinstance(settings.engine.pool, QueuePool):
            pytest.skip(f"the pool here is {type(settings.engine.pool).__name__}, not a QueuePool")
        yield settings.engine.pool
    finally:
        monkeypatch.undo()
        settings.reconfigure_orm()


@pytest.mark.proves(P_BACKGROUND)
@pytest.mark.parametrize("path", ["executor_events", "heartbeat_timeout"])
def test_hung_listeners_hold_no_connection_and_the_scheduler_goes_on(
    dag_maker, session, scheduler_job_runner, listener_manager, one_connection_pool, path
):
    """
    Three failed tries in one scheduler step (the executor-event step, or the heartbeat-timeout pass
    for three tries whose heartbeat is an hour old), with a pool of one connection; the listener reads
    ``task_instance.dag_run``, tries ``task_instance.queued_by_job`` (not loaded) and
    then hangs. The step returns and commits while the first call hangs, no connection is checked out
    while it hangs, and the scheduler's next step (the heartbeat-timeout pass, which queries) gets the
    one connection. Once released, each failed try got one call with its own dag run; the relationship
    not loaded raised ``DetachedInstanceError`` (a lazy load through a session would keep that
    session's connection while the listener hangs). Before: the step waited for every blocked call
    (the listener gave up three times).
    """
    listener = BlockingListener()
    listener_manager(listener)
    runner = scheduler_job_runner
    tis = []
    for i in range(3):
        (ti,) = make_running_tis(dag_maker, session, dag_id=f"bg_pool_{i}", queued_by_job_id=runner.job.id)
        if path == "executor_events":
            runner.executor.event_buffer[ti.key] = (FAILED, None)
        else:
            ti.last_heartbeat_at = timezone.utcnow() - timedelta(hours=1)
        tis.append((ti.dag_id, ti.run_id))
    session.commit()
    session.close()
    settings.Session.remove()
    assert one_connection_pool.checkedout() == 0
    in_background(runner)
    try:
        if path == "executor_events":
            runner._process_events_of_executors()
        else:
            runner._find_and_purge_task_instances_without_heartbeats()
        assert listener.started.wait(WAIT), "the listener was not called"
        assert listener.gave_up == 0, "the scheduler's step waited for the hung listener"
        assert settings.engine.pool.checkedout() == 0, "the hung listener holds a connection"
        runner._find_and_purge_task_instances_without_heartbeats()  # the next step: it queries
        with create_session() as s:
            states = s.scalars(select(TI.state).where(TI.dag_id.in_([d for d, _ in tis]))).all()
        assert sorted(states) == [UP_FOR_RETRY] * 3
        assert listener.gave_up == 0
    finally:
        listener.release.set()
    made(runner)
    assert sorted((c["dag_id"], c["run_id"]) for c in listener.calls) == sorted(tis)
    assert [c["state"] for c in listener.calls] == [UP_FOR_RETRY] * 3
    assert [c["db_state"] for c in listener.calls] == [UP_FOR_RETRY] * 3  # read after the commit
    assert all(c["has_task"] for c in listener.calls)
    # the task instance is detached: another lazy load raises instead of checking out a connection
    assert [c["queued_by_job"] for c in listener.calls] == ["detached"] * 3


@pytest.mark.proves(P_BACKGROUND)
def test_every_failed_try_gets_one_call_after_its_commit(dag_maker, session, scheduler_job_runner, listener):
    """
    One task instance (retries=2) fails three tries in three scheduler steps while the listener's first
    call hangs: no step waits for it; once released, the listener gets exactly three calls, in try
    order, each with the state that try's failure committed and the id the try had after the commit,
    off the scheduler's thread. Before: every step waited for
    its call until the listener gave up.
    """
    runner = scheduler_job_runner
    (ti,) = make_running_tis(dag_maker, session, dag_id="bg_tries", retries=2, queued_by_job_id=runner.job.id)
    dag_id, key = ti.dag_id, ti.key
    in_background(runner)
    ids = []
    for attempt in range(3):
        if attempt:
            row = session.scalars(select(TI).where(TI.dag_id == dag_id)).one()
            row.state = TaskInstanceState.RUNNING
            row.try_number += 1
            key = row.key
            session.commit()
        runner.executor.event_buffer[key] = (FAILED, None)
        session.expunge_all()
        runner._process_events_of_executors()
        ids.append(session.scalar(select(TI.id).where(TI.dag_id == dag_id)))
    assert listener.gave_up == 0, "a scheduler step waited for the hung listener"
    listener.release.set()
    made(runner)

    assert listener.gave_up == 0
    assert [(c["try_number"], c["state"]) for c in listener.calls] == [
        (1, UP_FOR_RETRY),
        (2, UP_FOR_RETRY),
        (3, FAILED),
    ]
    assert [c["ti_id"] for c in listener.calls] == ids
    assert all(c["thread"] != threading.get_ident() for c in listener.calls)
