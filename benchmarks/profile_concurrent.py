# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
cProfile of benchmark 3's scheduler thread (the thread that runs ``_process_executor_events``; the
API thread is not profiled) and its statement counts, for the tree airflow-core/ is checked out at.

    python benchmarks/profile_concurrent.py <project root> SECONDS LISTENER_S fresh|stale OUT.pstats [ORDER]

ORDER: race (default), api-first or scheduler-first (see ``worker.bench_concurrent``).

Resets the database like worker.py (give it a database of its own).
"""

import cProfile
import io
import json
import pstats
import sys

sys.path.insert(0, sys.argv[1] + "/benchmarks")
import worker as W  # noqa: E402  (sets up the environment before airflow is imported)

duration, latency, stale, dump = float(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "stale", sys.argv[5]
order = sys.argv[6] if len(sys.argv) > 6 else "race"
W.H.reset_schema()
prof = cProfile.Profile()
prof.enable()
(r,) = W.bench_concurrent(duration, 100, 10, [latency], stale_heartbeats=stale, order=order)
prof.disable()
prof.dump_stats(dump)
keys = (
    "stale_heartbeats",
    "events",
    "handled",
    "sched_seconds",
    "events_per_s",
    "crashes",
    "api",
    "outcomes",
)
print(json.dumps({k: r[k] for k in keys}, default=str))
print(
    f"scheduler statements {r['sched_statements']}, commits {r['sched_commits']}, per handled event "
    f"{r['sched_statements'] / max(r['handled'], 1):.1f} / {r['sched_commits'] / max(r['handled'], 1):.2f}; "
    f"lock waits {r['sched_lock_waits']} ({r['sched_lock_wait_s']:.2f} s)"
)
out = io.StringIO()
pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(45)
print(out.getvalue())
