#!/usr/bin/env python3
"""
Print which patches an apache-airflow-core installation (or wheel) carries, with their upstream status.

Reads ``airflow-core-series.json``, which ``nox -s build`` puts in the wheel's ``.dist-info/extra_metadata/``.
Standard library only: run it with the deployment's own Python, e.g.
``/opt/airflow/venv/bin/python series_info.py``, or give it a built wheel: ``series_info.py dist/X.whl``.
Without this file, the same record prints with:
``python -c "from importlib.metadata import distribution as d;
print(d('apache-airflow-core').read_text('extra_metadata/airflow-core-series.json'))"``.
Exits 1 if the installed core carries no series (the pristine release).
"""

from __future__ import annotations

import json
import sys
import zipfile
from importlib.metadata import PackageNotFoundError, distribution

RECORD = "extra_metadata/airflow-core-series.json"


def load(wheel: str | None) -> dict | None:
    if wheel:
        with zipfile.ZipFile(wheel) as z:
            names = [n for n in z.namelist() if n.endswith(".dist-info/" + RECORD)]
            return json.loads(z.read(names[0])) if names else None
    text = distribution("apache-airflow-core").read_text(RECORD)
    return json.loads(text) if text else None


def main(argv: list[str]) -> int:
    if argv and (argv[0].startswith("-") or len(argv) > 1):
        print(
            "usage: series_info.py [WHEEL]  (without WHEEL: the installed apache-airflow-core)",
            file=sys.stderr,
        )
        return 2
    try:
        data = load(argv[0] if argv else None)
    except PackageNotFoundError:
        print("series_info.py: apache-airflow-core is not installed in this Python", file=sys.stderr)
        return 1
    except (OSError, zipfile.BadZipFile, json.JSONDecodeError) as e:
        print(f"series_info.py: {argv[0] if argv else RECORD}: not a readable wheel ({e})", file=sys.stderr)
        return 1
    if data is None:
        version = distribution("apache-airflow-core").version if not argv else argv[0]
        print(f"series_info.py: {version} carries no patch series (no {RECORD})", file=sys.stderr)
        return 1
    patches = data["patches"]
    print(
        f"{data['distribution']} {data['version']}: {data['base']} + {len(patches)} patch(es), tier {data['tier']}"
    )
    for i, p in enumerate(patches, 1):
        bugs = ", ".join("#" + b.rsplit("/", 1)[-1] for b in p["bug"]) or "-"
        applied = "; applied upstream: " + ", ".join(p["applied-upstream"]) if p["applied-upstream"] else ""
        # a backport's origin is its upstream status when patches/upstream.toml has no entry for it
        origin = "; origin: " + ", ".join(p["origin"]) if p.get("origin", ["self"]) != ["self"] else ""
        print(
            f"{i:2}. {p['subject']}  [{bugs}; forwarded: {', '.join(p['forwarded']) or '-'}{applied}{origin}]"
        )
        if p["upstream-status"]:
            print(f"    {p['upstream-status']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
