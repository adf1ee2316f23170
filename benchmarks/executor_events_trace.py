# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
Statement trace of one ``_process_executor_events`` batch of 10 FAILED executor events for RUNNING
TIs whose task has callbacks (benchmark 3's shape, without the concurrent API; issue 17, target 2).

    python benchmarks/executor_events_trace.py <project root> [stale]   # like purge_trace.py

The TIs' last heartbeat is fresh, or with ``stale`` older than the heartbeat timeout: the series'
patch 17 holds FAILED events of tries with a recent heartbeat (then the trace shows only the reads).

Resets the database like worker.py (give it a database of its own).
"""

import collections
import sys

sys.path.insert(0, sys.argv[1] + "/benchmarks")
import worker as W  # noqa: E402  (sets up the environment before airflow is imported)

H = W.H
from sqlalchemy import select  # noqa: E402
from airflow import settings  # noqa: E402
from airflow.models.taskinstance import TaskInstance as TI  # noqa: E402
from airflow.utils.state import TaskInstanceState  # noqa: E402

H.reset_schema()
H.clear_db()
runner = H.make_runner()
with settings.NonScopedSession() as s:
    dag = H.write_dag("trace_events", 10, retries=1, callbacks=True, session=s)
    (dr,) = H.create_runs(dag, 1, session=s)
    stale = len(sys.argv) > 2 and sys.argv[2] == "stale"
    age = runner._task_instance_heartbeat_timeout_secs + 3600 if stale else 0
    H.set_running(s, (TI.dag_id == dag.dag_id,), job_id=runner.job.id, heartbeat_age_s=age)
    keys = [ti.key for ti in s.scalars(select(TI).where(TI.dag_id == dag.dag_id))]
settings.Session.remove()
for key in keys:
    runner.executor.event_buffer[key] = (TaskInstanceState.FAILED, None)
with H.StatementRecorder(settings.engine, width=120, commit_marker="--COMMIT--") as rec:
    H.process_executor_events(runner)
stmts = rec.statements
n = len([x for x in stmts if x != "--COMMIT--"])
print(f"== {n} statements, {rec.commits} commits for {len(keys)} FAILED events")
for k, v in collections.Counter(stmts).most_common():
    print(f"{v:4d}  {k}")
