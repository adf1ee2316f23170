"""tests/soak/run_soak.py: what it reads from real process titles and log lines, and its never-answering endpoint.

The log lines are copied from a Celery soak of this project (Airflow 3.3.2, celery provider 3.26.0).
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "soak"))
import run_soak  # noqa: E402

TI = "01a23120-159e-7540-b89f-2b4f98165017"


def test_task_process_titles_of_both_executors():
    for title in (
        f"airflow worker -- LocalExecutor: {TI}",
        f"airflow supervisor: {TI}",
        f"airflow worker -- {TI}",
    ):
        m = run_soak.TITLE_RE.match(title)
        assert m and m.group(3) == TI, title
    for title in (
        f"airflow scheduler {TI}",
        "[celery worker-1@soak:ForkPoolWorker-1]",
        "airflow celery worker",
    ):
        assert run_soak.TITLE_RE.match(title) is None, title


def test_executor_failed_event_line():
    line = (
        "2026-12-01T10:24:23.613613Z [info     ] Received executor event with state failed for task instance "
        "TaskInstanceKey(dag_id='soak_sensors', task_id='sensor_3', run_id='scheduled__2026-12-01T10:21:55.267805+00:00',"
        " try_number=2, map_index=-1) [airflow.jobs.scheduler_job_runner.SchedulerJobRunner] loc=scheduler_job_runner.py:1488"
    )
    m = run_soak.EVENT_RE.search(line)
    assert m.groups() == (
        "soak_sensors",
        "sensor_3",
        "scheduled__2026-12-01T10:21:55.267805+00:00",
        "2",
        "-1",
    )
    assert run_soak.parse_log_ts(line) == pytest.approx(1796120663.613613)
    assert run_soak.EVENT_RE.search(line.replace("state failed", "state success")) is None


def test_access_log_line():
    line = (
        "2026-12-01T10:14:16.186113Z [info     ] request finished               [http.access] "
        "client_addr=127.0.0.1:43832 duration_us=10053176 loc=http_access_log.py:130 method=PATCH "
        f"path=/execution/task-instances/{TI}/run query= status_code=500"
    )
    m = run_soak.ACCESS_RE.search(line)
    assert (m.group(1), run_soak.UUID_RE.sub("{id}", m.group(2)), m.group(3)) == (
        "PATCH",
        "/execution/task-instances/{id}/run",
        "500",
    )


def test_histogram_counts_zero_one_more():
    assert run_soak.histogram([0, 1, 1, 2, 5]) == {"0": 1, "1": 2, "more": 2}


def test_openlineage_endpoint_accepts_and_never_answers():
    soak = run_soak.Soak.__new__(run_soak.Soak)
    soak.blackhole, soak.blackhole_conns, soak.blackhole_accepted = None, [], 0
    port = soak._start_blackhole()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
            c.sendall(b"POST /api/v1/lineage HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
            c.settimeout(1.0)
            try:
                data = c.recv(1)
            except TimeoutError:
                data = None
            assert data is None, "the endpoint answered or closed the connection"
    finally:
        soak.blackhole.close()
    assert soak.blackhole_accepted == 1


def test_per_failed_try_counts(tmp_path):
    """Failed tries come from task_instance + history; callbacks and listener calls are counted per try."""
    import collections
    import json
    import types

    calls = [
        {
            "dag_id": "d",
            "run_id": "r",
            "task_id": "t",
            "try_number": 1,
            "pid": 11,
            "ts_first": 1.0,
            "ts_end": 3.5,
        },
        {
            "dag_id": "d",
            "run_id": "r",
            "task_id": "u",
            "try_number": 2,
            "pid": 12,
            "ts_first": 1.0,
            "ts_end": 2.0,
        },
        {
            "dag_id": "d",
            "run_id": "r",
            "task_id": "u",
            "try_number": 2,
            "pid": 99,
            "ts_first": 1.0,
            "ts_end": 1.5,
        },
    ]
    (tmp_path / "listener.jsonl").write_text("".join(json.dumps(c) + "\n" for c in calls))
    soak = run_soak.Soak.__new__(run_soak.Soak)
    soak.listener_file = tmp_path / "listener.jsonl"
    soak.components = {
        "scheduler": run_soak.Component("scheduler", [], tmp_path / "s.log", pids=[11]),
        "scheduler-2": run_soak.Component("scheduler-2", [], tmp_path / "s2.log", pids=[12]),
    }
    soak.log_sizes_at_stop, soak.heartbeat_max, soak.heartbeat_samples = {}, {}, 0
    soak.restarts, soak.blackhole_accepted, soak.celery = [], 0, False
    soak.args = types.SimpleNamespace(
        executor="local", schedulers=2, workers=3, worker_concurrency=2, listener="slow"
    )
    t, u = ("d", "r", "t", -1), ("d", "r", "u", -1)
    tis = {t: {"state": "up_for_retry", "try_number": 1}, u: {"state": "failed", "try_number": 2}}
    tih = collections.defaultdict(dict, {u: {1: "up_for_retry"}})
    file_cbs = {(t, 1): [{}], (u, 2): [{}, {}]}

    r = run_soak.analyse_tries_and_services(soak, tis, tih, file_cbs, "")

    assert r["failed_tries"] == 3
    assert r["callbacks_per_failed_try"] == {"0": 1, "1": 1, "more": 1}
    assert r["listener_calls_per_failed_try"] == {"0": 1, "1": 1, "more": 1}
    assert r["listener_calls_by_side"] == {"scheduler": 2, "task process": 1}
    assert r["failed_tries_without_callback"] == [{"try": "d.u r try 1", "state": "up_for_retry"}]
    assert r["tries_handled_by_two_schedulers"] == []
    assert r["scheduler_listener_s"] == {"calls": 2, "median": 2.5, "max": 2.5, "total": 3.5}


def test_healthy_tries_failed_by_a_duplicate_dispatch():
    """A duplicated try that no other fault hit and that the scheduler failed from RUNNING counts; the rest not."""
    import datetime
    import json

    def sent(ti_id, task, ts, ok=True):
        return json.dumps(
            {
                "ts": ts,
                "ti_id": ti_id,
                "dag_id": "d",
                "task_id": task,
                "run_id": "r",
                "map_index": -1,
                "try_number": 1,
                "sent": ok,
            }
        )

    healthy, faulted, declined, early = (TI[:-1] + c for c in "1234")
    t0 = 1796120663.0  # 2026-12-01T10:24:23Z

    def mismatch(task, dt, ti_state="running"):
        return {
            "dttm": datetime.datetime.fromtimestamp(t0 + dt, datetime.timezone.utc).replace(tzinfo=None),
            "dag_id": "d",
            "task_id": task,
            "run_id": "r",
            "map_index": -1,
            "try_number": 1,
            "extra": "Executor LocalExecutor(parallelism=8) reported that the task instance <TaskInstance: d.x r"
            f" [{ti_state}]> finished with state failed, but the task instance's state attribute is {ti_state}.",
        }

    def access(dt, method, ti_id, route, status):
        ts = (
            datetime.datetime.fromtimestamp(t0 + dt, datetime.timezone.utc).isoformat().replace("+00:00", "Z")
        )
        return (
            f"{ts} [info     ] request finished [http.access] method={method} "
            f"path=/execution/task-instances/{ti_id}/{route} query= status_code={status}"
        )

    states = {"h": "up_for_retry", "f": "failed", "d": "running", "e": "success"}
    r = run_soak.analyse_duplicates(
        requested=5,
        sent_lines=[
            sent(healthy, "h", t0),
            sent(faulted, "f", t0),
            sent(declined, "d", t0),
            sent(early, "e", t0, ok=False),
            "not json",
        ],
        faulted_ti_ids={faulted},
        mismatch_rows=[mismatch("h", 2), mismatch("h", -30), mismatch("f", 2), mismatch("d", 2)],
        try_state=lambda key, n: states[key[2]],
        api_log="\n".join(
            [
                access(1, "PATCH", healthy, "run", 409),
                access(1, "PATCH", faulted, "run", 409),
                access(5, "PUT", healthy, "heartbeat", 409),
                access(-5, "PUT", healthy, "heartbeat", 204),
            ]
        ),
    )
    assert r["duplicate_dispatch"] == {
        "requested": 5,
        "sent": 3,
        "not_sent": 1,
        "copies_refused_by_ti_run_409": 2,
    }
    assert r["healthy_tries_failed_by_another_process"] == [
        {
            "try": "d.h r try 1",
            "ti_id": healthy,
            "state": "up_for_retry",
            "failed_s_after_dispatch": 2.0,
            "heartbeats_after_failure": {409: 1},
        }
    ]


def report_of(code: int, **fields) -> dict:
    """A run_soak report's fields that exit_status reads."""
    report = {
        "exit_code": code,
        "verdict": "FAIL (series areas)" if code == 1 else "PASS",
        "scheduler_exits": [{"category": "series"}] if code == 1 else [],
        "scheduler_exits_series": 1 if code == 1 else 0,
        "scheduler_exits_outside": 0,
        "other_component_exits": [],
        "ti_states": {"success": 5},
        "orphans_left": [],
        "interrupted": False,
    }
    return {**report, **fields}


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, 0),  # only the races the series fixes: what the pristine release is expected to show
        ({"scheduler_exits_outside": 1}, 1),  # a crash outside the series' areas is not hidden by them
        ({"other_component_exits": [{"component": "api-server"}]}, 1),
        ({"ti_states": {"failed": 3}}, 1),  # the deployment did not work
        ({"orphans_left": [{"pid": 1}]}, 1),
        ({"interrupted": True, "exit_code": 2}, 2),
    ],
)
def test_expected_races_of_the_base_pass_only_without_other_exits(fields, expected):
    code, why = run_soak.exit_status(report_of(1, **fields), expect_races=True)
    assert code == expected, why
    assert why.startswith(f"exit {expected}")
    assert "scheduler exits" in why and "other component exits" in why


def test_findings_are_not_expected_without_the_option():
    assert run_soak.exit_status(report_of(1), expect_races=False)[0] == 1
    assert run_soak.exit_status(report_of(0), expect_races=True)[0] == 0


def test_existing_report_is_not_overwritten(tmp_path):
    import os
    import subprocess

    report = tmp_path / "postgres-series"
    (tmp_path / "postgres-series.md").write_text("an earlier run\n")
    proc = subprocess.run(
        [sys.executable, str(Path(run_soak.__file__)), "--backend", "postgres", "--report", str(report)],
        env={**os.environ, "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": "postgresql://u:secret@127.0.0.1:1/db"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert f"soak: {tmp_path / 'postgres-series.md'} exists: not overwritten" in proc.stderr
    assert (tmp_path / "postgres-series.md").read_text() == "an earlier run\n"
    assert "secret" not in proc.stdout + proc.stderr


def test_database_holding_airflow_data_is_not_wiped(tmp_path, monkeypatch):
    """The DSN is read from the environment, where an operator's Airflow may have left it: refused."""
    import types

    from sqlalchemy import create_engine, text

    dsn = f"sqlite:///{tmp_path / 'prod.db'}"
    engine = create_engine(dsn)
    with engine.begin() as conn:  # not Airflow's schema: the one table the check reads, with a row
        conn.execute(text("CREATE TABLE dag (dag_id VARCHAR(250) PRIMARY KEY)"))
        conn.execute(text("INSERT INTO dag VALUES ('prod')"))
    monkeypatch.delenv("DB_RESET", raising=False)
    soak = run_soak.Soak.__new__(run_soak.Soak)
    soak.args = types.SimpleNamespace(dsn=dsn)
    soak.home, soak.duplicates = tmp_path / "home", False
    soak.callback_file, soak.listener_file = tmp_path / "callbacks.jsonl", tmp_path / "listener.jsonl"
    with pytest.raises(run_soak.SoakError, match=r"holds Airflow data \(rows in dag\).*nothing was changed"):
        soak.setup()
    with engine.connect() as conn:
        assert conn.execute(text("SELECT dag_id FROM dag")).scalars().all() == ["prod"]
    engine.dispose()


def test_a_crash_is_classified_by_its_own_exception_not_by_an_earlier_handled_error():
    """A scheduler exit counts in the series' areas (and, with --expect-races, lets the base soak exit 0) only
    if the exception that ended it is one of the series' races; a lock wait timeout the scheduler logged
    and survived a few lines before an unrelated crash must not make that crash one."""
    handled = (
        "2026-12-01T10:24:23.613613Z [warning  ] Executor event could not be processed: (MySQLdb.OperationalError) "
        "(1205, 'Lock wait timeout exceeded; try restarting transaction') [airflow.jobs.scheduler_job_runner]"
    )
    crash = [
        "2026-12-01T10:24:30.000000Z [error    ] Exception when executing SchedulerJob._run_scheduler_loop",
        "Traceback (most recent call last):",
        '  File "/x/airflow/jobs/scheduler_job_runner.py", line 1044, in _execute',
        "    self._run_scheduler_loop()",
        "KeyError: 'sensor_3'",
    ]
    text = "\n".join([handled, *["[info     ] Loop took 0.1 s"] * 10, *crash])
    category, cause = run_soak.classify_exit(run_soak.Soak._exit_context(text))
    assert category != "series", cause
    series = [
        "2026-12-01T10:24:30.000000Z [error    ] Exception when executing SchedulerJob._run_scheduler_loop",
        "Traceback (most recent call last):",
        'psycopg2.errors.ForeignKeyViolation: insert or update on table "task_reschedule" violates foreign key',
        "",
        "The above exception was the direct cause of the following exception:",
        "",
        "Traceback (most recent call last):",
        '  File "/x/airflow/jobs/scheduler_job_runner.py", line 1044, in _execute',
        "RuntimeError: the scheduler loop failed",
        "2026-12-01T10:24:31.000000Z [info     ] Exited execute loop",
    ]
    text = "\n".join([handled, *series])
    assert run_soak.classify_exit(run_soak.Soak._exit_context(text))[0] == "series"


def test_installed_without_network_to_the_index_is_one_line_and_leaves_no_venv(tmp_path):
    """--installed (issue 31): the venv of the released Airflow cannot be made; the cause is named."""
    import os
    import subprocess
    import zipfile

    wheel = tmp_path / "apache_airflow_core-3.3.2+series.1.abc-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(
            "apache_airflow_core-3.3.2+series.1.abc.dist-info/METADATA", "Version: 3.3.2+series.1.abc\n"
        )
    temp, closed = tmp_path / "temp", "http://127.0.0.1:9/simple"
    temp.mkdir()
    argv = ["--backend", "postgres", "--report", str(tmp_path / "r"), "--installed", str(wheel)]
    env = {"AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": "postgresql://u:secret@127.0.0.1:1/db", "TMPDIR": str(temp),
           "UV_DEFAULT_INDEX": closed, "UV_INDEX_URL": closed, "PIP_INDEX_URL": closed}  # fmt: skip
    proc = subprocess.run([sys.executable, str(Path(run_soak.__file__)), *argv, "--installed-with", "asyncpg"],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "soak: --installed: [1] install the released apache-airflow==3.3.2"
    )
    assert "Connection refused" in lines[0] and "secret" not in proc.stdout + proc.stderr
    assert not list(temp.iterdir())
    missing = subprocess.run([sys.executable, str(Path(run_soak.__file__)), *argv[:4], "--installed", "x.whl"],
                             env={**os.environ, **env}, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert missing.returncode == 2 and "--installed x.whl: no such wheel" in missing.stderr
