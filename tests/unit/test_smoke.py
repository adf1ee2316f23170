# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""Smoke test of the harness: real airflow tree, real schema, real scheduler code, real DB."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from airflow._shared.timezones import timezone
from airflow.callbacks.callback_requests import DagCallbackRequest
from airflow.models.db_callback_request import DbCallbackRequest
from airflow.models.taskinstance import TaskInstance
from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.utils.state import TaskInstanceState
from sqlalchemy import func, select

from tests.unit.harness.env import BACKEND
from tests.unit.harness.db import dialect_locks_rows, no_row_locks_reason, schema_revisions, server_version
from tests.unit.harness.dags import DEFAULT_DATE

pytestmark = [pytest.mark.db_test, pytest.mark.guard]


def test_airflow_is_imported_from_generated_tree():
    import airflow

    path = Path(airflow.__file__).resolve()
    print(f"airflow {airflow.__version__} imported from {path}")
    from tests.unit.harness.series import BASE_VERSION, CORE_DIR

    assert path.is_relative_to(CORE_DIR / "src" / "airflow")  # airflow-core/ or airflow-core-<version>/
    assert airflow.__version__ == BASE_VERSION


def test_schema_is_at_migration_head(session, backend):
    current, heads = schema_revisions(session)
    print(f"{backend}: {server_version(session)}; alembic revision {current}, heads {heads}")
    assert backend == BACKEND
    assert heads, "no alembic heads found in airflow's migration scripts"
    assert (current,) == heads


def test_dialect_locks_rows_matches_backend(session):
    version = server_version(session)
    locks = dialect_locks_rows(session)
    print(f"{version}: with_row_locks emits FOR UPDATE: {locks}")
    if BACKEND == "postgres":
        assert locks
    elif BACKEND == "sqlite" or "mariadb" in version.lower():
        assert not locks


def test_dag_maker_dagrun_and_scheduler(dag_maker, session, scheduler_job_runner):
    with dag_maker("smoke_dag", session=session):
        EmptyOperator(task_id="op", retries=1)
    assert dag_maker.dag_model.bundle_name == dag_maker.bundle_name
    assert dag_maker.dag_version is not None
    assert dag_maker.serialized_dag.task_dict.keys() == {"op"}

    dag_run = dag_maker.create_dagrun()
    (ti,) = dag_run.task_instances
    assert ti.task_id == "op"
    assert ti.dag_version_id == dag_maker.dag_version.id

    # A running TI queued by this scheduler with a fresh heartbeat: the real scan finds nothing.
    ti.state = TaskInstanceState.RUNNING
    ti.queued_by_job_id = scheduler_job_runner.job.id
    ti.last_heartbeat_at = timezone.utcnow()
    session.merge(ti)
    session.commit()

    scheduler_job_runner._find_and_purge_task_instances_without_heartbeats()

    executor = scheduler_job_runner.executor
    assert executor is scheduler_job_runner.executors[0]
    assert executor.callbacks_sent == []
    assert executor.state_changes == []
    session.expire_all()
    assert session.scalar(select(TaskInstance.state).where(TaskInstance.id == ti.id)) == "running"
    assert session.scalar(select(func.count()).select_from(DbCallbackRequest)) == 0

    # TI.task loads through the runner's DB dag bag, like the scheduler does.
    ti = session.get(TaskInstance, ti.id)
    dag = scheduler_job_runner.scheduler_dag_bag.get_dag_for_run(dag_run=ti.dag_run, session=session)
    assert dag.get_task("op").retries == 1


def test_scheduler_queues_task(dag_maker, session, scheduler_job_runner):
    with dag_maker("smoke_queue", session=session):
        EmptyOperator(task_id="op")
    dag_run = dag_maker.create_dagrun()
    (ti,) = dag_run.task_instances
    ti.state = TaskInstanceState.SCHEDULED
    session.merge(ti)
    session.commit()

    runner = scheduler_job_runner
    if hasattr(runner, "_executable_task_instances_to_queued"):
        queued = runner._executable_task_instances_to_queued(max_tis=32, session=session)
    else:  # 3.4: the pool capacity is taken first, then the selection marks the TIs QUEUED
        pools, max_tis, starved = runner._acquire_pool_capacity(32, session=session)
        queued = runner._select_task_instances_to_queue(max_tis, pools, starved, session=session)
    session.commit()
    assert [t.task_id for t in queued] == ["op"]
    assert session.scalar(select(TaskInstance.state).where(TaskInstance.id == ti.id)) == "queued"


def test_recording_executor_send_callback_writes_callback_row(dag_maker, session, scheduler_job_runner):
    with dag_maker("smoke_cb", session=session):
        EmptyOperator(task_id="op")
    dag_run = dag_maker.create_dagrun()
    request = DagCallbackRequest(
        filepath=dag_maker.dag_model.relative_fileloc,
        dag_id=dag_run.dag_id,
        run_id=dag_run.run_id,
        bundle_name=dag_maker.bundle_name,
        bundle_version=None,
        is_failure_callback=True,
        msg="smoke",
    )
    scheduler_job_runner.executor.send_callback(request)
    session.commit()
    assert scheduler_job_runner.executor.callbacks_sent == [request]
    assert session.scalar(select(func.count()).select_from(DbCallbackRequest)) == 1


def test_other_session_is_independent(dag_maker, session, other_session):
    from airflow.utils.sqlalchemy import with_row_locks
    from sqlalchemy.exc import OperationalError

    assert other_session.get_bind() is not session.get_bind()
    with dag_maker("smoke_conc", session=session):
        EmptyOperator(task_id="op")
    (ti,) = dag_maker.create_dagrun().task_instances
    assert other_session.get(TaskInstance, ti.id) is not None  # dag_maker commits: visible elsewhere
    other_session.rollback()

    if not dialect_locks_rows(session):
        pytest.skip(no_row_locks_reason(session))
    stmt = select(TaskInstance).where(TaskInstance.id == ti.id)
    session.execute(with_row_locks(stmt, session=session)).all()
    with pytest.raises(OperationalError):
        other_session.execute(with_row_locks(stmt, session=other_session, nowait=True)).all()
    other_session.rollback()
    session.rollback()


def test_tables_are_clean_between_tests(session):
    from airflow.models.dag import DagModel
    from airflow.models.dagrun import DagRun
    from airflow.models.pool import Pool

    assert session.scalar(select(func.count()).select_from(DagModel)) == 0
    assert session.scalar(select(func.count()).select_from(DagRun)) == 0
    assert session.scalar(select(func.count()).select_from(DbCallbackRequest)) == 0
    assert session.scalar(select(Pool.pool).where(Pool.pool == Pool.DEFAULT_POOL_NAME)) == "default_pool"


def test_backend_marker(request):
    assert request.node.get_closest_marker("guard") is not None


def test_dag_maker_scheduled_run_and_new_version(dag_maker, session):
    from airflow.models.dag_version import DagVersion
    from airflow.utils.types import DagRunType

    with dag_maker("smoke_sched", session=session, schedule="@daily"):
        EmptyOperator(task_id="a")
    first_version = dag_maker.dag_version
    dr = dag_maker.create_dagrun(run_type=DagRunType.SCHEDULED)
    assert dr.run_id.startswith("scheduled__")
    assert (dr.data_interval_start, dr.data_interval_end - dr.data_interval_start) == (
        DEFAULT_DATE,
        timedelta(days=1),
    )

    # Re-defining the DAG in the same test writes a new DagVersion right away.
    with dag_maker("smoke_sched", session=session, schedule="@daily"):
        EmptyOperator(task_id="a")
        EmptyOperator(task_id="b")
    assert dag_maker.dag_version.id != first_version.id
    assert session.scalar(select(func.count()).select_from(DagVersion)) == 2
    assert set(dag_maker.serialized_dag.task_dict) == {"a", "b"}
