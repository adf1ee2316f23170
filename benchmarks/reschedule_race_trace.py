# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
Where benchmark 3's execution-API reschedules fail (sqlite: FK IntegrityError on task_reschedule):
for every ``ti_update_state`` call of the API thread, the time from its read of the TI row to its
``INSERT INTO task_reschedule``, and whether the scheduler thread committed a change of that TI's
id (failure handling's retry) in between.

    python benchmarks/reschedule_race_trace.py <project root> SECONDS LISTENER_S fresh|stale

Resets the database like worker.py (give it a database of its own).
"""

import json
import statistics
import sys
import threading
import time

sys.path.insert(0, sys.argv[1] + "/benchmarks")
import worker as W  # noqa: E402  (sets up the environment before airflow is imported)

H = W.H
from sqlalchemy import event  # noqa: E402
from airflow import settings  # noqa: E402

duration, latency, stale = float(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "stale"
engines = []
make_engine = H.make_engine


def capture():
    e = make_engine()
    engines.append(e)
    return e


H.make_engine = capture
calls = []  # API thread: [ti_id, t_read, t_insert, error]
rotations = []  # scheduler: (t_commit, {old ids whose row got a new id in that transaction})
pending: set = set()
sched = threading.get_ident()


def params_of(parameters):
    if isinstance(parameters, dict):
        return [str(v) for v in parameters.values()]
    return [str(v) for v in (parameters or ())]


def api_before(conn, cursor, statement, parameters, context, executemany):
    s = " ".join(statement.split())
    if s.startswith("SELECT task_instance.state, task_instance.try_number, task_instance.max_tries"):
        calls.append([params_of(parameters)[-1], time.perf_counter(), None, None])
    elif s.startswith("INSERT INTO task_reschedule") and calls and calls[-1][2] is None:
        calls[-1][2] = time.perf_counter()


def api_error(ctx):
    if calls and calls[-1][3] is None and "task_reschedule" in str(ctx.statement or ""):
        calls[-1][3] = type(ctx.original_exception).__name__


def sched_before(conn, cursor, statement, parameters, context, executemany):
    if threading.get_ident() == sched and statement.lstrip().startswith("UPDATE task_instance SET id="):
        pending.update(params_of(parameters)[-1:])  # WHERE task_instance.id = <old id>


def sched_commit(conn):
    if threading.get_ident() == sched and pending:
        rotations.append((time.perf_counter(), set(pending)))
        pending.clear()


def sched_rollback(conn):
    if threading.get_ident() == sched:
        pending.clear()


orig_bench = W.bench_concurrent


def hooked(*a, **kw):
    event.listen(settings.engine, "before_cursor_execute", sched_before)
    event.listen(settings.engine, "commit", sched_commit)
    event.listen(settings.engine, "rollback", sched_rollback)
    return orig_bench(*a, **kw)


_orig_make_sf = H.make_session_factory


def make_sf(engine):
    event.listen(engine, "before_cursor_execute", api_before)
    event.listen(engine, "handle_error", api_error)
    return _orig_make_sf(engine)


H.make_session_factory = make_sf
H.reset_schema()
(r,) = hooked(duration, 100, 10, [latency], stale_heartbeats=stale)
done = [c for c in calls if c[2] is not None]
raced = [c for c in done if any(c[1] < t <= c[2] and c[0] in ids for t, ids in rotations)]
errors = [c for c in done if c[3]]
windows = [(c[2] - c[1]) * 1000 for c in done]
print(json.dumps({k: r[k] for k in ("events", "handled", "events_per_s", "crashes", "api")}))
print(
    f"reschedule calls that reached the INSERT: {len(done)}; FK errors at it: {len(errors)}; "
    f"calls with a committed id change of their TI between read and INSERT: {len(raced)} "
    f"(of them failed: {len([c for c in raced if c[3]])}); errors without one: "
    f"{len([c for c in errors if c not in raced])}"
)
if windows:
    q = statistics.quantiles(windows, n=10)
    print(
        f"read -> INSERT ms: median {statistics.median(windows):.1f}, p10 {q[0]:.1f}, p90 {q[-1]:.1f}; "
        f"scheduler commits changing an id: {len(rotations)} "
        f"({sum(len(ids) for _, ids in rotations)} ids)"
    )
