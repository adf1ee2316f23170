# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
A callback sink with the 3.3.2 signature ``send(self, callback)`` keeps working (guard).

``callback_sink`` is a public, pluggable attribute (``BaseCallbackSink`` subclasses); the series
gives ``BaseCallbackSink.send`` and ``BaseExecutor.send_callback`` a ``session`` keyword, and
``BaseExecutor.send_callback`` must not pass it to a sink written against 3.3.2 (``TypeError``
is not one of the errors the executor-event savepoint handler catches: it would leave the
scheduler loop). Holds on 3.3.2 and at every step of the series.
"""

from __future__ import annotations

import pytest

from airflow.callbacks.base_callback_sink import BaseCallbackSink
from airflow.utils.state import TaskInstanceState

from tests.unit.ti_race import make_running_tis

pytestmark = pytest.mark.db_test


def on_failure(context):  # pragma: no cover
    pass


class LegacySink(BaseCallbackSink):
    """A sink with the 3.3.2 signature."""

    def __init__(self):
        self.sent = []

    def send(self, callback):
        self.sent.append(callback)


@pytest.mark.guard
def test_callback_sink_with_332_signature_keeps_working(dag_maker, session, scheduler_job_runner):
    runner = scheduler_job_runner
    sink = LegacySink()
    runner.executor.callback_sink = sink
    (ti,) = make_running_tis(
        dag_maker,
        session,
        dag_id="legacy_sink",
        task_ids=("t",),
        queued_by_job_id=runner.job.id,
        on_failure_callback=on_failure,
    )
    runner.executor.event_buffer[ti.key] = (TaskInstanceState.FAILED, None)
    session.expunge_all()

    try:
        runner._process_executor_events(executor=runner.executor, session=session)
    except TypeError as e:
        pytest.fail(f"_process_executor_events raised {e!r} for a 3.3.2-style callback sink")
    session.commit()
    assert len(sink.sent) == 1
