# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
Review (2026-12-07) of two changes of the executor-events patch (docs/series-v3.md, docs/3.4.md).

1. 3.3.2 (50cb9da, ported to 3.2.2 / 3.1.8 in a7607ff): a heartbeat-timeout pass redone one task instance per pass
   also found FAILED tries, so a try its own worker failed in between was handled as timed out. Fixed (a re-run tells
   the executor only of tries its own fail_fast stopped); its test is in ``test_scheduler_executor_events_rerun.py``.
2. 3.4.0b2 (8ab29a6): the purge queues the listener call of a restarting try for after the pass's commit, where the
   try has been archived by ``complete_restart`` (the inline call ran before it).
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import time_machine

from airflow._shared.timezones import timezone as tz
from airflow.utils.state import TaskInstanceState

from tests.unit.harness.series import BASE_VERSION, _release
from tests.unit.jobs.test_scheduler_executor_events_kept import POISON, reject_updates_of
from tests.unit.jobs.test_scheduler_executor_events_rerun import record_incr
from tests.unit.ti_race import make_running_tis

pytestmark = pytest.mark.db_test


def _restart_and_retry_tries(dag_maker, session, runner):
    """``restarting`` (cleared while running) and ``retry`` (running, 1 retry left), heartbeats now, committed."""
    tis = make_running_tis(dag_maker, session, dag_id="listener_view", task_ids=("restarting", "retry"))
    for ti in tis:
        ti.queued_by_job_id = runner.job.id
        ti.last_heartbeat_at = tz.utcnow()
    tis[0].state = TaskInstanceState.RESTARTING
    session.commit()
    return {ti.task_id: (ti.id, ti.try_number) for ti in tis}


def _listener_view(dag_maker, session, scheduler_job_runner, listener_manager):
    """What ``on_task_instance_failed`` sees of each try, at the call, after one heartbeat-timeout pass."""
    from airflow.listeners import hookimpl

    seen: dict[str, dict] = {}

    class Recorder:
        @hookimpl
        def on_task_instance_failed(self, previous_state, task_instance, error):
            seen[task_instance.task_id] = {
                "id": task_instance.id,
                "try_number": task_instance.try_number,
                "state": task_instance.state,
                "working_set": task_instance.working_set,
            }

    listener_manager(Recorder())
    runner = scheduler_job_runner
    with time_machine.travel(tz.utcnow(), tick=False) as clock:
        tries = _restart_and_retry_tries(dag_maker, session, runner)
        session.expunge_all()
        clock.shift(timedelta(seconds=runner._task_instance_heartbeat_timeout_secs + 60))
        runner._find_and_purge_task_instances_without_heartbeats()
    return tries, seen


only_34 = pytest.mark.skipif(
    _release(BASE_VERSION) < (3, 4), reason="3.4: a try is a row of its own, archived (working_set NULL)"
)


@only_34
def test_listener_gets_the_try_that_failed(dag_maker, session, scheduler_job_runner, listener_manager):
    """Sound: the listener's task instance is the try whose failure was handled (its id and try number)."""
    tries, seen = _listener_view(dag_maker, session, scheduler_job_runner, listener_manager)
    assert {task_id: (v["id"], v["try_number"]) for task_id, v in seen.items()} == tries


@only_34
@pytest.mark.xfail(
    strict=True,
    reason="review 2026-12-07, finding 2 (8ab29a6; patch 2 for the retry): the listener is called after "
    "complete_restart / prepare_db_for_next_try archived the try: it sees state failed, working_set None, where "
    "3.4.0b2 showed restarting / up_for_retry of the current try (a listener cannot tell a restart or a retry "
    "from a final failure)",
)
@pytest.mark.parametrize("task_id", ["restarting", "retry"])
def test_listener_sees_the_state_the_failure_handling_gave_the_live_try(
    task_id, dag_maker, session, scheduler_job_runner, listener_manager
):
    _, seen = _listener_view(dag_maker, session, scheduler_job_runner, listener_manager)
    expected = {"restarting": TaskInstanceState.RESTARTING, "retry": TaskInstanceState.UP_FOR_RETRY}[task_id]
    assert (seen[task_id]["state"], seen[task_id]["working_set"]) == (expected, True)


@only_34
@pytest.mark.xfail(
    strict=True,
    reason="review 2026-12-07, minor finding 3: scheduler.zombies.detected is counted in the pass that is rolled "
    "back and again in each re-run (4 for 2 timed-out tries)",
)
def test_rolled_back_pass_counts_each_timed_out_try_once(
    dag_maker, session, scheduler_job_runner, monkeypatch
):
    runner = scheduler_job_runner
    with time_machine.travel(tz.utcnow(), tick=False) as clock:
        tis = make_running_tis(dag_maker, session, dag_id="rerun_counted", task_ids=("ok", POISON))
        for ti in tis:
            ti.queued_by_job_id = runner.job.id
            ti.last_heartbeat_at = tz.utcnow()
        session.commit()
        session.expunge_all()
        clock.shift(timedelta(seconds=runner._task_instance_heartbeat_timeout_secs + 60))
        counters = record_incr(monkeypatch)
        with reject_updates_of(POISON):
            runner._find_and_purge_task_instances_without_heartbeats()
    assert counters.count("scheduler.zombies.detected") == 2
