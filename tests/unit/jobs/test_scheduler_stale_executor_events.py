# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
Stale executor events: a SUCCESS reported for an earlier process of the live try must not fail it.

Every process of one try has the same executor key (dag, task, run, map_index, try_number). A
reschedule-mode sensor's poke that records UP_FOR_RESCHEDULE exits 0, and so does a worker that
calls ``defer()``; the executor then reports SUCCESS for the key. When that event is drained after
the next process of the same try was scheduled, queued or started, unpatched 3.3.2 takes the live
attempt for an externally killed one: failure/retry callback, ``handle_failure``. Upstream
https://github.com/apache/airflow/issues/71172 (PR #71194, reschedule) and
https://github.com/apache/airflow/issues/72716 (defer).

The timelines are driven through Airflow's own code: the worker side through the real execution
API (``InProcessExecutionAPI``: ``PATCH /task-instances/{id}/run`` and ``/state``), which writes
the ``task_reschedule`` row / trigger / ``next_method`` like a real worker's supervisor does; the
scheduler side through ``DagRun.schedule_tis``, ``Trigger.submit_event``, the executor's own
``change_state`` (``success``) and ``SchedulerJobRunner._process_executor_events``. Only the
scheduler's "queue it" step is written as the column values ``_executable_task_instances_to_queued``
writes (state, queued_by_job_id, queued_dttm).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from datetime import timedelta

import httpx
import pytest
import time_machine
from packaging.version import Version
from sqlalchemy import event, func, select

import airflow
from airflow._shared.timezones import timezone
from airflow.callbacks.callback_requests import TaskCallbackRequest
from airflow.models.db_callback_request import DbCallbackRequest
from airflow.models.log import Log
from airflow.models.taskinstance import TaskInstance
from airflow.models.taskinstancekey import TaskInstanceKey
from airflow.models.taskreschedule import TaskReschedule
from airflow.models.trigger import Trigger
from airflow.providers.standard.sensors.python import PythonSensor
from airflow.providers.standard.sensors.time_delta import TimeDeltaSensor
from airflow.triggers.base import TriggerEvent
from airflow.utils.state import TaskInstanceState

from tests.unit.harness.env import BACKEND
from tests.unit.harness.series import carries, guard_since, read_series
from tests.unit.harness.scheduler import once_its_heartbeat_timed_out, process_events_of_dead_process

PATCH = "Ignore-stale-executor-events-from-an-earlier-process-of-the-live-try.patch"
P_PURGE = "Fail-heartbeat-timed-out-tries-in-the-same-pass.patch"

pytestmark = pytest.mark.db_test

ON_3_4 = Version(airflow.__version__).release >= (3, 4)

LIVE_STATES = [TaskInstanceState.SCHEDULED, TaskInstanceState.QUEUED, TaskInstanceState.RUNNING]


def _on_failure(context):  # pragma: no cover - never run here, only makes the task have callbacks
    pass


def _on_retry(context):  # pragma: no cover
    pass


def _never(**_):  # pragma: no cover
    return False


# --------------------------------------------------------------------------------------------
# Worker side: the real execution API, in process (what a task's supervisor talks to).
# --------------------------------------------------------------------------------------------
@pytest.fixture
def execution_api(api) -> Iterator[httpx.Client]:
    """A client of the run's execution API app (the harness's ``api``)."""
    with api.client() as client:
        yield client


class TaskWorker:
    """One worker process of a try, as the execution API sees it."""

    def __init__(self, client: httpx.Client, ti: TaskInstance) -> None:
        self.client = client
        self.ti_id = ti.id

    def _patch(self, path: str, payload: dict) -> httpx.Response:
        response = self.client.patch(f"/task-instances/{self.ti_id}/{path}", json=payload)
        assert response.status_code < 300, (path, response.status_code, response.text)
        return response

    def start(self) -> None:
        self._patch(
            "run",
            {
                "state": "running",
                "hostname": socket.gethostname(),
                "unixname": "airflow",
                "pid": os.getpid(),
                "start_date": timezone.utcnow().isoformat(),
            },
        )

    def reschedule(self) -> None:
        now = timezone.utcnow()
        self._patch(
            "state",
            {
                "state": "up_for_reschedule",
                "reschedule_date": (now + timedelta(seconds=2)).isoformat(),
                "end_date": now.isoformat(),
            },
        )

    def defer(self) -> None:
        self._patch(
            "state",
            {
                "state": "deferred",
                "classpath": "airflow.providers.standard.triggers.temporal.DateTimeTrigger",
                "trigger_kwargs": {"moment": (timezone.utcnow() + timedelta(hours=1)).isoformat()},
                "next_method": "execute_complete",
                "next_kwargs": {},
            },
        )


# --------------------------------------------------------------------------------------------
# Scheduler side helpers.
# --------------------------------------------------------------------------------------------
def _reload(session, ti: TaskInstance) -> TaskInstance:
    session.expire_all()
    return session.scalars(
        select(TaskInstance).where(
            TaskInstance.dag_id == ti.dag_id,
            TaskInstance.task_id == ti.task_id,
            TaskInstance.run_id == ti.run_id,
            TaskInstance.map_index == ti.map_index,
        )
    ).one()


def _schedule(session, dag_run, tis: list[TaskInstance]) -> None:
    """The scheduler's own step (``DagRun.schedule_tis``): None/UP_FOR_RESCHEDULE -> SCHEDULED."""
    for ti in tis:
        ti.task = dag_run.dag.get_task(ti.task_id)
    dag_run.schedule_tis(tis, session=session)
    session.commit()


def _queue(session, runner, tis: list[TaskInstance]) -> None:
    """What ``_executable_task_instances_to_queued`` writes, and the executor taking the workload."""
    now = timezone.utcnow()
    for ti in tis:
        ti = _reload(session, ti)
        ti.state = TaskInstanceState.QUEUED
        ti.queued_by_job_id = runner.job.id
        ti.queued_dttm = now
        session.flush()  # _reload() expires the session: keep each TI's change
        # The executor runs the workload under the try's key (LocalExecutor: in ``running``).
        runner.executor.running.add(ti.key)
    session.commit()


def _drain_late_success(runner, tis: list[TaskInstance | TaskInstanceKey]) -> None:
    """The earlier process's exit 0 is reported now (``BaseExecutor.success``), for the same key."""
    for ti in tis:
        runner.executor.success(ti if isinstance(ti, TaskInstanceKey) else ti.key)


def _process_events(runner, session) -> int:
    n = runner._process_executor_events(executor=runner.executor, session=session)
    session.commit()
    return n


def _db_callbacks(session) -> int:
    return session.scalar(select(func.count()).select_from(DbCallbackRequest))


def _mismatch_logs(session) -> int:
    return session.scalar(select(func.count()).select_from(Log).where(Log.event == "state mismatch"))


# Every test task: one retry, failure/retry callbacks and emails (what a stale event must not trigger).
_RETRY_AND_CALLBACKS = {
    "retries": 1,
    "on_failure_callback": _on_failure,
    "on_retry_callback": _on_retry,
    "email": "ops@example.invalid",
    "email_on_failure": True,
    "email_on_retry": True,
}


def _make_sensors(dag_maker, session, n: int = 1, dag_id: str = "stale_sensor"):
    with dag_maker(dag_id, session=session):
        for i in range(n):
            PythonSensor(
                task_id=f"sensor_{i}",
                python_callable=_never,
                mode="reschedule",
                poke_interval=2,
                **_RETRY_AND_CALLBACKS,
            )
    dag_run = dag_maker.create_dagrun()
    return dag_run, sorted(dag_run.task_instances, key=lambda t: t.task_id)


def _make_deferrable(dag_maker, session, n: int = 1, dag_id: str = "stale_defer"):
    with dag_maker(dag_id, session=session):
        for i in range(n):
            TimeDeltaSensor(
                task_id=f"deferrable_{i}",
                delta=timedelta(hours=1),
                deferrable=True,
                **_RETRY_AND_CALLBACKS,
            )
    dag_run = dag_maker.create_dagrun()
    return dag_run, sorted(dag_run.task_instances, key=lambda t: t.task_id)


def _first_poke_rescheduled(session, runner, api, dag_run, tis) -> None:
    """Poke 1 of try 1 runs and records UP_FOR_RESCHEDULE (task_reschedule row); its exit is pending."""
    if BACKEND == "mysql" and airflow.__version__.startswith("3.1."):
        pytest.skip(
            "3.1.x on MySQL/MariaDB gives every reschedule poke a new try_number (DagRun.schedule_tis sets "
            "state before its CASE on state is evaluated, left to right; fixed upstream in 3.2): no later "
            "poke of the same try exists there"
        )
    _schedule(session, dag_run, tis)
    _queue(session, runner, tis)
    for ti in tis:
        worker = TaskWorker(api, _reload(session, ti))
        worker.start()
        worker.reschedule()


def _second_poke_reaches(session, runner, api, dag_run, tis, live_state: TaskInstanceState) -> None:
    """The reschedule date passed: the try's next poke goes SCHEDULED -> QUEUED -> RUNNING."""
    _schedule(session, dag_run, [_reload(session, ti) for ti in tis])
    if live_state in (TaskInstanceState.QUEUED, TaskInstanceState.RUNNING):
        _queue(session, runner, tis)
    if live_state == TaskInstanceState.RUNNING:
        for ti in tis:
            TaskWorker(api, _reload(session, ti)).start()


def _deferred_and_resumed(session, runner, api, dag_run, tis, live_state: TaskInstanceState) -> None:
    """Try 1 runs, defers (its process exits 0), the trigger fires and the resumed attempt goes on."""
    _schedule(session, dag_run, tis)
    _queue(session, runner, tis)
    for ti in tis:
        worker = TaskWorker(api, _reload(session, ti))
        worker.start()
        worker.defer()
    session.expire_all()
    for ti in tis:
        trigger_id = _reload(session, ti).trigger_id
        assert trigger_id is not None
        Trigger.submit_event(trigger_id, TriggerEvent({"fired": True}), session=session)
    session.commit()
    if live_state in (TaskInstanceState.QUEUED, TaskInstanceState.RUNNING):
        _queue(session, runner, tis)
    if live_state == TaskInstanceState.RUNNING:
        for ti in tis:
            TaskWorker(api, _reload(session, ti)).start()


# --------------------------------------------------------------------------------------------
# Regression tests.
# --------------------------------------------------------------------------------------------
@pytest.mark.proves(PATCH)
@pytest.mark.parametrize("live_state", LIVE_STATES, ids=lambda s: s.value)
def test_reschedule_poke_success_drained_late_does_not_fail_live_poke(
    dag_maker, session, scheduler_job_runner, execution_api, live_state
):
    """#71172: poke 1's SUCCESS drained while poke 2 of the same try is scheduled/queued/running."""
    runner = scheduler_job_runner
    dag_run, (ti,) = _make_sensors(dag_maker, session)
    _first_poke_rescheduled(session, runner, execution_api, dag_run, [ti])
    assert session.scalar(select(func.count()).select_from(TaskReschedule)) == 1
    _second_poke_reaches(session, runner, execution_api, dag_run, [ti], live_state)
    before = _reload(session, ti)
    assert (before.state, before.try_number) == (live_state, 1)

    _drain_late_success(runner, [before])
    _process_events(runner, session)

    after = _reload(session, ti)
    assert after.state == live_state, "the live poke was failed by poke 1's exit event"
    assert (after.try_number, after.id) == (1, before.id)
    assert runner.executor.callbacks_sent == []
    assert _db_callbacks(session) == 0
    assert _mismatch_logs(session) == 0
    assert runner.executor.get_event_buffer() == {}, "the stale event must be consumed"


@pytest.mark.parametrize(
    "live_state",
    [
        # 3.4's resume-after-defer guard covers a resumed try back in QUEUED: a guard there.
        pytest.param(TaskInstanceState.QUEUED, marks=guard_since("3.4.0", PATCH)),
        pytest.param(TaskInstanceState.RUNNING, marks=pytest.mark.proves(PATCH)),
    ],
    ids=lambda s: s.value,
)
def test_defer_exit_success_drained_late_does_not_fail_resumed_attempt(
    dag_maker, session, scheduler_job_runner, execution_api, live_state
):
    """#72716: the defer exit's SUCCESS drained while the resumed attempt is queued/running."""
    runner = scheduler_job_runner
    dag_run, (ti,) = _make_deferrable(dag_maker, session)
    _deferred_and_resumed(session, runner, execution_api, dag_run, [ti], live_state)
    before = _reload(session, ti)
    assert (before.state, before.try_number, before.next_method) == (live_state, 1, "execute_complete")

    _drain_late_success(runner, [before])
    _process_events(runner, session)

    after = _reload(session, ti)
    assert after.state == live_state, "the resumed attempt was failed by the defer exit's event"
    assert after.next_method == "execute_complete"
    assert runner.executor.callbacks_sent == []
    assert _db_callbacks(session) == 0
    assert _mismatch_logs(session) == 0


@guard_since("3.2.0", PATCH)  # 3.1.x fails the resumed try: the stale-event patch there covers it
def test_defer_exit_success_drained_late_while_resume_is_scheduled(
    dag_maker, session, scheduler_job_runner, execution_api
):
    """The SCHEDULED case of #72716: handled since 3.2 (a guard there); on 3.1.x the stale-event patch."""
    runner = scheduler_job_runner
    dag_run, (ti,) = _make_deferrable(dag_maker, session)
    _deferred_and_resumed(session, runner, execution_api, dag_run, [ti], TaskInstanceState.SCHEDULED)
    _drain_late_success(runner, [_reload(session, ti)])
    _process_events(runner, session)
    assert _reload(session, ti).state == TaskInstanceState.SCHEDULED
    assert runner.executor.callbacks_sent == []
    assert _db_callbacks(session) == 0


# --------------------------------------------------------------------------------------------
# Not stale: a process that really died is still failed.
# --------------------------------------------------------------------------------------------
@pytest.mark.guard
@pytest.mark.parametrize("event_state", [TaskInstanceState.SUCCESS, TaskInstanceState.FAILED])
def test_sensor_killed_during_first_poke_is_failed_once(
    dag_maker, session, scheduler_job_runner, execution_api, event_state
):
    """No task_reschedule row for the try: the event is the live poke's own exit -> externally killed."""
    runner = scheduler_job_runner
    dag_run, (ti,) = _make_sensors(dag_maker, session)
    _schedule(session, dag_run, [ti])
    _queue(session, runner, [ti])
    TaskWorker(execution_api, _reload(session, ti)).start()
    running = _reload(session, ti)
    assert running.state == TaskInstanceState.RUNNING

    runner.executor.change_state(running.key, event_state)
    process_events_of_dead_process(runner, session)  # no heartbeat of the dead process follows
    session.commit()

    after = _reload(session, ti)
    assert after.state == TaskInstanceState.UP_FOR_RETRY
    callbacks = [c for c in runner.executor.callbacks_sent if isinstance(c, TaskCallbackRequest)]
    assert len(callbacks) == 1
    assert callbacks[0].task_callback_type == TaskInstanceState.UP_FOR_RETRY
    assert "finished with state" in callbacks[0].msg
    assert _mismatch_logs(session) == 1


@pytest.mark.guard
@pytest.mark.parametrize("kind", ["reschedule", "defer"])
def test_failed_event_of_live_attempt_is_never_stale(
    dag_maker, session, scheduler_job_runner, execution_api, kind
):
    """The live poke 2 / resumed attempt exits FAILED without reporting: externally killed, once."""
    runner = scheduler_job_runner
    if kind == "reschedule":
        dag_run, (ti,) = _make_sensors(dag_maker, session)
        _first_poke_rescheduled(session, runner, execution_api, dag_run, [ti])
        _second_poke_reaches(session, runner, execution_api, dag_run, [ti], TaskInstanceState.RUNNING)
    else:
        dag_run, (ti,) = _make_deferrable(dag_maker, session)
        _deferred_and_resumed(session, runner, execution_api, dag_run, [ti], TaskInstanceState.RUNNING)
    running = _reload(session, ti)
    assert running.state == TaskInstanceState.RUNNING

    runner.executor.fail(running.key)
    process_events_of_dead_process(runner, session)  # no heartbeat of the dead process follows
    session.commit()

    assert _reload(session, ti).state == TaskInstanceState.UP_FOR_RETRY
    callbacks = [c for c in runner.executor.callbacks_sent if isinstance(c, TaskCallbackRequest)]
    assert len(callbacks) == 1
    assert _mismatch_logs(session) == 1


def _applied_last(*patches: str) -> str:
    """Of ``patches``, all of which a test needs, the one its base's queue applies last (3.1.8 has the
    purge patch after the stale-event patch, 3.2.2 and 3.3.2 before it)."""
    series = read_series() or []
    return max(patches, key=lambda p: series.index(p) if p in series else -1)


@pytest.mark.proves(_applied_last(PATCH, P_PURGE))
@pytest.mark.skipif(
    not (carries(P_PURGE) or ON_3_4), reason=f"needs {P_PURGE} (the purge fails the try), not in this queue"
)  # 3.4 has upstream #68008: its purge fails the try in the same pass
def test_second_poke_killed_without_heartbeat_is_failed_by_the_purge_once(
    dag_maker, session, scheduler_job_runner, execution_api
):
    """
    Poke 2's process dies without a word (supervisor killed): only poke 1's SUCCESS is pending.

    The stale event is ignored; the heartbeat-timeout purge is what fails the try, exactly once,
    and the FAILED event the purge produces adds nothing. The last part needs the heartbeat-timeout
    patches of the series (the purge fails the TI in the same pass, upstream #42553); on 3.3.2
    alone the purge leaves the TI RUNNING and its FAILED event sends a second callback.
    """
    runner = scheduler_job_runner
    dag_run, (ti,) = _make_sensors(dag_maker, session)
    _first_poke_rescheduled(session, runner, execution_api, dag_run, [ti])
    _second_poke_reaches(session, runner, execution_api, dag_run, [ti], TaskInstanceState.RUNNING)
    _drain_late_success(runner, [_reload(session, ti)])

    # 1. Poke 1's late SUCCESS: stale, nothing happens; poke 2 is still RUNNING.
    _process_events(runner, session)
    assert _reload(session, ti).state == TaskInstanceState.RUNNING
    assert runner.executor.callbacks_sent == []

    # 2. Poke 2 never heartbeats again: past the timeout the purge fails it.
    timeout = runner._task_instance_heartbeat_timeout_secs
    with time_machine.travel(timezone.utcnow() + timedelta(seconds=timeout + 60), tick=False):
        runner._find_and_purge_task_instances_without_heartbeats()
        session.expire_all()
        # 3. The FAILED event the purge produced is processed in the next loop.
        _process_events(runner, session)

    callbacks = [c for c in runner.executor.callbacks_sent if isinstance(c, TaskCallbackRequest)]
    assert len(callbacks) == 1, [c.msg for c in callbacks]
    assert "Task Id" in callbacks[0].msg, "the one callback must come from the heartbeat-timeout purge"
    assert _reload(session, ti).state == TaskInstanceState.UP_FOR_RETRY


@pytest.mark.proves(PATCH)
def test_one_batch_tells_stale_from_dead_per_task_instance(
    dag_maker, session, scheduler_job_runner, execution_api
):
    """One batch: sensor_0's event is poke 1's late exit (stale), sensor_1's first poke died (not)."""
    runner = scheduler_job_runner
    dag_run, (stale_ti, dead_ti) = _make_sensors(dag_maker, session, n=2)
    _first_poke_rescheduled(session, runner, execution_api, dag_run, [stale_ti])
    _second_poke_reaches(session, runner, execution_api, dag_run, [stale_ti], TaskInstanceState.RUNNING)
    _schedule(session, dag_run, [_reload(session, dead_ti)])
    _queue(session, runner, [dead_ti])
    TaskWorker(execution_api, _reload(session, dead_ti)).start()

    _drain_late_success(runner, [_reload(session, stale_ti), _reload(session, dead_ti)])
    with once_its_heartbeat_timed_out():  # no heartbeat of the dead poke follows
        _process_events(runner, session)

    assert _reload(session, stale_ti).state == TaskInstanceState.RUNNING
    assert _reload(session, dead_ti).state == TaskInstanceState.UP_FOR_RETRY
    callbacks = [c for c in runner.executor.callbacks_sent if isinstance(c, TaskCallbackRequest)]
    assert [c.ti.task_id for c in callbacks] == [dead_ti.task_id]
    assert _mismatch_logs(session) == 1


# --------------------------------------------------------------------------------------------
# Batch: bounded number of queries, not one per event.
# --------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _count_statements(session) -> Iterator[list[str]]:
    statements: list[str] = []
    engine = session.get_bind()

    def before_cursor_execute(conn, cursor, statement, parameters, context, executemany):
        statements.append(statement)

    event.listen(engine, "before_cursor_execute", before_cursor_execute)
    try:
        yield statements
    finally:
        event.remove(engine, "before_cursor_execute", before_cursor_execute)


def _stale_batch(dag_maker, session, runner, api, n: int, suffix: str) -> list[TaskInstance]:
    """n sensors on poke 2 (RUNNING) and n resumed deferred tasks (RUNNING), all with a late SUCCESS."""
    sensors_run, sensors = _make_sensors(dag_maker, session, n=n, dag_id=f"batch_sensors_{suffix}")
    _first_poke_rescheduled(session, runner, api, sensors_run, sensors)
    _second_poke_reaches(session, runner, api, sensors_run, sensors, TaskInstanceState.RUNNING)
    defer_run, deferred = _make_deferrable(dag_maker, session, n=n, dag_id=f"batch_defer_{suffix}")
    _deferred_and_resumed(session, runner, api, defer_run, deferred, TaskInstanceState.RUNNING)
    tis = [_reload(session, ti) for ti in sensors + deferred]
    assert {ti.state for ti in tis} == {TaskInstanceState.RUNNING}
    return tis


@pytest.mark.proves(PATCH)
def test_batch_of_stale_events_issues_a_bounded_number_of_queries(
    dag_maker, session, scheduler_job_runner, execution_api
):
    runner = scheduler_job_runner
    small_tis = _stale_batch(dag_maker, session, runner, execution_api, n=1, suffix="s")
    large_tis = _stale_batch(dag_maker, session, runner, execution_api, n=8, suffix="l")
    if ON_3_4:
        # 3.4: an executor captures the try's id when it takes the workload; registered here, so that the
        # RecordingExecutor's lookup of a key event's try (one query per key) is not counted as the scheduler's.
        for ti in small_tis + large_tis:
            runner.executor._register_task(ti)
    small, large = [ti.key for ti in small_tis], [ti.key for ti in large_tis]
    session.expunge_all()  # both batches start from an empty identity map

    _drain_late_success(runner, small)
    with _count_statements(session) as small_statements:
        _process_events(runner, session)
    session.expunge_all()
    _drain_late_success(runner, large)
    with _count_statements(session) as large_statements:
        _process_events(runner, session)

    print(f"{len(small)} events: {len(small_statements)} statements; "
          f"{len(large)} events: {len(large_statements)} statements")  # fmt: skip
    assert len(large_statements) == len(small_statements), (small_statements, large_statements)
    reschedule_lookups = [s for s in large_statements if "task_reschedule" in s.lower()]
    assert len(reschedule_lookups) == 1, reschedule_lookups
    assert runner.executor.callbacks_sent == []
    session.expire_all()
    states = session.scalars(
        select(TaskInstance.state).where(TaskInstance.dag_id.in_({k.dag_id for k in small + large}))
    ).all()
    assert states == [TaskInstanceState.RUNNING] * len(small + large)
