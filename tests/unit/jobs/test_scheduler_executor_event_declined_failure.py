# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
Breaker: a callback / email request is committed for a failure that handle_failure declined.

``_process_executor_events`` sends the TaskCallbackRequest (and EmailRequest) for an "externally
killed" TI into the session *before* ``ti.handle_failure``. Since the series,
``handle_failure`` re-reads the TI under its row lock and, when another writer changed the TI
meanwhile, does nothing to the TI - but it then calls ``session.commit()``, which commits the
callback row already added for that TI. The DAG processor runs a failure callback for a TI that
was not failed by the scheduler (duplicate of the worker's own callback in Airflow 3).

The window is real on every backend:

* postgres / MySQL 8: the batch's ``FOR UPDATE SKIP LOCKED`` locks are released by the first
  event's ``handle_failure`` commit, so the rest of the batch is handled from a stale read;
* sqlite / MariaDB: the batch query locks nothing at all.

The other writer here is the real execution API (``PATCH /task-instances/{id}/state`` with
``failed``, what a worker's supervisor sends when its task fails), driven on its own thread and
connection. It is started right after the first event's failure handling committed (an
``after_commit`` hook of the scheduler's session), the moment the batch's row locks are released.
"""

from __future__ import annotations


import pytest
from sqlalchemy import event, select

from airflow import settings
from airflow._shared.timezones import timezone
from airflow.callbacks.callback_requests import EmailRequest, TaskCallbackRequest
from airflow.models.db_callback_request import DbCallbackRequest
from airflow.utils.state import TaskInstanceState

from tests.unit.harness import env, series
from tests.unit.jobs.test_scheduler_failure_declines import EVENTS_BASE_OK, EVENTS_PATCH, AfterStatement
from tests.unit.ti_race import ExecutionApi, Worker, make_running_tis, read_rows

pytestmark = pytest.mark.db_test

PATCH = "Serialise-TI-failure-handling-with-the-execution-API-via-the-row-lock.patch"


def on_failure(context):  # pragma: no cover - only its presence on the task matters
    pass


def committed_requests() -> list:
    with settings.NonScopedSession() as s:
        return [row.get_callback_request() for row in s.scalars(select(DbCallbackRequest))]


def api_fail(api: ExecutionApi, ti_id) -> int:
    """The worker's supervisor reporting its task failed (TITerminalStatePayload)."""

    with api.client() as client:
        response = client.patch(
            f"/task-instances/{ti_id}/state",
            json={"state": "failed", "end_date": timezone.utcnow().isoformat()},
            headers={"Authorization": "Bearer in-process"},
        )
    return response.status_code


class WorkerFailsOtherTiOnFirstCommit:
    """After the scheduler session's first commit, the still-running TI's worker reports FAILED via the API."""

    def __init__(self, session, api, ids_by_task, keys):
        self.session = session
        self.api = api
        self.ids_by_task = ids_by_task
        self.keys = keys
        self.failed_first: str | None = None
        self.api_status: int | None = None
        self.other: str | None = None
        if series.V3:
            # Series v3 commits nothing before the batch ends: the worker reports right after the batch's
            # read, which locks no row where with_row_locks takes none (SQLite, MariaDB).
            if env.BACKEND == "postgres":
                pytest.skip("series v3: the batch's locked read holds its rows until the batch commits")
            self.hook = AfterStatement(
                r"^\s*SELECT\b.*\bFROM task_instance\b", lambda: self._after_commit(session)
            )
        else:
            self.hook = None
            event.listen(session, "after_commit", self._after_commit)

    def _after_commit(self, session):
        # SQLAlchemy also fires after_commit when a savepoint is released: only a real commit counts.
        if self.failed_first is not None or session.get_nested_transaction() is not None:
            return
        running = [t for t, key in self.keys.items() if read_rows(*key).state == TaskInstanceState.RUNNING]
        self.other = sorted(running)[-1]  # series v3: both still running (after the batch's read)
        (self.failed_first,) = [t for t in self.keys if t != self.other]
        worker = Worker(lambda: api_fail(self.api, self.ids_by_task[self.other]), name="worker-api")
        worker.start()
        self.api_status = worker.join_or_fail()

    def remove(self):
        if self.hook is not None:
            self.hook.remove()
        else:
            event.remove(self.session, "after_commit", self._after_commit)


@pytest.mark.proves(EVENTS_PATCH, base_ok_on=EVENTS_BASE_OK)
def test_no_callback_committed_when_handle_failure_declines(dag_maker, session, scheduler_job_runner, api):
    runner = scheduler_job_runner
    executor = runner.executor
    tis = make_running_tis(
        dag_maker,
        session,
        dag_id="declined_failure",
        task_ids=("a", "b"),
        retries=0,
        queued_by_job_id=runner.job.id,
        on_failure_callback=on_failure,
        email=["ops@example.invalid"],
        email_on_failure=True,
    )
    keys = {ti.task_id: (ti.dag_id, ti.task_id, ti.run_id, ti.map_index) for ti in tis}
    for ti in tis:
        # The executor says both processes died (e.g. OOM-killed); no heartbeat timeout involved.
        executor.event_buffer[ti.key] = (TaskInstanceState.FAILED, None)
    ids_by_task = {ti.task_id: ti.id for ti in tis}
    session.expunge_all()

    listener = WorkerFailsOtherTiOnFirstCommit(session, api, ids_by_task, keys)
    try:
        runner._process_executor_events(executor=executor, session=session)
        session.commit()
    finally:
        listener.remove()

    assert listener.failed_first is not None, "no failure was handled"
    other = listener.other
    assert listener.api_status == 204, listener.api_status
    # The worker's own report won: the TI is FAILED by the API, the scheduler declined to fail it.
    assert read_rows(*keys[other]).state == TaskInstanceState.FAILED
    assert read_rows(*keys[listener.failed_first]).state == TaskInstanceState.FAILED

    requests = committed_requests()
    cb = [r for r in requests if isinstance(r, TaskCallbackRequest) and r.ti.task_id == other]
    em = [r for r in requests if isinstance(r, EmailRequest) and r.ti.task_id == other]
    assert cb == [] and em == [], (
        f"the scheduler declined to fail {other!r} (another writer had already failed it) but "
        f"committed {len(cb)} TaskCallbackRequest(s) and {len(em)} EmailRequest(s) for it"
    )
