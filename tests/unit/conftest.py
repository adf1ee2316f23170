# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
# ruff: noqa: E402  (airflow must only be imported after the environment below is set)
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

import os
import tempfile
from pathlib import Path

# --------------------------------------------------------------------------------------
# Environment: must be set BEFORE anything imports airflow (airflow reads its config and
# builds its engine at import time).
# --------------------------------------------------------------------------------------
PROJECT_ROOT = Path(__file__).resolve().parents[2]


def _base_queue() -> tuple[str, Path, Path]:
    """The base under test (USE_AIRFLOW_VERSION, as the nox sessions select it), its patches/series and
    its generated tree."""
    import sys

    sys.path.insert(0, str(PROJECT_ROOT / "scripts" / "ci"))
    import tree

    root = PROJECT_ROOT
    return tree.base_config(root)["version"], tree.patches_dir(root) / "series", tree.core_dir(root)


# A test marked proves(P) for a patch of the newest base's queue (patches/series) that another base's queue
# does not carry (not ported, or not needed there: see `nox -s series-status`) is skipped on that base.
BASE_VERSION, SERIES_FILE, CORE_DIR = _base_queue()
DEFAULT_SERIES_FILE = PROJECT_ROOT / "patches" / "series"


def _release(version: str) -> tuple[int, ...]:
    """``(3, 4, 0)`` for ``3.4.0`` and for a pre-release such as ``3.4.0b2``."""
    import re

    return tuple(int(re.match(r"\d+", part).group()) for part in version.split(".")[:3])


# The 3.3.2 queue is series v3 (the scheduler owns its transaction); the older bases' queues are still v2. A test
# marked with a v2 patch proves, on a v3 queue, the v3 patch that carries that change (README: "Series v3"). The v2
# patches missing here (killed-runner callbacks, background listeners, held FAILED events, SQLite's write lock,
# giving up on an event) are not in v3: their tests are skipped on a v3 queue.
V3_PATCH_OF = {
    "Row-lock-the-heartbeat-timeout-scan.patch": "Fail-heartbeat-timed-out-tries-in-the-same-pass.patch",
    "Revalidate-heartbeat-timeouts-under-the-row-lock.patch": "Fail-heartbeat-timed-out-tries-in-the-same-pass.patch",
    "Derive-heartbeat-timeout-callback-type-from-the-task.patch": "Fail-heartbeat-timed-out-tries-in-the-same-pass.patch",
    "Call-on_task_instance_failed-listeners-after-the-failure-is-committed.patch": (
        "Fail-a-task-instance-in-the-caller-s-transaction.patch"
    ),
    "Delete-task-reschedules-of-a-retried-TI-right-before-its-id-changes.patch": (
        "Lock-the-task-instance-row-when-handling-its-failure.patch"
    ),
    "Serialise-TI-failure-handling-with-the-execution-API-via-the-row-lock.patch": (
        "Lock-the-task-instance-row-when-handling-its-failure.patch"
    ),
    "Keep-the-scheduler-running-when-one-executor-event-fails-in-the-DB.patch": (
        "Keep-executor-events-until-the-scheduler-s-transaction-commits-them.patch"
    ),
    "Keep-executor-events-until-their-effects-are-committed.patch": (
        "Keep-executor-events-until-the-scheduler-s-transaction-commits-them.patch"
    ),
}


# The v2 tail patches that no queue carries since every base is on series v3: their tests skip ("not in the series").
V2_TAIL = (
    "Request-callbacks-for-tries-whose-task-runner-was-killed-by-a-signal.patch",
    "Call-on_task_instance_failed-listeners-in-a-background-thread.patch",
    "Hold-a-failed-executor-event-until-the-running-try-s-heartbeat-decides.patch",
    "Read-a-failing-task-instance-under-SQLite-s-write-lock.patch",
    "Give-up-on-an-executor-event-whose-handling-keeps-failing-in-the-DB.patch",
)


def queue_name(patch: str, series: list[str] | None = None) -> str:
    """``patch`` as the queue of the base under test names it: its v3 patch on a v3 queue."""
    series = read_series(SERIES_FILE) if series is None else series
    if series is not None and patch not in series and V3_PATCH_OF.get(patch) in series:
        return V3_PATCH_OF[patch]
    return patch


def carries(patch: str) -> bool:
    """Whether the queue of the base under test carries ``patch`` (for tests that need a later patch)."""
    return queue_name(patch) in (read_series(SERIES_FILE) or ())


def _in_other_queue(patch: str) -> bool:
    """Whether another base's queue (``patches/<base>/series``) lists ``patch``."""
    return any(patch in (read_series(f) or ()) for f in (PROJECT_ROOT / "patches").glob("*/series"))


# Test modules about one patch of the 3.3.2 queue (its regression tests and the guards written with
# it), added after the older bases' queues were made: not collected on a base whose queue does not
# carry that patch (they import or rely on what only it brings). README: "Bases".
_MODULE_OF_PATCH = {
    "jobs/test_scheduler_executor_events_kept.py": "Keep-executor-events-until-their-effects-are-committed.patch",
    "jobs/test_scheduler_failure_from_queued_history.py": (
        "Record-TaskInstanceHistory-when-a-task-fails-from-a-non-running-state.patch"
    ),
    "jobs/test_scheduler_stuck_in_queued_recheck.py": "Re-check-task-instances-stuck-in-queued-under-the-row-lock.patch",
    "jobs/test_scheduler_killed_task_runner_callback.py": (
        "Request-callbacks-for-tries-whose-task-runner-was-killed-by-a-signal.patch"
    ),
    "executors/test_local_executor_runner_exit.py": (
        "Request-callbacks-for-tries-whose-task-runner-was-killed-by-a-signal.patch"
    ),
    "jobs/test_killed_task_runner_real_supervisor.py": (
        "Request-callbacks-for-tries-whose-task-runner-was-killed-by-a-signal.patch"
    ),
    "jobs/test_task_runner_startup_failure_real_supervisor.py": (
        "Request-callbacks-for-tries-whose-task-runner-was-killed-by-a-signal.patch"
    ),
    "jobs/test_scheduler_failure_listeners_background.py": (
        "Call-on_task_instance_failed-listeners-in-a-background-thread.patch"
    ),
    "models/test_taskinstance_sqlite_write_lock.py": "Read-a-failing-task-instance-under-SQLite-s-write-lock.patch",
    "models/test_taskinstance_sqlite_write_lock_busy.py": "Read-a-failing-task-instance-under-SQLite-s-write-lock.patch",
    "models/test_taskinstance_sqlite_write_lock_order.py": "Read-a-failing-task-instance-under-SQLite-s-write-lock.patch",
    "models/test_taskinstance_sqlite_write_lock_skip.py": "Read-a-failing-task-instance-under-SQLite-s-write-lock.patch",
    "api_fastapi/execution_api/versions/head/test_task_instances_heartbeat_lock_order.py": (
        "Serialise-TI-failure-handling-with-the-execution-API-via-the-row-lock.patch"
    ),
}


def guard_since(version: str, patch: str):
    """Marker: a guard on bases from ``version`` on, which already behave so; on an older base, where a
    patch of its queue brings the behaviour, a regression test of ``patch`` (compat across bases)."""
    import pytest

    return pytest.mark.guard if _release(BASE_VERSION) >= _release(version) else pytest.mark.proves(patch)


if not os.environ.get("AIRFLOW_HOME"):
    import atexit
    import shutil

    os.environ["AIRFLOW_HOME"] = tempfile.mkdtemp(prefix="airflow-tests-home-")
    atexit.register(shutil.rmtree, os.environ["AIRFLOW_HOME"], ignore_errors=True)
_AIRFLOW_HOME = Path(os.environ["AIRFLOW_HOME"])
(_AIRFLOW_HOME / "dags").mkdir(parents=True, exist_ok=True)

if not os.environ.get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"):
    os.environ["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = f"sqlite:///{_AIRFLOW_HOME / 'unittests.db'}"

_TEST_ENV = {
    # Loads airflow/config_templates/unit_tests.cfg (random fernet key / jwt secret, ...);
    # the AIRFLOW__* variables below still take precedence over it.
    "AIRFLOW__CORE__UNIT_TEST_MODE": "True",
    "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
    "AIRFLOW__CORE__DAGS_FOLDER": str(_AIRFLOW_HOME / "dags"),
    "AIRFLOW__CORE__PLUGINS_FOLDER": str(_AIRFLOW_HOME / "plugins"),
    "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
    "AIRFLOW__DATABASE__LOAD_DEFAULT_CONNECTIONS": "False",
    "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(_AIRFLOW_HOME / "logs"),
    # dag_maker rewrites a DAG right away when a test changes it (default: at most every 30 s).
    "AIRFLOW__CORE__MIN_SERIALIZED_DAG_UPDATE_INTERVAL": "0",
}
for _key, _value in _TEST_ENV.items():
    os.environ[_key] = _value
os.environ.setdefault("AIRFLOW__CORE__FERNET_KEY", "Y2FjYTJhZWQ4ZjFmMzY1NTQ5ZTMxNDM2NjljNGQ4YmQ=")
os.environ.setdefault("AIRFLOW__API_AUTH__JWT_SECRET", "airflow-patch-series-tests-not-a-secret")

KNOWN_BACKENDS = ("sqlite", "postgres", "mysql")


def _backend_from_dsn(dsn: str) -> str:
    scheme = dsn.split(":", 1)[0].split("+", 1)[0].lower()
    return {"postgresql": "postgres", "postgres": "postgres", "mysql": "mysql", "mariadb": "mysql"}.get(
        scheme, scheme
    )


BACKEND = os.environ.get("BACKEND") or _backend_from_dsn(os.environ["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"])
os.environ["BACKEND"] = BACKEND

# airflow.settings also builds an async engine at import time, deriving its DSN from the sync
# one (postgresql+asyncpg / mysql+aiomysql / sqlite+aiosqlite) unless SQL_ALCHEMY_CONN_ASYNC is
# set; without the driver `import airflow` dies with a bare ModuleNotFoundError. Say why instead.
if not os.environ.get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC"):
    import importlib.util

    _async_driver = {"postgres": "asyncpg", "mysql": "aiomysql", "sqlite": "aiosqlite"}.get(BACKEND)
    if _async_driver and importlib.util.find_spec(_async_driver) is None:
        raise ImportError(
            f"airflow.settings creates its async engine with {_async_driver!r} for BACKEND={BACKEND}: "
            f"install {_async_driver} (or set AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC)"
        )

# --------------------------------------------------------------------------------------
# Imports that pull in airflow (after the environment is in place).
# --------------------------------------------------------------------------------------
import contextlib
import importlib.util
from collections.abc import Generator
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

import pytest
from airflow import settings
from airflow.executors.base_executor import BaseExecutor
from airflow.listeners.listener import get_listener_manager
from sqlalchemy import delete, select, text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import sessionmaker

if TYPE_CHECKING:
    from airflow.callbacks.callback_requests import CallbackRequest
    from airflow.jobs.scheduler_job_runner import SchedulerJobRunner
    from airflow.models.dagrun import DagRun
    from sqlalchemy.engine import Engine
    from sqlalchemy.orm import Session

# Same value as upstream tests_common.test_utils.db DEFAULT_DATE.
DEFAULT_DATE = datetime(2016, 1, 1, tzinfo=timezone.utc)
DAG_MAKER_BUNDLE = "dag_maker"

if BACKEND not in KNOWN_BACKENDS:
    raise pytest.UsageError(f"BACKEND={BACKEND!r}; expected one of {', '.join(KNOWN_BACKENDS)}")


# ======================================================================================
# Patch series / markers / options
# ======================================================================================
def read_series(path: Path = SERIES_FILE) -> list[str] | None:
    """Patch file names listed in ``patches/series`` (quilt format), or None if there is no file."""
    if not path.is_file():
        return None
    names = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(line.split()[0])
    return names


# On a v3 queue: tests of what only the v2 queues have are skipped (``pytest.mark.skipif(V3, reason=...)``).
V3 = carries("Fail-a-task-instance-in-the-caller-s-transaction.patch")


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

    series = read_series()
    if config.getoption("--run-unqueued"):
        series = [*(series or ()), *(read_series(DEFAULT_SERIES_FILE) or ()), *V3_PATCH_OF]
        collect_ignore[:] = [m for m in collect_ignore if _MODULE_OF_PATCH[m] in V2_TAIL]
    last = config.getoption("--proves-last")
    for option, wanted in (("--proves", config.getoption("--proves") or []), ("--proves-last", [last])):
        unknown = [w for w in wanted if w is not None and series is not None and w not in series]
        if unknown:
            raise pytest.UsageError(f"{option} {', '.join(unknown)}: not listed in {SERIES_FILE}")


def _proves_args(item: pytest.Item, series: list[str] | None) -> tuple[str, tuple[str, ...]] | None:
    marker = item.get_closest_marker("proves")
    if marker is None:
        return None
    where = f"{item.nodeid}: @pytest.mark.proves"
    if len(marker.args) != 1 or not isinstance(marker.args[0], str):
        raise pytest.UsageError(f"{where} takes exactly one patch file name, got {marker.args!r}")
    unknown_kw = set(marker.kwargs) - {"base_ok_on"}
    if unknown_kw:
        raise pytest.UsageError(f"{where}: unknown keyword(s) {sorted(unknown_kw)}")
    patch = marker.args[0]
    if not patch.endswith(".patch"):
        raise pytest.UsageError(f"{where}({patch!r}): expected a '*.patch' file name")
    known = {*(read_series(DEFAULT_SERIES_FILE) or ()), *V3_PATCH_OF, *V2_TAIL}
    if series is not None and patch not in series and patch not in known and not _in_other_queue(patch):
        raise pytest.UsageError(f"{where}({patch!r}): not listed in {SERIES_FILE}")
    patch = queue_name(patch, series)
    base_ok_on = marker.kwargs.get("base_ok_on", ())
    if isinstance(base_ok_on, str):
        base_ok_on = (base_ok_on,)
    bad = set(base_ok_on) - set(KNOWN_BACKENDS)
    if bad:
        raise pytest.UsageError(f"{where}: base_ok_on has unknown backend(s) {sorted(bad)}")
    return patch, tuple(base_ok_on)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    series = read_series()
    wanted = config.getoption("--proves")
    last = config.getoption("--proves-last")
    if last is not None:
        wanted = [*(wanted or ()), last]
    guards = config.getoption("--guards")
    selected, deselected, tail = [], [], set()
    for item in items:
        proves = _proves_args(item, series)
        unqueued = config.getoption("--run-unqueued") and proves is not None and proves[0] not in V2_TAIL
        if proves is not None and series is not None and proves[0] not in series and not unqueued:
            why = f"{proves[0]} is not in the {BASE_VERSION} series ({SERIES_FILE.relative_to(PROJECT_ROOT)})"
            item.add_marker(pytest.mark.skip(reason=why))
        if proves is not None:
            patch, base_ok_on = proves
            # Exposed to --junitxml / reports for the verify-series tool.
            item.user_properties.append(("proves", patch))
            item.user_properties.append(("base_ok", BACKEND in base_ok_on))
        is_guard = item.get_closest_marker("guard") is not None
        if is_guard:
            item.user_properties.append(("guard", True))

        backend_marker = item.get_closest_marker("backend")
        if backend_marker is not None:
            bad = set(backend_marker.args) - set(KNOWN_BACKENDS)
            if bad or not backend_marker.args:
                raise pytest.UsageError(
                    f"{item.nodeid}: @pytest.mark.backend{backend_marker.args!r}: "
                    f"expected names from {KNOWN_BACKENDS}"
                )
            if BACKEND not in backend_marker.args:
                why = backend_marker.kwargs.get("reason")
                item.add_marker(
                    pytest.mark.skip(
                        reason=f"backend {BACKEND!r} not in {', '.join(backend_marker.args)}"
                        + (f": {why}" if why else "")
                    )
                )

        everything = wanted is None and not guards
        proves_wanted = (
            wanted is not None
            and proves is not None
            and (
                proves[0] in wanted or V3_PATCH_OF.get(proves[0]) in wanted  # --run-unqueued: the v3 name
            )
        )
        if everything or proves_wanted or (guards and is_guard):
            selected.append(item)
            if proves is not None and proves[0] == last:
                tail.add(item)
        else:
            deselected.append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
    # --proves-last: its tests after all others, so that what they leave behind when they fail cannot
    # disturb the others.
    items[:] = [i for i in selected if i not in tail] + [i for i in selected if i in tail]


def pytest_report_header(config: pytest.Config) -> list[str]:
    import sys

    import airflow

    sys.path.insert(0, str(PROJECT_ROOT / "scripts" / "ci"))
    import dbserver

    # Not SQLAlchemy's hide_password: it leaves a password given in the query string (?password=...).
    url = dbserver.masked(settings.SQL_ALCHEMY_CONN)
    lines = [
        f"airflow {airflow.__version__} from {Path(airflow.__file__).parent}",
        f"backend {BACKEND}: {url}",
    ]
    try:
        with settings.engine.connect() as conn:
            lines.append(f"server version: {_server_version(conn)}")
    except SQLAlchemyError as e:  # The DB fixtures report the real error.
        lines.append(f"server version: <unreachable: {type(e).__name__}>")
    return lines


# ======================================================================================
# Database helpers
# ======================================================================================
def _server_version(conn) -> str:
    name = conn.dialect.name
    if name == "sqlite":
        return "SQLite " + conn.execute(text("select sqlite_version()")).scalar_one()
    if name == "postgresql":
        return conn.execute(text("select version()")).scalar_one()
    if name == "mysql":
        version = conn.execute(text("select version()")).scalar_one()
        flavour = "MariaDB" if "mariadb" in version.lower() else "MySQL"
        return f"{flavour} {version}"
    return f"{name} {conn.dialect.server_version_info}"


def server_version(session: Session) -> str:
    """Human-readable server version, e.g. ``'PostgreSQL 15.8 ...'``, ``'MariaDB 10.11.6-MariaDB...'``."""
    return _server_version(session.connection())


def schema_revisions(session: Session) -> tuple[str | None, tuple[str, ...]]:
    """``(revision stamped in alembic_version, heads of Airflow's migration scripts)``."""
    from airflow.utils.db import _get_current_revision, _get_script_object

    return _get_current_revision(session), tuple(_get_script_object().get_heads())


def dialect_locks_rows(session: Session) -> bool:
    """
    Whether ``airflow.utils.sqlalchemy.with_row_locks`` really emits ``FOR UPDATE`` here.

    False on sqlite (no row locks at all) and on MariaDB: Airflow only locks on the mysql
    dialect when ``dialect.supports_for_update_of`` (MySQL >= 8), which MariaDB never has
    (https://jira.mariadb.org/browse/MDEV-13115), so ``with_row_locks`` returns the query
    unchanged there.
    """
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.sqlalchemy import with_row_locks

    stmt = with_row_locks(select(TaskInstance.id), session=session)
    sql = str(stmt.compile(dialect=session.get_bind().dialect))
    return "FOR UPDATE" in sql.upper() or "FOR NO KEY UPDATE" in sql.upper()


def no_row_locks_reason(session: Session) -> str:
    """Skip reason to use when :func:`dialect_locks_rows` is False."""
    if BACKEND == "mysql":
        return (
            f"Airflow's with_row_locks emits no FOR UPDATE on {server_version(session)} "
            "(MariaDB / MySQL < 8 lack supports_for_update_of; Airflow does not support MariaDB)"
        )
    return f"Airflow's with_row_locks emits no row lock on {BACKEND}"


def make_engine() -> Engine:
    """
    A new, independent Engine on the test DSN, built like ``airflow.settings.configure_orm``.

    Same engine args (MySQL READ COMMITTED, pool settings), connect args and event handlers
    (sqlite foreign keys + WAL, MySQL UTC time zone). The caller must ``dispose()`` it; the
    ``other_session`` fixture does so.
    """
    from airflow.utils.orm_event_handlers import setup_event_handlers

    connect_args = dict(settings._get_connect_args("sync"))
    if settings.SQL_ALCHEMY_CONN.startswith("sqlite"):
        connect_args["check_same_thread"] = False
    if hasattr(settings, "create_metadata_engine"):
        engine = settings.create_metadata_engine(
            settings.SQL_ALCHEMY_CONN,
            engine_args=settings.prepare_engine_args(),
            connect_args=connect_args,
        )
    else:  # compat 3.1.x: settings.configure_orm() calls create_engine itself
        from sqlalchemy import create_engine

        engine = create_engine(
            settings.SQL_ALCHEMY_CONN,
            connect_args=connect_args,
            **settings.prepare_engine_args(),
            future=True,
        )
    setup_event_handlers(engine)
    return engine


def make_session_factory(engine: Engine) -> sessionmaker:
    """A sessionmaker configured like Airflow's (no autoflush, no expire on commit)."""
    return sessionmaker(bind=engine, autoflush=False, expire_on_commit=False)


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


# Tables whose rows come from initdb itself and must survive cleaning.
_KEEP_TABLES = {"alembic_version", "log_template"}


def clear_db(session: Session | None = None) -> None:
    """
    Delete the rows tests create (upstream ``clear_db_*`` helpers, in one go).

    Every Airflow table is emptied with a Core ``DELETE`` in reverse foreign-key order
    (dag runs, TIs, TI history, task_reschedule, callback, job, dag, serialized_dag,
    dag_version, dag_bundle, log, xcom, assets, ...), except ``alembic_version`` and
    ``log_template``; ``slot_pool`` keeps only the default pool. The schema is untouched.
    """
    from airflow.models.base import Base
    from airflow.models.pool import Pool

    own = session is None
    if own:
        session = settings.NonScopedSession()
    try:
        session.rollback()
        if session.get_bind().dialect.name == "postgresql":
            # A test that leaked a row lock makes cleaning fail loudly instead of hanging.
            session.execute(text("SET LOCAL lock_timeout = '30s'"))
        for table in reversed(Base.metadata.sorted_tables):
            if table.name in _KEEP_TABLES:
                continue
            if table.name == Pool.__tablename__:
                session.execute(delete(table).where(table.c.pool != Pool.DEFAULT_POOL_NAME))
            else:
                session.execute(delete(table))
        session.commit()
    finally:
        if own:
            session.close()


# ======================================================================================
# Fixtures: database
# ======================================================================================
@pytest.fixture(scope="session", autouse=True)
def _initialize_db() -> Generator[None, None, None]:
    """
    Create the schema once with Airflow's own code (``airflow db reset``).

    A database holding Airflow data (rows in ``dag``, ``connection``, ...) is refused unless ``DB_RESET=true``
    (breeze's ``--db-reset``): every test empties all tables. The nox sessions set it for their throwaway
    databases.

    A database already stamped at the migration head (a previous run, e.g. the steps of verify-series:
    the series changes no schema) is kept; ``clear_db`` empties it around every test.
    """
    import sys

    from airflow.models import import_all_models
    from airflow.utils import db

    sys.path.insert(0, str(PROJECT_ROOT / "scripts" / "ci"))
    import dbserver  # the nox sessions run its check first; this covers pytest run directly

    import_all_models()
    with settings.NonScopedSession() as s:
        held = dbserver.airflow_data(s.connection())
        if held and os.environ.get("DB_RESET", "").lower() != "true":
            pytest.exit(dbserver.refusal(held), returncode=4)
        stamped, heads = schema_revisions(s)
    if stamped is None or (stamped,) != heads:
        db.resetdb()
    settings.Session.remove()
    yield
    settings.Session.remove()
    settings.engine.dispose()


@pytest.fixture(autouse=True)
def _clean_db(_initialize_db) -> Generator[None, None, None]:
    clear_db()
    yield
    settings.Session.remove()
    clear_db()


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
def backend() -> str:
    """``'sqlite'``, ``'postgres'`` or ``'mysql'`` (MariaDB counts as mysql)."""
    return BACKEND


@pytest.fixture
def session() -> Generator[Session, None, None]:
    """
    Upstream's ``session``: ``create_session()`` (the thread's scoped ``settings.Session()``, i.e. the very
    session ``@provide_session`` code called without ``session=`` uses), rolled back at teardown.
    """
    from airflow.utils.session import create_session

    with create_session() as session:
        yield session
        session.rollback()
    settings.Session.remove()


@pytest.fixture
def other_session() -> Generator[Session, None, None]:
    """A session on a second, independent Engine (its own connection) for concurrency tests."""
    engine = make_engine()
    session = make_session_factory(engine)()
    try:
        yield session
    finally:
        with contextlib.suppress(Exception):
            session.rollback()
        session.close()
        engine.dispose()


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


@pytest.fixture
def testing_dag_bundle() -> None:
    """Upstream's ``testing_dag_bundle``: a ``DagBundleModel`` named ``testing`` exists (committed)."""
    from airflow.models.dagbundle import DagBundleModel
    from airflow.utils.session import create_session
    from sqlalchemy import func

    with create_session() as s:
        if not s.scalar(
            select(func.count()).select_from(DagBundleModel).where(DagBundleModel.name == "testing")
        ):
            s.add(DagBundleModel(name="testing"))


# ======================================================================================
# dag_maker
# ======================================================================================
class DagMaker:
    """
    Builds an SDK DAG and writes it to the DB the way the dag-processor does.

    ``with dag_maker("dag_id", session=session, **dag_kwargs) as dag: <operators>``.
    On exit the DAG is serialized (``LazyDeserializedDAG``) and written with
    ``airflow.dag_processing.collection.update_dag_parsing_results_in_db`` (DagModel,
    SerializedDagModel, DagVersion, DagCode) under bundle ``dag_maker`` (DagBundleModel row
    created first), then committed.

    Attributes after the ``with`` block: ``dag`` (SDK DAG), ``serialized_dag``
    (scheduler-side ``SerializedDAG``, read back from the DB), ``serialized_model``
    (``SerializedDagModel``), ``dag_model`` (``DagModel``), ``dag_version`` (``DagVersion``),
    ``session``.
    """

    def __init__(self, default_date: datetime = DEFAULT_DATE) -> None:
        self.default_date = default_date
        self.start_date = default_date
        self.dag = None
        self.session: Session | None = None
        self.bundle_name = DAG_MAKER_BUNDLE
        self.serialized_dag = None
        self.serialized_model = None
        self.dag_model = None
        self.dag_version = None
        self._dag_kwargs: dict[str, Any] = {}
        self._dag_id: str | None = None

    def __call__(
        self,
        dag_id: str = "test_dag",
        *,
        session: Session | None = None,
        bundle_name: str = DAG_MAKER_BUNDLE,
        **dag_kwargs: Any,
    ) -> DagMaker:
        self._dag_id = dag_id
        self.session = session if session is not None else settings.Session()
        self.bundle_name = bundle_name
        # Upstream's defaults: the test module's DEFAULT_DATE if it has one, a daily schedule.
        dag_kwargs.setdefault("start_date", self.default_date)
        dag_kwargs.setdefault("schedule", timedelta(days=1))
        self.start_date = dag_kwargs["start_date"]
        self._dag_kwargs = dag_kwargs
        return self

    def __enter__(self):
        from airflow.sdk import DAG

        self.dag = DAG(self._dag_id, **self._dag_kwargs)
        self.dag.fileloc = str(_AIRFLOW_HOME / "dags" / f"{self._dag_id}.py")
        self.dag.relative_fileloc = f"{self._dag_id}.py"
        self.dag.__enter__()
        return self.dag

    def __exit__(self, exc_type, exc, tb):
        self.dag.__exit__(exc_type, exc, tb)
        if exc_type is not None:
            return
        self.sync_to_db()

    def sync_dag_to_db(self) -> None:
        """Upstream's name: (re)write ``self.dag`` to the DB like the dag-processor, and commit."""
        self.sync_to_db()

    def sync_to_db(self) -> None:
        """(Re)write ``self.dag`` to the DB like the dag-processor, and commit."""
        from airflow.dag_processing.collection import update_dag_parsing_results_in_db
        from airflow.models.dag import DagModel
        from airflow.models.dag_version import DagVersion
        from airflow.models.dagbundle import DagBundleModel
        from airflow.models.serialized_dag import SerializedDagModel
        from airflow.serialization.serialized_objects import LazyDeserializedDAG

        session = self.session
        if session.get(DagBundleModel, self.bundle_name) is None:
            session.add(DagBundleModel(name=self.bundle_name))
            session.flush()
        import_errors: dict[tuple[str, str], str] = {}
        update_dag_parsing_results_in_db(
            bundle_name=self.bundle_name,
            bundle_version=None,
            dags=[LazyDeserializedDAG.from_dag(self.dag)],
            import_errors=import_errors,
            parse_duration=None,
            warnings=set(),
            session=session,
        )
        if import_errors:
            raise RuntimeError(f"dag_maker: writing {self.dag.dag_id!r} failed: {import_errors}")
        session.commit()

        dag_id = self.dag.dag_id
        self.dag_model = session.get(DagModel, dag_id)
        self.serialized_model = SerializedDagModel.get(dag_id, session=session)
        self.serialized_dag = self.serialized_model.dag
        self.dag_version = DagVersion.get_latest_version(dag_id, session=session)

    def create_dagrun(self, *, session: Session | None = None, **kwargs: Any) -> DagRun:
        """
        ``SerializedDAG.create_dagrun`` (the scheduler's code path) with test defaults, committed.

        Defaults: ``run_type=MANUAL``, ``logical_date=DEFAULT_DATE`` (pass ``None`` for a run
        without one), ``run_after=logical_date or now``, ``data_interval`` from the timetable
        (for non-manual runs: the scheduled interval starting at ``logical_date``),
        ``state=RUNNING``, ``start_date=now``, ``triggered_by=TEST``, ``run_id`` generated
        like Airflow's. Any other ``create_dagrun`` keyword is passed through.
        Returns the DagRun; its TIs (state None) exist in the DB (``dag_run.task_instances``).
        """
        from airflow._shared.timezones import timezone as tz
        from airflow.models.dagrun import DagRun
        from airflow.utils.state import DagRunState
        from airflow.utils.types import DagRunTriggeredByType, DagRunType

        if self.serialized_dag is None:
            raise RuntimeError("dag_maker.create_dagrun() called before the `with dag_maker(...)` block")
        session = session if session is not None else self.session
        dag = self.serialized_dag

        # Upstream's defaults: run_id "test" unless a run_type is given, logical_date = the DAG's start
        # date, run_after = the end of the data interval, start_date = the DAG's start date.
        run_type_given = "run_type" in kwargs
        run_type = DagRunType(kwargs.pop("run_type", DagRunType.MANUAL))
        logical_date = kwargs.pop("logical_date", self.start_date)
        if logical_date is not None:
            logical_date = tz.coerce_datetime(logical_date)
            if "data_interval" not in kwargs:
                kwargs["data_interval"] = _infer_data_interval(dag, run_type, logical_date)
        interval = kwargs.get("data_interval")
        run_after = tz.coerce_datetime(
            kwargs.pop("run_after", None) or (interval[-1] if interval else None) or tz.utcnow()
        )
        if not run_type_given:
            kwargs.setdefault("run_id", "test")
        kwargs.setdefault(
            "run_id",
            DagRun.generate_run_id(run_type=run_type, logical_date=logical_date, run_after=run_after),
        )
        kwargs.setdefault("state", DagRunState.RUNNING)
        kwargs.setdefault("start_date", self.start_date)
        kwargs.setdefault("triggered_by", DagRunTriggeredByType.TEST)

        dag_run = dag.create_dagrun(
            run_type=run_type, logical_date=logical_date, run_after=run_after, session=session, **kwargs
        )
        session.commit()
        return dag_run


def _infer_data_interval(dag, run_type, logical_date):
    """Data interval the scheduler would give a run of ``dag`` at ``logical_date``."""
    from airflow.timetables.base import TimeRestriction
    from airflow.utils.types import DagRunType

    if run_type != DagRunType.MANUAL:
        restriction = TimeRestriction(earliest=logical_date, latest=None, catchup=True)
        if hasattr(dag.timetable, "next_dagrun_info_v2"):
            info = dag.timetable.next_dagrun_info_v2(last_dagrun_info=None, restriction=restriction)
        else:  # compat 3.1.x
            info = dag.timetable.next_dagrun_info(last_automated_data_interval=None, restriction=restriction)
        if info is not None and info.logical_date == logical_date and info.data_interval is not None:
            return info.data_interval
    return dag.timetable.infer_manual_data_interval(run_after=logical_date)


@pytest.fixture
def dag_maker(request: pytest.FixtureRequest) -> Generator[DagMaker, None, None]:
    """See :class:`DagMaker` (upstream's defaults: the test module's ``DEFAULT_DATE`` if it defines one)."""
    yield DagMaker(getattr(request.module, "DEFAULT_DATE", DEFAULT_DATE))


# ======================================================================================
# Scheduler
# ======================================================================================
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
    The clock when series v3 lets an executor event fail a running try whose process died: past
    ``[scheduler] task_instance_heartbeat_timeout`` (``V3_HEARTBEAT_RULE``); now on a queue without that patch.
    """
    import contextlib

    import time_machine
    from airflow._shared.timezones import timezone as tz
    from airflow.configuration import conf

    if not carries(V3_HEARTBEAT_RULE):
        return contextlib.nullcontext()
    timeout = conf.getint("scheduler", "task_instance_heartbeat_timeout")
    return time_machine.travel(tz.utcnow() + timedelta(seconds=timeout + 1), tick=False)


def process_events_of_dead_process(runner: SchedulerJobRunner, session: Session, executor=None) -> int:
    """
    ``runner._process_executor_events`` for events of a try whose process died (no commit).

    How the series lets such an event fail a running try whose process heartbeated recently:
    series v3 (``Do-not-fail-a-running-try-that-still-heartbeats-on-an-executor-event.patch``) only once the
    try's heartbeat timed out, so the pass runs that much later; the v2 series holds the event until the try
    heartbeats again or the hold ends (``failed_event_hold``), so where the event is still in the executor's
    buffer after the pass, the clock is moved past the hold and the events are processed again. Before those
    patches the first pass handles the event and there is no second one.
    """
    import time_machine
    from airflow._shared.timezones import timezone as tz
    from airflow.utils.state import TaskInstanceState

    executor = executor or runner.executor
    if carries(V3_HEARTBEAT_RULE):
        with once_its_heartbeat_timed_out():
            return runner._process_executor_events(executor=executor, session=session)
    processed = runner._process_executor_events(executor=executor, session=session)
    if any(state == TaskInstanceState.FAILED for state, _ in executor.event_buffer.values()):
        with time_machine.travel(tz.utcnow() + failed_event_hold() + timedelta(seconds=1), tick=False):
            processed += runner._process_executor_events(executor=executor, session=session)
    return processed


collect_ignore = [module for module, patch in _MODULE_OF_PATCH.items() if not carries(patch)]
