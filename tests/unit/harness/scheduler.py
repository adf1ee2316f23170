# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
The scheduler: a real ``SchedulerJobRunner`` with a :class:`RecordingExecutor` (``scheduler_job_runner``),
what it talks to (the execution API, ``api``; listeners, ``listener_manager``) and the helpers that hand it
executor events of a try whose process died.
"""

from __future__ import annotations

import tests.unit.harness.env  # noqa: F401  (first: sets the environment before airflow is imported)

from collections.abc import Generator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import pytest
from airflow import settings
from sqlalchemy import select
from airflow.executors.base_executor import BaseExecutor
from airflow.listeners.listener import get_listener_manager


if TYPE_CHECKING:
    from airflow.callbacks.callback_requests import CallbackRequest
    from airflow.jobs.scheduler_job_runner import SchedulerJobRunner
    from sqlalchemy.orm import Session


@pytest.fixture(scope="session")
def api():
    """
    Airflow's execution API in-process (``ti_race.ExecutionApi``), built and warmed up once per run: building
    its versioned routers takes seconds, and no test changes the app (each request opens its own session).
    """
    from tests.unit.ti_race import ExecutionApi

    execution_api = ExecutionApi()
    execution_api.warm_up()
    return execution_api


@pytest.fixture
def listener_manager():
    """
    Upstream's ``listener_manager``: yields ``add_listener(listener)``, which registers with the core (and,
    if present, the task-sdk) listener manager; both are emptied before and after the test.
    """
    core = get_listener_manager()
    try:
        from airflow.sdk.listener import get_listener_manager as get_sdk_listener_manager

        sdk = get_sdk_listener_manager()
    except ImportError:
        sdk = None
    managers = [m for m in (core, sdk) if m is not None]
    for m in managers:
        m.clear()

    def add_listener(listener) -> None:
        for m in managers:
            m.add_listener(listener)

    yield add_listener
    for m in managers:
        m.clear()


class RecordingExecutor(BaseExecutor):
    """
    A real ``BaseExecutor`` that executes nothing and records what the scheduler tells it.

    ``callbacks_sent``: list of ``CallbackRequest`` passed to ``send_callback`` (which still
    runs ``BaseExecutor.send_callback`` -> ``callback_sink.send`` -> a ``callback`` row).
    ``state_changes``: list of ``(key, state, remove_running)`` from ``change_state``
    (``fail``/``success`` go through it too), recorded before the real implementation runs.
    Queued workloads stay in ``queued_tasks``; ``sync`` does nothing.
    """

    supports_callbacks = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.callbacks_sent: list[CallbackRequest] = []
        self.state_changes: list[tuple[Any, Any, bool]] = []

    def send_callback(self, request: CallbackRequest, **kwargs: Any) -> None:
        # **kwargs: the series passes the caller's ``session`` (issue 8); the base passes nothing.
        self.callbacks_sent.append(request)
        super().send_callback(request, **kwargs)

    def change_state(self, key, state, info=None, remove_running=True) -> None:
        self.state_changes.append((key, state, remove_running))
        super().change_state(key, state, info, remove_running=remove_running)

    def _process_workloads(self, workloads) -> None:
        pass  # Nothing is executed.

    def _drain_events_with_task_ids(self, *args: Any, **kwargs: Any) -> Any:
        """
        3.4: the scheduler takes a ``TaskInstanceKey`` event for the try whose id the executor captured when
        it took the workload (``_register_task``); the tests hand over workloads by key only
        (``running.add(ti.key)``), so each key is resolved here to the row of that try, live or archived.
        """
        from airflow.models.taskinstance import TaskInstance
        from airflow.models.taskinstancekey import TaskInstanceKey

        for key in [k for k in self.event_buffer if isinstance(k, TaskInstanceKey)]:
            if key in self._task_coordinates.values():
                continue
            with settings.NonScopedSession() as s:
                stmt = select(TaskInstance).where(
                    TaskInstance.dag_id == key.dag_id,
                    TaskInstance.task_id == key.task_id,
                    TaskInstance.run_id == key.run_id,
                    TaskInstance.try_number == key.try_number,
                    TaskInstance.map_index == key.map_index,
                )
                if (ti := s.scalars(stmt.execution_options(include_all_attempts=True)).first()) is not None:
                    self._register_task(ti)
        return super()._drain_events_with_task_ids(*args, **kwargs)

    def sync(self) -> None:
        pass

    def end(self) -> None:
        pass

    def terminate(self) -> None:
        pass


@pytest.fixture
def scheduler_job_runner() -> Generator[SchedulerJobRunner, None, None]:
    """
    A real ``SchedulerJobRunner`` on a real, persisted ``Job`` (``runner.job.id`` set).

    Wired like ``SchedulerJobRunner._execute``: ``runner.executor is runner.executors[0]``
    is a :class:`RecordingExecutor` with ``job_id`` set and a ``DatabaseCallbackSink``;
    ``runner.scheduler_dag_bag`` is the real ``CachedDBDagBag``.
    """
    import inspect

    from airflow.callbacks.database_callback_sink import DatabaseCallbackSink
    from airflow.executors.executor_utils import ExecutorName
    from airflow.jobs.job import Job
    from airflow.jobs.scheduler_job_runner import SchedulerJobRunner

    executor = RecordingExecutor()
    executor.name = ExecutorName(module_path=f"{__name__}.RecordingExecutor", alias="RecordingExecutor")
    if "executors" in inspect.signature(SchedulerJobRunner).parameters:
        job = Job()
        runner = SchedulerJobRunner(job=job, executors=[executor])
    else:  # compat 3.1.x: the job holds the executors; the runner reads self.job.executors
        job = Job(executor=executor)
        runner = SchedulerJobRunner(job=job)
        runner.executors, runner.executor = job.executors, executor
    with settings.NonScopedSession() as s:
        job.prepare_for_execution(session=s)  # what run_job() does: state RUNNING, committed
    for ex in runner.executors:
        ex.job_id = job.id
        ex.callback_sink = DatabaseCallbackSink()
        ex.start()
    yield runner
    for ex in runner.executors:
        ex.end()


V3_HEARTBEAT_RULE = "Do-not-fail-a-running-try-that-still-heartbeats-on-an-executor-event.patch"


def failed_event_hold() -> timedelta:
    """
    How long the series holds a FAILED executor event of a running try whose process heartbeated
    recently before it handles the event as a task killed externally, if no heartbeat follows
    (``Hold-a-failed-executor-event-until-the-running-try-s-heartbeat-decides.patch``; defaults: 20 s).
    """
    from airflow.configuration import conf

    interval = conf.getint("workers", "min_heartbeat_interval")
    attempts = conf.getint("workers", "max_failed_heartbeats")
    timeout = conf.getint("scheduler", "task_instance_heartbeat_timeout")
    return timedelta(seconds=min(timeout, (attempts + 1) * interval))


def once_its_heartbeat_timed_out():
    """
    The clock when an executor event may fail a running try whose process died: past
    ``[scheduler] task_instance_heartbeat_timeout``, as series v3 requires (``V3_HEARTBEAT_RULE``). The same on
    a tree without that patch, so that exported tests need no knowledge of the series.
    """
    import time_machine
    from airflow._shared.timezones import timezone as tz
    from airflow.configuration import conf

    timeout = conf.getint("scheduler", "task_instance_heartbeat_timeout")
    return time_machine.travel(tz.utcnow() + timedelta(seconds=timeout + 1), tick=False)


def process_events_of_dead_process(runner: SchedulerJobRunner, session: Session, executor=None) -> int:
    """
    ``runner._process_executor_events`` for events of a try whose process died (no commit), run once the try's
    heartbeat timed out (``once_its_heartbeat_timed_out``): series v3 does not let an event fail a running try
    that still heartbeats.
    """
    with once_its_heartbeat_timed_out():
        return runner._process_executor_events(executor=executor or runner.executor, session=session)
