# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
Retry preparation of a task instance racing the execution API's reschedule (upstream #71923).

For a RUNNING, retry-eligible TI, failure handling (``TaskInstance.handle_failure``, reached from
the scheduler's ``_process_executor_events``) records try history, deletes the TI's
``task_reschedule`` rows, gives the TI a new ``id``, calls the ``on_task_instance_failed``
listeners, flushes and commits. The execution API's ``ti_update_state`` with a
``TIRescheduleStatePayload`` (``SELECT ... FOR UPDATE`` on the TI, INSERT ``task_reschedule`` for
its id, state ``up_for_reschedule``, COMMIT) for the same TI must not make it fail.

Both writers are real: failure handling runs Airflow's code on ``settings.Session``; the API is
Airflow's execution API app in-process (``InProcessExecutionAPI``, JWT auth overridden by Airflow
itself), whose route runs on its own session and connection. Interleavings are forced with
:class:`ti_race.Pause` (a thread stops right after a given SQL statement, inside its open
transaction) and observed with :func:`ti_race.lock_waiters` (the server's lock-wait views);
every wait has a timeout.

A consistent end state is one of:

* the reschedule won: the TI keeps its id, is ``up_for_reschedule``, has its ``task_reschedule``
  row, no try history was recorded, the API answered 204;
* the failure won: the TI has a new id, is ``up_for_retry``, one try-history row (try 1), no
  ``task_reschedule`` row for either id, and the API answered 404 (the id it asked for is gone).

Backends: "mysql" is MariaDB 10.11 here, at READ COMMITTED like Airflow runs MySQL. MySQL 8 was not
available; its InnoDB locking reads behave like MariaDB's for these statements.
"""

from __future__ import annotations

import logging
import sqlite3

import pytest
from packaging.version import Version
from sqlalchemy import select, text

from airflow import __version__ as airflow_version, settings
from airflow.listeners import hookimpl
from airflow.models.taskinstance import TaskInstance, clear_task_instances
from airflow.utils.session import create_session
from airflow.utils.state import TaskInstanceState

from tests.unit.harness import env, series
from tests.unit.ti_race import (
    WAIT,
    Pause,
    Worker,
    lock_waiters,
    make_running_tis,
    read_rows,
    wait_until,
)

ON_3_4 = Version(airflow_version).release >= (3, 4)
# 3.4's queue has series v3 only: its name of the row-lock patch, which the export matches (docs/3.4.md).
P_ROW_LOCK = "Lock-the-task-instance-row-when-handling-its-failure.patch"
P1 = P_ROW_LOCK if ON_3_4 else "Delete-task-reschedules-of-a-retried-TI-right-before-its-id-changes.patch"
P2 = P_ROW_LOCK if ON_3_4 else "Serialise-TI-failure-handling-with-the-execution-API-via-the-row-lock.patch"
P3 = "Call-on_task_instance_failed-listeners-after-the-failure-is-committed.patch"
P3_V3 = "Fail-a-task-instance-in-the-caller-s-transaction.patch"  # series v3: the caller owns the transaction

pytestmark = pytest.mark.db_test

# SQL the two writers run; the pauses are placed after these statements.
API_INSERTS_RESCHEDULE = r"^\s*INSERT INTO task_reschedule\b"
READS_TRY_HISTORY = r"\bFROM task_instance_history\b"  # record_ti(), just before the delete + new id
# The API's answer to a request for a try the failure won: 404; 3.4 answers 410 Gone for an archived try.
REFUSED = (404, 410) if hasattr(TaskInstance, "working_set") else (404,)
# 3.4 has no history table: its retry preparation starts with archive()'s locking read of the try.
if hasattr(TaskInstance, "working_set"):
    READS_TRY_HISTORY = r"^\s*SELECT task_instance\.working_set, task_instance\.state\b.*\bFOR UPDATE"
SCHEDULER_READS_BATCH = r"^\s*SELECT\b.*\bFROM task_instance\b"  # _process_executor_events' batch query


class CallListener:
    """An ``on_task_instance_failed`` listener that runs ``action`` (once) and records its calls."""

    def __init__(self, action=None):
        self.action = action
        self.calls: list[dict] = []

    @hookimpl
    def on_task_instance_failed(self, previous_state, task_instance, error):
        self.calls.append({"previous_state": previous_state, "task_instance": task_instance, "error": error})
        if self.action is not None and len(self.calls) == 1:
            self.action()


def reschedule_during_listener(api, ti_id) -> tuple[CallListener, list[Worker]]:
    """
    An ``on_task_instance_failed`` listener whose first call starts the execution API's reschedule
    of ``ti_id`` and returns once that call has committed or waits for the TI row lock (bounded).
    Returns the listener and the list the API call (a ``Worker``) is appended to.
    """
    calls: list[Worker] = []

    def reschedule_while_listener_runs():
        worker = api.reschedule_in_thread(ti_id)
        calls.append(worker)
        wait_until(
            lambda: worker.done.is_set() or lock_waiters() > 0,
            "the API's reschedule committed or waits for the TI row lock",
        )

    return CallListener(reschedule_while_listener_runs), calls


@pytest.fixture
def pauses():
    made: list[Pause] = []

    def make(*args, **kwargs) -> Pause:
        pause = Pause(*args, **kwargs)
        made.append(pause)
        return pause

    yield make
    for pause in made:
        pause.remove()


def skip_where_v3_takes_no_row_lock(session) -> None:
    """Series v3 locks the row with ``with_row_locks``, which emits no lock on MariaDB: say so, do not hide it."""
    from tests.unit.harness.series import V3
    from tests.unit.harness.db import dialect_locks_rows

    if V3 and not dialect_locks_rows(session):
        pytest.skip(
            "series v3 takes the task instance row lock with Airflow's with_row_locks, which emits no "
            "FOR UPDATE on MariaDB (Airflow does not support MariaDB; MySQL 8 gets the lock): the race is open here"
        )


def _key(ti: TaskInstance) -> tuple[str, str, str, int]:
    return ti.dag_id, ti.task_id, ti.run_id, ti.map_index


def assert_consistent(rows, old_id, api_status: int) -> str:
    """Assert one of the two consistent outcomes (module docstring); return which one."""
    if rows.state == TaskInstanceState.UP_FOR_RESCHEDULE:
        assert rows.ti_id == old_id, rows
        assert rows.reschedule_ti_ids == [old_id], rows
        assert rows.history_tries == [], rows
        assert api_status == 204, (api_status, rows)
        return "reschedule won"
    assert rows.state == TaskInstanceState.UP_FOR_RETRY, rows
    assert rows.ti_id != old_id, rows
    assert rows.history_tries == [1], rows
    assert rows.reschedule_ti_ids == [], rows
    assert api_status in REFUSED, (
        f"the API answered {api_status} and its reschedule of {old_id} was overwritten by the retry: {rows}"
    )
    return "failure won"


def run_in_scheduler_thread(fn, name="failure-handling") -> Worker:
    """Run ``fn(session)`` on the new thread's own ``settings.Session`` (own connection); removed after."""

    def target():
        session = settings.Session()
        try:
            return fn(session)
        finally:
            session.rollback()
            settings.Session.remove()

    return Worker(target, name=name)


def handle_failure_of(key, task):
    def fn(session):
        dag_id, task_id, run_id, map_index = key
        ti = session.scalars(
            select(TaskInstance).where(
                TaskInstance.dag_id == dag_id,
                TaskInstance.task_id == task_id,
                TaskInstance.run_id == run_id,
                TaskInstance.map_index == map_index,
            )
        ).one()
        ti.task = task
        ti.handle_failure("task failed (test)", session=session)
        session.commit()  # the caller owns the transaction

    return fn


# ---------------------------------------------------------------------------------------------
# Patch 1: the task_reschedule delete and the id change are flushed together
# ---------------------------------------------------------------------------------------------
@pytest.mark.proves(P1)
@pytest.mark.backend("postgres", "mysql")
def test_reschedule_committed_while_failure_listener_runs(dag_maker, session, listener_manager, api):
    """
    The reported race: the API's reschedule arrives while an ``on_task_instance_failed`` listener runs.

    On 3.3.2 the API commits its task_reschedule row for the old id during the listener and the
    flush fails: postgres ``ForeignKeyViolation ... task_reschedule_ti_fkey``, MariaDB/MySQL
    ``(1451, 'Cannot delete or update a parent row ...')``. With the delete and the new id flushed
    before the listeners run, the API's locking read waits for the updated row and then finds no
    task instance with the old id: 404, the failure won.
    """
    skip_where_v3_takes_no_row_lock(session)
    (ti,) = make_running_tis(dag_maker, session, dag_id="listener_race")
    old_id = ti.id
    listener, calls = reschedule_during_listener(api, old_id)
    listener_manager(listener)

    error = None
    try:
        ti.handle_failure("task failed (test)", session=session)
        session.commit()  # the caller owns the transaction
    except Exception as e:  # the base raises the FK IntegrityError here
        error = e
        session.rollback()
    status = calls[0].join_or_fail() if calls else None
    assert error is None, f"failure handling raised {error!r}"
    assert len(listener.calls) == 1
    assert assert_consistent(read_rows(*_key(ti)), old_id, status) == "failure won"


# ---------------------------------------------------------------------------------------------
# Patch 2: the two writers are serialised by the TI row lock
# ---------------------------------------------------------------------------------------------
@pytest.mark.proves(P2)
@pytest.mark.backend("postgres", "mysql")
def test_api_takes_row_lock_first(dag_maker, session, listener_manager, api, pauses):
    """
    Lock order 1: the API holds the TI row lock, with its task_reschedule row written, uncommitted;
    then failure handling starts. It must wait for the API's commit and then see
    ``up_for_reschedule``: keep the id, not overwrite the state (the reschedule won).

    On 3.3.2 it does not wait before the UPDATE of the id, which then fails on the committed
    task_reschedule row (postgres: ForeignKeyViolation); on MariaDB its DELETE waits for the API's
    row instead and deletes it after the commit, overwriting the reschedule the API confirmed.
    """
    skip_where_v3_takes_no_row_lock(session)
    listener_manager(CallListener())
    (ti,) = make_running_tis(dag_maker, session, dag_id="api_first")
    old_id = ti.id
    failure = run_in_scheduler_thread(handle_failure_of(_key(ti), ti.task))
    api_paused = pauses(API_INSERTS_RESCHEDULE, not_thread=failure)

    api_call = api.reschedule_in_thread(old_id)
    assert api_paused.reached.wait(WAIT), "the API never wrote its task_reschedule row"

    failure.start()
    wait_until(
        lambda: failure.done.is_set() or lock_waiters() > 0, "failure handling waits for a row lock or ends"
    )
    api_paused.release()
    status = api_call.join_or_fail()
    failure.join_or_fail()

    assert failure.error is None, f"failure handling raised {failure.error!r}"
    assert status == 204
    assert assert_consistent(read_rows(*_key(ti)), old_id, status) == "reschedule won"


# 3.4: retry preparation starts with archive()'s FOR UPDATE of the row, so the API waits on the release already.
@pytest.mark.proves(P2, base_ok_on=("postgres",) if ON_3_4 else ())
@pytest.mark.backend("postgres", "mysql")
def test_failure_handling_takes_row_lock_first(dag_maker, session, listener_manager, api, pauses):
    """
    Lock order 2: failure handling has started retry preparation (it is about to delete and rotate
    the id) when the API's reschedule arrives. The API must wait for the row lock and then answer
    404; the failure won.

    On 3.3.2 nothing makes the API wait: it commits its reschedule (204), which failure handling
    then deletes and overwrites with up_for_retry.
    """
    skip_where_v3_takes_no_row_lock(session)
    listener_manager(CallListener())
    (ti,) = make_running_tis(dag_maker, session, dag_id="failure_first")
    old_id = ti.id
    failure = run_in_scheduler_thread(handle_failure_of(_key(ti), ti.task))
    paused = pauses(READS_TRY_HISTORY, thread=failure)

    failure.start()
    assert paused.reached.wait(WAIT), "failure handling never recorded try history"
    api_call = api.reschedule_in_thread(old_id)
    wait_until(lambda: api_call.done.is_set() or lock_waiters() > 0, "the API waits for the row lock or ends")
    paused.release()
    failure.join_or_fail()
    status = api_call.join_or_fail()

    assert failure.error is None, f"failure handling raised {failure.error!r}"
    assert assert_consistent(read_rows(*_key(ti)), old_id, status) == "failure won"


@pytest.mark.skipif(
    series.V3,
    reason="series v3 has no SQLite write-lock patch: on SQLite the window between failure handling's re-read and its write stays open (README, known limitations)",
)
@pytest.mark.proves(P3)
@pytest.mark.backend("sqlite")
def test_sqlite_reschedule_while_failure_listener_runs(dag_maker, session, listener_manager, api):
    """
    The reported race on SQLite, which has no row locks: on 3.3.2 failure handling has already
    written (its task_reschedule DELETE) when the listener runs, so SQLite's database lock makes
    the API wait out its busy timeout and fail (``database is locked``); the scheduler survives.
    With the delete and the new id flushed before the listeners (and a FOR UPDATE that SQLite does
    not emit), the same holds: the API waits for the database lock the open transaction holds and
    answers 500. Only running the listeners after the commit makes the outcome consistent: the API
    gets 404.
    """
    (ti,) = make_running_tis(dag_maker, session, dag_id="sqlite_listener_race")
    old_id = ti.id
    calls: list[Worker] = []

    def reschedule_while_listener_runs():
        worker = api.reschedule_in_thread(old_id)
        calls.append(worker)
        worker.join_or_fail()

    listener = CallListener(reschedule_while_listener_runs)
    listener_manager(listener)
    ti.handle_failure("task failed (test)", session=session)

    api_call = calls[0]
    assert api_call.error is None, f"the API call raised {api_call.error!r}"
    assert assert_consistent(read_rows(*_key(ti)), old_id, api_call.result) == "failure won"


@pytest.mark.proves("Lock-task-instance-rows-before-clearing-them.patch" if series.V3 else P2)
@pytest.mark.backend("postgres", "mysql")
def test_clearing_running_sensor_while_reschedule_in_flight(dag_maker, session, api, pauses):
    """
    Another caller of ``prepare_db_for_next_try``: clearing the TI of a running sensor
    (``clear_task_instances``: try history, delete, new id, ``restarting``) while the API holds the
    TI row lock with its task_reschedule row written. Clearing must wait, then clear the task
    instance as the API left it (up_for_reschedule, no longer running, so cleared to no state rather
    than ``restarting``): new id, no task_reschedule row, one history row, no error.

    On 3.3.2, postgres: the UPDATE of the id fails with ForeignKeyViolation on the API's committed
    row. MariaDB: clearing's early DELETE waits for the API's uncommitted row (InnoDB locks it),
    deletes it after the commit and then writes ``restarting``, decided from the state it read
    before the API's commit, over the committed ``up_for_reschedule``.
    """
    skip_where_v3_takes_no_row_lock(session)
    (ti,) = make_running_tis(dag_maker, session, dag_id="clear_race")
    old_id = ti.id
    key = _key(ti)

    def clear(s):
        dag_id, task_id, run_id, map_index = key
        tis = list(
            s.scalars(
                select(TaskInstance).where(TaskInstance.dag_id == dag_id, TaskInstance.run_id == run_id)
            )
        )
        clear_task_instances(tis, s)
        s.commit()

    clearing = run_in_scheduler_thread(clear, name="clear")
    api_paused = pauses(API_INSERTS_RESCHEDULE, not_thread=clearing)
    api_call = api.reschedule_in_thread(old_id)
    assert api_paused.reached.wait(WAIT), "the API never wrote its task_reschedule row"

    clearing.start()
    wait_until(lambda: clearing.done.is_set() or lock_waiters() > 0, "clearing waits for a row lock or ends")
    api_paused.release()
    status = api_call.join_or_fail()
    clearing.join_or_fail()

    assert clearing.error is None, f"clearing raised {clearing.error!r}"
    assert status == 204
    rows = read_rows(*key)
    assert rows.state is None, rows
    assert rows.ti_id != old_id, rows
    assert rows.reschedule_ti_ids == [], rows
    assert rows.history_tries == [1], rows


@pytest.mark.proves("Lock-task-instance-rows-before-clearing-them.patch")
def test_clearing_a_task_instance_whose_try_failed_after_it_was_read(dag_maker, session):
    """
    A clear (UI, API, ``dag.clear``) reads the task instance without a lock; the scheduler then fails the try
    for retry and commits, which gives the row a new id. The clear must clear the row as it is now. Found by
    review of series v3: locking and re-reading by the old id found nothing and the flush raised
    ``StaleDataError`` (on the release, too: it updates by the id it read).
    """
    (ti,) = make_running_tis(dag_maker, session, dag_id="clear_after_retry", retries=1)
    key = _key(ti)
    to_clear = list(session.scalars(select(TaskInstance).where(TaskInstance.dag_id == "clear_after_retry")))
    session.commit()
    with settings.NonScopedSession() as other:
        failing = other.get(TaskInstance, ti.id)
        failing.task = ti.task
        failing.handle_failure("killed (test)", session=other)
        other.commit()
        new_id = failing.id
    assert read_rows(*key).state == TaskInstanceState.UP_FOR_RETRY

    clear_task_instances(to_clear, session)
    session.commit()

    rows = read_rows(*key)
    assert rows.state is None, rows
    assert rows.ti_id not in (ti.id, new_id), rows
    assert rows.history_tries == [1], rows


@pytest.mark.proves("Lock-task-instance-rows-before-clearing-them.patch")
@pytest.mark.backend("postgres", "mysql")
@pytest.mark.skipif(not ON_3_4, reason="3.4's retry archives the try and inserts its successor as a new row")
def test_clearing_waits_for_a_retry_in_flight_and_clears_its_successor(dag_maker, session, pauses):
    """
    3.4: a clear reads the running try; the scheduler's failure handling has archived it and inserted the next
    try, not yet committed, when the clear starts. The clear must wait for the row lock and then clear the
    next try (``up_for_retry`` to no state, one archived try). On PostgreSQL the locking read that waited
    for the archived row returns no row (the successor is newer than its snapshot): the clear reads the key
    once more. Before (postgres): no error, the next try stayed ``up_for_retry``: the clear was lost.
    """
    skip_where_v3_takes_no_row_lock(session)
    (ti,) = make_running_tis(dag_maker, session, dag_id="clear_during_retry", retries=1)
    key = _key(ti)
    to_clear = list(session.scalars(select(TaskInstance).where(TaskInstance.dag_id == "clear_during_retry")))
    session.commit()

    failure = run_in_scheduler_thread(handle_failure_of(key, ti.task))
    paused = pauses(r"^\s*INSERT INTO task_instance\b", thread=failure)
    failure.start()
    assert paused.reached.wait(WAIT), "failure handling never inserted the next try"
    clearing = Worker(lambda: clear_task_instances(to_clear, session), name="clear")
    clearing.start()
    wait_until(lambda: clearing.done.is_set() or lock_waiters() > 0, "clearing waits for a row lock or ends")
    paused.release()
    failure.join_or_fail()
    clearing.join_or_fail()

    assert failure.error is None, f"failure handling raised {failure.error!r}"
    assert clearing.error is None, f"clearing raised {clearing.error!r}"
    session.commit()
    rows = read_rows(*key)
    assert rows.state is None, rows
    assert rows.ti_id != ti.id, rows
    assert rows.history_tries == [1], rows


# ---------------------------------------------------------------------------------------------
# Patch 2 through the real scheduler path: _process_executor_events
# ---------------------------------------------------------------------------------------------
def _running_ti_with_failed_event(dag_maker, session, runner, dag_id):
    (ti,) = make_running_tis(
        dag_maker,
        session,
        dag_id=dag_id,
        queued_by_job_id=runner.job.id,
        on_retry_callback=lambda context: None,
    )
    runner.executor.event_buffer[ti.key] = (TaskInstanceState.FAILED, None)
    session.expunge_all()
    return ti


# On SQLite and MariaDB (no row lock in v3) failure handling in the caller's transaction is what makes it pass.
# 3.4 passes it on every backend without a patch (docs/3.4.md): the row-lock patch's there, on no vulnerable backend.
@pytest.mark.proves(
    P2
    if env.BACKEND == "postgres" or not series.V3 or ON_3_4
    else "Fail-a-task-instance-in-the-caller-s-transaction.patch",
    base_ok_on=("postgres", "sqlite", "mysql") if ON_3_4 else ("postgres",),
)
def test_executor_event_while_reschedule_commits(
    dag_maker, session, listener_manager, api, pauses, scheduler_job_runner
):
    """
    The scheduler's path: a FAILED executor event for a running TI (task with on_retry_callback),
    processed by ``_process_executor_events``, while the API's reschedule of the TI commits after
    the scheduler read its batch of TIs and before it handles the failure.

    Vulnerable on the base (+ the callback-sink patch): MariaDB and SQLite, where the batch query
    locks nothing (``with_row_locks`` emits no FOR UPDATE there): failure handling overwrote the
    committed up_for_reschedule with up_for_retry, keeping the id and the reschedule row, after the
    API answered 204. Not on postgres, where the batch query's ``FOR NO KEY UPDATE SKIP LOCKED``
    lock (kept until failure handling commits) makes the API wait and answer 404. With the series
    none is: failure handling re-reads under its own lock and leaves the rescheduled TI alone.
    """
    runner = scheduler_job_runner
    listener_manager(CallListener())
    ti = _running_ti_with_failed_event(dag_maker, session, runner, "executor_event_race")
    old_id = ti.id

    def process(s):
        return runner._process_executor_events(executor=runner.executor, session=s)

    scheduler = run_in_scheduler_thread(process, name="scheduler")
    paused = pauses(SCHEDULER_READS_BATCH, thread=scheduler)
    scheduler.start()
    assert paused.reached.wait(WAIT), "the scheduler never read its batch of TIs"
    api_call = api.reschedule_in_thread(old_id)
    wait_until(lambda: api_call.done.is_set() or lock_waiters() > 0, "the API waits for the row lock or ends")
    paused.release()
    scheduler.join_or_fail()
    status = api_call.join_or_fail()

    assert scheduler.error is None, f"_process_executor_events raised {scheduler.error!r}"
    assert_consistent(read_rows(*_key(ti)), old_id, status)


# On MariaDB (no row lock in v3) the executor-event patch is what makes it pass.
@pytest.mark.proves(
    P1
    if env.BACKEND == "postgres" or not series.V3
    else "Keep-executor-events-until-their-effects-are-committed.patch",
    base_ok_on=("postgres",),
)
@pytest.mark.backend("postgres", "mysql")
def test_executor_event_while_failure_listener_runs(
    dag_maker, session, listener_manager, api, scheduler_job_runner
):
    """
    The production crash: ``_process_executor_events`` handles a FAILED event while a slow
    ``on_task_instance_failed`` listener runs and the API's reschedule for the TI arrives.

    On MariaDB (base + callback-sink patch) the API commits during the listener and the
    ``(1451, ... task_reschedule_ti_fkey ...)`` IntegrityError leaves ``_process_executor_events``
    (the scheduler exits). Postgres is not vulnerable on that base: the batch query's row lock,
    kept by the callback-sink patch, makes the API wait (404). With the delete and the new id
    flushed before the listener runs, the API waits for the updated row on MariaDB too (404).
    """
    runner = scheduler_job_runner
    ti = _running_ti_with_failed_event(dag_maker, session, runner, "executor_listener_race")
    old_id = ti.id
    listener, calls = reschedule_during_listener(api, old_id)
    listener_manager(listener)
    error = None
    session.commit()
    try:
        if hasattr(runner, "_process_events_of_executors"):  # the scheduler loop's own transaction
            runner._process_events_of_executors()
        else:
            with create_session() as s:
                runner._process_executor_events(executor=runner.executor, session=s)
    except Exception as e:  # the base raises the FK IntegrityError here
        error = e
    status = calls[0].join_or_fail() if calls else None
    assert error is None, f"_process_executor_events raised {error!r}"
    assert assert_consistent(read_rows(*_key(ti)), old_id, status) == "failure won"


# ---------------------------------------------------------------------------------------------
# Patch 3: on_task_instance_failed listeners run after the commit
# ---------------------------------------------------------------------------------------------
def _row_lock_free(key) -> bool:
    """Whether another connection can lock the TI row (or, on SQLite, the database) without waiting."""
    from tests.unit.harness.db import make_engine

    dag_id, task_id, run_id, map_index = key
    engine = make_engine()
    try:
        with engine.connect() as conn:
            if conn.dialect.name == "sqlite":
                raw = conn.connection.driver_connection
                raw.execute("PRAGMA busy_timeout = 0")
                try:
                    raw.execute("BEGIN IMMEDIATE")
                    raw.execute("ROLLBACK")
                    return True
                except sqlite3.OperationalError:
                    return False
            try:
                conn.execute(
                    select(TaskInstance.id)
                    .where(
                        TaskInstance.dag_id == dag_id,
                        TaskInstance.task_id == task_id,
                        TaskInstance.run_id == run_id,
                        TaskInstance.map_index == map_index,
                    )
                    .with_for_update(nowait=True)
                ).all()
                return True
            except Exception:
                return False
            finally:
                conn.rollback()
    finally:
        engine.dispose()


@pytest.mark.proves(P3_V3)
def test_failure_listener_runs_after_commit(dag_maker, session, listener_manager):
    """
    A caller that owns the transaction passes a ``callback_sink``: handle_failure queues the
    ``on_task_instance_failed`` call there and makes none. Made after the caller's commit, the call sees
    the failure committed (a second connection reads the new id and up_for_retry and can lock the row at
    once: NOWAIT; on SQLite, take the write lock), and the caller's session has no open transaction.
    """
    (ti,) = make_running_tis(dag_maker, session, dag_id="listener_after_commit")
    old_id = ti.id
    key = _key(ti)
    seen: dict = {}

    def look_from_outside():
        seen["rows"] = read_rows(*key)
        seen["lock_free"] = _row_lock_free(key)
        seen["in_transaction"] = session.in_transaction()

    listener = CallListener(look_from_outside)
    listener_manager(listener)
    calls: list = []
    ti.handle_failure("task failed (test)", session=session, callback_sink=calls)
    assert listener.calls == [], "listener called inside the caller's transaction"
    session.commit()
    session.close()
    for call in calls:
        call()

    assert len(listener.calls) == 1
    rows = seen["rows"]
    assert (rows.state, rows.ti_id != old_id) == (TaskInstanceState.UP_FOR_RETRY, True), rows
    assert seen["lock_free"], "the TI row was still locked while the listener ran"
    assert seen["in_transaction"] is False


@pytest.mark.proves(P3_V3)
def test_failure_listener_loads_through_a_session_of_its_own(dag_maker, session, listener_manager):
    """
    Called after the caller's session was closed, the listener still reads ``task_instance.dag_run``
    (lazy-loaded through a session of its own, not the caller's or the thread's scoped one), and what it
    changes on the task instance is not written.
    """
    (ti,) = make_running_tis(dag_maker, session, dag_id="listener_own_session")
    key = _key(ti)
    seen: dict = {}

    class Reader:
        @hookimpl
        def on_task_instance_failed(self, previous_state, task_instance, error):
            seen["run_id"] = task_instance.dag_run.run_id
            task_instance.state = TaskInstanceState.SUCCESS  # must not be written

    listener_manager(Reader())
    calls: list = []
    ti.handle_failure("task failed (test)", session=session, callback_sink=calls)
    session.commit()
    session.expire_all()  # dag_run must be loaded again, after the caller's session is closed
    session.close()
    for call in calls:
        call()
    assert seen["run_id"] == key[2]
    assert read_rows(*key).state == TaskInstanceState.UP_FOR_RETRY


@pytest.mark.skipif(
    series.V3,
    reason="v2 queues: listeners deferred by session hooks in model code; series v3 hands them to the caller (callback_sink)",
)
@pytest.mark.proves(P3)
def test_v2_failure_listener_runs_after_commit(dag_maker, session, listener_manager):
    """
    While an ``on_task_instance_failed`` listener blocks, the failure is committed: a second
    connection sees the new id and up_for_retry, and can lock the row at once (NOWAIT; on SQLite:
    take the write lock); the failing session has no open transaction.
    """
    (ti,) = make_running_tis(dag_maker, session, dag_id="listener_after_commit")
    old_id = ti.id
    key = _key(ti)
    seen: dict = {}

    def look_from_outside():
        seen["rows"] = read_rows(*key)
        seen["lock_free"] = _row_lock_free(key)
        seen["in_transaction"] = session.in_transaction()

    listener = CallListener(look_from_outside)
    listener_manager(listener)
    ti.handle_failure("task failed (test)", session=session)

    assert len(listener.calls) == 1
    rows = seen["rows"]
    assert (rows.state, rows.ti_id != old_id) == (TaskInstanceState.UP_FOR_RETRY, True), rows
    assert seen["lock_free"], "the TI row was still locked while the listener ran"
    assert seen["in_transaction"] is False


@pytest.mark.skipif(
    series.V3,
    reason="v2 queues: listeners deferred by session hooks in model code; series v3 hands them to the caller (callback_sink)",
)
@pytest.mark.proves(P3)
@pytest.mark.parametrize("outcome", ["commit", "rollback"])
def test_failure_listener_follows_callers_transaction(dag_maker, session, listener_manager, outcome):
    """
    A caller of ``fetch_handle_failure_context`` that owns the transaction: the listeners run after
    its commit, not before; after a rollback (the failure was never recorded) they do not run.
    """
    (ti,) = make_running_tis(dag_maker, session, dag_id=f"listener_{outcome}")
    listener = CallListener()
    listener_manager(listener)

    TaskInstance.fetch_handle_failure_context(ti, "task failed (test)", session=session)
    assert listener.calls == [], "listener called before the caller's transaction ended"
    getattr(session, outcome)()
    assert len(listener.calls) == (1 if outcome == "commit" else 0)
    # A later, unrelated transaction does not trigger them either.
    session.execute(text("SELECT 1"))
    session.commit()
    assert len(listener.calls) == (1 if outcome == "commit" else 0)


@pytest.mark.skipif(
    series.V3,
    reason="v2 queues: listeners deferred by session hooks in model code; series v3 hands them to the caller (callback_sink)",
)
@pytest.mark.backend(
    "postgres",
    "mysql",
    reason="pysqlite: a SAVEPOINT opened before the transaction's first write is released as a commit, "
    "so the outer rollback cannot undo the failure (the scheduler takes no savepoint on SQLite)",
)
@pytest.mark.skipif(
    series.V3,
    reason="v2 queues: listeners deferred by session hooks in model code; series v3 hands them to the caller (callback_sink)",
)
@pytest.mark.proves(P3)
@pytest.mark.parametrize("outcome", ["commit", "rollback"])
def test_failure_listener_in_released_savepoint_follows_outer_transaction(
    dag_maker, session, listener_manager, outcome
):
    """
    Failure handled inside a savepoint (as the scheduler does per executor event) that is released:
    the failure is durable only when the outer transaction commits, so the listeners run after
    that commit, and not at all if the outer transaction rolls back. SQLAlchemy fires
    ``after_commit`` on a savepoint release too; that alone must not dispatch them.
    """
    (ti,) = make_running_tis(dag_maker, session, dag_id=f"listener_savepoint_{outcome}")
    key = _key(ti)
    listener = CallListener()
    listener_manager(listener)

    savepoint = session.begin_nested()
    TaskInstance.fetch_handle_failure_context(ti, "task failed (test)", session=session)
    savepoint.commit()
    assert listener.calls == [], "listener called when the savepoint was released"
    getattr(session, outcome)()
    committed = read_rows(*key).state
    assert committed == (TaskInstanceState.UP_FOR_RETRY if outcome == "commit" else TaskInstanceState.RUNNING)
    assert len(listener.calls) == (1 if outcome == "commit" else 0)


@pytest.mark.skipif(
    series.V3,
    reason="v2 queues: listeners deferred by session hooks in model code; series v3 hands them to the caller (callback_sink)",
)
@pytest.mark.proves(P3)
def test_failure_listener_dropped_when_transaction_is_closed(dag_maker, session, listener_manager):
    """
    ``close()`` ends the transaction with a database rollback but fires no rollback event: the
    failure was never recorded, so the thread's (scoped, long-lived) session must not announce it
    at its next, unrelated commit. (Found by review; reached from ``create_session()`` when a
    ``KeyboardInterrupt``/``SystemExit`` ends the block, which then only closes the session.)
    """
    (ti,) = make_running_tis(dag_maker, session, dag_id="listener_closed")
    key = _key(ti)
    listener = CallListener()
    listener_manager(listener)

    TaskInstance.fetch_handle_failure_context(ti, "task failed (test)", session=session)
    session.close()
    assert read_rows(*key).state == TaskInstanceState.RUNNING

    session.execute(text("SELECT 1"))
    session.commit()
    assert listener.calls == [], "listener announced a failure that was never committed"


@pytest.mark.skipif(
    series.V3,
    reason="v2 queues: listeners deferred by session hooks in model code; series v3 hands them to the caller (callback_sink)",
)
@pytest.mark.proves(P3)
def test_failure_listener_dropped_when_create_session_is_interrupted(dag_maker, session, listener_manager):
    """``create_session()`` interrupted after the failure was queued: the next block announces nothing."""
    (ti,) = make_running_tis(dag_maker, session, dag_id="listener_interrupted")
    key = _key(ti)
    listener = CallListener()
    listener_manager(listener)

    with pytest.raises(KeyboardInterrupt):
        with create_session() as s:
            assert s is session  # the thread's scoped session
            TaskInstance.fetch_handle_failure_context(ti, "task failed (test)", session=s)
            raise KeyboardInterrupt
    assert read_rows(*key).state == TaskInstanceState.RUNNING

    with create_session() as s:
        s.execute(text("SELECT 1"))
    assert listener.calls == [], "listener announced a failure that was never committed"


@pytest.mark.guard
def test_failure_listener_arguments(dag_maker, session, listener_manager):
    """
    Listener arguments are unchanged: previous_state RUNNING, the task instance, the error.

    3.4 keeps each try as a row of its own: the task instance the listener gets is the try that is archived
    (``failed``) right after the call, and the next try is the row left ``up_for_retry``.
    """
    (ti,) = make_running_tis(dag_maker, session, dag_id="listener_args")
    listener = CallListener()
    listener_manager(listener)
    ti.handle_failure("task failed (test)", session=session)
    session.commit()

    assert len(listener.calls) == 1
    call = listener.calls[0]
    assert call["previous_state"] == TaskInstanceState.RUNNING
    assert call["task_instance"] is ti
    assert call["error"] == "task failed (test)"
    if ON_3_4:
        assert call["task_instance"].state == TaskInstanceState.FAILED
        assert read_rows(*_key(ti)).state == TaskInstanceState.UP_FOR_RETRY
    else:
        assert call["task_instance"].state == TaskInstanceState.UP_FOR_RETRY


@pytest.mark.guard
def test_raising_failure_listener_is_logged(dag_maker, session, listener_manager, caplog):
    """A listener exception is logged and swallowed; the failure is recorded."""
    (ti,) = make_running_tis(dag_maker, session, dag_id="listener_raises")

    def boom():
        raise RuntimeError("listener exploded")

    listener_manager(CallListener(boom))
    with caplog.at_level(logging.ERROR, logger="airflow.models.taskinstance"):
        ti.handle_failure("task failed (test)", session=session)
        session.commit()

    records = [r for r in caplog.records if r.getMessage() == "error calling listener"]
    assert records and records[0].exc_info and "listener exploded" in str(records[0].exc_info[1])
    assert read_rows(*_key(ti)).state == TaskInstanceState.UP_FOR_RETRY
