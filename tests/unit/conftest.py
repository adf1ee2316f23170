# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
Shared pytest harness for the airflow-core 3.3.2 patch-series regression tests: the pytest hooks and
the fixtures' registration. The harness itself is in ``tests/unit/harness/``:

``env``
    the environment, set before anything imports airflow (``AIRFLOW__DATABASE__SQL_ALCHEMY_CONN``,
    ``BACKEND``, ``AIRFLOW_HOME``)
``series``
    the base and its queue (``BASE_VERSION``, ``V3``, ``carries``, ``guard_since``), the ``proves`` /
    ``guard`` selection
``db``
    schema, ``clear_db``, engines and sessions, server facts (``dialect_locks_rows``, ``server_version``)
``dags``
    ``dag_maker``, ``testing_dag_bundle``, ``DEFAULT_DATE``
``scheduler``
    ``scheduler_job_runner``, ``RecordingExecutor``, ``api``, ``listener_manager``, executor-event helpers
``compat``
    what differs between the bases and their task-sdk releases

Modelled on upstream ``devel-common/src/tests_common/pytest_plugin.py`` (``dag_maker``,
``session``, ``clear_db_*``), cut down to what this series needs. Everything runs against
a real database; the schema is created once per run by Airflow itself
(:func:`airflow.utils.db.resetdb`) and never hand-written.

Markers: ``db_test``, ``backend(*names)``, ``proves(patch, base_ok_on=())``, ``guard``.
Options: ``--proves PATCH`` (only tests proving PATCH), ``--guards`` (guard tests), ``--proves-last PATCH``
(also PATCH's tests, run last).
"""

from __future__ import annotations

import tests.unit.harness.env  # noqa: F401  (first: sets the environment before airflow is imported)

import pytest

from tests.unit.harness import db, series

# The fixtures, registered here for every test under tests/unit.
from tests.unit.harness.dags import dag_maker, testing_dag_bundle  # noqa: F401
from tests.unit.harness.db import _clean_db, _initialize_db, backend, other_session, session  # noqa: F401
from tests.unit.harness.scheduler import api, listener_manager, scheduler_job_runner  # noqa: F401


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
        "--run-unqueued",
        action="store_true",
        default=False,
        help="Run the tests marked @pytest.mark.proves(PATCH) whose PATCH the base's queue does not carry "
        "instead of skipping them, and collect the test modules of such patches (not those of the v2 tail, "
        "which no queue carries): on the pristine base (e.g. 3.4.0b2's empty queue) a failure shows the "
        "bug is there. --proves then takes any patch of the 3.3.2 queue.",
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

    series.check_options(config)
    if config.getoption("--run-unqueued"):
        collect_ignore[:] = series.not_collected(unqueued=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    series.select_items(config, items)


def pytest_report_header(config: pytest.Config) -> list[str]:
    return db.report_header()


collect_ignore = series.not_collected()
