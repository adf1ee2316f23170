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


# --------------------------------------------------------------------------------------
# Imports that pull in airflow (after the environment is in place).
# --------------------------------------------------------------------------------------
import importlib.util
from collections.abc import Generator
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

import pytest
from airflow import settings
from airflow.executors.base_executor import BaseExecutor
from airflow.listeners.listener import get_listener_manager
from sqlalchemy import select

if TYPE_CHECKING:
    from airflow.callbacks.callback_requests import CallbackRequest
    from airflow.jobs.scheduler_job_runner import SchedulerJobRunner
    from airflow.models.dagrun import DagRun
    from sqlalchemy.orm import Session

# Same value as upstream tests_common.test_utils.db DEFAULT_DATE.
DEFAULT_DATE = datetime(2016, 1, 1, tzinfo=timezone.utc)
DAG_MAKER_BUNDLE = "dag_maker"


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


collect_ignore = not_collected()
