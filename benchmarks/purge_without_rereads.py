# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
What-if measurement for issue 17 (not a proposed change): ``profile_purge.py`` on the series tree
with failure handling's re-reads of the TI row (``TaskInstance._lock_for_failure_handling``) replaced
by ``return True``, so that only the purge's revalidation reads the row. Shows what those re-reads
cost (function calls, statements, CPU). ``SKIP_REREADS=0`` runs the unchanged tree.

    SKIP_REREADS=1 python benchmarks/purge_without_rereads.py <project root> N OUT.pstats|-

Resets the database like worker.py (give it a database of its own).
"""

import os
import runpy
import sys

sys.path.insert(0, sys.argv[1] + "/benchmarks")
import worker as W  # noqa: E402,F401  (sets up the environment before airflow is imported)
from airflow.models.taskinstance import TaskInstance  # noqa: E402

if os.environ.get("SKIP_REREADS") == "1":
    TaskInstance._lock_for_failure_handling = classmethod(lambda cls, ti, *, session, skip_locked=False: True)
sys.argv = [sys.argv[1] + "/benchmarks/profile_purge.py"] + sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
