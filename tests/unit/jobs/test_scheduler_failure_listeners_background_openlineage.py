# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
OpenLineage 2.15.0's scheduler-side FAIL event with the background listener thread (patch 13 on 3.3.2).

Needs apache-airflow-providers-openlineage (not in the tests venvs: skipped there). The listener forks and
its child builds the event; the adapter's ``emit`` is replaced by a write to a file (inherited by the
child), so no transport or metrics registry is involved.
"""

from __future__ import annotations

import json

import pytest

from airflow.jobs.scheduler_job_runner import SchedulerJobRunner
from airflow.utils.state import TaskInstanceState

from tests.unit.ti_race import make_running_tis

pytestmark = pytest.mark.db_test


@pytest.mark.guard
@pytest.mark.skipif(
    not hasattr(SchedulerJobRunner, "_process_events_of_executors"),
    reason="the executor-event step comes with the executor-event patch",
)
def test_openlineage_fail_event_keeps_the_dag_version(
    dag_maker, session, scheduler_job_runner, listener_manager, tmp_path, monkeypatch
):
    pytest.importorskip("airflow.providers.openlineage")
    from openlineage.client.serde import Serde

    from airflow.providers.openlineage.plugins.adapter import OpenLineageAdapter
    from airflow.providers.openlineage.plugins.listener import get_openlineage_listener

    out = tmp_path / "ol.jsonl"

    def emit(self, event):
        with open(out, "a") as f:
            f.write(Serde.to_json(event) + "\n")
        return event

    monkeypatch.setattr(OpenLineageAdapter, "emit", emit)
    listener_manager(get_openlineage_listener())
    runner = scheduler_job_runner
    (ti,) = make_running_tis(dag_maker, session, dag_id="brk_ol", queued_by_job_id=runner.job.id)
    runner.executor.event_buffer[ti.key] = (TaskInstanceState.FAILED, None)
    session.commit()
    session.close()
    from airflow.jobs import scheduler_job_runner as module

    if hasattr(module, "FailureListenerThread"):
        runner.failure_listener_thread = module.FailureListenerThread()
    runner._process_events_of_executors()
    thread = getattr(runner, "failure_listener_thread", None)
    assert thread is None or thread.wait(30)
    (event,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert event["eventType"] == "FAIL"
    dag_run = event["run"]["facets"]["airflow"]["dagRun"]
    assert dag_run["dag_version_number"] == 1
    assert dag_run["dag_bundle_name"] == "dag_maker"
