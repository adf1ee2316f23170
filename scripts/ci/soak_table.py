#!/usr/bin/env python3
"""
Print a Markdown table of soak reports side by side, read from their JSON (``tests/soak/run_soak.py`` writes
``REPORT.json`` beside ``REPORT.md``), so that a results table in the docs is regenerated, not retyped.

Usage: ``soak_table.py REPORT.json [REPORT.json ...]`` (one column each, headed by the file name).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

FAULTS = ("kill_runner", "kill_supervisor", "stop_runner", "stop_supervisor", "duplicate_dispatch")


def rows(r: dict) -> dict[str, str]:
    faults = r.get("actions_by_kind", {})
    restarts = r.get("worker_restarts") or []
    per_try = r.get("callbacks_per_failed_try", {})
    states = r.get("ti_states", {})
    listener = r.get("listener_calls_per_failed_try", {})
    dup = r.get("duplicate_dispatch") or {}
    return {
        "verdict (exit status)": f"{r.get('verdict', '?')} ({r.get('exit_code', '?')})",
        "apache-airflow-core": r["airflow"],
        "warm-up / chaos (s)": f"{r['warmup_s']:.0f} / {r['duration_s']:.0f}",
        "load average (1 min) at start / end": f"{r['loadavg_start'].split()[0]} / {r['loadavg_end'].split()[0]}",
        "faults: " + " / ".join(k.replace("_", " ") for k in FAULTS): " / ".join(
            str(faults.get(k, 0)) for k in FAULTS
        ),
        "worker restarts: warm / SIGKILL": (
            f"{sum(w['kind'] == 'warm' for w in restarts)} / {sum(w['kind'] == 'kill' for w in restarts)}"
            if r.get("executor") == "celery"
            else "n/a"
        ),
        "scheduler exits (series' areas / outside)": (
            f"**{len(r['scheduler_exits'])}** ({r['scheduler_exits_series']} / {r['scheduler_exits_outside']})"
        ),
        "other component exits": str(len(r.get("other_component_exits", []))),
        "task instances (of them SUCCESS)": f"{r['task_instances']} ({states.get('success', 0)})",
        "failed tries: failure/retry callbacks 0 / 1 / more": (
            f"{r['failed_tries']}: {per_try.get('0', 0)} / {per_try.get('1', 0)} / {per_try.get('more', 0)}"
        ),
        "failed tries: `on_task_instance_failed` calls 0 / 1 / more": (
            f"{listener.get('0', 0)} / {listener.get('1', 0)} / {listener.get('more', 0)}"
        ),
        "duplicate dispatches sent / copies refused (409) / healthy tries failed by the copy's event": (
            f"{dup.get('sent', 0)} / {dup.get('copies_refused_by_ti_run_409', 0)} / "
            f"{len(r.get('healthy_tries_failed_by_another_process', []))}"
            if dup.get("enabled")
            else "n/a"
        ),
        "tries without a try-history row": str(len(r.get("tries_without_history", []))),
        "execution API 5xx (of requests)": f"{sum(r.get('api_5xx_by_route', {}).values())} ({r['api_requests']})",
        "orphans left": str(len(r.get("orphans_left", []))),
    }


def table(paths: list[Path]) -> str:
    columns = [rows(json.loads(p.read_text())) for p in paths]
    lines = ["| | " + " | ".join(f"`{p.stem}`" for p in paths) + " |", "|---" * (len(paths) + 1) + "|"]
    lines += [f"| {key} | " + " | ".join(c[key] for c in columns) + " |" for key in columns[0]]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__.strip().splitlines()[-1])
    print(table([Path(a) for a in sys.argv[1:]]))
