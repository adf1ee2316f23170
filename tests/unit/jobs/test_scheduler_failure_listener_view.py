# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
What an ``on_task_instance_failed`` listener sees of a try the heartbeat-timeout purge failed, on 3.4 (a try is a row
of its own, archived when it is retried or restarted): the try that failed, in the state failure handling gave it,
also when the call is made after the pass's commit.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import time_machine

from airflow._shared.timezones import timezone as tz
from airflow.models.taskinstance import TaskInstance
from airflow.utils.state import TaskInstanceState

from tests.unit.ti_race import make_running_tis

pytestmark = pytest.mark.db_test

only_34 = pytest.mark.skipif(
    not hasattr(TaskInstance, "working_set"),
    reason="3.4: a try is a row of its own, archived (working_set NULL)",
)


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


@only_34
@pytest.mark.guard
def test_listener_gets_the_try_that_failed(dag_maker, session, scheduler_job_runner, listener_manager):
    """Sound: the listener's task instance is the try whose failure was handled (its id and try number)."""
    tries, seen = _listener_view(dag_maker, session, scheduler_job_runner, listener_manager)
    assert {task_id: (v["id"], v["try_number"]) for task_id, v in seen.items()} == tries


@only_34
@pytest.mark.guard
@pytest.mark.parametrize("task_id", ["restarting", "retry"])
def test_listener_sees_the_state_the_failure_handling_gave_the_live_try(
    task_id, dag_maker, session, scheduler_job_runner, listener_manager
):
    """
    Called after the pass's commit, the listener still sees ``restarting`` / ``up_for_retry`` of the live try, as
    3.4.0b2 showed when it called it inline: not the failed, archived row that ``complete_restart`` /
    ``prepare_db_for_next_try`` made of it (review 2026-12-07, finding 2: a listener could not tell a restart or a
    retry from a final failure).
    """
    _, seen = _listener_view(dag_maker, session, scheduler_job_runner, listener_manager)
    expected = {"restarting": TaskInstanceState.RESTARTING, "retry": TaskInstanceState.UP_FOR_RETRY}[task_id]
    assert (seen[task_id]["state"], seen[task_id]["working_set"]) == (expected, True)
