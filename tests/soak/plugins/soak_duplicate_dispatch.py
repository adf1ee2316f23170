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
Duplicate dispatch for the chaos soak (upstream #58441, #65708, #63183, PR #69336).

Active only in ``airflow scheduler`` processes and only when ``SOAK_DUPLICATE_DIR`` is set (the soak's
``duplicate_dispatch`` fault, LocalExecutor). ``LocalExecutor._process_workloads`` keeps the
``ExecuteTask`` workload it sends, by TI id. At every ``sync`` (each scheduler loop, in the scheduler's
thread) a request file ``$SOAK_DUPLICATE_DIR/<ti_id>`` written by the soak runner (for a try whose task
runner it saw running) makes this executor put that same workload on its activity queue a second time.
(The executor's ``running`` set says nothing here: LocalExecutor drops a key from it at the worker's
RUNNING event.)
A LocalExecutor worker process runs the copy as it runs any workload: its supervisor forks a task runner
and calls ``ti_run``, which the execution API refuses (409, the try is already running with another
pid); the supervisor raises and the worker reports FAILED for the same key while the first copy runs and
heartbeats. Each request handled appends one JSON line to ``$SOAK_DUPLICATE_DIR/sent.jsonl``.
"""

from __future__ import annotations

import json
import os
import sys
import time

from airflow.plugins_manager import AirflowPlugin

_DIR = os.environ.get("SOAK_DUPLICATE_DIR")


def _record(rec: dict) -> None:
    fd = os.open(os.path.join(_DIR, "sent.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(rec, default=str) + "\n").encode())
    finally:
        os.close(fd)


def _install() -> None:
    from airflow.executors.local_executor import LocalExecutor
    from airflow.executors.workloads import ExecuteTask

    if getattr(LocalExecutor, "_soak_duplicates", None) is not None:
        return
    sent: dict[str, ExecuteTask] = {}
    LocalExecutor._soak_duplicates = sent
    process_workloads, sync = LocalExecutor._process_workloads, LocalExecutor.sync

    def _process_workloads(self, workload_list):
        for workload in workload_list:
            if isinstance(workload, ExecuteTask):
                sent[str(workload.ti.id)] = workload
        return process_workloads(self, workload_list)

    def _duplicate_requested(self) -> None:
        for name in os.listdir(_DIR):
            workload = sent.get(name)
            if workload is None:
                continue  # not a try this scheduler sent (or not a request file)
            try:
                os.unlink(os.path.join(_DIR, name))
            except FileNotFoundError:
                continue
            key = workload.ti.key  # ExecuteTask.key does not exist on 3.1.x
            rec = {
                "ts": time.time(),
                "ti_id": name,
                "dag_id": key.dag_id,
                "task_id": key.task_id,
                "run_id": key.run_id,
                "map_index": key.map_index,
                "try_number": key.try_number,
                "pid": os.getpid(),
            }
            self.activity_queue.put(workload)
            with self._unread_messages:
                self._unread_messages.value += 1
            self._check_workers()
            _record({**rec, "sent": True})

    def _sync(self):
        try:
            _duplicate_requested(self)
        except Exception as e:  # the fault must not become a scheduler exit of its own
            print(f"soak duplicate dispatch: {type(e).__name__}: {e}", file=sys.stderr)
        return sync(self)

    LocalExecutor._process_workloads = _process_workloads
    LocalExecutor.sync = _sync


if _DIR and sys.argv[1:2] == ["scheduler"]:
    _install()


class SoakDuplicateDispatchPlugin(AirflowPlugin):
    name = "soak_duplicate_dispatch"
