# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
What differs between the bases (3.3.2, 3.2.2, 3.1.8) and their task-sdk releases, for tests that run on
every base: callback keys, LocalExecutor's worker, task-sdk's supervisor, the execution API's answers,
the metrics object.
"""

from __future__ import annotations

import tests.unit.harness.env  # noqa: F401  (first: sets the environment before airflow is imported)

import importlib.util
from typing import Any

import pytest
from airflow.executors.base_executor import BaseExecutor

from tests.unit.harness.series import BASE_VERSION, _release

# compat 3.1.x: no callback table and no callback-key executor events (airflow.models.callback is 3.2+).
HAS_CALLBACK_EVENTS = importlib.util.find_spec("airflow.models.callback") is not None


def callback_key_of(callback_id: Any) -> Any:
    """The executor-event key of the callback with ``callback_id`` (``airflow.models.callback.CallbackKey``)."""
    from airflow.models.callback import CallbackKey

    if CallbackKey is str:  # compat 3.2.x: the key is str(UUID)
        return str(callback_id)
    return CallbackKey(id=str(callback_id))


def callback_key_uuid(key: Any) -> Any:
    """The ``callback.id`` a callback's executor-event key names (see :func:`callback_key_of`)."""
    import uuid

    return uuid.UUID(key if isinstance(key, str) else key.id)


def stub_task_runner_exit(monkeypatch: pytest.MonkeyPatch, exit_code: int) -> None:
    """Make LocalExecutor's worker run a task workload as if its task runner exited with ``exit_code``."""
    from airflow.executors import local_executor

    if hasattr(BaseExecutor, "run_workload"):
        monkeypatch.setattr(BaseExecutor, "run_workload", staticmethod(lambda workload, **kwargs: exit_code))
    else:  # compat 3.2.x / 3.1.x: the worker runs a task workload through local_executor._execute_work
        # (3.2.x: (log, workload, team_conf); 3.1.x: (log, workload))
        monkeypatch.setattr(local_executor, "_execute_work", lambda log, workload, *team_conf: exit_code)


def run_local_executor_worker(work: Any, output: Any, unread: Any, team_conf: Any) -> None:
    """``local_executor._run_worker`` on the queues given, until its poison pill (``None``)."""
    import inspect

    from airflow.executors import local_executor

    if "team_conf" in inspect.signature(local_executor._run_worker).parameters:
        local_executor._run_worker("test", work, output, unread, team_conf)
    else:  # compat 3.1.x: no per-team configuration
        local_executor._run_worker("test", work, output, unread)


def retry_report_fields() -> list[str]:
    """
    The fields of the ``up_for_retry`` state report task-sdk's supervisor sends for a runner's ``RetryTask``:
    task-sdk 1.1.x (the 3.1.x bases') sends no ``retry_delay_seconds`` / ``retry_reason`` (3.1 has no
    retry-policy overrides).
    """
    fields = ["end_date", "rendered_map_index", "retry_delay_seconds", "retry_reason", "state"]
    if _release(BASE_VERSION) < (3, 2):
        fields = [f for f in fields if f not in ("retry_delay_seconds", "retry_reason")]
    return fields


def supervise_in_process(*, ti: Any, bundle_info: Any, dag_rel_path: Any, client: Any) -> int:
    """
    task-sdk's supervisor for one task workload on ``client``, as the executors' workers run it; returns
    the exit code of the task runner. ``supervise_task()`` (task-sdk 1.3.x); task-sdk 1.1.x (3.1.x) has
    ``supervise()``, which takes the same arguments and a preconfigured ``client`` (both fork the runner
    with ``ActivitySubprocess.start`` and return ``process.wait()``).
    """
    from airflow.sdk.execution_time import supervisor

    if hasattr(supervisor, "supervise_task"):
        run = supervisor.supervise_task
    else:  # compat task-sdk 1.1.x
        run = supervisor.supervise
    return run(ti=ti, bundle_info=bundle_info, dag_rel_path=dag_rel_path, token="", client=client)


def duplicate_report_statuses(*on_3_3: int) -> tuple[int, ...]:
    """
    HTTP statuses the execution API answers when a worker reports the state its try already has.

    3.3 accepts the duplicate without writing (``on_3_3``, e.g. 200); 3.2.x has no duplicate check and
    refuses any report for a task instance that is not running (409).
    """
    return on_3_3 if _release(BASE_VERSION) >= (3, 3) else (409,)


def metrics_of(module: Any) -> Any:
    """What ``module`` emits its metrics through (``.incr``, ``.gauge``, ...): 3.3's ``stats`` module."""
    if hasattr(module, "stats"):
        return module.stats
    return module.Stats  # compat 3.2.x: the Stats object


def put_back_key(key: Any, ti_id: Any) -> Any:
    """
    The key under which the scheduler puts back a task instance's executor event (``key``) it took but did not
    apply: on 3.4 the key is resolved to the try's id when the buffer is drained (``TaskInstanceUuid``, as 3.4
    puts back an event of a row ``SKIP LOCKED`` skipped); on older bases the key itself.
    """
    try:
        from airflow.executors.workloads.types import TaskInstanceUuid
    except ImportError:  # before 3.4
        return key
    return TaskInstanceUuid(ti_id)
