# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
What a real task-sdk supervisor reports for a failed try, and how many callbacks the try then gets
(upstream #60858).

Each test runs task-sdk's own ``supervise_task()`` (the code LocalExecutor's worker and the
CeleryExecutor's Celery task call) in the test process: it forks a real task runner that loads a DAG
file and fails its task, by an exception or by a SIGKILL of its own process (an OOM kill), before or
after it reported its state. The supervisor talks to Airflow's execution API in-process
(``tests.unit.ti_race.ExecutionApi``) through a transport that records every state report
(``PATCH /task-instances/{id}/state``). The runner's callbacks append to a file; the scheduler then
processes the executor event as each executor sends it, and the callback requests it commits are
counted from the ``callback_request`` table:

* LocalExecutor: ``success`` with ``TaskRunnerExit(exit code)`` for a non-zero exit code (the worker's
  code, ``tests/unit/executors/test_local_executor_runner_exit.py``);
* CeleryExecutor: ``success`` without info (``apache-airflow-providers-celery``'s ``execute_workload``
  returns ``None`` whatever ``supervise()`` returned; the provider is not installed here: its event
  is built as it sends it).

What task-sdk 1.3.2 reports (shown below):

* the runner failed by an exception on an earlier try: ``RetryTask``, which the supervisor sends at
  once (``up_for_retry``), before the runner runs ``on_retry_callback``;
* on the last try: ``TaskState(failed)``, held by the supervisor and sent (``finish()``) after the
  runner exited, i.e. after it ran ``on_failure_callback``;
* a runner killed by a signal before it reported: on the last try ``finish(failed)``, the same request
  as above; on an earlier try nothing at all (``UP_FOR_RETRY`` is in ``STATES_SENT_DIRECTLY`` and
  ``finish()`` cannot send it; upstream PR #70572 says so): the try stays running for the executor
  event (any executor: "killed externally") or the heartbeat-timeout purge.
"""

from __future__ import annotations

import json
import signal
import textwrap
from collections.abc import Callable
from pathlib import Path

import airflow
import httpx
import pytest
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
from tests.unit.harness.compat import retry_report_fields, supervise_in_process
from tests.unit.jobs.test_scheduler_killed_task_runner_callback import executor_event, runner_exit
from tests.unit.ti_race import ExecutionApi

pytestmark = pytest.mark.db_test

_supervisor = pytest.importorskip("airflow.sdk.execution_time.supervisor")
if not hasattr(_supervisor, "supervise_task") and airflow.__version__.startswith("3.2."):
    pytest.skip(
        "this task-sdk has no supervise_task() (task-sdk 1.2.x, the 3.2.2 base's); the module drives a real "
        "supervisor through it (task-sdk 1.3.x, 3.3.2) or through supervise(client=...) (task-sdk 1.1.x, "
        "3.1.8: compat.supervise_in_process); not run against task-sdk 1.2.x's supervise()",
        allow_module_level=True,
    )

P_KILLED = "Request-the-failure-callback-of-a-last-try-whose-task-runner-was-killed.patch"

QUEUED = TaskInstanceState.QUEUED
SIGKILL_EXIT = -signal.SIGKILL
SUPERVISE_TIMEOUT = 180  # seconds; one try takes 1-6 s on the loaded 2-core machine

DAG_FILE = """
import os
import signal
from datetime import datetime, timedelta

from airflow.providers.standard.operators.python import PythonOperator
from airflow.sdk import DAG

MARKER = {marker!r}
MODE = {mode!r}


def _mark(what):
    with open(MARKER, "a") as f:
        f.write(what + "\\n")


def _callback(what):
    _mark(what)
    if MODE == "kill-in-callback":
        os.kill(os.getpid(), signal.SIGKILL)


def on_failure(context):
    _callback("on_failure_callback")


def on_retry(context):
    _callback("on_retry_callback")


def work():
    if MODE == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError("the task failed")


with DAG({dag_id!r}, schedule=None, start_date=datetime(2026, 1, 1)):
    PythonOperator(
        task_id="t",
        python_callable=work,
        retries=1,
        retry_delay=timedelta(seconds=1),
        on_failure_callback=on_failure,
        on_retry_callback=on_retry,
    )
"""


class RecordingTransport(httpx.BaseTransport):
    """
    Passes each request to the in-process execution API and records the state reports; ``before``,
    if given, is called with each request before it is passed on (in the supervisor's thread).
    """

    def __init__(
        self, inner: httpx.BaseTransport, before: Callable[[httpx.Request], None] | None = None
    ) -> None:
        self.inner = inner
        self.before = before
        self.state_reports: list[dict] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if self.before is not None:
            self.before(request)
        if request.method == "PATCH" and request.url.path.endswith("/state"):
            self.state_reports.append(json.loads(request.read()))
        return self.inner.handle_request(request)


def supervise(
    api: ExecutionApi, ti, dag_file: str, before: Callable[[httpx.Request], None] | None = None
) -> tuple[int, list[dict]]:
    """
    task-sdk's ``supervise_task()`` for ``ti`` (queued), as the executors' workers call it, on the
    in-process execution API. Returns the exit code of the task runner and the state reports sent.
    ``before``: see :class:`RecordingTransport`.
    """
    from airflow.executors.workloads import BundleInfo, ExecuteTask
    from airflow.sdk.execution_time import supervisor
    from airflow.sdk.execution_time.supervisor import InProcessTestSupervisor

    transport = RecordingTransport(api._transport, before)
    # The client dag.test() uses for its in-process API (without tenacity's retries), on our transport.
    client = InProcessTestSupervisor._Client(base_url=None, token="", dry_run=True, transport=transport)
    client.base_url = "http://in-process.invalid./"  # type: ignore[assignment]
    workload = ExecuteTask.make(
        ti, dag_rel_path=Path(dag_file), bundle_info=BundleInfo(name="dags-folder", version=None)
    )

    def timed_out(signum, frame):
        raise TimeoutError(f"the supervisor did not finish within {SUPERVISE_TIMEOUT} s")

    # The supervisor waits for its runner without a limit; this wait has one (a forked child does not
    # inherit the alarm).
    previous = signal.signal(signal.SIGALRM, timed_out)
    signal.alarm(SUPERVISE_TIMEOUT)
    # The supervisor's select() waits up to [workers] min_heartbeat_interval (default 5 s, read at import) per
    # loop; with 3.1.8's task-sdk one such wait followed each runner's exit here (5.2 s a test, 0.2 s on
    # 3.3.2's). 0.2 s: the same steps and heartbeats, shorter waits.
    interval, supervisor.MIN_HEARTBEAT_INTERVAL = supervisor.MIN_HEARTBEAT_INTERVAL, 0.2
    try:
        exit_code = supervise_in_process(
            ti=workload.ti,
            bundle_info=workload.bundle_info,
            dag_rel_path=workload.dag_rel_path,
            client=client,
        )
    finally:
        supervisor.MIN_HEARTBEAT_INTERVAL = interval
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return exit_code, transport.state_reports


def run_try(dag_maker, session, api, runner, tmp_path, request, *, mode: str, try_number: int):
    """
    A queued try (``retries=1``) of task ``t``, run by a real supervisor whose runner fails by ``mode``:
    ``raise`` (an exception), ``kill`` (SIGKILL of the runner before it reports), ``kill-in-callback``
    (an exception, then SIGKILL in the runner's callback after the callback recorded that it ran).
    Returns (ti, exit code, state reports, callbacks the runner ran).
    """
    from airflow.configuration import conf

    dag_id = f"real_supervisor_{mode.replace('-', '_')}_{try_number}"
    tmp_path.mkdir(parents=True, exist_ok=True)
    marker = tmp_path / "callbacks-run"
    # The runner loads the file from the ``dags-folder`` bundle (the session's [core] dags_folder).
    dag_path = Path(conf.get("core", "dags_folder")) / f"{dag_id}.py"
    dag_path.write_text(textwrap.dedent(DAG_FILE).format(marker=str(marker), mode=mode, dag_id=dag_id))
    request.addfinalizer(lambda: dag_path.unlink(missing_ok=True))

    ti = running_try(
        dag_maker, session, dag_id, retries=1, try_number=try_number, state=QUEUED,
        queued_by_job_id=runner.job.id, **BOTH_CALLBACKS,
    )  # fmt: skip
    exit_code, reports = supervise(api, ti, f"{dag_id}.py")
    ran = marker.read_text().split() if marker.exists() else []
    return ti, exit_code, reports, ran


def states(reports: list[dict]) -> list[tuple[str, list[str]]]:
    """Each state report: its state and the fields it carries."""
    return [(r["state"], sorted(r)) for r in reports]


FINISH_FIELDS = ["end_date", "rendered_map_index", "state"]
RETRY_FIELDS = retry_report_fields()


# ----------------------------------------------------------------------------------------------
# What the execution API receives
# ----------------------------------------------------------------------------------------------
@pytest.mark.guard
def test_last_try_killed_and_last_try_failed_send_the_same_report(
    dag_maker, session, api, scheduler_job_runner, tmp_path, request
):
    """
    On the last try, a runner killed before it reported and a runner that reported ``failed`` and ran
    its callback make the supervisor send the same request (``failed``, the same fields): only the
    exit code (-9 / 0) tells them apart, and it reaches the scheduler only through the executor.
    """
    killed = run_try(
        dag_maker, session, api, scheduler_job_runner, tmp_path / "k", request, mode="kill", try_number=2
    )
    failed = run_try(
        dag_maker, session, api, scheduler_job_runner, tmp_path / "f", request, mode="raise", try_number=2
    )

    _, k_exit, k_reports, k_ran = killed
    _, f_exit, f_reports, f_ran = failed
    assert (k_exit, states(k_reports), k_ran) == (SIGKILL_EXIT, [("failed", FINISH_FIELDS)], [])
    assert (f_exit, states(f_reports), f_ran) == (0, [("failed", FINISH_FIELDS)], ["on_failure_callback"])
    assert committed_state(killed[0]) == committed_state(failed[0]) == FAILED


@pytest.mark.guard
def test_earlier_try_killed_sends_no_report(dag_maker, session, api, scheduler_job_runner, tmp_path, request):
    """
    On an earlier try the supervisor reports nothing for a runner killed before it reported (it never
    sends ``up_for_retry`` itself): the try stays running. A runner that failed by an exception sends
    ``up_for_retry`` (``RetryTask``, with the retry fields) itself and runs ``on_retry_callback``.
    """
    killed = run_try(
        dag_maker, session, api, scheduler_job_runner, tmp_path / "k", request, mode="kill", try_number=1
    )
    failed = run_try(
        dag_maker, session, api, scheduler_job_runner, tmp_path / "f", request, mode="raise", try_number=1
    )

    assert killed[1:] == (SIGKILL_EXIT, [], [])
    assert committed_state(killed[0]) == TaskInstanceState.RUNNING
    assert (failed[1], states(failed[2]), failed[3]) == (
        0,
        [("up_for_retry", RETRY_FIELDS)],
        ["on_retry_callback"],
    )
    assert committed_state(failed[0]) == UP_FOR_RETRY


# ----------------------------------------------------------------------------------------------
# Callbacks per try: the runner's own + the scheduler's requests, per executor
# ----------------------------------------------------------------------------------------------
def local_event(exit_code: int):
    """LocalExecutor's event info: ``TaskRunnerExit`` for a non-zero exit code (its worker's rule)."""
    return runner_exit(exit_code) if exit_code else None


@pytest.mark.guard
@pytest.mark.parametrize("executor", ["local", "celery"])
def test_earlier_try_killed_one_retry_callback(
    dag_maker, session, api, scheduler_job_runner, tmp_path, request, executor
):
    """Killed before it reported, earlier try: the executor event finds the try running and requests
    the retry callback (task killed externally), on both executors; a repeated event adds none."""
    runner = scheduler_job_runner
    ti, exit_code, _, ran = run_try(
        dag_maker, session, api, runner, tmp_path, request, mode="kill", try_number=1
    )
    info = local_event(exit_code) if executor == "local" else None

    executor_event(runner, ti, SUCCESS, info)
    executor_event(runner, ti, SUCCESS, info)

    assert ran == []
    assert callbacks_of_try(ti) == [UP_FOR_RETRY]
    assert committed_state(ti) == UP_FOR_RETRY


@pytest.mark.proves(P_KILLED)
def test_last_try_killed_local_executor_one_failure_callback(
    dag_maker, session, api, scheduler_job_runner, tmp_path, request
):
    """Killed before it reported, last try, LocalExecutor: its event's exit code -9 makes the scheduler
    request the failure callback, once."""
    runner = scheduler_job_runner
    ti, exit_code, _, ran = run_try(
        dag_maker, session, api, runner, tmp_path, request, mode="kill", try_number=2
    )

    executor_event(runner, ti, SUCCESS, local_event(exit_code))
    executor_event(runner, ti, SUCCESS, local_event(exit_code))

    assert ran == []
    assert callbacks_of_try(ti) == [FAILED]


@pytest.mark.guard
def test_last_try_killed_celery_executor_gets_no_callback(
    dag_maker, session, api, scheduler_job_runner, tmp_path, request
):
    """
    Known limitation (README): killed before it reported, last try, CeleryExecutor: the supervisor
    reports ``failed`` as for a runner that ran its callback, and the Celery event is ``success``
    without the exit code: no callback at all (upstream #60858).
    """
    runner = scheduler_job_runner
    ti, _, _, ran = run_try(dag_maker, session, api, runner, tmp_path, request, mode="kill", try_number=2)

    executor_event(runner, ti, SUCCESS, None)

    assert ran == []
    assert callbacks_of_try(ti) == []
    assert committed_state(ti) == FAILED


@pytest.mark.guard
@pytest.mark.parametrize("executor", ["local", "celery"])
@pytest.mark.parametrize(
    ("try_number", "callback"),
    [(1, "on_retry_callback"), (2, "on_failure_callback")],
    ids=["earlier", "last"],
)
def test_runner_failed_by_exception_runs_its_own_callback_only(
    dag_maker, session, api, scheduler_job_runner, tmp_path, request, executor, try_number, callback
):
    """The runner failed by an exception and ran its callback (exit code 0): no request from the scheduler."""
    runner = scheduler_job_runner
    ti, exit_code, _, ran = run_try(
        dag_maker, session, api, runner, tmp_path, request, mode="raise", try_number=try_number
    )

    executor_event(runner, ti, SUCCESS, local_event(exit_code) if executor == "local" else None)

    assert (exit_code, ran) == (0, [callback])
    assert callbacks_of_try(ti) == []


@pytest.mark.guard
@pytest.mark.parametrize("executor", ["local", "celery"])
def test_earlier_try_killed_in_its_retry_callback_gets_no_second_one(
    dag_maker, session, api, scheduler_job_runner, tmp_path, request, executor
):
    """
    The runner reported ``up_for_retry`` itself (``RetryTask``: the supervisor sends it at once), ran
    ``on_retry_callback`` and was then killed (exit code -9): the up_for_retry state at the server
    always comes from the runner itself, so the scheduler requests no second retry callback.
    """
    runner = scheduler_job_runner
    ti, exit_code, reports, ran = run_try(
        dag_maker, session, api, runner, tmp_path, request, mode="kill-in-callback", try_number=1
    )

    executor_event(runner, ti, SUCCESS, local_event(exit_code) if executor == "local" else None)

    assert (exit_code, [r["state"] for r in reports], ran) == (
        SIGKILL_EXIT,
        ["up_for_retry"],
        ["on_retry_callback"],
    )
    assert callbacks_of_try(ti) == []


def test_known_limitation_last_try_killed_after_its_failure_callback_local_executor(
    dag_maker, session, api, scheduler_job_runner, tmp_path, request
):
    """
    Known limitation (README), documented: the runner reported ``failed``, ran ``on_failure_callback``
    and was then killed (an OOM kill in the callback, or the supervisor's kill after
    ``[core] task_success_overtime`` while a listener hangs). The supervisor sends ``failed`` as for a
    runner killed before it reported, LocalExecutor's event says -9: the scheduler requests the failure
    callback a second time. Telling the two apart needs the supervisor to say whether the runner
    reported the state (it knows: its ``_terminal_state``); task-sdk 1.3.2 does not send it.
    """
    runner = scheduler_job_runner
    ti, exit_code, reports, ran = run_try(
        dag_maker, session, api, runner, tmp_path, request, mode="kill-in-callback", try_number=2
    )

    executor_event(runner, ti, SUCCESS, local_event(exit_code))

    assert (exit_code, [r["state"] for r in reports], ran) == (
        SIGKILL_EXIT,
        ["failed"],
        ["on_failure_callback"],
    )
    assert callbacks_of_try(ti) == [FAILED]
