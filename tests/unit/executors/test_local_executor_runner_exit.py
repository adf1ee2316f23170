# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""LocalExecutor sends the task runner's non-zero exit code with the workload's event (upstream #60858)."""

from __future__ import annotations

import multiprocessing
from multiprocessing import SimpleQueue
from types import SimpleNamespace

import pytest

from airflow.executors import base_executor, local_executor
from airflow.executors.workloads import ExecuteTask
from airflow.models.taskinstancekey import TaskInstanceKey
from airflow.utils.state import TaskInstanceState

from tests.unit.harness.compat import run_local_executor_worker, stub_task_runner_exit

P_KILLED = "Request-the-failure-callback-of-a-last-try-whose-task-runner-was-killed.patch"


class _Conf:
    team_name = None

    def get(self, section, key, fallback=None):
        return fallback


KEY = TaskInstanceKey("d", "t", "r", 1, -1)


class _Workload(ExecuteTask):
    """A real ``ExecuteTask`` type built without its fields; the worker reads only these."""

    @property
    def key(self) -> TaskInstanceKey:
        return KEY

    @property
    def display_name(self) -> str:
        return "t"

    @property
    def running_state(self) -> None:
        return None


@pytest.mark.parametrize(
    ("exit_code", "expected"),
    [
        pytest.param(-9, -9, marks=pytest.mark.proves(P_KILLED)),
        pytest.param(1, 1, marks=pytest.mark.proves(P_KILLED)),
        # A runner that exited 0 (it reported its state and ran its callback): no info, as on 3.3.2.
        pytest.param(0, None, marks=pytest.mark.guard),
    ],
)
def test_worker_sends_runner_exit_code(monkeypatch, exit_code, expected):
    """The worker (the supervisor process) runs one workload whose runner exited with ``exit_code``."""
    key = KEY
    stub_task_runner_exit(monkeypatch, exit_code)
    monkeypatch.setattr(local_executor, "setproctitle", lambda title, logger: None)

    work: SimpleQueue = SimpleQueue()
    output: SimpleQueue = SimpleQueue()
    unread = multiprocessing.Value("I", 2)
    work.put(_Workload.model_construct(ti=SimpleNamespace(key=KEY)))  # 3.2.x's worker reads ti.key
    work.put(None)
    run_local_executor_worker(work, output, unread, _Conf())

    got_key, state, info = output.get()
    assert (got_key, state) == (key, TaskInstanceState.SUCCESS)
    if expected is None:
        assert info is None
    else:
        assert isinstance(info, getattr(base_executor, "TaskRunnerExit", ()))
        assert info.exit_code == expected
