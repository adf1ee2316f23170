#
# Licensed to the Apache Software Foundation (ASF) under one
# or more contributor license agreements.  See the NOTICE file
# distributed with this work for additional information
# regarding copyright ownership.  The ASF licenses this file
# to you under the Apache License, Version 2.0 (the
# "License"); you may not use this file except in compliance
# with the License.  You may obtain a copy of the License at
#
#   http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing,
# software distributed under the License is distributed on an
# "AS IS" BASIS, WITHOUT WARRANTIES OR CONDITIONS OF ANY
# KIND, either express or implied.  See the License for the
# specific language governing permissions and limitations
# under the License.
"""
DAGs for the chaos soak (tests/soak/run_soak.py); issue #10.

* ``soak_sensors``: four reschedule-mode sensors poking every 2-3 s. Each try succeeds 30-60 s after
  its first poke (a marker file per TI id and try under ``$AIRFLOW_HOME/sensor-marks``), so every
  try produces a stream of short poke processes and task_reschedule rows (and, upstream, stale
  executor SUCCESS events for them) however slow the machine is.
* ``soak_sleepers``: three tasks sleeping 15-40 s, long enough for the chaos loop to kill or stop
  their worker processes mid-run (heartbeat timeouts, task-side failures).

Every task has ``retries=3`` and on_retry/on_failure callbacks that append one JSON line per call to
``$SOAK_CALLBACK_FILE`` (default ``$AIRFLOW_HOME/callbacks.jsonl``). Lines are appended with a single
``O_APPEND`` write, so concurrent writers (task runners, dag-processor callback processes) never
interleave within a line. The runner counts duplicate callbacks per try from this file.
"""

from __future__ import annotations

import datetime
import json
import os
import time

from airflow.providers.standard.operators.python import PythonOperator
from airflow.providers.standard.sensors.python import PythonSensor
from airflow.sdk import DAG

START = datetime.datetime(2025, 1, 1, tzinfo=datetime.timezone.utc)


def _callback_file() -> str:
    return os.environ.get("SOAK_CALLBACK_FILE") or os.path.join(
        os.environ.get("AIRFLOW_HOME", "."), "callbacks.jsonl"
    )


def _proc_title() -> str:
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
    except OSError:
        return ""


def _record(kind: str, context) -> None:
    ti = context.get("ti") or context.get("task_instance")
    exc = context.get("exception")
    rec = {
        "kind": kind,
        "ts": time.time(),
        "ti_id": str(getattr(ti, "id", "")),
        "dag_id": getattr(ti, "dag_id", None),
        "task_id": getattr(ti, "task_id", None),
        "run_id": getattr(ti, "run_id", None),
        "map_index": getattr(ti, "map_index", -1),
        "try_number": getattr(ti, "try_number", None),
        "pid": os.getpid(),
        "proc": _proc_title(),
        "exception": None if exc is None else str(exc)[:300],
    }
    data = (json.dumps(rec, default=str) + "\n").encode()
    fd = os.open(_callback_file(), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def on_retry(context) -> None:
    _record("retry", context)


def on_failure(context) -> None:
    _record("failure", context)


def _try_age(context) -> float:
    """Seconds since the first poke of this try (a marker file per TI id and try number)."""
    ti = context["ti"]
    marks = os.path.join(os.environ.get("AIRFLOW_HOME", "."), "sensor-marks")
    os.makedirs(marks, exist_ok=True)
    marker = os.path.join(marks, f"{ti.id}-{ti.try_number}")
    try:
        with open(marker) as f:
            first = float(f.read() or time.time())
    except FileNotFoundError:
        first = time.time()
        with open(marker, "w") as f:
            f.write(repr(first))
    return time.time() - first


def sensor_ready(min_age: float, **context) -> bool:
    return _try_age(context) >= min_age


def sleep_for(seconds: float) -> None:
    time.sleep(seconds)


DEFAULT_ARGS = {
    "retries": 3,
    "retry_delay": datetime.timedelta(seconds=3),
    "on_retry_callback": on_retry,
    "on_failure_callback": on_failure,
}

with DAG(
    "soak_sensors",
    schedule=datetime.timedelta(minutes=1),
    start_date=START,
    catchup=False,
    max_active_runs=1,
    default_args=DEFAULT_ARGS,
    tags=["soak"],
):
    for i, (poke, age) in enumerate([(2, 30), (2, 40), (3, 50), (3, 60)]):
        PythonSensor(
            task_id=f"sensor_{i}",
            python_callable=sensor_ready,
            op_kwargs={"min_age": age},
            mode="reschedule",
            poke_interval=poke,
            timeout=3600,
        )

with DAG(
    "soak_sleepers",
    schedule=datetime.timedelta(minutes=1),
    start_date=START,
    catchup=False,
    max_active_runs=1,
    default_args=DEFAULT_ARGS,
    tags=["soak"],
):
    for i, seconds in enumerate([15, 25, 40]):
        PythonOperator(task_id=f"sleep_{i}", python_callable=sleep_for, op_kwargs={"seconds": seconds})
