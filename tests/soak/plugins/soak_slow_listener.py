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
Slow listener plugin for the chaos soak (issue #10).

``on_task_instance_failed`` sleeps ``SOAK_LISTENER_SLEEP`` seconds (default 5). Listeners run in
the task runner when a task fails in-process, and in the scheduler when it fails a task instance
itself (heartbeat timeout, stale executor event): a slow listener there widens the window between
the scheduler's failure handling and its commit, which is the window the series is about. Each call
appends one JSON line to ``$SOAK_LISTENER_FILE`` (default ``$AIRFLOW_HOME/listener.jsonl``): the try,
the process (pid), and when the call started and ended. With ``SOAK_LISTENER_SLEEP=0`` it only records
(the soak's ``--listener openlineage``, where the OpenLineage provider's listener is the slow one).
"""

from __future__ import annotations

import json
import os
import sys
import time

from airflow.listeners import hookimpl
from airflow.plugins_manager import AirflowPlugin


def _listener_file() -> str:
    return os.environ.get("SOAK_LISTENER_FILE") or os.path.join(
        os.environ.get("AIRFLOW_HOME", "."), "listener.jsonl"
    )


_first_called: dict[int, float] = {}  # id(task_instance) -> when the first listener was called


class _FirstFailureListener:
    # tryfirst: runs before the other listeners (e.g. OpenLineage's) of the same call
    @hookimpl(tryfirst=True)
    def on_task_instance_failed(self, previous_state, task_instance, error):
        _first_called[id(task_instance)] = time.time()


class _SlowFailureListener:
    # trylast: runs after the other listeners, so ``ts_end - ts_first`` is how long all of them took
    @hookimpl(trylast=True)
    def on_task_instance_failed(self, previous_state, task_instance, error):
        started = time.time()
        first = _first_called.pop(id(task_instance), started)
        time.sleep(float(os.environ.get("SOAK_LISTENER_SLEEP", "5")))
        rec = {
            "ts_first": first,
            "ts": started,
            "ts_end": time.time(),
            "ti_id": str(getattr(task_instance, "id", "")),
            "dag_id": getattr(task_instance, "dag_id", None),
            "run_id": getattr(task_instance, "run_id", None),
            "task_id": getattr(task_instance, "task_id", None),
            "map_index": getattr(task_instance, "map_index", -1),
            "try_number": getattr(task_instance, "try_number", None),
            "previous_state": str(previous_state),
            "pid": os.getpid(),
            "argv": " ".join(sys.argv)[:120],
        }
        fd = os.open(_listener_file(), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(rec, default=str) + "\n").encode())
        finally:
            os.close(fd)


first_failure_listener = _FirstFailureListener()
slow_failure_listener = _SlowFailureListener()


class SoakSlowListenerPlugin(AirflowPlugin):
    name = "soak_slow_listener"
    listeners = [first_failure_listener, slow_failure_listener]
