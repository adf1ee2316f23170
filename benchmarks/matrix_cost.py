#!/usr/bin/env python3
# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
Wall time of the test matrix: ``nox -s tests-<backend>`` and ``nox -s verify-series-<backend>``, cold
and warm; writes ``benchmarks/results/matrix-<backend>.md`` (``run.py`` includes it in
``results/<backend>.md``).

    python benchmarks/matrix_cost.py --backend postgres [--sessions tests,verify-series] [--no-cold]

cold = ``nox --reuse-venv=no`` (the session's venv is recreated and airflow-core reinstalled; uv's
download cache stays warm, the sdist cache too); warm = ``--reuse-venv=yes`` right after. Database:
as the sessions themselves (a throwaway server unless ``AIRFLOW__DATABASE__SQL_ALCHEMY_CONN`` and
``BACKEND`` are set). Run it by hand, with no other session using ``airflow-core/`` (verify-series
moves it). Exit status: 1 if a timed session failed (its time is still recorded).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(os.path.abspath(__file__)).parent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", required=True, choices=["sqlite", "postgres", "mysql"])
    p.add_argument("--sessions", default="tests,verify-series")
    p.add_argument("--no-cold", action="store_true", help="only warm runs")
    p.add_argument("--root", type=Path, default=HERE.parent)
    args = p.parse_args()
    rows, failed = [], False
    for prefix in args.sessions.split(","):
        name = f"{prefix}-{args.backend}"
        for mode in ([] if args.no_cold else ["cold"]) + ["warm"]:
            cmd = ["nox", "-s", name, f"--reuse-venv={'no' if mode == 'cold' else 'yes'}"]
            print("$", " ".join(cmd), flush=True)
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, cwd=args.root, capture_output=True, text=True)
            secs = time.perf_counter() - t0
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
            failed |= proc.returncode != 0
            rows.append((name, mode, secs, proc.returncode, tail[0][:120]))
            print(f"  {secs:.1f} s, exit {proc.returncode}: {tail[0][:120]}", flush=True)
    series = [ln.split("#")[0].strip() for ln in (args.root / "patches" / "series").read_text().splitlines()]
    n = len([s for s in series if s])
    load = "%.2f %.2f %.2f" % os.getloadavg()
    out = [
        f"Measured {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC by `benchmarks/matrix_cost.py` "
        f"({os.cpu_count()} cores, load average at end {load}, series of {n} patches).",
        "",
        "| session | venv | wall s | exit | last line |",
        "|---|---|---|---|---|",
    ]
    out += [f"| `nox -s {s}` | {m} | {t:.0f} | {rc} | `{tail}` |" for s, m, t, rc, tail in rows]
    dest = HERE / "results" / f"matrix-{args.backend}.md"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text("\n".join(out) + "\n")
    print("\n".join(out))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
