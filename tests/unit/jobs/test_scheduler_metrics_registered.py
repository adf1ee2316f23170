# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
Every metric the scheduler emits under a literal name is declared in Airflow's metrics registry.

Upstream declares each metric in ``metrics_template.yaml`` (the registry ``airflow.stats`` reads,
from which the metrics documentation is generated); a metric emitted but not declared there fails
upstream's metrics check and is missing from the documentation. The stale-executor-event patch
adds ``scheduler.tasks.stale_executor_events``.
"""

from __future__ import annotations

import inspect
import re

import pytest

from airflow.jobs import scheduler_job_runner

try:
    from airflow._shared.observability.metrics.metrics_registry import MetricsRegistry
except ImportError:  # 3.1.x: no metrics registry; a metric needs no declaration
    MetricsRegistry = None

PATCH = "Ignore-stale-executor-events-from-an-earlier-process-of-the-live-try.patch"

# 3.3 emits through the ``stats`` module, 3.2 through the ``Stats`` object.
EMITTED = re.compile(r'\b[Ss]tats\.(?:incr|decr|gauge|timing|timer)\(\s*"([^"{}]+)"')


@pytest.mark.proves(PATCH)
@pytest.mark.skipif(
    MetricsRegistry is None, reason="this base has no metrics registry (metrics_template.yaml) to declare in"
)
def test_scheduler_metrics_are_declared_in_the_registry():
    source = inspect.getsource(scheduler_job_runner)
    emitted = set(EMITTED.findall(source))
    assert "scheduler_heartbeat" in emitted  # the pattern finds the scheduler's metrics at all
    registry = MetricsRegistry()
    undeclared = sorted(name for name in emitted if registry.get(name) is None)
    assert undeclared == [], (
        f"emitted by the scheduler but not declared in metrics_template.yaml: {undeclared}"
    )
    assert "scheduler.tasks.stale_executor_events" in emitted
    assert registry.get("scheduler.tasks.stale_executor_events")["type"] == "counter"
