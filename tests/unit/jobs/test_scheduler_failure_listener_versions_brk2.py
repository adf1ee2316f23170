# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
Review (2026-12-07, helper "brk2") of commit 8930361: the after-commit ``on_task_instance_failed`` call
unloads only the collections a listener loaded, and leaves its many-to-one loads (e.g.
``dag_run.created_dag_version``) on the scheduler's objects it shares with the next call of the same run.
"""

from __future__ import annotations

import pytest
import time_machine

from airflow._shared.timezones import timezone as tz
from airflow.listeners import hookimpl
from airflow.models.taskinstance import TaskInstance

from tests.unit.jobs.test_scheduler_failure_listeners_background import in_background, made
from tests.unit.jobs.test_scheduler_heartbeat_timeout_rerun import (
    AFTER_COMMIT,
    DagVersionsListener,
    HAS_THREAD,
    committed_states,
    time_out,
)

pytestmark = pytest.mark.db_test

RUNNING = "running"
FAILED = "failed"


class CreatedVersionListener:
    """Records each call's task id and the version number of ``task_instance.dag_run.created_dag_version``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    @hookimpl
    def on_task_instance_failed(self, previous_state, task_instance, error):
        try:
            read: object = task_instance.dag_run.created_dag_version.version_number
        except Exception as e:  # recorded: the hook's caller only logs what a listener raises
            read = f"{type(e).__name__}: {e}"
        self.calls.append((task_instance.task_id, read))


def fail_two_tries_of_a_run_with_two_dag_versions(
    dag_maker, session, runner, monkeypatch, dag_id, *, versioned
):
    """
    A run created with Dag version 1 (``versioned``: a versioned bundle's run, which keeps it); the Dag changed
    (version 2) and ``a`` was cleared and re-ran with it while ``b`` still runs with version 1. Both time out
    (no retries left) and are failed in one heartbeat-timeout pass, ``a`` first.
    """
    from airflow.providers.standard.operators.empty import EmptyOperator

    with time_machine.travel(tz.utcnow(), tick=False) as clock:
        with dag_maker(dag_id, schedule=None, session=session):
            EmptyOperator(task_id="a", retries=0)
            EmptyOperator(task_id="b", retries=0)
        dag_run = dag_maker.create_dagrun()
        if versioned:
            dag_run.bundle_version = "v1"
        v1 = dag_run.created_dag_version_id
        session.commit()
        with dag_maker(dag_id, schedule=None, session=session):  # the Dag changed: a new version
            EmptyOperator(task_id="a", retries=0, doc_md="changed")
            EmptyOperator(task_id="b", retries=0)
            EmptyOperator(task_id="c", retries=0)
        v2 = dag_maker.dag_version.id
        if v2 == v1:
            pytest.skip("the changed Dag was written into the run's Dag version, not a new one")
        tis = {t: dag_run.get_task_instance(t, session=session) for t in ("a", "b")}
        for ti in tis.values():
            ti.state = RUNNING
            ti.try_number = 1
            ti.hostname = "worker-1"
            ti.start_date = tz.utcnow()
        tis["a"].dag_version_id = v2  # cleared and re-run with the new version
        time_out(runner, session, list(tis.values()), clock)
        real = runner._find_task_instances_without_heartbeats
        monkeypatch.setattr(  # the pass handles ``a`` before ``b``
            runner,
            "_find_task_instances_without_heartbeats",
            lambda *a, **kw: sorted(real(*a, **kw), key=lambda ti: ti.task_id),
        )
        runner._find_and_purge_task_instances_without_heartbeats()


@pytest.mark.skipif(not AFTER_COMMIT, reason="no after-commit listener call in this tree")
@pytest.mark.skipif(
    not hasattr(TaskInstance, "working_set"),
    reason="before 3.4 the listener runs on detached objects: it cannot load created_dag_version at all",
)
@pytest.mark.xfail(
    strict=True,
    reason="brk2 2026-12-07: the after-commit listener call (3.4 _notify_failure_after_commit) expires only "
    "collections; the DagVersion the first call's listener loaded as dag_run.created_dag_version "
    "stays on the run the scheduler's tries share, so the next try's call, whose dag_version (the "
    "run's created version, loaded by the scheduler's scan) is another object of that identity, "
    "fails in session.add: InvalidRequestError 'Can't attach instance <DagVersion>; another instance "
    "with key ... is already present in this session' and its listeners are never called",
)
@pytest.mark.parametrize(
    "listener_thread",
    [pytest.param(True, id="listener-thread"), pytest.param(False, id="inline")],
)
def test_two_failures_of_a_run_with_two_dag_versions_each_reach_the_listener(
    listener_thread, dag_maker, session, scheduler_job_runner, listener_manager, caplog, monkeypatch
):
    """
    A run created with Dag version 1; the Dag changed (version 2) and ``a`` was cleared and re-ran with it,
    while ``b`` still runs with version 1. Both time out together (their worker died, no retries left) and are
    failed in one heartbeat-timeout pass, ``a`` first. A listener that reads
    ``task_instance.dag_run.created_dag_version`` must be called for each and read version 1.
    """
    if listener_thread and not HAS_THREAD:
        pytest.skip("no background listener thread in this tree")
    listener = CreatedVersionListener()
    listener_manager(listener)
    runner = scheduler_job_runner
    if listener_thread:
        in_background(runner)
    dag_id = "one_run_two_versions"
    fail_two_tries_of_a_run_with_two_dag_versions(
        dag_maker, session, runner, monkeypatch, dag_id, versioned=False
    )
    made(runner)

    assert committed_states(dag_id) == {"a": FAILED, "b": FAILED}
    logged = [r.exc_info[1] for r in caplog.records if r.exc_info]
    assert sorted(listener.calls) == [("a", 1), ("b", 1)], f"calls raised: {logged!r}"


@pytest.mark.skipif(not AFTER_COMMIT, reason="no after-commit listener call in this tree")
@pytest.mark.xfail(
    strict=True,
    reason="brk2 2026-12-07: a versioned bundle's run reads dag_versions as [created_dag_version], a "
    "many-to-one that the after-commit call (3.3.2 _call_failed_listeners_after_commit pre-load, 3.4 "
    "the listener in _notify_failure_after_commit) leaves loaded on the run the scheduler's tries "
    "share; the next try's call, whose dag_version the scheduler's scan loaded as another object of "
    "that identity, fails in session.add: InvalidRequestError 'Can't attach instance <DagVersion>; "
    "another instance with key ... is already present in this session' and its listeners are never "
    "called (inline calls; the 3.3.2 listener thread copies each try)",
)
def test_two_failures_of_a_versioned_run_one_cleared_on_the_latest_version_each_reach_the_listener(
    dag_maker, session, scheduler_job_runner, listener_manager, caplog, monkeypatch
):
    """
    A versioned bundle's run (``bundle_version`` kept), created with Dag version 1. The Dag changed (version
    2) and ``a`` was cleared "on the latest version" while the run kept running: ``a`` re-ran with version 2,
    the run keeps version 1, ``b`` still runs with it. Both time out together (no retries left) and are failed
    in one heartbeat-timeout pass, ``a`` first, their listener calls made inline after the commit. A listener
    that reads ``task_instance.dag_run.dag_versions`` (OpenLineage does) must be called for each and read
    ``[1]``.
    """
    listener = DagVersionsListener()
    listener_manager(listener)
    runner = scheduler_job_runner
    dag_id = "versioned_run_two_versions"
    fail_two_tries_of_a_run_with_two_dag_versions(
        dag_maker, session, runner, monkeypatch, dag_id, versioned=True
    )
    made(runner)

    assert committed_states(dag_id) == {"a": FAILED, "b": FAILED}
    logged = [r.exc_info[1] for r in caplog.records if r.exc_info]
    assert sorted(listener.calls) == [("a", [1]), ("b", [1])], f"calls raised: {logged!r}"
