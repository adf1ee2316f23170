# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
Statement trace of one heartbeat purge pass over N=10 timed-out TIs and of its executor events
(issue 17, target 1): the scheduler thread's statements, grouped, and its commits.

    python benchmarks/purge_trace.py <project root>   # with the venv and DSN of a bench session,
                                                       # airflow-core/ checked out at the tree to trace

Resets the database like worker.py (give it a database of its own).
"""

import collections
import sys

sys.path.insert(0, sys.argv[1] + "/benchmarks")
import worker as W  # noqa: E402  (sets up the environment before airflow is imported)

H = W.H
from airflow import settings  # noqa: E402
from airflow.models.taskinstance import TaskInstance as TI  # noqa: E402

H.reset_schema()
H.clear_db()
runner = H.make_runner()
with settings.NonScopedSession() as s:
    dag = H.write_dag("trace_purge", 10, retries=1, session=s)
    (dr,) = H.create_runs(dag, 1, session=s)
    H.set_running(
        s,
        (TI.dag_id == dag.dag_id,),
        job_id=runner.job.id,
        heartbeat_age_s=runner._task_instance_heartbeat_timeout_secs + 3600,
    )
settings.Session.remove()
with H.StatementRecorder(settings.engine, width=140) as rec:
    runner._find_and_purge_task_instances_without_heartbeats()
    settings.Session.remove()
    purge = (list(rec.statements), rec.commits)
    rec.clear()
    H.process_executor_events(runner)
    events = (list(rec.statements), rec.commits)
for name, (ss, c) in (("purge pass", purge), ("its executor events", events)):
    print(f"== {name}: {len(ss)} statements, {c} commits (N=10)")
    for k, v in collections.Counter(ss).most_common():
        print(f"{v:4d}  {k}")
