# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
One benchmark process: measures the airflow-core tree that is checked out *now* (``run.py`` switches
``airflow-core/`` before starting it) and writes raw figures as JSON.

    python benchmarks/worker.py --variant base --out /tmp/base.json [--quick] [--only purge,listener,concurrent]

The database named by ``AIRFLOW__DATABASE__SQL_ALCHEMY_CONN`` is reset with Airflow's own code first
(every table of it is dropped: give it a database of its own). Not a test: nothing is asserted, the
figures (and what was observed) are reported.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import sqlite3
import subprocess
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _harness as H  # noqa: E402

H.setup_env()

from sqlalchemy import func, select, text  # noqa: E402

from airflow import settings  # noqa: E402
from airflow._shared.timezones import timezone as tz  # noqa: E402
from airflow.listeners import hookimpl  # noqa: E402
from airflow.listeners.listener import get_listener_manager  # noqa: E402
from airflow.models.taskinstance import TaskInstance as TI  # noqa: E402
from airflow.utils.session import create_session  # noqa: E402
from airflow.utils.state import TaskInstanceState  # noqa: E402

RUNNING = TaskInstanceState.RUNNING
FAILED = TaskInstanceState.FAILED
DIALECT = settings.engine.dialect.name  # sqlite | postgresql | mysql


# =============================================================================================
# Listener
# =============================================================================================
class SlowFailureListener:
    """``on_task_instance_failed`` that sleeps ``latency`` seconds and records when it ran."""

    def __init__(self) -> None:
        self.latency = 0.0
        self.calls: list[tuple[float, float, str]] = []

    @hookimpl
    def on_task_instance_failed(self, previous_state, task_instance, error):
        start = time.perf_counter()
        if self.latency:
            time.sleep(self.latency)
        self.calls.append((start, time.perf_counter(), str(getattr(task_instance, "task_id", ""))))


LISTENER = SlowFailureListener()
get_listener_manager().add_listener(LISTENER)


# =============================================================================================
# Lock observer (second connection)
# =============================================================================================
class LockObserver(threading.Thread):
    """
    Polls from a second connection whether the TI row (dag_id, task_id, run_id, map_index=-1) is
    locked, every ``period`` s, and what state it shows (committed read, no lock):

    * postgres / MySQL / MariaDB: ``SELECT ... FOR UPDATE NOWAIT`` on the row, then rollback;
    * sqlite (no row locks): ``BEGIN IMMEDIATE`` with no busy timeout, i.e. whether another
      connection holds the database's write lock, then rollback.

    Samples are ``(perf_counter, locked, state)``.
    """

    def __init__(self, engine, key: tuple[str, str, str], period: float = 0.002) -> None:
        super().__init__(daemon=True)
        self.engine, self.key, self.period = engine, key, period
        self.samples: list[tuple[float, bool, str | None]] = []
        self.go = threading.Event()
        self.stop = threading.Event()
        self.error: str | None = None

    def run(self) -> None:
        try:
            self._run()
        except Exception as e:  # reported with the figures
            self.error = f"{type(e).__name__}: {e}"

    def _run(self) -> None:
        dag_id, task_id, run_id = self.key
        if DIALECT == "sqlite":
            conn = sqlite3.connect(settings.engine.url.database, timeout=0, isolation_level=None)
            state_sql = (
                "SELECT state FROM task_instance WHERE dag_id=? AND task_id=? AND run_id=? AND map_index=-1"
            )
            params: tuple = (dag_id, task_id, run_id)
        else:
            conn = self.engine.raw_connection()
            ph = "%s"
            state_sql = (
                f"SELECT state FROM task_instance WHERE dag_id={ph} AND task_id={ph} AND run_id={ph} "
                "AND map_index=-1"
            )
            params = (dag_id, task_id, run_id)
        lock_sql = state_sql + " FOR UPDATE NOWAIT"
        if not self.go.wait(60):
            return
        try:
            while not self.stop.is_set():
                cur = conn.cursor()
                t = time.perf_counter()
                locked = False
                try:
                    if DIALECT == "sqlite":
                        cur.execute("BEGIN IMMEDIATE")
                        cur.execute("ROLLBACK")
                    else:
                        cur.execute(lock_sql, params)
                        cur.fetchall()
                except Exception as e:
                    text_ = str(e).lower()
                    if "lock" not in text_ and "could not obtain" not in text_:
                        raise
                    locked = True
                finally:
                    if DIALECT != "sqlite":
                        conn.rollback()
                cur.execute(state_sql, params)
                row = cur.fetchone()
                if DIALECT != "sqlite":
                    conn.rollback()
                cur.close()
                self.samples.append((t, locked, row[0] if row else None))
                time.sleep(self.period)
        finally:
            conn.close()


def lock_interval(samples, started_locked_at: float | None) -> tuple[float | None, float | None]:
    """(start, end) of the observed lock: first locked sample (or ``started_locked_at``) to the first
    unlocked sample after the last locked one."""
    locked = [t for t, lk, _ in samples if lk]
    if not locked and started_locked_at is None:
        return None, None
    start = min([*locked, *([started_locked_at] if started_locked_at else [])])
    last = max(locked) if locked else start
    after = [t for t, lk, _ in samples if t > last and not lk]
    return start, (after[0] if after else last)


# =============================================================================================
# Benchmark 1: purge scaling
# =============================================================================================
def bench_purge(sizes: list[int], repeats: dict[int, int]) -> list[dict]:
    """One ``_find_and_purge_task_instances_without_heartbeats`` pass over N timed-out RUNNING TIs,
    ``repeats[N]`` times."""
    out = []
    tasks_per_run = 10
    for n in sizes:
        H.clear_db()
        runner = H.make_runner()
        # As `SchedulerJobRunner._execute`: the operator tail's listener calls go to their own thread
        # (None where the tree has none: the calls run on this thread, inside the timed phases).
        listener_thread = H.start_failure_listener_thread(runner)
        n_runs = math.ceil(n / tasks_per_run)
        n_dags = min(5, n_runs)
        with settings.NonScopedSession() as s:
            made = 0
            for d in range(n_dags):
                runs_here = n_runs // n_dags + (1 if d < n_runs % n_dags else 0)
                dag = H.write_dag(f"bench_purge_{d}", tasks_per_run, retries=1, session=s)
                H.create_runs(dag, runs_here, session=s)
                made += runs_here
            # exactly N TIs: all tasks of the runs, minus the surplus of the last run left unscheduled
            keys = s.execute(
                select(TI.dag_id, TI.run_id, TI.task_id).order_by(TI.dag_id, TI.run_id, TI.task_id)
            ).all()
        chosen = keys[:n]
        from sqlalchemy import tuple_

        where = (tuple_(TI.dag_id, TI.run_id, TI.task_id).in_([tuple(k) for k in chosen]),)
        timeout = runner._task_instance_heartbeat_timeout_secs

        def running_and_callback_rows(where=where) -> tuple[int, int]:
            """(chosen TIs still RUNNING, rows in the callback table), committed."""
            with settings.NonScopedSession() as s:
                running = s.scalar(select(func.count()).select_from(TI).where(*where, TI.state == RUNNING))
                return running, s.scalar(text("SELECT count(*) FROM callback"))

        for rep in range(repeats[n]):
            with settings.NonScopedSession() as s:
                for table in ("callback", "log", "task_instance_history", "task_reschedule"):
                    s.execute(text(f"DELETE FROM {table}"))
                s.commit()
                got = H.set_running(s, where, job_id=runner.job.id, heartbeat_age_s=timeout + 3600)
            assert got == n, (got, n)
            H.reset_executor(runner.executor)
            settings.Session.remove()
            load_before = "%.2f %.2f %.2f" % os.getloadavg()
            with (
                H.SqlCounter(settings.engine, threads={threading.get_ident()}) as c,
                H.PhaseMeter(settings.engine) as pm,
            ):
                t0 = time.perf_counter()
                runner._find_and_purge_task_instances_without_heartbeats()
                dt = time.perf_counter() - t0
            settings.Session.remove()
            still_running, cb_rows = running_and_callback_rows()
            # Follow-up: the FAILED executor events the pass produced (executor.change_state), handled as
            # the scheduler loop's next `_process_executor_events` would. On the base this is where the
            # TIs are actually failed (as "killed externally"); with the series they left RUNNING already.
            events = len(runner.executor.event_buffer)
            with (
                H.SqlCounter(settings.engine, threads={threading.get_ident()}) as f,
                H.PhaseMeter(settings.engine) as fm,
            ):
                t0 = time.perf_counter()
                H.process_executor_events(runner)
                f_dt = time.perf_counter() - t0
            settings.Session.remove()
            # Not scheduler time: how long the listener thread still worked after the events step.
            t0 = time.perf_counter()
            drained = listener_thread.wait(300) if listener_thread else True
            drain_dt = time.perf_counter() - t0
            assert drained, "listener thread did not finish its calls in 300 s"
            running_after, cb_after = running_and_callback_rows()
            out.append(
                {
                    "n": n,
                    "runs": n_runs,
                    "dags": n_dags,
                    "repeat": rep,
                    "seconds": dt,
                    "statements": c.statements,
                    "commits": c.commits,
                    "rollbacks": c.rollbacks,
                    "lock_statements": c.lock_statements,
                    "locked_rows": c.locked_rows,
                    "lock_span_max_s": max((b - a for a, b in c.lock_spans), default=0.0),
                    "callbacks_sent": len(runner.executor.callbacks_sent),
                    "callback_rows": cb_rows,
                    "state_changes": len(runner.executor.state_changes),
                    "still_running": still_running,
                    "followup_events": events,
                    "followup_seconds": f_dt,
                    "listener_thread": listener_thread is not None,
                    "listener_drain_seconds": drain_dt,
                    "followup_statements": f.statements,
                    "followup_commits": f.commits,
                    "running_after_followup": running_after,
                    "callback_rows_after_followup": cb_after,
                    "phase_pass": pm.figures(c),
                    "phase_followup": fm.figures(f),
                    "load_before": load_before,
                    "load_after": "%.2f %.2f %.2f" % os.getloadavg(),
                }
            )
            print(
                f"  purge N={n} rep={rep}: {dt * 1000:.0f} ms, {c.statements} stmts, {c.commits} commits, "
                f"{c.locked_rows} rows locked, {still_running} still RUNNING; then {events} executor events: "
                f"{f_dt * 1000:.0f} ms, {f.statements} stmts, {f.commits} commits, {running_after} RUNNING"
                + (f"; listener thread busy {drain_dt * 1000:.0f} ms after" if listener_thread else ""),
                flush=True,
            )
            for name, ph in (("pass", pm.figures(c)), ("events", fm.figures(f))):
                print(
                    f"    {name}: wall {ph['wall_s']:.2f} s, CPU user {ph['cpu_user_s']:.2f} + sys {ph['cpu_sys_s']:.2f} s; "
                    f"driver execute {ph['exec_s']:.2f} s (CPU {ph['exec_cpu_s']:.2f}); commit {ph['commit_s']:.2f} s "
                    f"(CPU {ph['commit_cpu_s']:.2f}, {ph['commit_calls']} calls); ctx switches vol {ph['vol_ctx_switches']} "
                    f"/ invol {ph['invol_ctx_switches']}; load {load_before}",
                    flush=True,
                )
    return out


# =============================================================================================
# Benchmark 2: failure handling vs listener latency
# =============================================================================================
def bench_listener(latencies: list[float], repeats: int, paths: list[str]) -> list[dict]:
    """
    How long the TI row stays locked / the transaction stays open while a failure is handled with a
    slow ``on_task_instance_failed`` listener, seen from a second connection.

    paths: ``handle_failure`` (``ti.handle_failure(error, session=...)`` on a RUNNING TI, as its
    callers do) and ``executor_event`` (one FAILED executor event through
    ``SchedulerJobRunner._process_executor_events`` inside ``create_session()``, as the loop runs it).
    """
    H.clear_db()
    runner = H.make_runner()
    observer_engine = H.make_engine()
    with settings.NonScopedSession() as s:
        dag = H.write_dag("bench_listener", 1, retries=1, session=s)
        locks_rows = H.dialect_locks_rows(s)
    out = []
    run_no = 0
    me = threading.get_ident()
    for path in paths:
        for latency in latencies:
            for rep in range(repeats):
                LISTENER.latency = latency
                LISTENER.calls.clear()
                H.reset_executor(runner.executor)
                with settings.NonScopedSession() as s:
                    (dr,) = H.create_runs(dag, 1, session=s, start=run_no)
                    run_id = dr.run_id
                    H.set_running(
                        s,
                        (TI.dag_id == dag.dag_id, TI.run_id == run_id),
                        job_id=runner.job.id,
                        heartbeat_age_s=0,
                    )
                run_no += 1
                key = (dag.dag_id, "t000", run_id)
                obs = LockObserver(observer_engine, key)
                obs.start()
                settings.Session.remove()
                err = None
                with H.SqlCounter(settings.engine, threads={me}) as c:
                    if path == "executor_event" and locks_rows:
                        c.on_lock = (
                            obs.go.set
                        )  # start polling once the scan's SKIP LOCKED select holds the row
                    else:
                        obs.go.set()
                    t0 = time.perf_counter()
                    try:
                        if path == "handle_failure":
                            session = settings.Session()
                            ti = session.scalar(
                                select(TI).where(
                                    TI.dag_id == key[0], TI.task_id == key[1], TI.run_id == key[2]
                                )
                            )
                            ti.task = dag.get_task(ti.task_id)
                            ti.handle_failure("bench: simulated failure", session=session)
                            session.commit()
                        else:
                            with settings.NonScopedSession() as s:
                                ti = s.scalar(select(TI).where(TI.dag_id == key[0], TI.run_id == key[2]))
                                runner.executor.event_buffer[ti.key] = (FAILED, None)
                            H.process_executor_events(runner)
                    except Exception as e:
                        err = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    t1 = time.perf_counter()
                    settings.Session.remove()
                    time.sleep(0.02)  # let the observer take a sample after the end (measurement only)
                    obs.stop.set()
                    obs.go.set()
                    obs.join(10)
                with settings.NonScopedSession() as s:
                    final = s.scalar(select(TI.state).where(TI.dag_id == key[0], TI.run_id == key[2]))
                lk_start, lk_end = lock_interval(obs.samples, c.first_lock_at if c.on_lock else None)
                l_start, l_end = (
                    (LISTENER.calls[0][0], LISTENER.calls[0][1]) if LISTENER.calls else (None, None)
                )
                in_listener = [(lk, st) for t, lk, st in obs.samples if l_start and l_start <= t <= l_end]
                txn_during_listener = bool(
                    l_start and any(a <= l_start and b >= l_end for a, b in c.txn_spans)
                )
                out.append(
                    {
                        "path": path,
                        "latency": latency,
                        "repeat": rep,
                        "seconds": t1 - t0,
                        "lock_held_s": (lk_end - lk_start) if lk_start is not None else 0.0,
                        "locked_while_listener": any(lk for lk, _ in in_listener),
                        "states_seen_in_listener": sorted({str(st) for _, st in in_listener}),
                        "txn_max_s": max((b - a for a, b in c.txn_spans), default=0.0),
                        "txn_open_during_listener": txn_during_listener,
                        "listener_calls": len(LISTENER.calls),
                        "listener_after_commit": bool(
                            l_start
                            and c.txn_spans
                            and all(b <= l_start or a >= l_end for a, b in c.txn_spans)
                        ),
                        "samples": len(obs.samples),
                        "observer_error": obs.error,
                        "final_state": str(final),
                        "error": err,
                        "commits": c.commits,
                    }
                )
                r = out[-1]
                print(
                    f"  listener {path} {latency}s rep={rep}: call {r['seconds']:.3f}s, lock held "
                    f"{r['lock_held_s'] * 1000:.0f} ms, txn max {r['txn_max_s'] * 1000:.0f} ms, "
                    f"locked in listener={r['locked_while_listener']}, final={final}, err={err}",
                    flush=True,
                )
    observer_engine.dispose()
    LISTENER.latency = 0.0
    return out


# =============================================================================================
# Benchmark 3: concurrent throughput
# =============================================================================================
def _call_api(api_factory, dag_bag, fn: str, ti_id, results: dict) -> None:
    """One execution-API request through its real route function, with SessionDep's session
    semantics (commit on success, rollback on exception; ``create_session(scoped=False)``)."""
    from fastapi import HTTPException

    from airflow.api_fastapi.execution_api.datamodels.taskinstance import (
        TIHeartbeatInfo,
        TIRescheduleStatePayload,
    )
    from airflow.api_fastapi.execution_api.routes import task_instances as routes

    session = api_factory()
    try:
        if fn == "heartbeat":
            routes.ti_heartbeat(ti_id, TIHeartbeatInfo(hostname="bench-worker", pid=4242), session=session)
        else:
            now = tz.utcnow()
            payload = TIRescheduleStatePayload(
                state="up_for_reschedule", reschedule_date=now + timedelta(minutes=5), end_date=now
            )
            routes.ti_update_state(ti_id, payload, session=session, dag_bag=dag_bag)
        session.commit()
        results[f"{fn}_ok"] = results.get(f"{fn}_ok", 0) + 1
    except HTTPException as e:
        session.rollback()
        results[f"{fn}_{e.status_code}"] = results.get(f"{fn}_{e.status_code}", 0) + 1
    except Exception as e:
        session.rollback()
        name = f"{fn}_error:{type(e).__name__}"
        results[name] = results.get(name, 0) + 1
        results.setdefault("api_error_examples", []).append(str(e).splitlines()[0][:200])
    finally:
        session.close()


def _held_keys(executor) -> set:
    """Keys of the FAILED events the series' patch 17 holds for ``executor`` (none on the base)."""
    from airflow.jobs import scheduler_job_runner

    held = getattr(scheduler_job_runner, "_held_failed_events", None)
    return set(held.get(executor, {})) if held is not None else set()


def bench_concurrent(
    duration: float,
    m: int,
    batch: int,
    latencies: list[float],
    *,
    stale_heartbeats: bool = False,
    order: str = "race",
) -> list[dict]:
    """
    Executor FAILED events for M RUNNING TIs (tasks with retries and on_failure/on_retry callbacks),
    handled by ``_process_executor_events`` in batches of ``batch`` (one ``create_session()`` per
    batch, as the scheduler loop), while a second connection (thread) sends, for each TI of the batch
    being handled, an execution-API heartbeat then a reschedule (``ti_heartbeat`` / ``ti_update_state``
    route functions). Rounds of M TIs repeat until ``duration`` s of scheduler time have passed.
    An exception leaving ``_process_executor_events`` is what would stop a real scheduler: counted
    as a crash (then rolled back and the run carries on).

    The TIs' last heartbeat is fresh (0 s old), or with ``stale_heartbeats`` older than the heartbeat
    timeout (a dead worker's tries): the series' patch 17 holds a FAILED event of a try with a recent
    heartbeat (judged again on later loops, not within this benchmark's 3 passes per batch), and
    handles one without a recent heartbeat at once, as the base handles every event.

    The scheduler side runs as ``SchedulerJobRunner._execute`` runs its loop: inside
    ``runner.failure_listeners_in_background()`` where the tree has it (the series), so there the
    ``latency``-second listener runs off the scheduler's thread; listener calls still queued when the
    last round ends are counted (``listener_calls_queued_at_end``), then the block's exit waits for them.

    ``order`` says when the API thread acts on a batch's TIs: ``race`` (as above: it starts when the
    scheduler starts the batch, and the row locks decide), ``api-first`` (its heartbeat and
    reschedule of every TI of the batch are committed before the scheduler's first pass: every event
    finds its TI rescheduled) or ``scheduler-first`` (it acts after the batch's passes: every event
    finds its TI RUNNING and fails it; with fresh heartbeats the series' patch 17 holds the events
    instead, so use ``stale_heartbeats`` to compare failure handling). The fixed orders give both
    trees the same work per event; the time the scheduler waits for the API thread there is not
    counted as scheduler time.
    """
    if order not in ("race", "api-first", "scheduler-first"):
        raise ValueError(f"order: race, api-first or scheduler-first, not {order!r}")
    import contextlib

    from airflow.models.dagbag import DBDagBag

    out = []
    for latency in latencies:
        H.clear_db()
        runner = H.make_runner()
        api_engine = H.make_engine()
        api_factory = H.make_session_factory(api_engine)
        dag_bag = DBDagBag()
        LISTENER.latency = latency
        LISTENER.calls.clear()
        with settings.NonScopedSession() as s:
            dag = H.write_dag("bench_concurrent", 10, retries=1, callbacks=True, session=s)
        # As SchedulerJobRunner._execute runs its loop: inside failure_listeners_in_background() where
        # the tree has it (the series' patch 16 runs on_task_instance_failed calls off the loop's thread).
        background = getattr(runner, "failure_listeners_in_background", None)
        listener_calls = contextlib.ExitStack()
        in_background = listener_calls.enter_context(background()) if background is not None else None
        # Series v3 (operator tail): the one listener thread that `_execute` gives the runner.
        v3_thread = H.start_failure_listener_thread(runner)
        # Series v3's step rolls back a failed transaction and puts the events back (no crash): count
        # the exceptions that leave `_process_executor_events` inside it.
        rolled_back: dict[str, int] = {}
        if hasattr(runner, "_process_events_of_executors"):
            inner = runner._process_executor_events

            def counted(*a, **kw):
                try:
                    return inner(*a, **kw)
                except Exception as e:
                    rolled_back[type(e).__name__] = rolled_back.get(type(e).__name__, 0) + 1
                    raise

            runner._process_executor_events = counted
        me = threading.get_ident()
        sched_time = 0.0
        events = handled = crashes = 0
        crash_types: dict[str, int] = {}
        leftover: list = []
        not_handled: dict[str, int] = {}
        crash_examples: list[str] = []
        api: dict = {}
        outcomes: dict[str, int] = {}
        rounds = 0
        run_start = 0
        api_counter = H.SqlCounter(api_engine)
        sched_counter = H.SqlCounter(settings.engine, threads={me})
        with api_counter, sched_counter:
            warm_events = warm_handled = 0
            while (sched_time < duration or rounds < 2) and rounds < 1000:
                rounds += 1
                if rounds == 2:  # round 1 warms caches (DAG bag, statement cache): not in the rate
                    warm_events, warm_handled, sched_time = events, handled, 0.0
                n_runs = math.ceil(m / 10)
                H.reset_executor(runner.executor)
                with settings.NonScopedSession() as s:
                    runs = H.create_runs(dag, n_runs, session=s, start=run_start)
                    run_ids = [r.run_id for r in runs]
                    run_start += n_runs
                    H.set_running(
                        s,
                        (TI.dag_id == dag.dag_id, TI.run_id.in_(run_ids)),
                        job_id=runner.job.id,
                        heartbeat_age_s=runner._task_instance_heartbeat_timeout_secs + 3600
                        if stale_heartbeats
                        else 0,
                    )
                    tis = s.scalars(
                        select(TI)
                        .where(TI.dag_id == dag.dag_id, TI.run_id.in_(run_ids))
                        .order_by(TI.run_id, TI.task_id)
                    ).all()[:m]
                    keys = [(ti.key, ti.id) for ti in tis]
                batches = [keys[i : i + batch] for i in range(0, len(keys), batch)]
                go = [threading.Event() for _ in batches]
                api_done = [threading.Event() for _ in batches]
                done = threading.Event()

                def api_side(
                    batches=batches,
                    go=go,
                    api_done=api_done,
                    done=done,
                    factory=api_factory,
                    bag=dag_bag,
                    api=api,
                ) -> None:
                    for i, b in enumerate(batches):
                        if not go[i].wait(60) or done.is_set():
                            return
                        for _, ti_id in b:
                            _call_api(factory, bag, "heartbeat", ti_id, api)
                            _call_api(factory, bag, "reschedule", ti_id, api)
                        api_done[i].set()

                def wait_for_api(i: int) -> float:
                    t = time.perf_counter()
                    go[i].set()
                    if not api_done[i].wait(120):
                        raise RuntimeError(f"the API thread did not finish batch {i} within 120 s")
                    return time.perf_counter() - t

                th = threading.Thread(target=api_side, daemon=True)
                th.start()
                t_round = time.perf_counter()
                api_wait = 0.0
                for i, b in enumerate(batches):
                    for k, _ in b:
                        runner.executor.event_buffer[k] = (FAILED, None)
                    events += len(b)
                    if order == "race":
                        go[i].set()
                    elif order == "api-first":
                        api_wait += wait_for_api(i)
                    for _attempt in range(3):  # events skipped (locked) stay in the buffer: next loop
                        try:
                            H.process_executor_events(runner)
                        except Exception as e:
                            crashes += 1
                            name = type(e).__name__
                            crash_types[name] = crash_types.get(name, 0) + 1
                            if len(crash_examples) < 3:
                                crash_examples.append(str(e).splitlines()[0][:240])
                            settings.Session.remove()
                            # a real scheduler exits here; the events popped so far are lost
                        if not runner.executor.event_buffer:
                            break
                    left = [k for k, _ in b if k in runner.executor.event_buffer]
                    handled += len(b) - len(left)
                    if left:
                        # Not handled within the 3 passes (e.g. held by the series' patch 17 while the
                        # try heartbeats): recorded with whether the scheduler holds it and the TI's
                        # state at the end of the round, instead of being dropped unseen.
                        held = _held_keys(runner.executor)
                        leftover.extend((k, k in held) for k in left)
                    runner.executor.event_buffer.clear()
                    if order == "scheduler-first":
                        api_wait += wait_for_api(i)
                sched_time += time.perf_counter() - t_round - api_wait
                done.set()
                for e in go:
                    e.set()
                th.join(120)
                settings.Session.remove()
                with settings.NonScopedSession() as s:
                    for (st,) in s.execute(
                        select(TI.state).where(TI.dag_id == dag.dag_id, TI.run_id.in_(run_ids))
                    ).all()[:m]:
                        outcomes[str(st)] = outcomes.get(str(st), 0) + 1
                    # A retry that overwrote a committed reschedule: UP_FOR_RETRY with a task_reschedule
                    # row still on the TI's current id (the reschedule's effect silently lost).
                    from airflow.models.taskreschedule import TaskReschedule

                    lost = s.scalar(
                        select(func.count())
                        .select_from(TI)
                        .where(
                            TI.dag_id == dag.dag_id,
                            TI.run_id.in_(run_ids),
                            TI.state == TaskInstanceState.UP_FOR_RETRY,
                            select(TaskReschedule.id).where(TaskReschedule.ti_id == TI.id).exists(),
                        )
                    )
                    outcomes["retry_over_reschedule"] = outcomes.get("retry_over_reschedule", 0) + (lost or 0)
                    for k, was_held in leftover:
                        st, ti_try = s.execute(
                            select(TI.state, TI.try_number).where(
                                TI.dag_id == k.dag_id,
                                TI.task_id == k.task_id,
                                TI.run_id == k.run_id,
                                TI.map_index == k.map_index,
                            )
                        ).one()
                        name = (
                            f"{'held' if was_held else 'not_held'}:{st}:try{ti_try}/event_try{k.try_number}"
                        )
                        not_handled[name] = not_handled.get(name, 0) + 1
                    leftover.clear()
        queued_at_end = len(in_background.pending) if in_background is not None else 0
        if v3_thread is not None:
            queued_at_end = v3_thread._queue.qsize()
        calls_by_end = len(LISTENER.calls)  # the queued ones above that run in the shutdown wait: not these
        listener_calls.close()  # the scheduler's shutdown: waits up to 5 s for queued calls
        if v3_thread is not None:
            v3_thread.wait(timeout=30)  # as `_execute` does at exit
        api_engine.dispose()
        examples = api.pop("api_error_examples", [])
        out.append(
            {
                "latency": latency,
                "stale_heartbeats": stale_heartbeats,
                "order": order,
                "m": m,
                "batch": batch,
                "rounds": rounds,
                "events": events,
                "handled": handled,
                "sched_seconds": sched_time,
                "warmup_events": warm_events,
                "events_per_s": (handled - warm_handled) / sched_time if sched_time else 0.0,
                "crashes": crashes,
                "not_handled": not_handled,
                "crash_types": crash_types,
                "crash_examples": crash_examples,
                "api": api,
                "api_error_examples": examples[:3],
                "outcomes": outcomes,
                "sched_lock_waits": sched_counter.lock_waits,
                "sched_lock_wait_s": sched_counter.lock_wait_s,
                "api_lock_waits": api_counter.lock_waits,
                "api_lock_wait_s": api_counter.lock_wait_s,
                "sched_commits": sched_counter.commits,
                "sched_statements": sched_counter.statements,
                "listeners_in_background": in_background is not None or v3_thread is not None,
                "rolled_back_steps": rolled_back,
                "listener_calls": len(LISTENER.calls),
                "listener_calls_queued_at_end": queued_at_end,
                "listener_calls_by_end": calls_by_end,
            }
        )
        r = out[-1]
        print(
            f"  concurrent ({order}) listener={latency}s: {rounds} rounds, {handled}/{events} events in "
            f"{sched_time:.1f}s = {r['events_per_s']:.1f}/s, crashes={crashes} {crash_types}, "
            f"rolled back={rolled_back}, api={api}, "
            f"outcomes={outcomes}, not handled within 3 passes={not_handled}",
            flush=True,
        )
    LISTENER.latency = 0.0
    return out


# =============================================================================================
class DeliveryListener:
    """
    ``on_task_instance_failed`` for benchmark 5: sleeps ``latency`` seconds (the first call waits
    up to ``hang_first`` s on ``release`` instead: a hung listener) and records, per call, which
    try it was called for, what the task instance it got says, and what the database says about
    that TI row at the start of the call (read through ``create_session()``, as listeners do).
    """

    def __init__(self) -> None:
        self.latency = 0.0
        self.hang_first = 0.0
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.calls: list[dict] = []
        self.active = 0
        self.max_active = 0
        self.all_done = threading.Event()
        self.expected = 0

    def reset(self, latency: float, expected: int, hang_first: float = 0.0) -> None:
        with self.lock:
            self.latency, self.expected, self.hang_first = latency, expected, hang_first
            self.calls, self.active, self.max_active = [], 0, 0
            self.release = threading.Event()
            self.all_done = threading.Event()

    @hookimpl
    def on_task_instance_failed(self, previous_state, task_instance, error):
        start = time.perf_counter()
        with self.lock:
            n = len(self.calls)
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            call = {
                "n": n,
                "start": start,
                "end": None,
                "thread": threading.get_ident(),
                "key": (
                    task_instance.dag_id,
                    task_instance.task_id,
                    task_instance.run_id,
                    task_instance.map_index,
                ),
                "try_number": task_instance.try_number,
                "id": str(task_instance.id),
                "state": str(task_instance.state),
                "end_date": str(task_instance.end_date),
            }
            self.calls.append(call)
        try:
            with create_session() as s:
                row = s.execute(
                    select(TI.id, TI.state, TI.try_number, TI.end_date).where(
                        TI.dag_id == task_instance.dag_id,
                        TI.task_id == task_instance.task_id,
                        TI.run_id == task_instance.run_id,
                        TI.map_index == task_instance.map_index,
                    )
                ).one()
            call["db"] = (str(row.id), str(row.state), row.try_number, str(row.end_date))
            if n == 0 and self.hang_first:
                self.release.wait(self.hang_first)
            elif self.latency:
                time.sleep(self.latency)
        finally:
            with self.lock:
                call["end"] = time.perf_counter()
                self.active -= 1
                if sum(1 for c in self.calls if c["end"] is not None) >= self.expected:
                    self.all_done.set()


# Registered only while benchmark 5 runs (``bench_slow_listener``): its database read per call
# would otherwise be a listener in every other benchmark too.
DELIVERY = DeliveryListener()


class HeartbeatAge(threading.Thread):
    """
    Polls the scheduler job's ``latest_heartbeat`` every 0.25 s on a connection of its own, as
    the health check reads it, and keeps the oldest age seen (now - latest_heartbeat).
    """

    def __init__(self, job_id: int) -> None:
        super().__init__(daemon=True, name="heartbeat-age")
        self.job_id = job_id
        self.stop = threading.Event()
        self.max_age = 0.0
        self.samples = 0

    def run(self) -> None:
        from airflow.jobs.job import Job

        with settings.engine.connect() as conn:
            while not self.stop.wait(0.25):
                hb = conn.execute(select(Job.latest_heartbeat).where(Job.id == self.job_id)).scalar()
                conn.rollback()
                if hb is None:
                    continue
                if hb.tzinfo is None:
                    hb = hb.replace(tzinfo=tz.utc)
                self.max_age = max(self.max_age, (tz.utcnow() - hb).total_seconds())
                self.samples += 1


class LogCapture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.levelname} {record.getMessage()}")


def _delivery_figures(n: int) -> dict:
    """Exactly once per failed try, order per TI, committed state seen: from DELIVERY's records."""
    from collections import Counter, defaultdict

    calls = list(DELIVERY.calls)
    per_try = Counter((c["key"], c["try_number"]) for c in calls)
    tries_per_ti: dict = defaultdict(list)
    for c in sorted(calls, key=lambda c: c["start"]):
        tries_per_ti[c["key"]].append(c["try_number"])
    return {
        "calls": len(calls),
        "failed_tries": n,
        "tries_with_one_call": sum(1 for v in per_try.values() if v == 1),
        "tries_with_more_calls": sum(1 for v in per_try.values() if v > 1),
        "tis_called_in_try_order": sum(1 for v in tries_per_ti.values() if v == sorted(v)),
        "calls_seeing_committed_row": sum(
            1
            for c in calls
            if c.get("db")
            and c["db"][:3] == (c["id"], c["state"], c["try_number"])
            and c["state"] != "running"
        ),
        "states_seen": dict(Counter(c["state"] for c in calls)),
        "max_calls_at_once": DELIVERY.max_active,
        "off_scheduler_thread": sum(1 for c in calls if c["thread"] != threading.get_ident()),
    }


def bench_slow_listener(latency: float, n: int, hang: float = 0.0, hang_timeout: float = 2.0) -> list[dict]:
    """Benchmark 5 (``_bench_slow_listener``) with ``DELIVERY`` registered while it runs, also if it raises."""
    get_listener_manager().add_listener(DELIVERY)
    try:
        return _bench_slow_listener(latency, n, hang, hang_timeout)
    finally:
        get_listener_manager().pm.unregister(DELIVERY)


def _bench_slow_listener(latency: float, n: int, hang: float, hang_timeout: float) -> list[dict]:
    """
    Issue 17, target 4: the scheduler loop with a slow ``on_task_instance_failed`` listener. One DAG
    run of ``n`` tasks (``retries=1``) RUNNING; ``n`` FAILED executor events are handled in the first
    iteration of a loop run the way ``SchedulerJobRunner._execute`` runs its loop (inside
    ``runner.failure_listeners_in_background()`` where the tree has it, the series; plainly on the
    base): each iteration heartbeats the scheduler job (``perform_heartbeat(..., only_if_necessary=True)``
    as ``_run_scheduler_loop`` does) and runs ``_process_executor_events`` in ``create_session()``;
    between iterations it waits up to 1 s (the loop's idle sleep) for the listener calls to finish.
    The loop runs until every failed try's call finished (or ``n * latency + 120`` s). A second
    connection polls the job's ``latest_heartbeat`` (``HeartbeatAge``). Measured once with a no-op
    listener and once with a listener sleeping ``latency`` s: extra = first iteration (slow) - first
    iteration (no-op). With ``hang`` > 0 a third run: ``min(n, 10)`` failures, the first call hangs
    (waits ``hang`` s), the others take 1 s each, ``task_instance_failed_listener_timeout`` =
    ``hang_timeout``; the block is left right after the first iteration, so the shutdown (5 s) finds
    calls pending and logs them.
    """
    import contextlib

    from airflow.jobs.job import perform_heartbeat

    H.clear_db()
    runner = H.make_runner()
    with settings.NonScopedSession() as s:
        dag = H.write_dag("bench_slow_listener", n, retries=1, session=s)
    background = getattr(runner, "failure_listeners_in_background", None)
    capture = LogCapture()
    logging.getLogger("airflow.listeners.background").addHandler(capture)
    logging.getLogger("airflow.listeners.background").setLevel(logging.INFO)
    out = []
    runs = [("noop", 0.0, n), ("slow", latency, n)] + ([("hang", 1.0, min(n, 10))] if hang else [])
    for run_no, (kind, lat, n_ev) in enumerate(runs):
        DELIVERY.reset(lat, n_ev, hang_first=hang if kind == "hang" else 0.0)
        capture.records.clear()
        os.environ["AIRFLOW__SCHEDULER__TASK_INSTANCE_FAILED_LISTENER_TIMEOUT"] = (
            str(hang_timeout) if kind == "hang" else "60"
        )
        H.reset_executor(runner.executor)
        with settings.NonScopedSession() as s:
            (dr,) = H.create_runs(dag, 1, session=s, start=run_no)
            # The workers are gone (heartbeats an hour old), as after a mass worker loss: the series'
            # patch 17 would otherwise hold FAILED events of tries with a recent heartbeat.
            H.set_running(
                s,
                (TI.dag_id == dag.dag_id, TI.run_id == dr.run_id),
                job_id=runner.job.id,
                heartbeat_age_s=3600,
            )
            tis = s.scalars(select(TI).where(TI.dag_id == dag.dag_id, TI.run_id == dr.run_id)).all()
            for ti in tis[:n_ev]:
                runner.executor.event_buffer[ti.key] = (FAILED, None)
        settings.Session.remove()
        runner.job.heartbeat(heartbeat_callback=runner.heartbeat_callback)  # the loop's age starts at 0
        monitor = HeartbeatAge(runner.job.id)
        monitor.start()
        err = None
        iterations: list[float] = []
        ctx = background() if background is not None else contextlib.nullcontext()
        ctx.__enter__()
        t0 = time.perf_counter()
        deadline = t0 + n_ev * lat + 120
        try:
            while True:
                it0 = time.perf_counter()
                perform_heartbeat(
                    runner.job, heartbeat_callback=runner.heartbeat_callback, only_if_necessary=True
                )
                H.process_executor_events(runner)
                iterations.append(time.perf_counter() - it0)
                if kind == "hang" or DELIVERY.all_done.is_set() or time.perf_counter() > deadline:
                    break
                DELIVERY.all_done.wait(1.0)
        except Exception as e:
            err = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        t1 = time.perf_counter()
        done_in_first = (
            sum(1 for c in DELIVERY.calls if c["end"] is not None and c["end"] <= t0 + iterations[0])
            if iterations
            else 0
        )
        ctx.__exit__(None, None, None)
        t2 = time.perf_counter()
        monitor.stop.set()
        monitor.join(10)
        DELIVERY.release.set()  # let a hung call return
        with settings.NonScopedSession() as s:
            states = dict(
                s.execute(
                    select(TI.state, func.count())
                    .where(TI.dag_id == dag.dag_id, TI.run_id == dr.run_id)
                    .group_by(TI.state)
                ).all()
            )
        starts = sorted(c["start"] for c in DELIVERY.calls)
        rec = {
            "kind": kind,
            "latency": lat,
            "failures": n_ev,
            "background": background is not None,
            "step_seconds": iterations[0] if iterations else None,
            "loop_iterations": len(iterations),
            "max_later_iteration_seconds": max(iterations[1:], default=None),
            "loop_seconds": t1 - t0,
            "max_heartbeat_age_seconds": monitor.max_age,
            "heartbeat_samples": monitor.samples,
            "listener_calls_done_in_step": done_in_first,
            "listener_calls_done_by_shutdown": sum(
                1 for c in DELIVERY.calls if c["end"] is not None and c["end"] <= t2
            ),
            "listener_calls_started": len(DELIVERY.calls),
            "shutdown_seconds": t2 - t1,
            "delivery": _delivery_figures(n_ev),
            "states": {str(k): v for k, v in states.items()},
            "error": err,
            "log": capture.records[:20],
            "timeout_logs": sum(1 for r in capture.records if "did not return within" in r),
            "shutdown_log": next((r for r in capture.records if "Shutting down with" in r), None),
        }
        if kind == "hang":
            rec["hang_timeout"] = hang_timeout
            rec["first_to_second_call_start_seconds"] = starts[1] - starts[0] if len(starts) > 1 else None
        out.append(rec)
        print(
            f"[slow_listener] {json.dumps({k: v for k, v in rec.items() if k != 'log'}, default=str)}",
            flush=True,
        )
    logging.getLogger("airflow.listeners.background").removeHandler(capture)
    os.environ.pop("AIRFLOW__SCHEDULER__TASK_INSTANCE_FAILED_LISTENER_TIMEOUT", None)
    return out


def tree_facts(root: Path) -> dict:
    tree = root / "airflow-core"

    def git(*a):
        return subprocess.run(["git", "-C", str(tree), *a], capture_output=True, text=True).stdout.strip()

    return {
        "head": git("rev-parse", "--short", "HEAD"),
        "subject": git("log", "-1", "--format=%s"),
        "patches_applied": len(git("rev-list", "base..HEAD").split()),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", required=True)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--root", type=Path, default=Path(os.path.abspath(__file__)).parents[1])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", default="purge,listener,concurrent")
    p.add_argument("--repeats", type=int)
    p.add_argument("--sizes", help="purge sizes, e.g. 10,100,500 (default 10,100,500,1000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stale-heartbeats", action="store_true", help="concurrent: TIs' heartbeats timed out")
    p.add_argument("--order", default="race", help="concurrent: race, api-first or scheduler-first")
    p.add_argument(
        "--concurrent-seconds", type=float, help="concurrent: scheduler seconds (default 20, quick 3)"
    )
    p.add_argument("--slow-listener", type=float, default=10.0, help="slowlistener: listener seconds")
    p.add_argument("--slow-failures", type=int, default=100, help="slowlistener: failures in one step")
    p.add_argument(
        "--slow-hang", type=float, default=0.0, help="slowlistener: a hung first call waits this long"
    )
    p.add_argument(
        "--slow-hang-timeout", type=float, default=2.0, help="slowlistener: listener timeout in the hang run"
    )
    args = p.parse_args()
    random.seed(args.seed)
    only = set(args.only.split(","))
    import airflow

    result: dict = {
        "variant": args.variant,
        "tree": tree_facts(args.root),
        "airflow_file": str(Path(airflow.__file__).parent),
        "airflow_version": airflow.__version__,
    }
    t0 = time.perf_counter()
    H.reset_schema()
    result["reset_seconds"] = time.perf_counter() - t0
    with settings.engine.connect() as conn:
        result["server_version"] = H.server_version(conn)
    with settings.NonScopedSession() as s:
        result["with_row_locks_locks"] = H.dialect_locks_rows(s)
    print(
        f"[{args.variant}] {result['tree']} airflow from {result['airflow_file']}; {result['server_version']}",
        flush=True,
    )
    errors = {}
    if "purge" in only:
        try:
            sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else None
            sizes = sizes or ([10, 100] if args.quick else [10, 100, 500, 1000])
            # N=1000 passes take minutes on 2 shared cores: 3 repeats there unless --repeats says otherwise
            reps = {n: args.repeats or (2 if args.quick else 3 if n >= 1000 else 5) for n in sizes}
            result["purge"] = bench_purge(sizes, reps)
        except Exception:
            errors["purge"] = traceback.format_exc()
    if "listener" in only:
        try:
            lat = [0.0, 0.1, 1.0, 2.0] if not args.quick else [0.0, 0.1, 1.0]
            result["listener"] = bench_listener(
                lat, args.repeats or (1 if args.quick else 3), ["handle_failure", "executor_event"]
            )
        except Exception:
            errors["listener"] = traceback.format_exc()
    if "concurrent" in only:
        try:
            if args.quick:
                result["concurrent"] = bench_concurrent(
                    args.concurrent_seconds or 3.0,
                    20,
                    5,
                    [0.0, 0.02],
                    stale_heartbeats=args.stale_heartbeats,
                    order=args.order,
                )
            else:
                result["concurrent"] = bench_concurrent(
                    args.concurrent_seconds or 20.0,
                    100,
                    10,
                    [0.0, 0.02],
                    stale_heartbeats=args.stale_heartbeats,
                    order=args.order,
                )
        except Exception:
            errors["concurrent"] = traceback.format_exc()
    if "slowlistener" in only:
        try:
            result["slow_listener"] = bench_slow_listener(
                args.slow_listener, args.slow_failures, args.slow_hang, args.slow_hang_timeout
            )
        except Exception:
            errors["slowlistener"] = traceback.format_exc()
    result["errors"] = errors
    for k, v in errors.items():
        print(f"[{args.variant}] benchmark {k} failed:\n{v}", file=sys.stderr, flush=True)
    args.out.write_text(json.dumps(result, default=str, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
