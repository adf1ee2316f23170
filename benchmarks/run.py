#!/usr/bin/env python3
# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
Benchmarks of the patch series, base vs series, in one run on one database: prints Markdown tables
and writes them to ``benchmarks/results/<backend>.md``.

    nox -s bench-postgres [-- --quick] [-- --only purge,listener] [-- --repeats 3]
    python benchmarks/run.py --backend postgres [--quick]   # in a venv with the editable airflow-core,
                                                             # AIRFLOW__DATABASE__SQL_ALCHEMY_CONN set

For each variant (``base`` = ``tree.py checkout 0``, ``series`` = ``checkout all``) the tree is moved
*first*, then a fresh ``worker.py`` process imports airflow from it, resets the database with Airflow's
own code and measures; the tree is put back at ``checkout all`` at the end, also on error or Ctrl-C.
This moves the shared ``airflow-core/`` working tree: do not run it while a test session uses it.
This file does not import airflow.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "ci"))
import tree  # noqa: E402  (stdlib only: run.py never imports airflow)

HERE = Path(os.path.abspath(__file__)).parent  # not resolve(): a symlinked benchmarks/ uses its project


def tree_cmd(root: Path, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(root / "scripts" / "ci" / "tree.py"), "--root", str(root), *args],
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        raise SystemExit(f"tree.py {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout.strip()


def series_names(root: Path) -> list[str]:
    """Patch file names of ``root/patches/series``, parsed by the project's tree tool."""
    return [p.name for p in tree.series(root)]


def machine_facts() -> dict:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cores": os.cpu_count(),
        "cpu": cpu,
        "load_start": "%.2f %.2f %.2f" % os.getloadavg(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


# ---------------------------------------------------------------------------------------------
# Formatting
# ---------------------------------------------------------------------------------------------
def med(xs):
    return statistics.median(xs) if xs else float("nan")


def ms(x: float) -> str:
    return f"{x * 1000:.0f}" if x == x else "n/a"


def spread(xs) -> str:
    """median (min–max) in ms."""
    if not xs:
        return "n/a"
    return f"{ms(med(xs))} ({ms(min(xs))}–{ms(max(xs))})"


def one(xs):
    """The value if all repeats agree, else 'a–b'."""
    xs = list(xs)
    if not xs:
        return "n/a"
    lo, hi = min(xs), max(xs)
    return f"{lo}" if lo == hi else f"{lo}–{hi}"


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def purge_table(res: dict[str, dict]) -> str:
    b, s = res.get("base", {}).get("purge", []), res.get("series", {}).get("purge", [])
    rows, rows2 = [], []
    for n in sorted({r["n"] for r in b + s}):
        rb, rs = [r for r in b if r["n"] == n], [r for r in s if r["n"] == n]
        tb, ts = [r["seconds"] for r in rb], [r["seconds"] for r in rs]
        ratio = med(ts) / med(tb) if tb and ts else float("nan")
        eb = [r["seconds"] + r.get("followup_seconds", float("nan")) for r in rb]
        es = [r["seconds"] + r.get("followup_seconds", float("nan")) for r in rs]
        e_ratio = med(es) / med(eb) if eb and es else float("nan")
        runs = (rb or rs)[0]

        def pair(key, rb=rb, rs=rs):
            return f"{one(r.get(key, 'n/a') for r in rb)} / {one(r.get(key, 'n/a') for r in rs)}"

        lock_span = f"{ms(med([r['lock_span_max_s'] for r in rs]))}" if rs else "n/a"
        rows.append(
            [
                n,
                f"{runs['runs']} runs, {runs['dags']} DAGs",
                spread(tb),
                spread(ts),
                f"{ratio:.2f}",
                pair("statements"),
                pair("commits"),
                pair("lock_statements"),
                pair("locked_rows"),
                lock_span,
                pair("callback_rows"),
                pair("still_running"),
                f"{len(tb)}/{len(ts)}",
            ]
        )
        rows2.append(
            [
                n,
                spread(eb),
                spread(es),
                f"{e_ratio:.2f}",
                pair("followup_events"),
                pair("followup_statements"),
                pair("followup_commits"),
                pair("running_after_followup"),
                pair("callback_rows_after_followup"),
                ms(med([r["listener_drain_seconds"] for r in rs]))
                if rs and rs[0].get("listener_thread")
                else "-",
            ]
        )
    one_pass = table(
        [
            "N TIs",
            "spread over",
            "base ms median (min–max)",
            "series ms median (min–max)",
            "ratio series/base",
            "SQL statements base / series",
            "commits base / series",
            "locking SELECTs base / series",
            "rows returned by locking SELECTs base / series",
            "series: longest lock span ms (first locking SELECT → commit), median",
            "callback rows base / series",
            "TIs still RUNNING after the pass base / series",
            "repeats",
        ],
        rows,
    )
    with_events = table(
        [
            "N TIs",
            "base ms: pass + its executor events",
            "series ms: pass + its executor events",
            "ratio series/base",
            "executor events base / series",
            "their SQL statements base / series",
            "their commits base / series",
            "TIs still RUNNING after both base / series",
            "callback rows after both base / series",
            "series: listener thread still busy after both, ms median (not scheduler time)",
        ],
        rows2,
    )
    return (
        one_pass
        + "\n\nThe same repeats, counting also what the pass leaves to the scheduler loop: the FAILED "
        "executor events it produced (`executor.change_state`), handled by the next `_process_executor_events` "
        "(on the base, that is where the TIs are actually failed, as “killed externally”; the base also "
        "re-sends the callback on every later scan while the TI stays RUNNING, not counted here). Where the tree "
        "has the operator tail's `FailureListenerThread`, the worker starts it as `_execute` does: the "
        "`on_task_instance_failed` calls (a no-op listener is registered) run there, their statements are not "
        "counted and their time is the last column.\n\n" + with_events + phase_table(b, s)
    )


def phase_table(b: list[dict], s: list[dict]) -> str:
    """Per repeat (in run order within each tree): wall and CPU per phase, if the worker recorded them."""
    if not any("phase_pass" in r for r in b + s):
        return ""
    rows = []
    for n in sorted({r["n"] for r in b + s}):
        for variant, rs in (("base", b), ("series", s)):
            for i, r in enumerate(x for x in rs if x["n"] == n and "phase_pass" in x):
                p, f = r["phase_pass"], r["phase_followup"]
                cpu_p, cpu_f = p["cpu_user_s"] + p["cpu_sys_s"], f["cpu_user_s"] + f["cpu_sys_s"]
                rows.append(
                    [
                        n,
                        variant,
                        i + 1,
                        r.get("load_before", "?").split()[0],
                        f"{p['wall_s'] + f['wall_s']:.1f}",
                        f"{cpu_p + cpu_f:.2f}",
                        f"{p['wall_s']:.1f} / {cpu_p:.2f}",
                        f"{f['wall_s']:.1f} / {cpu_f:.2f}",
                        f"{p['exec_s'] + f['exec_s']:.2f} / {p['exec_cpu_s'] + f['exec_cpu_s']:.2f}",
                        f"{p['commit_s'] + f['commit_s']:.2f} / {p['commit_cpu_s'] + f['commit_cpu_s']:.2f} "
                        f"({p['commit_calls'] + f['commit_calls']})",
                        f"{p['vol_ctx_switches'] + f['vol_ctx_switches']} / "
                        f"{p['invol_ctx_switches'] + f['invol_ctx_switches']}",
                    ]
                )
    return (
        "\n\nWhere the time went, per repeat (each tree's repeats in run order; the trees alternated): wall "
        "and CPU time (user + sys of the worker process, `getrusage`), for the pass and for its executor "
        "events; ‘driver execute’ = inside the DBAPI cursor's `execute` (wall / this thread's CPU), "
        "‘commit’ = inside the DBAPI connection's `commit` (wall / CPU, calls); context switches: voluntary "
        "(the process blocked: fsync, I/O) / involuntary (preempted by other processes).\n\n"
        + table(
            [
                "N TIs",
                "tree",
                "repeat",
                "load (1 min) before",
                "wall s, pass + events",
                "CPU s, pass + events",
                "pass: wall / CPU s",
                "events: wall / CPU s",
                "driver execute: wall / CPU s",
                "commit: wall / CPU s (calls)",
                "context switches vol / invol",
            ],
            rows,
        )
    )


def listener_table(res: dict[str, dict]) -> str:
    rows = []
    for variant in ("base", "series"):
        rs = res.get(variant, {}).get("listener", [])
        for path in dict.fromkeys(r["path"] for r in rs):
            for lat in sorted({r["latency"] for r in rs if r["path"] == path}):
                g = [r for r in rs if r["path"] == path and r["latency"] == lat]
                rows.append(
                    [
                        path,
                        f"{lat:g}",
                        variant,
                        spread([r["seconds"] for r in g]),
                        spread([r["lock_held_s"] for r in g]),
                        one("yes" if r["locked_while_listener"] else "no" for r in g),
                        spread([r["txn_max_s"] for r in g]),
                        one("yes" if r["txn_open_during_listener"] else "no" for r in g),
                        ", ".join(sorted({s for r in g for s in r["states_seen_in_listener"]})) or "-",
                        one(r["final_state"] for r in g),
                        "; ".join(
                            sorted(
                                {r["error"] for r in g if r["error"]}
                                | {r["observer_error"] for r in g if r["observer_error"]}
                            )
                        )
                        or "-",
                        len(g),
                    ]
                )
    return table(
        [
            "path",
            "listener s",
            "tree",
            "call ms",
            "TI row locked ms (2nd connection)",
            "locked while listener ran",
            "longest transaction ms",
            "listener ran inside an open transaction",
            "state seen by 2nd connection during listener",
            "final state",
            "errors",
            "repeats",
        ],
        rows,
    )


def concurrent_table(res: dict[str, dict]) -> str:
    rows = []
    for variant in ("base", "series"):
        for r in res.get(variant, {}).get("concurrent", []):
            api = r["api"]
            example = (r["crash_examples"] or [""])[0][:150].replace("`", "'")
            api_s = ", ".join(f"{k} {v}" for k, v in sorted(api.items()))
            rows.append(
                [
                    f"{r['latency']:g}",
                    variant,
                    f"{r['handled']}/{r['events']}",
                    f"{r['sched_seconds']:.1f}",
                    f"{r['events_per_s']:.1f}",
                    f"{r['crashes']}"
                    + (
                        f" ({', '.join(f'{k} {v}' for k, v in r['crash_types'].items())}: `{example}`)"
                        if r["crashes"]
                        else ""
                    ),
                    f"{r['sched_lock_waits']} / {r['sched_lock_wait_s']:.2f}",
                    f"{r['api_lock_waits']} / {r['api_lock_wait_s']:.2f}",
                    api_s,
                    ", ".join(
                        f"{k} {v}" for k, v in sorted(r["outcomes"].items()) if k != "retry_over_reschedule"
                    ),
                    r["outcomes"].get("retry_over_reschedule", "n/a"),
                    (
                        "n/a"
                        if "listeners_in_background" not in r
                        else f"{r['listener_calls']}"
                        + (
                            f" ({r['listener_calls'] - r['listener_calls_by_end']} of them in the shutdown wait)"
                            if r.get("listener_calls_by_end") is not None
                            and r["listener_calls"] != r["listener_calls_by_end"]
                            else ""
                        )
                        + ", "
                        + (
                            f"background thread ({r['listener_calls_queued_at_end']} queued at the end)"
                            if r["listeners_in_background"]
                            else "scheduler thread"
                        )
                    ),
                ]
            )
    return table(
        [
            "listener s",
            "tree",
            "events handled (all rounds)",
            "scheduler s (after warm-up round)",
            "events/s (after warm-up)",
            "scheduler crashes",
            "scheduler lock waits (n / s)",
            "API lock waits (n / s)",
            "API results",
            "final TI states",
            "UP_FOR_RETRY over a committed reschedule (lost update)",
            "listener calls, where they ran",
        ],
        rows,
    )


def concurrent_medians(res: dict[str, dict]) -> str:
    """Median events/s per listener latency and tree, where a variant ran more than once."""
    rows = []
    for lat in sorted({r["latency"] for v in res.values() for r in v.get("concurrent", [])}):
        cells = []
        for variant in ("base", "series"):
            rs = [r for r in res.get(variant, {}).get("concurrent", []) if r["latency"] == lat]
            rate = [r["events_per_s"] for r in rs]
            cells.append(f"{med(rate):.1f} ({', '.join(f'{x:.1f}' for x in rate)})" if rs else "n/a")
            cells.append(
                f"{sum(r['crashes'] for r in rs)} / {sum(r['outcomes'].get('retry_over_reschedule', 0) for r in rs)}"
            )
        b, s = (
            med([r["events_per_s"] for r in res.get(v, {}).get("concurrent", []) if r["latency"] == lat])
            for v in ("base", "series")
        )
        rows.append([f"{lat:g}", *cells, f"{s / b:.2f}" if b == b and s == s and b else "n/a"])
    if not rows or max(len(v.get("concurrent", [])) for v in res.values()) <= len(rows):
        return ""
    return table(
        [
            "listener s",
            "base events/s, median (runs)",
            "base crashes / lost updates (all runs)",
            "series events/s, median (runs)",
            "series crashes / lost updates (all runs)",
            "ratio series/base",
        ],
        rows,
    )


def concurrent_notes(res: dict[str, dict]) -> str:
    lines = []
    for variant in ("base", "series"):
        for r in res.get(variant, {}).get("concurrent", []):
            for e in r.get("api_error_examples", []):
                quoted = e.replace("`", "'")
                lines.append(f"- API error ({variant}, listener {r['latency']:g} s): `{quoted}`")
            if r.get("not_handled"):
                left = ", ".join(f"{k} {n}" for k, n in sorted(r["not_handled"].items()))
                lines.append(
                    f"- events still in the buffer after a batch's 3 passes ({variant}, listener "
                    f"{r['latency']:g} s; held or not: TI state at the round's end / try): {left}"
                )
    return "\n".join(lines)


def slow_listener_table(res: dict[str, dict]) -> str:
    rows, notes = [], []
    for variant, r in res.items():
        runs = r.get("slow_listener", [])
        noop = next((x for x in runs if x.get("kind", "noop") == "noop" and not x["latency"]), None)
        for x in runs:
            kind = x.get("kind", "noop" if not x["latency"] else "slow")
            extra = x["step_seconds"] - noop["step_seconds"] if noop and kind == "slow" else None
            d = x.get("delivery") or {}

            def f(v, fmt="{:.1f}"):
                return "-" if v is None else fmt.format(v)

            rows.append(
                [
                    variant,
                    "background thread" if x["background"] else "scheduler thread",
                    kind + (f" {x['latency']:g} s" if kind == "slow" else ""),
                    x["failures"],
                    f(x["step_seconds"], "{:.3f}"),
                    f(extra, "{:.3f}"),
                    f"{x.get('loop_iterations', '-')} / {f(x.get('max_later_iteration_seconds'), '{:.3f}')}",
                    f(x.get("loop_seconds")),
                    f(x.get("max_heartbeat_age_seconds")),
                    x["listener_calls_done_in_step"],
                    f"{d.get('tries_with_one_call', '-')} / {d.get('tries_with_more_calls', '-')}",
                    d.get("tis_called_in_try_order", "-"),
                    d.get("calls_seeing_committed_row", "-"),
                    d.get("max_calls_at_once", "-"),
                    f(x["shutdown_seconds"]) if x["background"] else "-",
                    x.get("timeout_logs", "-"),
                    ", ".join(f"{k} {v}" for k, v in sorted(x["states"].items())),
                    x["error"] or "-",
                ]
            )
            if kind == "hang":
                notes.append(
                    f"- {variant}, hang run (the first call hangs, the others take 1 s; listener timeout "
                    f"{x.get('hang_timeout')} s): first call start -> second call start "
                    f"{f(x.get('first_to_second_call_start_seconds'), '{:.2f}')} s; calls started "
                    f"{x.get('listener_calls_started')}, finished by the end of shutdown "
                    f"{x['listener_calls_done_by_shutdown']}"
                )
            if x.get("shutdown_log"):
                notes.append(f"- {variant}, {kind} run, shutdown log: `{x['shutdown_log'][:400]}`")
            for line in x.get("log") or []:
                if "did not return within" in line:
                    notes.append(f"- {variant}, {kind} run, timeout log: `{line[:300]}`")
                    break
    return table(
        [
            "tree",
            "listeners run on",
            "run",
            "FAILED events",
            "first loop iteration s (the step)",
            "extra s (vs no-op)",
            "loop iterations / longest later one s",
            "loop s (until every call finished)",
            "oldest job heartbeat age s",
            "calls finished within the step",
            "failed tries with 1 call / with more",
            "TIs called in try order",
            "calls seeing the committed row",
            "calls at once (max)",
            "shutdown wait s",
            "timeout logs",
            "TI states after",
            "errors",
        ],
        rows,
    ) + ("\n\n" + "\n".join(notes) if notes else "")


def matrix_section(backend: str) -> str:
    f = HERE / "results" / f"matrix-{backend}.md"
    if f.is_file():
        return f.read_text().strip()
    return (
        f"_Not measured in this run: `python benchmarks/matrix_cost.py --backend {backend}` writes "
        f"`benchmarks/results/matrix-{backend}.md`, included here on the next run._"
    )


def report(backend: str, facts: dict, res: dict[str, dict], args, names: list[str]) -> str:
    any_res = next(iter(res.values()), {})
    server = any_res.get("server_version", "?")
    locks = any_res.get("with_row_locks_locks")
    out = [f"# Benchmarks on {backend}: base vs series", ""]
    out += [
        f"- date: {facts['date']}; mode: {'quick (smoke sizes)' if args.quick else 'full'}",
        f"- machine: {facts['cores']} cores ({facts['cpu']}), load average at start {facts['load_start']}, "
        f"at end {facts.get('load_end', '?')} (shared machine: absolute times are noisy, compare within a table)",
        f"- Python {facts['python']}, {facts['platform']}",
        f"- database server: {server}; Airflow's `with_row_locks` emits a row lock here: "
        f"{'yes' if locks else 'no' + (' (MariaDB: no FOR UPDATE OF support, Airflow does not support MariaDB)' if backend == 'mysql' else ' (sqlite has no row locks)')}",
        f"- airflow-core {any_res.get('airflow_version', '?')}; "
        + "; ".join(
            f"{v}: tree at {r['tree']['head']} ({r['tree']['patches_applied']} patches, “{r['tree']['subject']}”)"
            for v, r in res.items()
        ),
        f"- series ({len(names)} patches): "
        + (
            ", ".join(f"`{n}`" for n in names)
            if names
            else "**empty — 'series' is the same tree as base (an A/A run: differences are noise)**"
        ),
        f"- project root: `{facts.get('root', '?')}` (its `patches/series` is the series measured)",
        "- each variant ran in its own process after `tree.py checkout`, on a schema freshly reset by "
        "Airflow (`db.resetdb`), in the order " + f"`{facts.get('variants', 'base,series')}`",
    ]
    out += [
        f"- load average (1/5/15 min) before -> after each {v} worker: " + "; ".join(r["loads"])
        for v, r in res.items()
        if r.get("loads")
    ]
    errs = {f"{v}/{k}": e for v, r in res.items() for k, e in r.get("errors", {}).items()}
    if errs:
        out += ["", "**Benchmarks that failed:**", ""]
        out += [f"- {k}: `{e.strip().splitlines()[-1]}`" for k, e in errs.items()]
    out += [
        "",
        "## 1. Heartbeat-timeout purge scaling",
        "",
        "One `SchedulerJobRunner._find_and_purge_task_instances_without_heartbeats()` pass (real runner, "
        "recording executor) over N RUNNING TIs whose heartbeat is older than the timeout (10 tasks per run, "
        "`retries=1`, up to 5 DAGs). SQL statements/commits counted with SQLAlchemy `before_cursor_execute`/"
        "`commit` events on the scheduler's engine; rows returned by row-locking SELECTs count a row again "
        "each time it is re-locked (e.g. scan + per-TI revalidation = 2 per TI). 5 repeats by default (N=1000: 3); the last column gives the repeats of this run.",
        "",
        purge_table(res),
        "",
        "## 2. Failure handling vs `on_task_instance_failed` listener latency",
        "",
        "`handle_failure`: `ti.handle_failure(error, session=...)` on a RUNNING, retry-eligible TI. "
        "`executor_event`: one FAILED executor event through `_process_executor_events` in `create_session()` "
        "(the scheduler loop). A second connection polls every 2 ms: postgres/MySQL `SELECT ... FOR UPDATE NOWAIT` "
        "on the TI row; sqlite has no row locks, so there it tries `BEGIN IMMEDIATE` with no busy timeout, i.e. "
        "reports whether the database write lock is held. ‘Longest transaction’ is measured in-process "
        "(engine `begin`→`commit`/`rollback` of the scheduler thread).",
        "",
        listener_table(res),
        "",
        "## 3. Concurrent throughput: executor FAILED events vs execution-API updates",
        "",
        "Rounds of M RUNNING TIs (`retries=1`, `on_failure_callback`/`on_retry_callback` set, so the "
        "scheduler sends callbacks): the scheduler thread handles FAILED events in batches with "
        "`_process_executor_events` (one `create_session()` per batch); for each TI of the batch being handled "
        "a second thread/connection calls the real execution-API route functions `ti_heartbeat` then "
        "`ti_update_state` (reschedule) with SessionDep semantics. A scheduler crash is an exception leaving "
        "`_process_executor_events` (a real scheduler exits); the harness rolls back and carries on. "
        "Lock waits: row-locking SELECTs slower than 5 ms. "
        + (
            "The scheduler side runs as `SchedulerJobRunner._execute` runs its loop: inside "
            "`runner.failure_listeners_in_background()` where the tree has it (the series: the listener runs "
            "off the scheduler's thread; the base calls it inline). "
            if any("listeners_in_background" in r for v in res.values() for r in v.get("concurrent", []))
            else "The scheduler side ran outside `runner.failure_listeners_in_background()` (a run from before "
            "project commit 2457456: the series called the listener on the scheduler's thread too, and "
            "benchmark 5's database-reading listener was registered in this benchmark). "
        )
        + "The TIs' last heartbeat: "
        + (
            "older than the heartbeat timeout (`--stale-heartbeats`: the series handles the events at once)."
            if getattr(args, "stale_heartbeats", False)
            else "fresh (the series' patch 17 holds a FAILED event of a try with a recent heartbeat)."
        )
        + {
            "race": " Order: race (the API thread starts on a batch when the scheduler does; the row locks decide).",
            "api-first": " Order: api-first (the API's heartbeat and reschedule of a batch's TIs are committed "
            "before the scheduler's first pass; its wait for them is not scheduler time): every event finds "
            "its TI rescheduled.",
            "scheduler-first": " Order: scheduler-first (the API acts on a batch after the scheduler's passes; "
            "that wait is not scheduler time): every event finds its TI running and fails it.",
        }[getattr(args, "order", "race")],
        "",
        concurrent_table(res),
        "",
        concurrent_medians(res),
        "",
        concurrent_notes(res),
        "",
        "## 4. Matrix cost",
        "",
        matrix_section(backend),
        "",
    ]
    if any("slow_listener" in r for r in res.values()):
        out += [
            "## 5. A slow `on_task_instance_failed` listener and the scheduler loop (issue 17)",
            "",
            "N FAILED executor events (worker heartbeats an hour old) handled in the first iteration of a loop "
            "run as `SchedulerJobRunner._execute` runs it (inside `runner.failure_listeners_in_background()` "
            "where the tree has it): each iteration heartbeats the scheduler job (`perform_heartbeat`, "
            "only if necessary) and runs `_process_executor_events`; the loop goes on, waiting up to 1 s "
            "between iterations, until every listener call finished. Extra = first iteration with the "
            "L-second listener - first iteration with the no-op one. Oldest job heartbeat age: a second "
            "connection polls `job.latest_heartbeat` every 0.25 s during the loop. Calls: each failed try's "
            "calls counted, the try order per TI, whether the task instance the listener got matches the "
            "TI row its own session reads (id, state, try: the committed state). Hang run: the first call "
            "waits for the hang, the others take 1 s, the block is left after the first iteration "
            "(the series' shutdown waits 5 s and logs what was pending; its timeout logs are shown).",
            "",
            slow_listener_table(res),
            "",
        ]
    only = set(getattr(args, "only", "purge,listener,concurrent").split(","))
    if only == {"slowlistener"}:  # a run of benchmark 5 alone: leave out the empty tables 1-4
        head = out[: out.index("## 1. Heartbeat-timeout purge scaling") - 1]
        out = (
            head
            + [""]
            + out[
                out.index(
                    "## 5. A slow `on_task_instance_failed` listener and the scheduler loop (issue 17)"
                ) :
            ]
        )
    return "\n".join(out)


def merge(into: dict, got: dict) -> None:
    """Add one worker's figures to its variant's: lists (repeats, runs, loads) are appended, so
    ``--variants base,series,base,series`` alternates the trees and keeps every run's figures."""
    for k, v in got.items():
        if isinstance(v, list) and isinstance(into.get(k), list):
            into[k] += v
        elif k == "errors" and k in into:
            into[k].update(v)
        else:
            into.setdefault(k, v)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default=os.environ.get("BACKEND", "sqlite"))
    p.add_argument("--root", type=Path, default=HERE.parent, help="project root (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="smoke sizes: N=10,100, 1 repeat, 3 s concurrency")
    p.add_argument(
        "--only", default="purge,listener,concurrent", help="any of purge,listener,concurrent,slowlistener"
    )
    p.add_argument("--repeats", type=int)
    p.add_argument("--sizes", help="purge sizes, e.g. 10,100,500 (default 10,100,500,1000)")
    p.add_argument(
        "--variants",
        default="base,series",
        help="trees in run order; repeat them to alternate, e.g. base,series,base,series (figures merged)",
    )
    p.add_argument("--slow-listener", type=float, default=10.0, help="benchmark 5: listener seconds")
    p.add_argument("--slow-failures", type=int, default=100, help="benchmark 5: FAILED events in one step")
    p.add_argument(
        "--slow-hang", type=float, default=0.0, help="benchmark 5: a run whose first call hangs this long"
    )
    p.add_argument("--slow-hang-timeout", type=float, default=2.0, help="benchmark 5: listener timeout there")
    p.add_argument(
        "--stale-heartbeats",
        action="store_true",
        help="benchmark 3: the TIs' last heartbeat is older than the timeout (default: fresh)",
    )
    p.add_argument(
        "--order",
        default="race",
        choices=("race", "api-first", "scheduler-first"),
        help="benchmark 3: when the API thread acts on a batch (default race: the row locks decide)",
    )
    p.add_argument(
        "--concurrent-seconds",
        type=float,
        help="benchmark 3: scheduler seconds per run (default 20, quick 3)",
    )
    p.add_argument("--out", type=Path, help="default: benchmarks/results/<backend>.md")
    p.add_argument(
        "--render", type=Path, metavar="JSON", help="only re-write the tables from a run's raw JSON"
    )
    args = p.parse_args()
    if args.render:
        data = json.loads(args.render.read_text())
        facts, res = data["facts"], data["results"]
        args.quick = facts.get("quick", False)
        args.stale_heartbeats = facts.get("stale_heartbeats", False)
        args.order = facts.get("order", "race")
        names = facts.get("series") or series_names(Path(facts.get("root", HERE.parent)))
        text = report(args.backend, facts, res, args, names)
        dest = args.out or args.render.with_suffix(".md")
        dest.write_text(text + "\n")
        print(f"written: {dest}")
        return 0
    root = args.root.resolve()
    # SIGTERM (nox/timeout/kill) must also reach the `finally` that puts the tree back at `checkout all`.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(f"terminated by signal {signum}"))
    if not os.environ.get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"):
        print(
            "warning: AIRFLOW__DATABASE__SQL_ALCHEMY_CONN not set: the worker uses a sqlite file",
            file=sys.stderr,
        )
    names = series_names(root)
    facts = machine_facts()
    facts["root"] = str(root)
    facts["series"] = names
    facts["quick"] = args.quick
    facts["variants"] = args.variants
    facts["stale_heartbeats"] = args.stale_heartbeats
    facts["order"] = args.order
    res: dict[str, dict] = {}
    checkouts = {"base": "0", "series": "all"}
    env = dict(os.environ)
    try:
        with tempfile.TemporaryDirectory(prefix="airflow-bench.") as tmp:
            for variant in args.variants.split(","):
                print(tree_cmd(root, "checkout", checkouts[variant]), flush=True)
                out = Path(tmp) / f"{variant}.json"
                cmd = [
                    sys.executable,
                    str(HERE / "worker.py"),
                    "--variant",
                    variant,
                    "--out",
                    str(out),
                    "--root",
                    str(root),
                    "--only",
                    args.only,
                ]
                if args.quick:
                    cmd.append("--quick")
                if args.repeats:
                    cmd += ["--repeats", str(args.repeats)]
                if args.sizes:
                    cmd += ["--sizes", args.sizes]
                if args.stale_heartbeats:
                    cmd.append("--stale-heartbeats")
                cmd += ["--order", args.order]
                if args.concurrent_seconds:
                    cmd += ["--concurrent-seconds", str(args.concurrent_seconds)]
                cmd += [
                    "--slow-listener",
                    str(args.slow_listener),
                    "--slow-failures",
                    str(args.slow_failures),
                    "--slow-hang",
                    str(args.slow_hang),
                    "--slow-hang-timeout",
                    str(args.slow_hang_timeout),
                ]
                load = "%.2f %.2f %.2f" % os.getloadavg()
                proc = subprocess.run(cmd, env=env)
                if proc.returncode or not out.is_file():
                    raise SystemExit(f"worker for {variant} failed (exit {proc.returncode})")
                got = json.loads(out.read_text())
                got["loads"] = [f"{load} -> " + "%.2f %.2f %.2f" % os.getloadavg()]
                merge(res.setdefault(variant, {}), got)
                # The first worker checked the database (no Airflow data, or DB_RESET=true): the later
                # ones reset what the benchmark itself wrote.
                env["DB_RESET"] = "true"
    finally:
        print(tree_cmd(root, "checkout", "all"), flush=True)
    facts["load_end"] = "%.2f %.2f %.2f" % os.getloadavg()
    text = report(args.backend, facts, res, args, names)
    dest = args.out or (HERE / "results" / f"{args.backend}{'-quick' if args.quick else ''}.md")
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(text + "\n")
    (dest.with_suffix(".json")).write_text(
        json.dumps({"facts": facts, "results": res}, indent=1, default=str)
    )
    print(text)
    print(f"\nwritten: {dest} (+ raw figures in {dest.with_suffix('.json').name})")
    return 1 if any(r.get("errors") for r in res.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
