# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
A slow ``on_task_instance_failed`` listener must not stall the scheduler loop (upstream #71923).

In 3.3.2 the listeners run inside failure handling's transaction; with the series' patch 8 they run
after the commit, but still on the scheduler's thread: N failures with an L-second listener hold one
loop for N x L seconds. The scheduler now hands the calls, after the commit, to one background
thread: in commit order, one at a time, each bounded by a timeout, and what is still queued at
shutdown is logged.

The listeners here block on a ``threading.Event`` (never a sleep); the test releases them only
after the scheduler's step has returned, so "returned while the listener was still blocked" is
decided by the order of events, not by a clock. Every wait has a timeout.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import pytest
from sqlalchemy import select
from sqlalchemy.orm import object_session

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
BLOCK = 5  # seconds a blocked listener waits for its release before giving up (never in a pass)


def in_background(runner):
    """
    What ``SchedulerJobRunner._execute`` wraps its loop in. Before the patch there is no such
    method and listeners run on the scheduler's thread: the tests then show that behaviour.
    """
    method = getattr(runner, "failure_listeners_in_background", None)
    return method() if method is not None else contextlib.nullcontext()


class BlockingListener:
    """
    Records every call; the first ``block_first`` calls block until ``release`` is set (or
    ``BLOCK`` seconds pass, recorded as a give-up). Each call reads the TI row on a session it
    opens with ``create_session()``, as listeners do.
    """

    def __init__(self, block_first: int = 1) -> None:
        self.block_first = block_first
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.calls: list[dict] = []
        self.started: list[threading.Event] = [threading.Event() for _ in range(10)]
        self.returned: list[threading.Event] = [threading.Event() for _ in range(10)]
        self.gave_up = 0
        self.active = 0
        self.max_active = 0  # calls running at the same time, at most

    @hookimpl
    def on_task_instance_failed(self, previous_state, task_instance, error):
        with self.lock:
            n = len(self.calls)
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            ti_session = object_session(task_instance)
            call = {
                "thread": threading.get_ident(),
                "ti_id": task_instance.id,
                "task_id": task_instance.task_id,
                "try_number": task_instance.try_number,
                "state": task_instance.state,
                "end_date": task_instance.end_date,
                "previous_state": previous_state,
                "error": error,
                "ti_session": None if ti_session is None else id(ti_session),
                "has_task": task_instance.__dict__.get("task") is not None,
            }
            self.calls.append(call)
        self.started[n].set()
        try:
            if n < self.block_first and not self.release.wait(BLOCK):
                with self.lock:
                    self.gave_up += 1
            with create_session() as s:
                call["session"] = id(s)
                call["db"] = s.execute(
                    select(TI.id, TI.state, TI.try_number, TI.end_date).where(
                        TI.dag_id == task_instance.dag_id,
                        TI.task_id == task_instance.task_id,
                        TI.run_id == task_instance.run_id,
                    )
                ).one()
            call["dag_run_id"] = task_instance.dag_run.run_id
        finally:
            with self.lock:
                self.active -= 1
            self.returned[n].set()


@pytest.fixture
def listener(listener_manager):
    blocking = BlockingListener()
    listener_manager(blocking)
    yield blocking
    blocking.release.set()


def dispatchers() -> list[threading.Thread]:
    """The background dispatcher threads of this process (none before the patch)."""
    return [t for t in threading.enumerate() if t.name == "on_task_instance_failed-dispatcher"]


def failed_events(dag_maker, session, runner, prefix: str, n: int) -> list[TI]:
    tis = []
    for i in range(n):
        (ti,) = make_running_tis(dag_maker, session, dag_id=f"{prefix}_{i}", queued_by_job_id=runner.job.id)
        runner.executor.event_buffer[ti.key] = (FAILED, None)
        tis.append(ti)
    session.expunge_all()
    return tis


@pytest.mark.proves(P_BACKGROUND)
def test_executor_events_return_while_the_failure_listener_blocks(
    dag_maker, session, scheduler_job_runner, listener
):
    """
    Three FAILED executor events in one batch; the listener's first call blocks. The batch (its
    processing and commit, one scheduler step) must return while that call is still blocked; once
    released, the listener gets exactly one call per failed try, in commit order, off the
    scheduler's thread, seeing the committed state (in the task instance it gets and in the
    database through its own session), and can load relationships through its own session.
    Before: the step waited for the listener (here: until it gave up after BLOCK seconds).
    """
    runner = scheduler_job_runner
    tis = failed_events(dag_maker, session, runner, "bg_batch", 3)
    with in_background(runner):
        runner._process_executor_events(executor=runner.executor, session=session)
        session.commit()
        assert not listener.returned[0].is_set(), "the scheduler's step waited for the listener"
        assert listener.gave_up == 0
        assert listener.started[0].wait(WAIT), "the listener was not called"
        listener.release.set()
        assert listener.returned[2].wait(WAIT)

    assert listener.gave_up == 0
    assert listener.max_active == 1, "calls overlapped though none overran the timeout"
    assert [c["task_id"] for c in listener.calls] == ["sensor"] * 3
    assert [c["db"] for c in listener.calls] == [
        (c["ti_id"], UP_FOR_RETRY, 1, c["end_date"]) for c in listener.calls
    ]
    assert all(c["end_date"] is not None for c in listener.calls)
    # a copy attached to a session of the listener thread, not the scheduler's object or session
    assert all(c["ti_session"] not in (None, id(session)) for c in listener.calls)
    # the error argument is the one failure handling got (the scheduler's executor-event message)
    assert all("reported that the task instance" in c["error"] for c in listener.calls)
    assert [(c["state"], c["try_number"], c["previous_state"]) for c in listener.calls] == [
        (UP_FOR_RETRY, 1, TaskInstanceState.RUNNING)
    ] * 3
    # commit order is event order here: one call per TI, each TI's run
    assert sorted(c["dag_run_id"] for c in listener.calls) == sorted(ti.run_id for ti in tis)
    assert all(c["has_task"] for c in listener.calls)
    assert all(c["thread"] != threading.get_ident() for c in listener.calls)
    assert all(c["session"] != id(session) for c in listener.calls)


def _next_try_running(session, dag_id: str, job_id: int) -> TI:
    ti = session.scalars(select(TI).where(TI.dag_id == dag_id)).one()
    ti.state = TaskInstanceState.RUNNING
    ti.try_number += 1
    ti.queued_by_job_id = job_id
    session.commit()
    return ti


@pytest.mark.proves(P_BACKGROUND)
def test_every_failed_try_gets_one_call_in_order(dag_maker, session, scheduler_job_runner, listener, caplog):
    """
    One task instance (retries=2) fails three tries in three scheduler steps while the listener's
    first call is blocked: none of the steps waits for it, and the listener then gets exactly three
    calls, in try order, each with the state that try's failure committed (UP_FOR_RETRY, UP_FOR_RETRY,
    FAILED) and the id the try had after the commit. Before: the first step waited for the listener.
    """
    runner = scheduler_job_runner
    (ti,) = make_running_tis(dag_maker, session, dag_id="bg_tries", retries=2, queued_by_job_id=runner.job.id)
    dag_id = ti.dag_id
    ids = []
    end_dates = []
    caplog.set_level(logging.WARNING, logger="airflow.listeners.background")
    with in_background(runner):
        for attempt in range(3):
            if attempt:
                ti = _next_try_running(session, dag_id, runner.job.id)
            runner.executor.event_buffer[ti.key] = (FAILED, None)
            session.expunge_all()
            runner._process_executor_events(executor=runner.executor, session=session)
            session.commit()
            ti_id, end_date = session.execute(select(TI.id, TI.end_date).where(TI.dag_id == dag_id)).one()
            ids.append(ti_id)
            end_dates.append(end_date)
        assert not listener.returned[0].is_set(), "a scheduler step waited for the listener"
        # released as the block ends: the shutdown must wait for the three queued calls
        listener.release.set()
    assert listener.returned[2].is_set(), "the shutdown did not wait for the queued calls"
    assert "Shutting down with" not in caplog.text

    assert listener.gave_up == 0
    assert listener.max_active == 1
    assert [(c["try_number"], c["state"]) for c in listener.calls] == [
        (1, UP_FOR_RETRY),
        (2, UP_FOR_RETRY),
        (3, FAILED),
    ]
    assert [c["ti_id"] for c in listener.calls] == ids
    # each call's end_date is its own try's (a copy), not what the row held when the call ran
    assert [c["end_date"] for c in listener.calls] == end_dates
    assert len(set(end_dates)) == 3


@pytest.mark.proves(P_BACKGROUND)
def test_a_hung_listener_is_bounded_by_the_timeout(
    dag_maker, session, scheduler_job_runner, listener, monkeypatch, caplog
):
    """
    The first call hangs (blocked until the test ends); with a 0.5 s timeout the second failure's
    call must start (and finish) while the first is still blocked, and the hung call is logged. The
    shutdown, while the abandoned call still runs, does not wait for it nor list it again; released
    afterwards, it returns (its thread kept running). Before: the scheduler's step waited for the
    first call.
    """
    monkeypatch.setenv("AIRFLOW__SCHEDULER__TASK_INSTANCE_FAILED_LISTENER_TIMEOUT", "0.5")
    runner = scheduler_job_runner
    failed_events(dag_maker, session, runner, "bg_hung", 2)
    caplog.set_level(logging.WARNING, logger="airflow.listeners.background")
    try:
        with in_background(runner):
            runner._process_executor_events(executor=runner.executor, session=session)
            session.commit()
            assert listener.returned[1].wait(WAIT), "the second call did not run"
            assert not listener.returned[0].is_set(), "the first call returned: it was not hung"
        # shut down while the abandoned call still runs: logged at its timeout, not listed again
        assert not listener.returned[0].is_set()
    finally:
        listener.release.set()
    assert listener.returned[0].wait(WAIT), "the abandoned call did not go on running"

    assert listener.gave_up == 0
    assert len(listener.calls) == 2
    assert "did not return within 0.5 s" in caplog.text
    assert "Shutting down with" not in caplog.text


@pytest.mark.proves(P_BACKGROUND)
def test_scheduler_loop_shutdown_logs_pending_listener_calls(
    dag_maker, session, scheduler_job_runner, listener, caplog
):
    """
    One real scheduler loop (``_execute`` with ``num_runs=1``) handles two FAILED executor events;
    the listener's first call blocks. ``_execute`` must return without waiting for it (after a
    short shutdown wait) and log both calls as not finished at shutdown; the second is not run.
    Before: the loop waited for the listener (until it gave up after BLOCK seconds).
    """
    from airflow.configuration import conf

    runner = scheduler_job_runner
    runner.num_runs = 1
    runner.failure_listener_shutdown_timeout = 0.2
    tis = failed_events(dag_maker, session, runner, "bg_shutdown", 2)
    caplog.set_level(logging.WARNING, logger="airflow.listeners.background")
    try:
        runner._execute()
    finally:
        returned_first = listener.returned[0].is_set()
        listener.release.set()
    assert not returned_first, "the scheduler loop waited for the listener"
    assert listener.returned[0].wait(WAIT)
    # the dispatcher ends once the released call returns; only then is "not run" decided
    for thread in dispatchers():
        thread.join(WAIT)
        assert not thread.is_alive(), "the dispatcher did not end"
    assert len(listener.calls) == 1, "a call queued at shutdown ran"
    assert "Shutting down with 2 on_task_instance_failed call(s) not finished" in caplog.text
    for ti in tis:
        assert f"{ti.dag_id}.{ti.task_id} run_id={ti.run_id} map_index=-1 try 1 " in caplog.text
    rows = session.execute(select(TI.state).where(TI.dag_id.in_([ti.dag_id for ti in tis]))).scalars().all()
    assert rows == [UP_FOR_RETRY, UP_FOR_RETRY]
    # the defaults the patch message states: 60 s per call, 5 s at shutdown
    assert conf.getfloat("scheduler", "task_instance_failed_listener_timeout") == 60.0
    assert type(runner).failure_listener_shutdown_timeout == 5.0


class ChangingListener(BlockingListener):
    """A BlockingListener that also changes the task instance it gets (it must not be written)."""

    @hookimpl
    def on_task_instance_failed(self, previous_state, task_instance, error):
        task_instance.hostname = "changed-by-listener"
        super().on_task_instance_failed(previous_state, task_instance, error)


@pytest.mark.proves(P_BACKGROUND)
def test_a_rolled_back_failure_gets_no_call_and_listener_changes_are_not_written(
    dag_maker, session, scheduler_job_runner, listener_manager
):
    """
    The first handling of a FAILED executor event fails in the database (a foreign-key error on the
    UPDATE of the TI's id) and is rolled back; the next pass handles it. While the first call is
    blocked, both passes return; the failed try then gets exactly one listener call, and what the
    listener changed on its task instance is not written. Before: the second pass waited for the
    listener.
    """
    from tests.unit.jobs.test_scheduler_survives_failure_handling import ForeignKeyViolationOnce

    listener = ChangingListener()
    listener_manager(listener)
    runner = scheduler_job_runner
    (ti,) = failed_events(dag_maker, session, runner, "bg_rollback", 1)
    try:
        with in_background(runner):
            injected = ForeignKeyViolationOnce([ti.id])
            try:
                runner._process_executor_events(executor=runner.executor, session=session)
                session.commit()
            finally:
                injected.remove()
            assert injected.fired
            assert list(runner.executor.event_buffer), "the event was not put back for the next pass"
            runner._process_executor_events(executor=runner.executor, session=session)
            session.commit()
            assert not listener.returned[0].is_set(), "the scheduler's step waited for the listener"
            listener.release.set()
            assert listener.returned[0].wait(WAIT)
    finally:
        listener.release.set()
    assert len(listener.calls) == 1
    assert listener.calls[0]["state"] == UP_FOR_RETRY
    hostnames = session.execute(select(TI.hostname).where(TI.dag_id == ti.dag_id)).scalars().all()
    assert hostnames == ["worker-1"]


@pytest.mark.proves(P_BACKGROUND)
def test_queueing_a_call_never_waits(scheduler_job_runner, caplog):
    """
    While one call is blocked, 1000 more are queued from another thread: each ``submit`` returns
    without waiting (the queue is not bounded), and the backlog is logged when it reaches 1000.
    Before: there are no background calls (listeners run on the scheduler's thread).
    """
    runner = scheduler_job_runner
    caplog.set_level(logging.WARNING, logger="airflow.listeners.background")
    started, release = threading.Event(), threading.Event()
    background = in_background(runner)
    calls = background.__enter__()
    try:
        assert calls is not None, "listener calls run on the scheduler's thread"
        calls.submit("blocking", lambda: (started.set(), release.wait(WAIT)))
        assert started.wait(WAIT)
        submitter = threading.Thread(
            target=lambda: [calls.submit(f"call {i}", lambda: None) for i in range(1000)], daemon=True
        )
        submitter.start()
        submitter.join(WAIT)
        if submitter.is_alive():
            # not shut down: its shutdown could wait on the blocked submit; no later test may see it
            import airflow.listeners.background as bg

            bg._active = None
            pytest.fail("queueing a call waited")
        assert "1000 on_task_instance_failed calls are waiting to run" in caplog.text
    finally:
        release.set()
    background.__exit__(None, None, None)
