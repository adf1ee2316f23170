# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
DAGs written to the database the way the dag-processor writes them: upstream's ``dag_maker`` (cut down to
what the series needs) and ``testing_dag_bundle``.
"""

from __future__ import annotations

from tests.unit.harness.env import _AIRFLOW_HOME  # first: sets the environment before airflow is imported

from collections.abc import Generator
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

import pytest
from airflow import settings
from sqlalchemy import select

if TYPE_CHECKING:
    from airflow.models.dagrun import DagRun
    from sqlalchemy.orm import Session

# Same value as upstream tests_common.test_utils.db DEFAULT_DATE.
DEFAULT_DATE = datetime(2016, 1, 1, tzinfo=timezone.utc)
DAG_MAKER_BUNDLE = "dag_maker"


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
