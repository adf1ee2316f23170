# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
Executor events are applied and committed, or kept in the executor's buffer for a later loop.

``SchedulerJobRunner._process_executor_events`` takes the events out of the executor's buffer
before their effects are committed. These tests make the database itself reject or end the
transaction at chosen points of one batch (a trigger that rejects the UPDATE of one task
instance, a real deadlock, a failed COMMIT, a row locked by another connection) and check, for
every event of the batch, that its effect is committed or that it is back in the buffer.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import pytest
from sqlalchemy import select, text, update

import airflow
from airflow import settings
from airflow.models.log import Log
from airflow.models.taskinstance import TaskInstance
from airflow.utils.state import TaskInstanceState

from tests.unit.harness import series
from tests.unit.harness.env import BACKEND
from tests.unit.harness.compat import (
    HAS_CALLBACK_EVENTS,
    callback_key_of,
    callback_key_uuid,
    metrics_of,
    put_back_key,
)
from tests.unit.harness.series import guard_since
from tests.unit.ti_race import (
    Worker,
    executor_events_step,
    lock_waiters,
    make_running_tis,
    read_rows,
    wait_until,
)

if HAS_CALLBACK_EVENTS:
    from airflow.models.callback import Callback, CallbackFetchMethod, CallbackKey, ExecutorCallback
    from airflow.utils.state import CallbackState
else:  # compat 3.1.x: executors report task instances only; the callback-key event parts are left out
    Callback = CallbackFetchMethod = ExecutorCallback = CallbackState = None
    CallbackKey = type("NoCallbackKey", (), {})

# The first write of a batch, which arms the connection killers: a callback-key event's UPDATE (handled
# first), or on 3.1.x (no such events) the first UPDATE of a task instance.
FIRST_BATCH_UPDATE = r"^\s*UPDATE callback " if HAS_CALLBACK_EVENTS else r"^\s*UPDATE task_instance "

P_CONTAIN = "Keep-the-scheduler-running-when-one-executor-event-fails-in-the-DB.patch"

pytestmark = pytest.mark.db_test

POISON = "poison"  # task_id whose UPDATE the trigger rejects

NO_SAVEPOINT_ON_SQLITE = (
    "sqlite: the series opens no savepoint per event there (pysqlite's SAVEPOINT pins a read snapshot), "
    "so a database error rolls back the batch's whole transaction"
)


@contextmanager
def reject_updates(table: str, task_id: str | None = None):
    """
    A database trigger that rejects every UPDATE of a ``table`` row (of ``task_id``'s row(s) only, if given)
    with the database's own integrity error (postgres 23503, MySQL/MariaDB 1451), until the block ends.
    """
    name = f"test_reject_{table}_update"
    message = f"update of {table} rejected by test trigger"
    with settings.engine.begin() as conn:
        if BACKEND == "postgres":
            when = f"WHEN (OLD.task_id = '{task_id}') " if task_id else ""
            conn.execute(
                text(
                    f"CREATE OR REPLACE FUNCTION {name}() RETURNS trigger AS $$ BEGIN RAISE EXCEPTION "
                    f"'{message}' USING ERRCODE = 'foreign_key_violation'; END $$ LANGUAGE plpgsql"
                )
            )
            conn.execute(
                text(
                    f"CREATE TRIGGER {name} BEFORE UPDATE ON {table} FOR EACH ROW {when}EXECUTE FUNCTION {name}()"
                )
            )
        elif BACKEND == "mysql":
            signal = f"SIGNAL SQLSTATE '23000' SET MESSAGE_TEXT = '{message}', MYSQL_ERRNO = 1451"
            body = f"BEGIN IF OLD.task_id = '{task_id}' THEN {signal}; END IF; END" if task_id else signal
            conn.execute(text(f"CREATE TRIGGER {name} BEFORE UPDATE ON {table} FOR EACH ROW {body}"))
        else:
            when = f"WHEN OLD.task_id = '{task_id}' " if task_id else ""
            conn.execute(
                text(
                    f"CREATE TRIGGER {name} BEFORE UPDATE ON {table} FOR EACH ROW {when}"
                    f"BEGIN SELECT RAISE(ABORT, '{message}'); END"
                )
            )
    try:
        yield
    finally:
        with settings.engine.begin() as conn:
            conn.execute(
                text(f"DROP TRIGGER IF EXISTS {name}" + (f" ON {table}" if BACKEND == "postgres" else ""))
            )
            if BACKEND == "postgres":
                conn.execute(text(f"DROP FUNCTION IF EXISTS {name}()"))


def reject_updates_of(task_id: str):
    """A database trigger that rejects every UPDATE of the task instance row(s) with ``task_id``."""
    return reject_updates("task_instance", task_id)


class _CallbackDef:
    """The smallest callback definition ``ExecutorCallback`` serialises."""

    def serialize(self) -> dict:
        return {"path": "tests.unit.noop", "kwargs": {}, "executor": None}


def queued_and_poison_with_a_callback(dag_maker, session, runner, dag_id: str, queued: str = "queued"):
    """Running TIs ``queued`` and POISON (by task id) and a queued callback's key (None on 3.1.x)."""
    tis = make_running_tis(
        dag_maker, session, dag_id=dag_id, task_ids=(queued, POISON), queued_by_job_id=runner.job.id
    )
    return {ti.task_id: ti for ti in tis}, make_queued_callback(session) if HAS_CALLBACK_EVENTS else None


def make_queued_callback(session):
    """A queued executor callback; its executor-event key."""
    # Imported here (only bases with callback events call it), so that a module importing this helper gets it whole.
    from airflow.models.callback import CallbackFetchMethod, ExecutorCallback
    from airflow.utils.state import CallbackState

    callback = ExecutorCallback(_CallbackDef(), fetch_method=CallbackFetchMethod.IMPORT_PATH)
    callback.state = CallbackState.QUEUED
    session.add(callback)
    session.commit()
    return callback_key_of(callback.id)


def committed_callback_state(key) -> str | None:
    from airflow.models.callback import Callback

    with settings.NonScopedSession() as s:
        return s.scalar(select(Callback.state).where(Callback.id == callback_key_uuid(key)))


def committed_ti(dag_id: str, task_id: str) -> tuple[str | None, str | None]:
    """(state, external_executor_id) of the task instance as a fresh connection sees it."""
    with settings.NonScopedSession() as s:
        return s.execute(
            select(TaskInstance.state, TaskInstance.external_executor_id).where(
                TaskInstance.dag_id == dag_id, TaskInstance.task_id == task_id
            )
        ).one()


def committed_mismatch_logs(dag_id: str) -> list[str]:
    with settings.NonScopedSession() as s:
        return sorted(
            s.scalars(select(Log.task_id).where(Log.dag_id == dag_id, Log.event == "state mismatch"))
        )


@pytest.mark.proves(P_CONTAIN)
def test_flush_error_undoes_only_the_failing_event(dag_maker, session, scheduler_job_runner, backend):
    """
    The UPDATE of one TI is rejected at the flush, every time. Every other event of the batch (a
    callback-key event, which is always handled first, and a QUEUED event's ``external_executor_id``)
    keeps its effect and is committed (handled again, each in a transaction of its own, after the
    batch's transaction rolled back); only the failing event is undone and put back in the buffer.
    """
    runner = scheduler_job_runner
    executor = runner.executor
    by_task, callback_key = queued_and_poison_with_a_callback(dag_maker, session, runner, "flush_error")
    if backend == "sqlite" and airflow.__version__.startswith("3.2."):
        callback_key = None  # 3.2.x on SQLite cannot apply a callback's event (Uuid bind of its str key)
    if callback_key is not None:
        executor.event_buffer[callback_key] = (CallbackState.SUCCESS, None)
    executor.event_buffer[by_task["queued"].key] = (TaskInstanceState.QUEUED, "external-id-1")
    executor.event_buffer[by_task[POISON].key] = (TaskInstanceState.FAILED, None)
    # 3.4: put back under the try's id (put_back_key)
    poison_key = put_back_key(by_task[POISON].key, by_task[POISON].id)
    session.expunge_all()

    with reject_updates_of(POISON):
        executor_events_step(runner)

    if callback_key is not None:
        assert committed_callback_state(callback_key) == CallbackState.SUCCESS, "callback event lost"
    assert committed_ti("flush_error", "queued") == (TaskInstanceState.RUNNING, "external-id-1"), (
        "QUEUED event's external_executor_id lost"
    )
    assert committed_ti("flush_error", POISON)[0] == TaskInstanceState.RUNNING
    assert committed_mismatch_logs("flush_error") == [], "the failing event's log row was committed"
    # Only the failing event is back in the buffer.
    assert list(executor.event_buffer) == [poison_key]


P_KEEP = "Keep-executor-events-until-their-effects-are-committed.patch"


def end_server_session(conn) -> None:
    """End ``conn``'s server session from another connection (``pg_terminate_backend`` / ``KILL``)."""
    if BACKEND == "postgres":
        pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
        kill = f"SELECT pg_terminate_backend({int(pid)})"
    else:
        kill = f"KILL {int(conn.exec_driver_sql('SELECT CONNECTION_ID()').scalar_one())}"
    with settings.engine.connect() as other:
        other.execute(text(kill))
        other.commit()


class KillConnectionAtCommit:
    """
    On this thread, once a statement matching ``armed_by`` ran, end the connection's server session
    from another connection right before its ``commit_number``-th COMMIT (``pg_terminate_backend`` / ``KILL``): the
    COMMIT then fails with the driver's OperationalError, as on a connection lost at the commit.
    """

    def __init__(self, armed_by: str, commit_number: int = 1):
        import re

        from sqlalchemy import event

        self._event = event
        self._pattern = re.compile(armed_by, re.IGNORECASE)
        self.thread = threading.current_thread()
        self.armed = False
        self.fired = False
        self.commits_left = commit_number
        event.listen(settings.engine, "before_cursor_execute", self._arm)
        event.listen(settings.engine, "commit", self._commit)

    def _arm(self, conn, cursor, statement, parameters, context, executemany):
        if threading.current_thread() is self.thread and self._pattern.search(statement):
            self.armed = True

    def _commit(self, conn):
        if self.fired or not self.armed or threading.current_thread() is not self.thread:
            return
        self.commits_left -= 1
        if self.commits_left:
            return
        self.fired = True
        end_server_session(conn)

    def remove(self):
        self._event.remove(settings.engine, "before_cursor_execute", self._arm)
        self._event.remove(settings.engine, "commit", self._commit)


@pytest.mark.proves(P_KEEP)
def test_failed_commit_puts_back_every_event_and_the_scheduler_goes_on(
    dag_maker, session, scheduler_job_runner, backend
):
    """
    The COMMIT of the batch fails (its connection is ended right before it): one pass of the real
    scheduler loop does not raise, and every event taken out of the buffer in that transaction, the callback-key
    event included, is put back and handled again, each in a transaction of its own (upstream #69975).
    """
    if backend == "sqlite":
        pytest.skip("sqlite: a server session that another connection can end does not exist there")
    runner = scheduler_job_runner
    executor = runner.executor
    tis = make_running_tis(
        dag_maker, session, dag_id="commit_fails", task_ids=("a", "b"), queued_by_job_id=runner.job.id
    )
    events = {
        tis[0].key: (TaskInstanceState.QUEUED, "external-a"),
        tis[1].key: (TaskInstanceState.RUNNING, "external-b"),
    }
    callback_key = None
    if HAS_CALLBACK_EVENTS:
        callback_key = make_queued_callback(session)
        events = {callback_key: (CallbackState.SUCCESS, None), **events}
    executor.event_buffer.update(events)
    session.expunge_all()
    session.close()

    runner.num_runs = 1  # one pass of the real scheduler loop
    killer = KillConnectionAtCommit(armed_by=FIRST_BATCH_UPDATE)
    try:
        try:
            runner._run_scheduler_loop()
        except Exception as e:
            pytest.fail(f"the scheduler loop raised {e!r}: the scheduler would exit")
    finally:
        killer.remove()
    assert killer.fired, "the batch's COMMIT was not reached"
    if callback_key is not None:
        assert committed_callback_state(callback_key) == CallbackState.SUCCESS
    assert committed_ti("commit_fails", "a") == (TaskInstanceState.RUNNING, "external-a")
    assert committed_ti("commit_fails", "b") == (TaskInstanceState.RUNNING, "external-b")
    assert executor.event_buffer == {}


# 3.4 puts back the events of rows SKIP LOCKED skipped on its own (#55004 fixed): a guard there.
@guard_since("3.4.0", P_KEEP)
def test_events_of_rows_skipped_by_skip_locked_are_kept(
    dag_maker, session, other_session, scheduler_job_runner, backend
):
    """
    Another transaction holds the row lock of one task instance: the batch's ``FOR UPDATE SKIP
    LOCKED`` read leaves it out. Its event stays in the buffer (upstream #55004) and is applied on
    the next pass, once the lock is gone; the other event is applied at once.
    """
    from tests.unit.harness.db import dialect_locks_rows, no_row_locks_reason

    if not dialect_locks_rows(session):
        pytest.skip(no_row_locks_reason(session))
    runner = scheduler_job_runner
    executor = runner.executor
    tis = make_running_tis(
        dag_maker, session, dag_id="skip_locked", task_ids=("free", "locked"), queued_by_job_id=runner.job.id
    )
    free, locked = tis
    executor.event_buffer[free.key] = (TaskInstanceState.QUEUED, "external-free")
    executor.event_buffer[locked.key] = (TaskInstanceState.QUEUED, "external-locked")
    locked_key = locked.key
    locked_id = locked.id
    session.expunge_all()

    other_session.execute(select(TaskInstance.id).where(TaskInstance.id == locked_id).with_for_update())
    runner._process_executor_events(executor=executor, session=session)
    session.commit()
    assert committed_ti("skip_locked", "free") == (TaskInstanceState.RUNNING, "external-free")
    assert committed_ti("skip_locked", "locked") == (TaskInstanceState.RUNNING, None)
    if hasattr(TaskInstance, "working_set"):  # 3.4 keeps the event under the try's id it resolved the key to
        from airflow.executors.workloads.types import TaskInstanceUuid

        locked_key = TaskInstanceUuid(locked_id)
    assert list(executor.event_buffer) == [locked_key], "the skipped row's event was dropped"

    other_session.rollback()
    runner._process_executor_events(executor=executor, session=session)
    session.commit()
    assert committed_ti("skip_locked", "locked") == (TaskInstanceState.RUNNING, "external-locked")
    assert executor.event_buffer == {}


P_POISON = "Give-up-on-an-executor-event-whose-handling-keeps-failing-in-the-DB.patch"


@pytest.mark.proves(P_POISON)
def test_poison_event_is_given_up_visibly_after_a_bounded_number_of_passes(
    dag_maker, session, scheduler_job_runner, monkeypatch, caplog, capsys
):
    """
    The database rejects the handling of one event on every pass (a trigger rejects the UPDATE of
    its task instance). The event is put back for a bounded number of passes, then dropped with one
    log line naming the cause and one ``scheduler.executor_events.given_up`` count; the task
    instance is left as it is (to the heartbeat and queued timeouts).
    """
    import logging

    from airflow.jobs import scheduler_job_runner as sjr

    counted: list[tuple[str, dict]] = []
    real_incr = metrics_of(sjr).incr

    def incr(name, *args, **kwargs):
        counted.append((name, kwargs.get("tags") or {}))
        return real_incr(name, *args, **kwargs)

    monkeypatch.setattr(metrics_of(sjr), "incr", incr)
    runner = scheduler_job_runner
    executor = runner.executor
    (ti,) = make_running_tis(
        dag_maker, session, dag_id="poison_event", task_ids=(POISON,), queued_by_job_id=runner.job.id
    )
    key = ti.key
    executor.event_buffer[key] = (TaskInstanceState.FAILED, None)
    session.expunge_all()

    # The documented bound; before the patch there is none and the event is re-queued on every pass.
    bound = getattr(sjr, "EXECUTOR_EVENT_MAX_DB_FAILURES", 5)
    with reject_updates_of(POISON), caplog.at_level(logging.INFO):
        for n in range(1, bound + 1):
            runner._process_executor_events(executor=executor, session=session)
            session.commit()
            if n < bound:
                assert list(executor.event_buffer) == [key], f"not put back after pass {n}"
        assert executor.event_buffer == {}, f"still re-queued after {bound} failed passes"
        # Further passes: nothing left to fail.
        runner._process_executor_events(executor=executor, session=session)
        session.commit()
    logged = caplog.text + "".join(capsys.readouterr())
    assert logged.count("Giving up on executor event") == 1, logged[-2000:]
    assert "rejected by test trigger" in logged, "the cause is not in the log"
    given_up = [tags for name, tags in counted if name == "scheduler.executor_events.given_up"]
    assert given_up == [{"dag_id": "poison_event", "task_id": POISON}]
    try:
        from airflow._shared.observability.metrics.metrics_registry import MetricsRegistry
    except ImportError:  # compat 3.1.x: no metrics registry (metrics_template.yaml) to declare it in
        MetricsRegistry = None
    if MetricsRegistry is not None:
        assert MetricsRegistry().get("scheduler.executor_events.given_up")["type"] == "counter"
    assert committed_ti("poison_event", POISON)[0] == TaskInstanceState.RUNNING


DEADLOCK = "deadlock"  # task_id whose UPDATE waits, through a trigger, for a row the test holds


# PostgreSQL checks a lock wait for a deadlock once, ``deadlock_timeout`` after the wait began, and
# the backend that finds the cycle aborts its own transaction. The scheduler must find it: its check
# (3 s, set in the trigger) has to come after the test's UPDATE closed the cycle, and the test's own
# check must never come first (30 s, set on the test's transaction). With the server's 1 s for both,
# a test thread slowed by over 1 s between seeing the scheduler wait and its UPDATE made the test the
# victim. Setting deadlock_timeout needs a superuser (the throwaway server's and breeze's user are).
SCHEDULER_DEADLOCK_TIMEOUT = (
    "IF current_setting('is_superuser') = 'on' THEN "
    "PERFORM set_config('deadlock_timeout', '3s', true); END IF; "
)
TEST_DEADLOCK_TIMEOUT = (
    "SELECT set_config('deadlock_timeout', '30s', true) WHERE current_setting('is_superuser') = 'on'"
)


@contextmanager
def updates_of_wait_for_blocker(task_id: str):
    """
    Tables ``test_blocker`` (one row) and ``test_weight``, and a trigger that makes every UPDATE of
    the task instance row(s) with ``task_id`` update ``test_blocker`` row 1 first: while another
    transaction holds that row, the UPDATE waits for it.
    """
    with settings.engine.begin() as conn:
        conn.execute(text("CREATE TABLE test_blocker (id INTEGER PRIMARY KEY, v INTEGER NOT NULL)"))
        conn.execute(text("CREATE TABLE test_weight (id INTEGER PRIMARY KEY)"))
        conn.execute(text("INSERT INTO test_blocker (id, v) VALUES (1, 0)"))
        if BACKEND == "postgres":
            conn.execute(
                text(
                    "CREATE OR REPLACE FUNCTION test_wait_for_blocker() RETURNS trigger AS $$ BEGIN "
                    # The scheduler's deadlock check comes 3 s into its wait (see SCHEDULER_DEADLOCK_TIMEOUT).
                    + SCHEDULER_DEADLOCK_TIMEOUT
                    + "UPDATE test_blocker SET v = v + 1 WHERE id = 1; RETURN NEW; END $$ LANGUAGE plpgsql"
                )
            )
            conn.execute(
                text(
                    "CREATE TRIGGER test_wait_for_blocker BEFORE UPDATE ON task_instance FOR EACH ROW "
                    f"WHEN (OLD.task_id = '{task_id}') EXECUTE FUNCTION test_wait_for_blocker()"
                )
            )
        else:
            conn.execute(
                text(
                    "CREATE TRIGGER test_wait_for_blocker BEFORE UPDATE ON task_instance FOR EACH ROW "
                    f"BEGIN IF OLD.task_id = '{task_id}' THEN "
                    "UPDATE test_blocker SET v = v + 1 WHERE id = 1; END IF; END"
                )
            )
    try:
        yield
    finally:
        with settings.engine.begin() as conn:
            if BACKEND == "postgres":
                conn.execute(text("DROP TRIGGER IF EXISTS test_wait_for_blocker ON task_instance"))
                conn.execute(text("DROP FUNCTION IF EXISTS test_wait_for_blocker()"))
            else:
                conn.execute(text("DROP TRIGGER IF EXISTS test_wait_for_blocker"))
            conn.execute(text("DROP TABLE IF EXISTS test_blocker"))
            conn.execute(text("DROP TABLE IF EXISTS test_weight"))


def deadlock_the_scheduler(other_session, callback_key: CallbackKey) -> None:
    """
    With the test's transaction holding ``test_blocker`` row 1 and the scheduler waiting for it (in
    the trigger on its UPDATE of the DEADLOCK task instance), update the callback row the scheduler
    has updated earlier in its transaction: a wait cycle, which the database breaks by aborting one
    side. The test's transaction inserted many rows first, so InnoDB (which aborts the transaction
    that changed fewer rows) picks the scheduler. The test's transaction is rolled back at the end.
    """
    wait_until(lambda: lock_waiters() >= 1, "the scheduler waits for test_blocker row 1")
    other_session.execute(
        update(Callback).where(Callback.id == callback_key_uuid(callback_key)).values(output="test")
    )
    other_session.rollback()


# Series v3 takes no savepoint before its executor-event patch: postgres is vulnerable there too.
@pytest.mark.proves(P_KEEP, base_ok_on=() if series.V3 else ("postgres",))
def test_deadlock_that_ends_the_whole_transaction_puts_back_every_event_of_it(
    dag_maker, session, other_session, scheduler_job_runner, backend
):
    """
    A real deadlock inside one event's savepoint. MySQL/MariaDB (InnoDB) roll back the whole
    transaction, savepoint and all: every event taken out of the buffer in that transaction (here
    the callback-key event, whose update was flushed before) must be back in the buffer, not
    silently lost while the session carries on. PostgreSQL aborts only the savepoint: there the
    earlier events' effects stay and are committed (the base is not vulnerable there).
    """
    if backend == "sqlite":
        pytest.skip("sqlite: no row locks, no deadlock")
    if not HAS_CALLBACK_EVENTS:
        pytest.skip(
            f"{airflow.__version__}: no callback-key events, whose UPDATE (always handled first in a batch) is the "
            "scheduler's write this deadlock needs before the failing event; the task instances of a "
            "batch come in no fixed order"
        )
    runner = scheduler_job_runner
    executor = runner.executor
    (ti,) = make_running_tis(
        dag_maker, session, dag_id="deadlock", task_ids=(DEADLOCK,), queued_by_job_id=runner.job.id
    )
    # 3.4, PostgreSQL: the event of the savepoint rolled back is put back under the try's id (put_back_key)
    ti_put_back = {ti.key, put_back_key(ti.key, ti.id)}
    callback_key = make_queued_callback(session)
    events = {
        callback_key: (CallbackState.SUCCESS, None),
        ti.key: (TaskInstanceState.FAILED, None),
    }
    executor.event_buffer.update(events)
    session.expunge_all()
    session.close()

    def one_pass():
        try:
            if series.V3:  # the scheduler loop's own transaction puts back what a failed one took
                executor_events_step(runner)
                return
            s = settings.Session()
            runner._process_executor_events(executor=executor, session=s)
            s.commit()
        finally:
            settings.Session.remove()

    with updates_of_wait_for_blocker(DEADLOCK):
        if backend == "postgres":
            other_session.execute(text(TEST_DEADLOCK_TIMEOUT))
        other_session.execute(
            text("INSERT INTO test_weight (id) VALUES " + ", ".join(f"({i})" for i in range(1, 501)))
        )
        other_session.execute(text("UPDATE test_blocker SET v = v + 1 WHERE id = 1"))
        scheduler = Worker(one_pass, name="scheduler")
        scheduler.start()
        try:
            deadlock_the_scheduler(other_session, callback_key)
        finally:
            other_session.rollback()
            scheduler.join_or_fail()
    assert scheduler.error is None, f"the scheduler step raised {scheduler.error!r}"

    callback_state = committed_callback_state(callback_key)
    ti_state = committed_ti("deadlock", DEADLOCK)[0]
    # Every event: applied and committed, or back in the buffer.
    assert callback_state == CallbackState.SUCCESS or callback_key in executor.event_buffer, (
        f"callback event lost: committed state {callback_state}, buffer {executor.event_buffer}"
    )
    assert ti_state == TaskInstanceState.UP_FOR_RETRY or ti_put_back & set(executor.event_buffer), (
        f"FAILED event lost: committed state {ti_state}, buffer {executor.event_buffer}"
    )
    # And the next pass applies what was put back.
    one_pass()
    assert committed_callback_state(callback_key) == CallbackState.SUCCESS
    assert committed_ti("deadlock", DEADLOCK)[0] == TaskInstanceState.UP_FOR_RETRY
    assert executor.event_buffer == {}


def second_executor(runner):
    """
    A second executor of ``runner``, wired like the fixture's first one (a scheduler configured with
    two executors): ``_process_executor_events_of_all_executors`` handles its events after all of the
    first executor's, in the same transaction.
    """
    from airflow.callbacks.database_callback_sink import DatabaseCallbackSink
    from airflow.executors.executor_utils import ExecutorName

    from tests.unit.harness.scheduler import RecordingExecutor

    executor = RecordingExecutor()
    executor.name = ExecutorName(
        module_path=f"{RecordingExecutor.__module__}.RecordingExecutor", alias="second"
    )
    executor.job_id = runner.job.id
    executor.callback_sink = DatabaseCallbackSink()
    executor.start()
    runner.executors.append(executor)
    return executor


@pytest.mark.proves(P_KEEP)
# Series v3 commits the loop's executor events once: its 1st COMMIT is the batch's own (no failure handling
# commits mid-batch); the v2 queues commit each failure handling, then the batch.
@pytest.mark.parametrize("killed_commit", [1] if series.V3 else [1, 2, 4])
def test_accounting_over_one_batch_with_injected_faults(
    dag_maker, session, other_session, scheduler_job_runner, backend, killed_commit
):
    """
    One batch of 13 events: in the first executor's buffer 2 callback-key events, 4 QUEUED events,
    3 FAILED events handled as externally killed (their failure handling commits mid-batch), 1
    FAILED event whose UPDATE the database rejects (flush error) and 1 QUEUED event of a row another
    transaction holds locked (postgres: skipped by SKIP LOCKED); in a second executor's buffer 2
    QUEUED events, handled after all of the first's, in the same transaction. The connection is
    ended before the ``killed_commit``-th COMMIT of the pass: 1 and 2 are commits of failure
    handling mid-batch, 4 is the batch's own (three failure handlings commit before it). After each
    scheduler pass, for every event: its effect is committed, or it is in its executor's buffer,
    never both, never neither (events in = applied + still buffered).

    The batch's read has no ORDER BY, so the database may return a FAILED event's task instance
    last (seen once on postgres); the second executor's events keep the batch's own COMMIT (the 4th)
    in the batch whatever that order. Without them, the batch's transaction was then empty after the
    last failure handling's commit, made no COMMIT of its own, and the 4th COMMIT of the pass was the
    deadline check's, outside the executor events: the scheduler loop raised.
    """
    from tests.unit.harness.db import dialect_locks_rows

    if backend == "sqlite":
        pytest.skip("sqlite: a server session that another connection can end does not exist there")
    runner = scheduler_job_runner
    executor = runner.executor
    second = second_executor(runner)
    queued = ("q1", "q2", "q3", "q4")
    failed = ("f1", "f2", "f3")
    of_second = ("s1", "s2")
    tis = make_running_tis(
        dag_maker,
        session,
        dag_id="accounting",
        task_ids=(*queued, *failed, POISON, "locked", *of_second),
        queued_by_job_id=runner.job.id,
    )
    by_task = {ti.task_id: ti for ti in tis}
    callbacks = [make_queued_callback(session) for _ in range(2)] if HAS_CALLBACK_EVENTS else []
    events: dict = {c: (CallbackState.SUCCESS, None) for c in callbacks}
    for t in (*queued, "locked", *of_second):
        events[by_task[t].key] = (TaskInstanceState.QUEUED, f"external-{t}")
    for t in (*failed, POISON):
        events[by_task[t].key] = (TaskInstanceState.FAILED, None)
    locked_id = by_task["locked"].id
    task_of = {by_task[t].key: t for t in by_task}
    # 3.4: an event put back by the batch is under the try's id (put_back_key)
    put_back = {by_task[t].key: put_back_key(by_task[t].key, by_task[t].id) for t in by_task}
    buffer_of = {k: second if task_of.get(k) in of_second else executor for k in events}
    for k, value in events.items():
        buffer_of[k].event_buffer[k] = value
    runner.num_runs = 1  # each pass: one pass of the real scheduler loop
    session.expunge_all()
    session.close()

    def applied(key) -> bool:
        if isinstance(key, CallbackKey):
            return committed_callback_state(key) == CallbackState.SUCCESS
        task_id = task_of[key]
        state, external_id = committed_ti("accounting", task_id)
        if events[key][0] == TaskInstanceState.QUEUED:
            return external_id == f"external-{task_id}"
        # The failure of try 1 is recorded (the loop's scheduling may have moved the retry on since).
        return 1 in read_rows("accounting", task_id, key.run_id).history_tries

    def account(after: str) -> tuple[set, set]:
        done = {k for k in events if applied(k)}
        buffered = {k for k in events if {k, put_back.get(k)} & set(buffer_of[k].event_buffer)}
        assert not done & buffered, f"{after}: applied and still buffered: {done & buffered}"
        lost = set(events) - done - buffered
        assert not lost, f"{after}: neither applied nor buffered (lost): {lost}"
        return done, buffered

    holds_lock = dialect_locks_rows(session)
    with reject_updates_of(POISON):
        if holds_lock:
            other_session.execute(
                select(TaskInstance.id).where(TaskInstance.id == locked_id).with_for_update()
            )
        killer = KillConnectionAtCommit(armed_by=FIRST_BATCH_UPDATE, commit_number=killed_commit)
        try:
            runner._run_scheduler_loop()
        except Exception as e:
            pytest.fail(f"the scheduler loop raised {e!r}: the scheduler would exit")
        finally:
            killer.remove()
            other_session.rollback()
        assert killer.fired, f"the pass made fewer than {killed_commit} commits"
        done, buffered = account("pass 1 (faults: flush error, lost connection at a commit, skipped lock)")
        if killed_commit == 4:
            # The second executor's events were taken in the batch's last transaction: it was the
            # batch's own COMMIT that failed, not a later one of the pass.
            assert {by_task[t].key for t in of_second} <= buffered, "the batch's own COMMIT did not fail"

        runner._run_scheduler_loop()
        done, buffered = account("pass 2 (flush error only)")
    assert buffered == {by_task[POISON].key}
    assert done == set(events) - buffered


@pytest.mark.skipif(
    series.V3 and BACKEND == "sqlite",
    reason="series v3 puts back the events of a rolled-back batch in the scheduler loop's own transaction (_process_events_of_executors), not in _process_executor_events",
)
@pytest.mark.proves(P_KEEP)
def test_sqlite_rollback_of_the_batch_puts_back_the_events_taken_in_it(
    dag_maker, session, scheduler_job_runner, backend
):
    """
    SQLite has no savepoint per event in this series: the rejected UPDATE of one task instance rolls
    back the batch's whole transaction, with the callback-key and QUEUED events' effects. Those
    events must then be back in the buffer, and the next pass (without the fault) applies them.
    """
    if backend != "sqlite":
        pytest.skip(
            f"{backend}: one savepoint per event, the rest of the batch is kept "
            "(test_flush_error_undoes_only_the_failing_event)"
        )
    if airflow.__version__.startswith("3.2."):
        pytest.skip(
            "3.2.x on SQLite cannot apply a callback's executor event: session.get(Callback, key) with the "
            "str key its executors send fails in SQLAlchemy's Uuid bind (no native UUID column; fixed "
            "upstream in 3.3, which converts the key to a UUID)"
        )
    runner = scheduler_job_runner
    executor = runner.executor
    # The QUEUED event must be taken before the failing one. A callback-key event always is; without
    # those (3.1.x), the batch's task instances come in the order of SQLite's plan for the batch's read
    # (no ORDER BY), which follows task_id here: "early" sorts before POISON, "queued" does not.
    q = "queued" if HAS_CALLBACK_EVENTS else "early"
    by_task, callback_key = queued_and_poison_with_a_callback(
        dag_maker, session, runner, "sqlite_rollback", queued=q
    )
    events = {
        by_task[q].key: (TaskInstanceState.QUEUED, "external-id-1"),
        by_task[POISON].key: (TaskInstanceState.FAILED, None),
    }
    if callback_key is not None:
        events = {callback_key: (CallbackState.SUCCESS, None), **events}
    executor.event_buffer.update(events)
    session.expunge_all()

    with reject_updates_of(POISON):
        runner._process_executor_events(executor=executor, session=session)
        session.commit()
    queued_applied = committed_ti("sqlite_rollback", q)[1] == "external-id-1"
    if callback_key is not None:
        callback_applied = committed_callback_state(callback_key) == CallbackState.SUCCESS
        assert callback_applied or callback_key in executor.event_buffer, "callback event lost"
    assert queued_applied or by_task[q].key in executor.event_buffer, "QUEUED event lost"
    assert by_task[POISON].key in executor.event_buffer

    runner._process_executor_events(executor=executor, session=session)
    session.commit()
    if callback_key is not None:
        assert committed_callback_state(callback_key) == CallbackState.SUCCESS
    assert committed_ti("sqlite_rollback", q) == (TaskInstanceState.RUNNING, "external-id-1")
    assert committed_ti("sqlite_rollback", POISON)[0] == TaskInstanceState.UP_FOR_RETRY
    assert executor.event_buffer == {}


class EndConnectionAtStatement:
    """End this thread's server connection right before its first ``pattern`` statement after ``after``."""

    def __init__(self, pattern: str, after: str):
        import re

        self.pattern = re.compile(pattern, re.IGNORECASE | re.DOTALL)
        self.after = re.compile(after, re.IGNORECASE | re.DOTALL)
        self.thread = threading.current_thread()
        self.armed = self.fired = False

    def __enter__(self):
        from sqlalchemy import event

        event.listen(settings.engine, "before_cursor_execute", self._before)
        return self

    def __exit__(self, *exc):
        from sqlalchemy import event

        event.remove(settings.engine, "before_cursor_execute", self._before)

    def _before(self, conn, cursor, statement, parameters, context, executemany):
        if self.fired or threading.current_thread() is not self.thread:
            return
        self.armed = self.armed or bool(self.after.search(statement))
        if not self.armed or not self.pattern.search(statement):
            return
        self.fired = True
        end_server_session(conn)


@pytest.mark.proves(P_KEEP)
def test_connection_lost_at_the_batch_locking_read_puts_back_every_event(
    dag_maker, session, scheduler_job_runner, backend
):
    """
    The connection is lost at the batch's read, before any event of a task instance was taken (found by
    review): those events are put back too, and handled again, each in a transaction of its own.
    """
    if backend == "sqlite":
        pytest.skip("sqlite: no server connection to end")
    runner = scheduler_job_runner
    executor = runner.executor
    tis = make_running_tis(
        dag_maker, session, dag_id="conn_lost", task_ids=("a", "b"), queued_by_job_id=runner.job.id
    )
    events = {
        tis[0].key: (TaskInstanceState.QUEUED, "external-a"),
        tis[1].key: (TaskInstanceState.RUNNING, "external-b"),
    }
    callback_key = make_queued_callback(session) if HAS_CALLBACK_EVENTS else None
    if callback_key is not None:
        events = {callback_key: (CallbackState.SUCCESS, None), **events}
    executor.event_buffer.update(events)
    session.expunge_all()
    session.close()
    runner.num_runs = 1
    # The batch's read of its task instances (locking where with_row_locks emits a lock), right after
    # the callback events were applied; 3.1.x has none: its read by the events' task ids (filter_for_tis).
    if HAS_CALLBACK_EVENTS:
        read, after = r"^\s*SELECT .*FROM task_instance", r"FROM callback\s+WHERE callback.id"
    else:
        read, after = r"^\s*SELECT .*FROM task_instance\b.*\btask_instance\.task_id IN", r""
    with EndConnectionAtStatement(read, after=after) as ended:
        runner._run_scheduler_loop()
    assert ended.fired
    if callback_key is not None:
        assert committed_callback_state(callback_key) == CallbackState.SUCCESS
    assert committed_ti("conn_lost", "a") == (TaskInstanceState.RUNNING, "external-a")
    assert committed_ti("conn_lost", "b") == (TaskInstanceState.RUNNING, "external-b")
    assert executor.event_buffer == {}, "events taken out of the buffer were lost"


@pytest.mark.proves(P_KEEP)
def test_connection_lost_in_the_dag_lookup_of_an_event_does_not_stop_the_scheduler(
    dag_maker, session, scheduler_job_runner, backend
):
    """
    The connection is lost while a FAILED event's handling reads the serialized DAG (found by review).
    Upstream's ``except Exception`` around that read swallows the error and the event's handling goes on:
    the session's next use raises ``PendingRollbackError``, not a ``DBAPIError``. Before: it left the
    scheduler loop. Now the step rolls back and handles the events again, one per transaction.
    """
    if backend == "sqlite":
        pytest.skip("sqlite: no server connection to end")
    from airflow.models.dagbag import DBDagBag

    runner = scheduler_job_runner
    runner.scheduler_dag_bag = DBDagBag()  # nothing cached: the event's handling reads the DAG
    executor = runner.executor
    failed, queued = make_running_tis(
        dag_maker,
        session,
        dag_id="lookup_lost",
        task_ids=("failed", "queued"),
        queued_by_job_id=runner.job.id,
    )
    executor.event_buffer[failed.key] = (TaskInstanceState.FAILED, None)
    executor.event_buffer[queued.key] = (TaskInstanceState.QUEUED, "external-q")
    session.expunge_all()
    session.close()

    with EndConnectionAtStatement(r"\bFROM serialized_dag\b", after=r"") as ended:
        try:
            executor_events_step(runner)
        except Exception as e:
            pytest.fail(f"the executor-event step raised {e!r}: the scheduler loop would exit")
    assert ended.fired, "the DAG lookup was not reached"
    assert committed_ti("lookup_lost", "failed")[0] == TaskInstanceState.UP_FOR_RETRY
    assert committed_ti("lookup_lost", "queued") == (TaskInstanceState.RUNNING, "external-q")
    assert executor.event_buffer == {}


@pytest.mark.proves(P_POISON)
def test_given_up_event_stays_dropped_when_its_transaction_rolls_back(
    dag_maker, session, scheduler_job_runner, backend
):
    """Given up once, never put back by the rollback of the transaction it was taken in (found by review)."""
    if backend == "sqlite":
        pytest.skip(NO_SAVEPOINT_ON_SQLITE)
    from airflow.jobs import scheduler_job_runner as sjr

    runner = scheduler_job_runner
    executor = runner.executor
    (ti,) = make_running_tis(
        dag_maker, session, dag_id="given_up", task_ids=(POISON,), queued_by_job_id=runner.job.id
    )
    executor.event_buffer[ti.key] = (TaskInstanceState.FAILED, None)
    session.expunge_all()
    with reject_updates_of(POISON):
        for _ in range(sjr.EXECUTOR_EVENT_MAX_DB_FAILURES - 1):
            runner._process_executor_events(executor=executor, session=session)
            session.commit()
        runner._process_executor_events(executor=executor, session=session)
        assert executor.event_buffer == {}, "not given up after the bound"
        session.rollback()  # the batch's COMMIT failed, or a later event ended the whole transaction
    assert executor.event_buffer == {}, "the given-up event came back with a fresh failure count"


@pytest.mark.proves(P_KEEP)
@pytest.mark.backend("postgres", "mysql")
@pytest.mark.skipif(
    series.V3,
    reason="series v3 commits nothing before the batch ends, so no other transaction can lock a batch row "
    "mid-batch on PostgreSQL / MySQL 8 (rows held before the batch's read: "
    "test_events_of_rows_skipped_by_skip_locked_are_kept); with_row_locks takes no lock on MariaDB / SQLite",
)
@pytest.mark.skipif(
    airflow.__version__.startswith("3.1."),
    reason=f"the {airflow.__version__} queue keeps the earlier shape of this patch: its failure handling waits "
    "for the row lock (the issue-17 change, 2026-12-01, is not ported to it yet)",
)
def test_event_of_a_row_another_transaction_holds_is_kept_without_waiting(
    dag_maker, session, other_session, scheduler_job_runner
):
    """
    Two FAILED events in one batch. Once the first event's failure handling has committed (the
    batch's row locks are released), another transaction (an execution-API state update in flight)
    locks the second task instance's row and keeps it. Failure handling does not wait for it: the
    batch ends, the second event is back in the buffer and nothing is written for it; the next
    loop, after the other transaction ended, fails it. Before: failure handling waited for the row
    lock, so the scheduler stalled behind every in-flight API request of its batch.
    """
    from sqlalchemy import event

    runner = scheduler_job_runner
    executor = runner.executor
    keys = {}
    for name in ("a", "b"):
        (ti,) = make_running_tis(
            dag_maker, session, dag_id=f"locked_row_{name}", task_ids=("t",), queued_by_job_id=runner.job.id
        )
        executor.event_buffer[ti.key] = (TaskInstanceState.FAILED, None)
        keys[ti.dag_id] = ti.key
    session.expunge_all()
    session.close()
    held: list[str] = []

    def api_locks_the_other(s) -> None:
        # After the first event's commit (a savepoint release fires after_commit too: not that).
        if held or s.get_nested_transaction() is not None:
            return
        (victim,) = other_session.scalars(
            select(TaskInstance.dag_id).where(
                TaskInstance.dag_id.in_(keys), TaskInstance.state == TaskInstanceState.RUNNING
            )
        )
        other_session.execute(select(TaskInstance.id).where(TaskInstance.dag_id == victim).with_for_update())
        held.append(victim)

    def one_pass() -> None:
        s = settings.Session()
        event.listen(s, "after_commit", api_locks_the_other)
        try:
            runner._process_executor_events(executor=executor, session=s)
            s.commit()
        finally:
            event.remove(s, "after_commit", api_locks_the_other)
            settings.Session.remove()

    scheduler = Worker(one_pass, name="scheduler")
    scheduler.start()
    try:
        wait_until(
            lambda: scheduler.done.is_set() or lock_waiters() > 0,
            "the batch ends or waits for the row lock",
        )
        waited = not scheduler.done.is_set()
    finally:
        other_session.rollback()  # the other transaction ends: its row lock is released
        scheduler.join_or_fail()
    assert scheduler.error is None, f"the batch raised {scheduler.error!r}"
    assert held, "no commit happened in the batch"
    assert not waited, "failure handling waited for the row lock another transaction holds"
    (victim,) = held
    assert list(executor.event_buffer) == [keys[victim]]
    assert read_rows(victim, "t", keys[victim].run_id).state == TaskInstanceState.RUNNING

    with settings.Session() as s:
        runner._process_executor_events(executor=executor, session=s)
        s.commit()
    settings.Session.remove()
    assert executor.event_buffer == {}
    assert read_rows(victim, "t", keys[victim].run_id).state == TaskInstanceState.UP_FOR_RETRY
