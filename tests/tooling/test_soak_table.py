"""scripts/ci/soak_table.py: the docs' soak tables come from the reports' JSON (issue 31)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TABLE = Path(__file__).resolve().parents[2] / "scripts" / "ci" / "soak_table.py"
REPORT = {
    "airflow": "3.3.2+series.19.74eb364c", "warmup_s": 48.2, "duration_s": 300.1, "loadavg_start": "2.04 1 1",
    "loadavg_end": "1.89 1 1", "actions_by_kind": {"kill_runner": 14, "duplicate_dispatch": 5},
    "worker_restarts": [], "executor": "local", "scheduler_exits": [{"t": 1}], "scheduler_exits_series": 1,
    "scheduler_exits_outside": 0, "other_component_exits": [], "task_instances": 17,
    "ti_states": {"success": 12}, "failed_tries": 27, "callbacks_per_failed_try": {"0": 1, "1": 26, "more": 0},
    "tries_without_history": [], "api_5xx_by_route": {"/x": 2}, "api_requests": 867, "orphans_left": [],
    "listener_calls_per_failed_try": {"0": 1, "1": 25, "more": 1}, "verdict": "PASS", "exit_code": 0,
    "duplicate_dispatch": {"enabled": True, "sent": 5, "copies_refused_by_ti_run_409": 4},
    "healthy_tries_failed_by_another_process": [{"ti": "x"}],
}  # fmt: skip


def test_one_column_per_report_read_from_its_json(tmp_path: Path):
    a, b = tmp_path / "editable.json", tmp_path / "installed.json"
    a.write_text(json.dumps({**REPORT, "airflow": "3.3.2"}))
    b.write_text(json.dumps(REPORT))
    out = subprocess.run([sys.executable, str(TABLE), str(a), str(b)], capture_output=True, text=True).stdout
    lines = out.splitlines()
    assert lines[0] == "| | `editable` | `installed` |" and lines[1] == "|---|---|---|"
    assert "| apache-airflow-core | 3.3.2 | 3.3.2+series.19.74eb364c |" in lines
    assert "| scheduler exits (series' areas / outside) | **1** (1 / 0) | **1** (1 / 0) |" in lines
    assert "| failed tries: failure/retry callbacks 0 / 1 / more | 27: 1 / 26 / 0 | 27: 1 / 26 / 0 |" in lines
    assert "| faults: kill runner / kill supervisor / stop runner / stop supervisor / duplicate dispatch " \
           "| 14 / 0 / 0 / 0 / 5 | 14 / 0 / 0 / 0 / 5 |" in lines  # fmt: skip
    assert "| execution API 5xx (of requests) | 2 (867) | 2 (867) |" in lines
    assert "| verdict (exit status) | PASS (0) | PASS (0) |" in lines
    assert "| failed tries: `on_task_instance_failed` calls 0 / 1 / more | 1 / 25 / 1 | 1 / 25 / 1 |" in lines
    assert "| duplicate dispatches sent / copies refused (409) / healthy tries failed by the copy's event " \
           "| 5 / 4 / 1 | 5 / 4 / 1 |" in lines  # fmt: skip


def test_duplicate_dispatch_is_n_a_where_the_soak_does_not_make_it(tmp_path: Path):
    a = tmp_path / "celery.json"
    a.write_text(json.dumps({**REPORT, "executor": "celery", "duplicate_dispatch": {"enabled": False}}))
    out = subprocess.run([sys.executable, str(TABLE), str(a)], capture_output=True, text=True).stdout
    assert "| duplicate dispatches sent / copies refused (409) / healthy tries failed by the copy's event | n/a |" \
           in out.splitlines()  # fmt: skip
