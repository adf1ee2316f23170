# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
Found by a review (2026-12-07, a helper trying to break them) of two changes of that morning, and fixed the same
day: the heartbeat-timeout re-run pass that scanned ``[ti_id, *the other tries of its run the rolled-back pass
found]`` (3.3.2's executor-events patch, its ports to 3.2.2 / 3.1.8, and 3.4's patch 10) scans the run's other tries
only for a fail_fast Dag (a quadratic scan otherwise), and 3.4 tells the executor of a restarting try fail_fast
skipped; the failure-listener call made after the commit (``_call_failed_listeners_after_commit``; on 3.4
``_notify_failure_after_commit``, patch 2) unloads what listeners loaded, so the next call of the same run can attach
its try.

The database errors are real ones: a trigger that rejects the UPDATE of one task instance
(``reject_updates_of``) makes the first heartbeat-timeout pass fail, so that it is rolled back and redone one
task instance per pass.
"""

from __future__ import annotations

import inspect
import time
from datetime import timedelta

import pytest
import time_machine
from sqlalchemy import select

from airflow import settings
from airflow._shared.timezones import timezone as tz
from airflow.jobs import scheduler_job_runner as sjr
from airflow.listeners import hookimpl
from airflow.models import taskinstance
from airflow.models.dag import DagModel
from airflow.models.taskinstance import TaskInstance
from airflow.utils.state import TaskInstanceState

from tests.unit.harness.series import guard_since
from tests.unit.jobs.test_scheduler_executor_events_kept import POISON, reject_updates_of
from tests.unit.jobs.test_scheduler_executor_events_rerun import P_FAIL_FAST_RELEASE, P_KEEP, record_incr
from tests.unit.jobs.test_scheduler_failure_listeners_background import in_background, made
from tests.unit.ti_race import make_running_tis

pytestmark = pytest.mark.db_test

RUNNING = TaskInstanceState.RUNNING
RESTARTING = TaskInstanceState.RESTARTING
FAILED = TaskInstanceState.FAILED
SKIPPED = TaskInstanceState.SKIPPED
UP_FOR_RETRY = TaskInstanceState.UP_FOR_RETRY

ON_3_4 = hasattr(TaskInstance, "working_set")  # a try is a row of its own
# The re-run pass (``ti_ids``) comes with the executor-events patch on every base.
HAS_RERUN = (
    "ti_ids"
    in inspect.signature(sjr.SchedulerJobRunner._find_and_purge_task_instances_without_heartbeats).parameters
)
needs_rerun = pytest.mark.skipif(
    not HAS_RERUN, reason="the heartbeat-timeout re-run pass comes with the executor-events patch"
)


def committed_states(*dag_ids: str) -> dict[str, str | None]:
    """``task_id -> state`` of the current tries of ``dag_ids``, as committed."""
    with settings.NonScopedSession() as s:
        rows = s.execute(
            select(TaskInstance.task_id, TaskInstance.state).where(TaskInstance.dag_id.in_(dag_ids))
        )
        return dict(rows.all())


def time_out(runner, session, tis, clock) -> None:
    """The tries ``tis`` as a worker left them (last heartbeat now, queued by ``runner``'s job), committed; then
    the clock moves past ``[scheduler] task_instance_heartbeat_timeout``."""
    for ti in tis:
        ti.queued_by_job_id = runner.job.id
        ti.last_heartbeat_at = tz.utcnow()
    session.commit()
    session.expunge_all()
    clock.shift(timedelta(seconds=runner._task_instance_heartbeat_timeout_secs + 60))


BIG_RUN = 30  # timed-out tries of one run


@needs_rerun
@pytest.mark.skipif(
    not hasattr(DagModel, "fail_fast"),
    reason="3.1.x: no DagModel.fail_fast, so a re-run still scans its run's other tries (a known limit)",
)
@pytest.mark.proves(P_KEEP)
def test_rerun_passes_of_a_big_run_scan_each_try_once(dag_maker, session, scheduler_job_runner, monkeypatch):
    """
    A worker node died: the 30 running tries of one run (retries left, no fail_fast) time out together, with one
    try of another Dag whose UPDATE the database rejects. The pass fails on that one, is rolled back and redone one
    task instance per pass. No re-run can stop another try of the run (no fail_fast): each scans its own try, 31 rows
    in all. When each re-run scanned ``[ti_id, *the run's other tries]`` it found all those not yet purged (30 + 29 +
    ... + 1); with 1,000 tries (a big mapped task) the re-runs held the scheduler loop for minutes (postgres 15,
    2026-12-07: 107 s, 501,502 rows; a single pass 11.4 s; re-runs that scan their own try only 17.6 s).
    """
    runner = scheduler_job_runner
    task_ids = tuple(f"t{i:02}" for i in range(BIG_RUN))
    with time_machine.travel(tz.utcnow(), tick=False) as clock:
        tis = make_running_tis(dag_maker, session, dag_id="rerun_big_run", task_ids=task_ids)
        (poison,) = make_running_tis(dag_maker, session, dag_id="rerun_big_run_other", task_ids=(POISON,))
        time_out(runner, session, (*tis, poison), clock)

        real = runner._find_task_instances_without_heartbeats
        scanned: list[int] = []

        def scan(*, session, ti_ids=None):
            found = real(session=session, ti_ids=ti_ids)
            if ti_ids is not None:
                scanned.append(len(found))
            return found

        monkeypatch.setattr(runner, "_find_task_instances_without_heartbeats", scan)
        started = time.monotonic()
        with reject_updates_of(POISON):
            runner._find_and_purge_task_instances_without_heartbeats()
        took = time.monotonic() - started

    assert committed_states("rerun_big_run", "rerun_big_run_other") == {
        **dict.fromkeys(task_ids, UP_FOR_RETRY),
        POISON: RUNNING,
    }
    assert len(scanned) == BIG_RUN + 1, scanned  # one re-run per try found
    assert sum(scanned) <= 2 * (BIG_RUN + 1), (
        f"the re-runs of a pass of {BIG_RUN + 1} tries scanned and locked {sum(scanned)} rows "
        f"({sorted(scanned, reverse=True)[:5]}...; {took:.1f} s for the whole pass)"
    )


@needs_rerun
@pytest.mark.proves(P_FAIL_FAST_RELEASE)
def test_restarting_sibling_stopped_by_fail_fast_in_a_rerun_pass_is_released_by_the_executor(
    dag_maker, session, scheduler_job_runner, monkeypatch
):
    """
    A fail_fast Dag: ``t1`` (no retries left) and ``r`` (cleared while it ran: restarting) both timed out, their
    worker gone. The re-run pass of ``t1`` (as a pass rolled back on another try makes it:
    ``ti_ids=[t1, r]``) fails ``t1``; fail_fast stops ``r``, which, not running, ``_stop_remaining_tasks`` sets
    SKIPPED. The executor must be told of ``r`` as of any try the pass's fail_fast stopped (3.3.2's purge tells it
    of every stopped try; 3.4's patch 10 told it only of a FAILED one until 2026-12-07). After the pass, ``r`` is no longer found (skipped):
    no later pass releases it.
    """
    from airflow.providers.standard.operators.empty import EmptyOperator

    runner = scheduler_job_runner
    with time_machine.travel(tz.utcnow(), tick=False) as clock:
        with dag_maker("rerun_restarting_sibling", schedule=None, session=session, fail_fast=True):
            EmptyOperator(task_id="t1", retries=0)
            EmptyOperator(task_id="r", retries=0)
        dag_run = dag_maker.create_dagrun()
        t1, r = (dag_run.get_task_instance(t, session=session) for t in ("t1", "r"))
        for ti in (t1, r):
            ti.state = RUNNING
            ti.try_number = 1
            ti.hostname = "worker-1"
            ti.start_date = tz.utcnow()
        r.state = RESTARTING
        ids = [t1.id, r.id]
        keys = {"t1": t1.key, "r": r.key}
        runner.executor.running.update(keys.values())
        time_out(runner, session, (t1, r), clock)
        # The scan returns ``r`` after ``t1``: without patch 10 (3.4) the pass follows scan order, which is the
        # database's (MariaDB gave ``r`` first, postgres mostly not: verify-series said "passes without" on both).
        real = runner._find_task_instances_without_heartbeats
        monkeypatch.setattr(
            runner,
            "_find_task_instances_without_heartbeats",
            lambda *a, **kw: sorted(real(*a, **kw), key=lambda ti: ti.task_id == "r"),
        )

        runner._find_and_purge_task_instances_without_heartbeats(ti_ids=ids)

    assert committed_states("rerun_restarting_sibling") == {"t1": FAILED, "r": SKIPPED}
    leaked = sorted(task_id for task_id, key in keys.items() if key in runner.executor.running)
    assert not leaked, f"the executor still counts the stopped try of {leaked} as running"


class DagVersionsListener:
    """Records each call's task id, and what it read of ``task_instance.dag_run.dag_versions`` (as OpenLineage)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    @hookimpl
    def on_task_instance_failed(self, previous_state, task_instance, error):
        try:
            read: object = [v.version_number for v in task_instance.dag_run.dag_versions]
        except Exception as e:  # recorded: the hook's caller only logs what a listener raises
            read = f"{type(e).__name__}: {e}"
        self.calls.append((task_instance.task_id, read))


HAS_THREAD = hasattr(sjr, "FailureListenerThread")  # 3.3.2 / 3.2.2 / 3.1.8 operator tail; not on 3.4
# The failure listener called after the commit, with the try detached (patch 2 on every base); before it, inline.
AFTER_COMMIT = any(
    hasattr(taskinstance, name)
    for name in ("_call_failed_listeners_after_commit", "_notify_failure_after_commit")
)


@pytest.mark.parametrize(
    "listener_thread",
    [
        pytest.param(True, id="listener-thread"),
        pytest.param(False, id="inline"),
    ],
)
# A guard on 3.4 (its purge fails both tries in the pass); before 3.4 the queues' listener calls reach both tries of
# the run only with the same-pass patch (verify-series-postgres: fails at base + 1..4 on 3.3.2, 3.2.2, 3.1.8).
@guard_since("3.4.0", "Fail-heartbeat-timed-out-tries-in-the-same-pass.patch")
def test_two_failures_of_one_run_in_one_pass_each_reach_the_listener(
    listener_thread, dag_maker, session, scheduler_job_runner, listener_manager, caplog
):
    """
    Two running tries of one run (no retries left) time out together (their worker node died) and are failed in one
    heartbeat-timeout pass. A failure listener that reads ``task_instance.dag_run.dag_versions`` (OpenLineage 2.15
    does; 3.3.2's after-commit call pre-loads it for listeners) must be called for each, and read the run's Dag
    version. ``listener-thread``: the calls are made on the background listener thread, as ``_execute`` sets it up
    where the tree has it (skipped where it does not: 3.4, and the core tier); ``inline``: made on the scheduler's
    thread after the commit, as 3.4's queue and the core tier make them.
    """
    if listener_thread and not HAS_THREAD:
        pytest.skip("no background listener thread in this tree (3.4's queue, or the core tier)")
    listener = DagVersionsListener()
    listener_manager(listener)
    runner = scheduler_job_runner
    if listener_thread:
        in_background(runner)
    with time_machine.travel(tz.utcnow(), tick=False) as clock:
        tis = make_running_tis(
            dag_maker, session, dag_id="one_run_two_failures", task_ids=("a", "b"), retries=0
        )
        time_out(runner, session, tis, clock)
        runner._find_and_purge_task_instances_without_heartbeats()
    made(runner)

    assert committed_states("one_run_two_failures") == {"a": FAILED, "b": FAILED}
    logged = [
        r.exc_info[1]
        for r in caplog.records
        if r.exc_info and "after the scheduler's commit" in r.getMessage()
    ]
    assert sorted(listener.calls) == [("a", [1]), ("b", [1])], (
        f"calls made after the commit raised: {logged!r}"
    )


@pytest.mark.skipif(
    not hasattr(TaskInstance, "complete_restart"),
    reason="scheduler.zombies.detected: 3.4's heartbeat-timeout pass counts it",
)
@pytest.mark.proves(P_KEEP)
def test_rolled_back_pass_counts_each_timed_out_try_once(
    dag_maker, session, scheduler_job_runner, monkeypatch
):
    """A pass rolled back and redone one task instance per pass counts each timed-out try it found once."""
    runner = scheduler_job_runner
    with time_machine.travel(tz.utcnow(), tick=False) as clock:
        tis = make_running_tis(dag_maker, session, dag_id="rerun_counted", task_ids=("ok", POISON))
        time_out(runner, session, tis, clock)
        counters = record_incr(monkeypatch)
        with reject_updates_of(POISON):
            runner._find_and_purge_task_instances_without_heartbeats()
    assert counters.count("scheduler.zombies.detected") == 2
