# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
cProfile of one heartbeat purge pass over N timed-out TIs plus the executor events it produces (as
benchmark 1 times them), for the tree airflow-core/ is checked out at: wall time, this process's
CPU time, statements, commits, time in the driver's ``execute`` and the functions with the most own
time; on a local PostgreSQL also the CPU time of the server's backends for this database (from
/proc, backends alive at the end). With ``-`` for OUT.pstats: no profiler (wall and CPU time without its overhead).

    python benchmarks/profile_purge.py <project root> N OUT.pstats|-   # with the venv and DSN of a bench session

Resets the database like worker.py (give it a database of its own).
"""

import cProfile
import io
import os
import pstats
import re
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, sys.argv[1] + "/benchmarks")
import worker as W  # noqa: E402  (sets up the environment before airflow is imported)

H = W.H
from sqlalchemy import event  # noqa: E402
from airflow import settings  # noqa: E402
from airflow.models.taskinstance import TaskInstance as TI  # noqa: E402

n, dump = int(sys.argv[2]), sys.argv[3]


def server_cpu() -> float | None:
    """CPU seconds of the local PostgreSQL server's backends of this database (/proc), else None."""
    if settings.engine.dialect.name != "postgresql":
        return None
    marker, total = f" {settings.engine.url.database} ".encode(), 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            if cmd.startswith(b"postgres: ") and marker in cmd:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])  # utime + stime
        except OSError:
            continue
    return total / os.sysconf("SC_CLK_TCK")


H.reset_schema()
H.clear_db()
runner = H.make_runner()
with settings.NonScopedSession() as s:
    for d in range(5):
        dag = H.write_dag(f"profile_purge_{d}", 10, retries=1, session=s)
        H.create_runs(dag, n // 50, session=s)
    got = H.set_running(
        s, (TI.dag_id.like("profile_purge_%"),), job_id=runner.job.id,
        heartbeat_age_s=runner._task_instance_heartbeat_timeout_secs + 3600,
    )  # fmt: skip
settings.Session.remove()
prof = cProfile.Profile(time.process_time) if os.environ.get("PROFILE_TIMER") == "cpu" else cProfile.Profile()
by_statement: dict[str, list[float]] = {}  # statement (as the trace scripts shorten it) -> [count, seconds]
started: list[float] = []


def before(conn, cursor, statement, parameters, context, executemany):
    started.append(time.perf_counter())


def after(conn, cursor, statement, parameters, context, executemany):
    key = re.sub(r"SELECT .*? FROM", "SELECT … FROM", " ".join(statement.split()), count=1)[:110]
    entry = by_statement.setdefault(key, [0, 0.0])
    entry[0] += 1
    entry[1] += time.perf_counter() - started.pop()


event.listen(settings.engine, "before_cursor_execute", before)
event.listen(settings.engine, "after_cursor_execute", after)
with H.SqlCounter(settings.engine, threads={threading.get_ident()}) as c, H.PhaseMeter(settings.engine) as pm:
    t0, cpu0, server0 = time.perf_counter(), time.process_time(), server_cpu()
    if dump != "-":
        prof.enable()
    runner._find_and_purge_task_instances_without_heartbeats()
    settings.Session.remove()
    H.process_executor_events(runner)
    prof.disable()
    wall, cpu, server1 = time.perf_counter() - t0, time.process_time() - cpu0, server_cpu()
server = f", {server1 - server0:.2f} s CPU of its server backends" if server0 is not None else ""
print(
    f"N={got}: {wall:.2f} s wall, {cpu:.2f} s CPU of this process{server}, {c.statements} statements, "
    f"{c.commits} commits"
)
ph = pm.figures(c)
print(
    f"CPU user {ph['cpu_user_s']:.2f} + sys {ph['cpu_sys_s']:.2f} s; driver execute {ph['exec_s']:.2f} s "
    f"(CPU {ph['exec_cpu_s']:.2f}); commit {ph['commit_s']:.2f} s (CPU {ph['commit_cpu_s']:.2f}, "
    f"{ph['commit_calls']} calls); context switches voluntary {ph['vol_ctx_switches']} / involuntary "
    f"{ph['invol_ctx_switches']}; blocks written {ph['fs_out_blocks']}"
)
print("statement time (driver call, s), top 8:")
for key, (count, seconds) in sorted(by_statement.items(), key=lambda kv: -kv[1][1])[:8]:
    print(f"  {seconds:7.2f} {count:5d}  {key}")
if dump == "-":
    sys.exit(0)
prof.dump_stats(dump)
st = pstats.Stats(prof)
execute = sum(
    v[2] for k, v in st.stats.items() if k[2] in ("<method 'execute' of 'psycopg2.extensions.cursor' objects>",
                                                   "<method 'execute' of 'sqlite3.Cursor' objects>",
                                                   "<method 'query' of '_mysql.connection' objects>")
)  # fmt: skip
print(
    f"profiled: driver execute {execute:.2f} s ({execute / max(c.statements, 1) * 1000:.1f} ms per statement), "
    f"the rest {wall - execute:.2f} s"
)
out = io.StringIO()
pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(40)
print(out.getvalue())
