# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
# ruff: noqa: E402, F811  (airflow must only be imported after the environment is set; fixtures imported from the harness)
"""
Shared pytest harness for the airflow-core 3.3.2 patch-series regression tests.

Modelled on upstream ``devel-common/src/tests_common/pytest_plugin.py`` (``dag_maker``,
``session``, ``clear_db_*``), cut down to what this series needs. Everything runs against
a real database; the schema is created once per run by Airflow itself
(:func:`airflow.utils.db.resetdb`) and never hand-written.

Environment (all optional):

``AIRFLOW__DATABASE__SQL_ALCHEMY_CONN``
    DSN of the test database. Default: a sqlite file in ``AIRFLOW_HOME``.
``BACKEND``
    ``sqlite`` | ``postgres`` | ``mysql``. Default: derived from the DSN.
``AIRFLOW_HOME``
    Default: a fresh temporary directory.

Fixtures: ``session``, ``other_session``, ``dag_maker``, ``scheduler_job_runner``,
``backend``. Helpers: :func:`make_engine`, :func:`dialect_locks_rows`,
:func:`server_version`, :func:`schema_revisions`, :func:`clear_db`.

Markers: ``db_test``, ``backend(*names)``, ``proves(patch, base_ok_on=())``, ``guard``.
Options: ``--proves PATCH`` (only tests proving PATCH), ``--guards`` (guard tests), ``--proves-last PATCH``
(also PATCH's tests, run last).
"""

from __future__ import annotations


from tests.unit.harness.env import _AIRFLOW_HOME, BACKEND, KNOWN_BACKENDS  # noqa: F401
from tests.unit.harness.series import (  # noqa: F401
    BASE_VERSION,
    CORE_DIR,
    DEFAULT_SERIES_FILE,
    PROJECT_ROOT,
    SERIES_FILE,
    V2_TAIL,
    V3,
    V3_PATCH_OF,
    _release,
    carries,
    check_options,
    guard_since,
    not_collected,
    queue_name,
    read_series,
    select_items,
)
from tests.unit.harness.db import (  # noqa: F401
    _clean_db,
    _initialize_db,
    backend,
    clear_db,
    dialect_locks_rows,
    make_engine,
    make_session_factory,
    no_row_locks_reason,
    other_session,
    report_header,
    schema_revisions,
    server_version,
    session,
)
from tests.unit.harness.dags import DAG_MAKER_BUNDLE, DEFAULT_DATE, DagMaker, dag_maker, testing_dag_bundle  # noqa: F401
from tests.unit.harness.scheduler import (  # noqa: F401
    V3_HEARTBEAT_RULE,
    RecordingExecutor,
    api,
    failed_event_hold,
    listener_manager,
    once_its_heartbeat_timed_out,
    process_events_of_dead_process,
    scheduler_job_runner,
)


# --------------------------------------------------------------------------------------
# Imports that pull in airflow (after the environment is in place).
# --------------------------------------------------------------------------------------
import importlib.util
from typing import TYPE_CHECKING, Any

import pytest
from airflow.executors.base_executor import BaseExecutor

if TYPE_CHECKING:
    pass


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("patch-series")
    group.addoption(
        "--proves",
        action="append",
        metavar="PATCH",
        default=None,
        help="Only run tests marked @pytest.mark.proves(PATCH) (PATCH must be listed in patches/series); "
        "repeat for several patches.",
    )
    group.addoption(
        "--proves-last",
        metavar="PATCH",
        default=None,
        help="Also run the tests marked @pytest.mark.proves(PATCH), after every other selected test "
        "(verify-series: the next patch's fail-before tests, in the run of this step's suite).",
    )
    group.addoption(
        "--guards",
        action="store_true",
        default=False,
        help="Select tests marked @pytest.mark.guard (combined with --proves: both sets).",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "db_test: test uses the metadata database")
    config.addinivalue_line(
        "markers",
        "backend(*names, reason=...): run only when BACKEND is one of names (sqlite, postgres, mysql); "
        "reason says why not elsewhere",
    )
    config.addinivalue_line(
        "markers",
        "proves(patch, base_ok_on=()): regression test for PATCH (a patches/series entry); must fail "
        "without it and pass with it, except on the backends in base_ok_on where the base is not "
        "vulnerable (there it must pass either way)",
    )
    config.addinivalue_line("markers", "guard: behaviour that must hold before and after every patch")

    check_options(config)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    select_items(config, items)


def pytest_report_header(config: pytest.Config) -> list[str]:
    return report_header()


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


collect_ignore = not_collected()
