# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
What runs once the scheduler's failure handling has committed (upstream #71923).

* ``on_task_instance_failed`` listeners run after the commit; a listener that opens a session the
  usual way (``create_session()``) must get one of its own, not the thread's scoped session the
  scheduler's batch is using, and closing it must not close the batch's session.
* An executor with the 3.3.2 ``send_callback(self, request)`` or a callback sink with the 3.3.2
  ``send(self, callback)`` commits the request on its own. When the executor event is rolled back
  (a database error) and handled again on the next pass, the failed try still gets exactly one
  callback request.
"""

from __future__ import annotations

import types

import pytest
from sqlalchemy import select

from airflow.callbacks.base_callback_sink import BaseCallbackSink
from airflow.callbacks.callback_requests import TaskCallbackRequest
from airflow.callbacks.database_callback_sink import DatabaseCallbackSink
from airflow.listeners import hookimpl
from airflow.models.taskinstance import TaskInstance as TI
from airflow.utils.session import create_session
from airflow.utils.state import TaskInstanceState

from tests.unit.harness import series
from tests.unit.jobs.test_scheduler_failure_declines import RETRIED, callbacks_of, rows, two_failed_events
from tests.unit.jobs.test_scheduler_survives_failure_handling import ForeignKeyViolationOnce
from tests.unit.ti_race import executor_events_step, make_running_tis

P_LISTENERS = "Call-on_task_instance_failed-listeners-after-the-failure-is-committed.patch"
P_SURVIVE = "Keep-the-scheduler-running-when-one-executor-event-fails-in-the-DB.patch"

pytestmark = pytest.mark.db_test

UP_FOR_RETRY = TaskInstanceState.UP_FOR_RETRY


class SessionOpeningListener:
    """A listener that, like many do, opens a session with create_session() and queries."""

    def __init__(self) -> None:
        self.sessions: list[int] = []
        self.seen_states: list = []

    @hookimpl
    def on_task_instance_failed(self, previous_state, task_instance, error):
        with create_session() as s:
            self.sessions.append(id(s))
            self.seen_states.append(s.scalar(select(TI.state).where(TI.dag_id == task_instance.dag_id)))


# Series v3: the calls come after the scheduler loop's own commit (the executor-event patch).
@pytest.mark.proves(
    "Keep-executor-events-until-the-scheduler-s-transaction-commits-them.patch" if series.V3 else P_LISTENERS
)
def test_failure_listener_gets_its_own_session(dag_maker, session, scheduler_job_runner, listener_manager):
    """
    Two FAILED executor events in one step of the scheduler loop; the listener opens a session with
    create_session() for each call and reads the task instance's state there. Both calls run once the
    step's failures are committed: each sees its try up_for_retry, and both failures are committed.
    Before: the listener ran inside the step's transaction, and create_session() returned the step's
    own (the thread's scoped) session, which the listener committed and closed in the middle of the batch.
    """
    runner = scheduler_job_runner
    listener = SessionOpeningListener()
    listener_manager(listener)
    tis = two_failed_events(dag_maker, session, runner, "listener_session")
    session.commit()
    executor_events_step(runner)
    assert len(listener.sessions) == 2
    assert listener.seen_states == [UP_FOR_RETRY, UP_FOR_RETRY]
    for dag_id in tis:
        assert [(r.state, r.try_number) for r in rows(dag_id)] == RETRIED


def _on_retry(context):  # pragma: no cover - only its presence on the task matters
    pass


class LegacySink(BaseCallbackSink):
    """A callback sink written for 3.3.2: ``send(self, callback)``, commits on its own."""

    def send(self, callback):
        DatabaseCallbackSink().send(callback)


def _legacy_send_callback(self, request):
    """``BaseExecutor.send_callback`` as an executor written for 3.3.2 overrides it."""
    self.callback_sink.send(request)


@pytest.mark.proves(P_SURVIVE)
@pytest.mark.parametrize("legacy", ["executor", "sink"])
def test_legacy_callback_path_sends_one_request_when_the_event_is_handled_again(
    dag_maker, session, scheduler_job_runner, legacy
):
    """
    The first handling of a FAILED executor event fails in the database (a foreign-key error on
    the UPDATE of the task instance's id) and is rolled back; it is handled again (by the same step,
    in a transaction of its own, or by the next one). The try must have exactly one callback request. Before: the 3.3.2-style executor/sink committed the
    request at once, in both passes: two requests for one failed try.
    """
    runner = scheduler_job_runner
    executor = runner.executor
    if legacy == "executor":
        executor.send_callback = types.MethodType(_legacy_send_callback, executor)
    else:
        executor.callback_sink = LegacySink()
    (ti,) = make_running_tis(
        dag_maker,
        session,
        dag_id=f"legacy_{legacy}_once",
        queued_by_job_id=runner.job.id,
        on_retry_callback=_on_retry,
    )
    dag_id = ti.dag_id
    executor.event_buffer[ti.key] = (TaskInstanceState.FAILED, None)
    session.expunge_all()

    injected = ForeignKeyViolationOnce([ti.id])
    try:
        executor_events_step(runner)
    finally:
        injected.remove()
    assert injected.fired
    executor_events_step(runner)
    assert [(r.state, r.try_number) for r in rows(dag_id)] == RETRIED
    requests = [r for r in callbacks_of(dag_id) if isinstance(r, TaskCallbackRequest)]
    assert len(requests) == 1, requests


@pytest.mark.proves("Keep-executor-events-until-the-scheduler-s-transaction-commits-them.patch")
def test_a_raising_call_after_the_commit_does_not_stop_the_others(dag_maker, session, scheduler_job_runner):
    """
    Two FAILED executor events in one step; the executor's 3.3.2-style ``send_callback(self, request)``
    raises for the first request. Both failures are committed, the second request is still sent, and the
    step does not raise. Before: the call was made inside the event's handling and its exception left the
    scheduler loop.
    """
    runner = scheduler_job_runner
    executor = runner.executor
    sent: list[str] = []

    def flaky_send_callback(self, request):
        if not sent:
            sent.append("raised")
            raise RuntimeError("callback sink down")
        sent.append(request.ti.dag_id)
        self.callback_sink.send(request)

    executor.send_callback = types.MethodType(flaky_send_callback, executor)
    tis = two_failed_events(dag_maker, session, runner, "raising_call")
    session.commit()
    executor_events_step(runner)
    assert sent[0] == "raised" and len(sent) == 2, sent
    for dag_id in tis:
        assert [(r.state, r.try_number) for r in rows(dag_id)] == RETRIED
    assert len([r for r in callbacks_of(sent[1]) if isinstance(r, TaskCallbackRequest)]) == 1
