# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
Tries that end without the task runner reporting their state, run by a real task-sdk supervisor:
a runner that cannot load its DAG or task at start-up, and a running try a user marks failed
(upstream #60858; issue 21 of this project).

As in ``test_killed_task_runner_real_supervisor.py`` (whose helpers this module uses), task-sdk's own
``supervise_task()`` forks a real task runner that talks to Airflow's execution API in-process; the
scheduler then processes the executor event as LocalExecutor (``TaskRunnerExit`` for a non-zero exit
code) and CeleryExecutor (no info) send it, and the callback requests are counted from the
``callback_request`` table.

A runner that cannot load its DAG or task at start-up (``parse()``: "Dag not found during start up",
"Task not found in Dag during start up") reschedules the try up to ``[workers] missing_dag_retries``
times (upstream PR #59604: not a retry), then logs "Startup reschedule limit exceeded" and exits with
code 1 without reporting a state (``sys.exit(1)``; it loaded no task, so it runs no callback). The
supervisor then derives the state from the exit code (``final_state``): on the last try it reports
``failed`` through ``finish()``, the same request as for a runner that failed and ran its callback;
on an earlier try ``up_for_retry``, which it never sends itself (``STATES_SENT_DIRECTLY``), so it
reports nothing and the try stays running for the executor event.

What the tests show (task-sdk 1.3.2): the last try ends FAILED with no callback on both executors,
and a runner whose ``on_failure_callback`` ran and then ended the process with ``sys.exit(1)``
sends the same report with the same exit code 1: neither the execution API nor the scheduler can
tell the two apart, so airflow-core cannot request the callback for the first without a second one
for the second (README, Known limitations). Only the supervisor knows the difference (whether the
runner reported the state to it, ``_terminal_state``); task-sdk 1.3.2 does not send it.

A user marking a running try failed (the UI and the public API's ``PATCH .../taskInstances/{task_id}``
call ``dag.set_task_instance_state``): no callback, as upstream documents ("Callback functions are
only invoked when the Dag or task state changes due to execution by a worker. As such, Dag and task
changes set by the command line interface (CLI) or user interface (UI) do not execute callback
functions", docs: administration-and-deployment/logging-monitoring/callbacks.html). The supervisor's
next heartbeat gets 409, it kills the runner and reports nothing.
"""

from __future__ import annotations

import signal
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from airflow import settings
from airflow.utils.state import TaskInstanceState

from tests.unit.api_fastapi.execution_api.versions.head.test_task_instances_unreported_exit import (
    BOTH_CALLBACKS,
    FAILED,
    SUCCESS,
    UP_FOR_RETRY,
    callbacks_of_try,
    committed_state,
    running_try,
)
from tests.unit.jobs.test_killed_task_runner_real_supervisor import (
    FINISH_FIELDS,
    SIGKILL_EXIT,
    local_event,
    states,
    supervise,
)
from tests.unit.jobs.test_scheduler_killed_task_runner_callback import executor_event

pytestmark = pytest.mark.db_test

QUEUED = TaskInstanceState.QUEUED
RUNNING = TaskInstanceState.RUNNING
UP_FOR_RESCHEDULE = TaskInstanceState.UP_FOR_RESCHEDULE
RESCHEDULE_FIELDS = ["end_date", "reschedule_date", "state"]


DAG_FILE = """
import os
import sys
import time
from datetime import datetime, timedelta

from airflow.providers.standard.operators.python import PythonOperator
from airflow.sdk import DAG, Variable

MARKER = {marker!r}
MODE = {mode!r}


def _mark(what):
    with open(MARKER, "a") as f:
        f.write(what + "\\n")


def on_failure(context):
    _mark("on_failure_callback")
    if MODE == "exit-in-callback":
        sys.exit(1)


def on_retry(context):
    _mark("on_retry_callback")


def work():
    if MODE == "sleep":
        # The test marks the try failed when this request passes its transport.
        Variable.get("mark_failed_now", default=None)
        time.sleep(120)
    raise RuntimeError("the task failed")


with DAG({dag_id!r}, schedule=None, start_date=datetime(2026, 1, 1)):
    PythonOperator(
        task_id="other" if MODE == "task-missing" else "t",
        python_callable=work,
        retries=1,
        retry_delay=timedelta(seconds=1),
        on_failure_callback=on_failure,
        on_retry_callback=on_retry,
    )
"""


def write_dag(request, dag_id: str, marker: Path, mode: str) -> None:
    """The DAG file the runner loads from the ``dags-folder`` bundle; none for ``dag-missing``."""
    from airflow.configuration import conf

    if mode == "dag-missing":
        return
    dag_path = Path(conf.get("core", "dags_folder")) / f"{dag_id}.py"
    dag_path.write_text(textwrap.dedent(DAG_FILE).format(marker=str(marker), mode=mode, dag_id=dag_id))
    request.addfinalizer(lambda: dag_path.unlink(missing_ok=True))


def queued_try(dag_maker, session, runner, tmp_path, request, *, mode: str, try_number: int):
    """
    A queued try (``retries=1``, both callbacks) of task ``t``; the runner's DAG file per ``mode``:
    ``dag-missing`` (no file), ``task-missing`` (the DAG without task ``t``), ``exit-in-callback``
    (``t`` raises, its ``on_failure_callback`` then calls ``sys.exit(1)``), ``sleep`` (``t`` asks for
    a variable, then sleeps). Returns the try and the file its runner's callbacks append to.
    """
    dag_id = f"startup_{mode.replace('-', '_')}_{try_number}"
    tmp_path.mkdir(parents=True, exist_ok=True)
    marker = tmp_path / "callbacks-run"
    write_dag(request, dag_id, marker, mode)
    ti = running_try(
        dag_maker, session, dag_id, retries=1, try_number=try_number, state=QUEUED,
        queued_by_job_id=runner.job.id, **BOTH_CALLBACKS,
    )  # fmt: skip
    return ti, marker


def run_queued_try(api, ti, marker: Path, before=None):
    """The try run by a real supervisor: (exit code, state reports, callbacks the runner ran)."""
    exit_code, reports = supervise(api, ti, f"{ti.dag_id}.py", before)
    ran = marker.read_text().split() if marker.exists() else []
    return exit_code, reports, ran


def run_try(dag_maker, session, api, runner, tmp_path, request, *, mode: str, try_number: int):
    """:func:`queued_try` run by a real supervisor: (ti, exit code, state reports, callbacks run)."""
    ti, marker = queued_try(dag_maker, session, runner, tmp_path, request, mode=mode, try_number=try_number)
    return (ti, *run_queued_try(api, ti, marker))


def requeue(ti) -> None:
    """What the scheduler does with an ``up_for_reschedule`` try once its date is due: queue it again."""
    from airflow.models.taskinstance import TaskInstance as TI

    with settings.NonScopedSession() as s:
        row = s.get(TI, ti.id)
        assert row.state == UP_FOR_RESCHEDULE
        row.state = QUEUED
        s.commit()


@pytest.fixture
def no_startup_reschedules(monkeypatch):
    """``[workers] missing_dag_retries = 0``: fail at once on a start-up failure (the runner reads it)."""
    monkeypatch.setenv("AIRFLOW__WORKERS__MISSING_DAG_RETRIES", "0")


# ----------------------------------------------------------------------------------------------
# A runner that cannot load its DAG or task
# ----------------------------------------------------------------------------------------------
@pytest.mark.guard
@pytest.mark.parametrize("executor", ["local", "celery"])
@pytest.mark.parametrize("mode", ["dag-missing", "task-missing"])
def test_known_limitation_last_try_startup_failure_gets_no_callback(
    dag_maker, session, api, scheduler_job_runner, tmp_path, request, no_startup_reschedules, mode, executor
):
    """
    Known limitation (README): on the last try the runner gives up at start-up and exits with code 1
    without running anything; the supervisor reports ``failed`` (``finish()``) and the try ends FAILED
    with no callback request, whatever the executor sends.
    """
    runner = scheduler_job_runner
    ti, exit_code, reports, ran = run_try(
        dag_maker, session, api, runner, tmp_path, request, mode=mode, try_number=2
    )

    executor_event(runner, ti, SUCCESS, local_event(exit_code) if executor == "local" else None)
    executor_event(runner, ti, SUCCESS, local_event(exit_code) if executor == "local" else None)

    assert (exit_code, states(reports), ran) == (1, [("failed", FINISH_FIELDS)], [])
    assert committed_state(ti) == FAILED
    assert callbacks_of_try(ti) == []


@pytest.mark.guard
def test_known_limitation_last_try_startup_failure_after_its_reschedules_gets_no_callback(
    dag_maker, session, api, scheduler_job_runner, tmp_path, request, monkeypatch
):
    """
    The path of the default configuration, shortened to ``missing_dag_retries = 1``: the first start-up
    failure of the try reschedules it (``up_for_reschedule``, exit code 0), the next one, once the
    limit is reached, exits with code 1 and the supervisor reports ``failed``: no callback.
    """
    monkeypatch.setenv("AIRFLOW__WORKERS__MISSING_DAG_RETRIES", "1")
    runner = scheduler_job_runner
    ti, first_exit, first_reports, first_ran = run_try(
        dag_maker, session, api, runner, tmp_path, request, mode="dag-missing", try_number=2
    )
    requeue(ti)
    second_exit, second_reports = supervise(api, ti, f"{ti.dag_id}.py")

    executor_event(runner, ti, SUCCESS, local_event(second_exit))

    assert (first_exit, states(first_reports), first_ran) == (
        0,
        [("up_for_reschedule", RESCHEDULE_FIELDS)],
        [],
    )
    assert (second_exit, states(second_reports)) == (1, [("failed", FINISH_FIELDS)])
    assert committed_state(ti) == FAILED
    assert callbacks_of_try(ti) == []


@pytest.mark.guard
@pytest.mark.parametrize("executor", ["local", "celery"])
def test_earlier_try_startup_failure_one_retry_callback(
    dag_maker, session, api, scheduler_job_runner, tmp_path, request, no_startup_reschedules, executor
):
    """
    On an earlier try the supervisor reports nothing for a runner that gave up at start-up (it never
    sends ``up_for_retry`` itself): the executor event finds the try running and requests the retry
    callback once, on both executors.
    """
    runner = scheduler_job_runner
    ti, exit_code, reports, ran = run_try(
        dag_maker, session, api, runner, tmp_path, request, mode="dag-missing", try_number=1
    )
    assert (exit_code, reports, ran) == (1, [], [])
    assert committed_state(ti) == RUNNING

    executor_event(runner, ti, SUCCESS, local_event(exit_code) if executor == "local" else None)
    executor_event(runner, ti, SUCCESS, local_event(exit_code) if executor == "local" else None)

    assert committed_state(ti) == UP_FOR_RETRY
    assert callbacks_of_try(ti) == [UP_FOR_RETRY]


@pytest.fixture
def terminal_states(monkeypatch) -> list[str | None]:
    """
    The state each supervisor's task runner reported to it (``ActivitySubprocess._terminal_state``, set by
    the runner's ``TaskState`` message), read when the supervisor decides its report to the API.
    """
    from airflow.sdk.execution_time.supervisor import ActivitySubprocess

    seen: list[str | None] = []
    decide = ActivitySubprocess.update_task_state_if_needed

    def recording(self):
        seen.append(self._terminal_state)
        return decide(self)

    monkeypatch.setattr(ActivitySubprocess, "update_task_state_if_needed", recording)
    return seen


@pytest.mark.guard
def test_last_try_callback_that_exits_sends_what_a_startup_failure_sends(
    dag_maker, session, api, scheduler_job_runner, tmp_path, request, no_startup_reschedules, terminal_states
):
    """
    Why airflow-core cannot close the limitation above: a runner that failed, ran ``on_failure_callback``
    and left the process with ``sys.exit(1)`` from it (``SystemExit`` passes the runner's handlers)
    sends the same report with the same exit code as a runner that gave up at start-up. The supervisor
    alone knows the difference, and does not send it: the runner reported ``failed`` to it before it ran
    its callback (``_terminal_state``), the one that gave up at start-up reported nothing.
    """
    runner = scheduler_job_runner
    startup = run_try(
        dag_maker, session, api, runner, tmp_path / "s", request, mode="dag-missing", try_number=2
    )
    exited = run_try(
        dag_maker, session, api, runner, tmp_path / "e", request, mode="exit-in-callback", try_number=2
    )

    assert (startup[1], states(startup[2]), startup[3]) == (1, [("failed", FINISH_FIELDS)], [])
    assert (exited[1], states(exited[2]), exited[3]) == (
        1,
        [("failed", FINISH_FIELDS)],
        ["on_failure_callback"],
    )
    assert terminal_states == [None, "failed"]
    executor_event(runner, exited[0], SUCCESS, local_event(exited[1]))
    assert callbacks_of_try(exited[0]) == []


# ----------------------------------------------------------------------------------------------
# A user marks the running try failed
# ----------------------------------------------------------------------------------------------
@pytest.fixture
def prompt_supervisor(monkeypatch) -> list[tuple[str, signal.Signals]]:
    """
    The supervisor's timings shortened, its steps kept: a heartbeat every 0.2 s (``[workers]
    min_heartbeat_interval``, default 5 s, read at import) and 0.5 s between SIGTERM and SIGKILL (``kill()``'s
    ``escalation_delay``, default 5 s). Only the waits change. Returns the ``kill()`` calls (the supervisor
    method that called it, the first signal): a heartbeat every 0.2 s also reaches ``[workers]
    max_failed_heartbeats`` (3) in 0.6 s, and that kill (from ``_handle_heartbeat_failures``) ends the
    runner the same way as the 409's (from ``_send_heartbeat_if_needed``).
    """
    import inspect

    from airflow.sdk.execution_time import supervisor

    kills: list[tuple[str, signal.Signals]] = []
    monkeypatch.setattr(supervisor, "MIN_HEARTBEAT_INTERVAL", 0.2)
    kill = supervisor.ActivitySubprocess.kill
    assert inspect.signature(kill).parameters["escalation_delay"].default == 5.0

    def prompt_kill(self, signal_to_send=signal.SIGINT, escalation_delay: float = 5.0, force: bool = False):
        kills.append((sys._getframe(1).f_code.co_name, signal_to_send))
        return kill(self, signal_to_send, escalation_delay=min(escalation_delay, 0.5), force=force)

    monkeypatch.setattr(supervisor.ActivitySubprocess, "kill", prompt_kill)
    return kills


@pytest.mark.guard
@pytest.mark.parametrize("executor", ["local", "celery"])
def test_user_marked_running_try_failed_gets_no_callback(
    dag_maker, session, api, scheduler_job_runner, tmp_path, request, prompt_supervisor, executor
):
    """
    A user marks the running try failed while its task runs (``set_task_instance_state``, what the UI
    and the public API's task-instance PATCH call): the supervisor's next heartbeat gets 409, it kills
    the runner (SIGTERM, then SIGKILL: the runner's SIGTERM handler only calls ``on_kill()``) and
    reports nothing; the runner ran no callback and the scheduler requests none, on both executors.
    """
    runner = scheduler_job_runner
    ti, marker = queued_try(dag_maker, session, runner, tmp_path, request, mode="sleep", try_number=1)
    marked: list[int] = []

    def mark_failed_when_the_task_asks(req: httpx.Request) -> None:
        if req.method == "GET" and req.url.path.endswith("/variables/mark_failed_now") and not marked:
            with settings.NonScopedSession() as s:
                updated = dag_maker.serialized_dag.set_task_instance_state(
                    task_id="t", run_id=ti.run_id, state=FAILED, session=s
                )
                marked.extend(t.try_number for t in updated)
                s.commit()

    exit_code, reports, ran = run_queued_try(api, ti, marker, before=mark_failed_when_the_task_asks)
    executor_event(runner, ti, SUCCESS, local_event(exit_code) if executor == "local" else None)

    assert marked == [1]
    # Killed once, on the heartbeat's 409 (not after failed heartbeats): kill(SIGTERM, force=True) sends
    # SIGTERM, then SIGKILL, of which the runner dies.
    assert prompt_supervisor == [("_send_heartbeat_if_needed", signal.SIGTERM)]
    assert (exit_code, reports, ran) == (SIGKILL_EXIT, [], [])
    assert committed_state(ti) == FAILED
    assert callbacks_of_try(ti) == []
