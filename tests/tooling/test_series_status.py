"""scripts/ci/series_status.py tells "applies" from "already contained" on two real releases.

3.1.8 builds the heartbeat-timeout callback without ``task_callback_type`` (so it is always a failure
callback); 3.3.2 derives it from retry eligibility. A patch made at test time from that real difference
(the 3.3.2 lines grafted into 3.1.8's ``_purge_task_instances_without_heartbeats``) must be reported as
applying to 3.1.8 and as already contained in 3.3.2. Needs git and both sdists (pip, cached).
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "ci"))
import series_status  # noqa: E402
import tree  # noqa: E402

SJR = "src/airflow/jobs/scheduler_job_runner.py"
PURGE = "def _purge_task_instances_without_heartbeats("
CALLBACK = "            request = TaskCallbackRequest(\n"
MSG = "                msg=str(task_instance_heartbeat_timeout_message_details),\n"
MESSAGE = """From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
From: Tester <t@example.com>
Date: Sun, 29 Nov 2026 00:00:00 +0000
Subject: [PATCH] Derive the heartbeat-timeout callback type from retry eligibility

A timed-out task that can still retry gets an up-for-retry callback, not a failure one.

related: #42553

Bug: https://github.com/apache/airflow/issues/42553
Origin: self
Forwarded: no
---
"""


def source(version: str) -> str:
    """``scheduler_job_runner.py`` of a release, read from its sha256-checked sdist."""
    bases = series_status.status_bases(ROOT)
    sdist = tree.fetch_sdist(
        {"package": "apache-airflow-core", "version": version, "sdist-sha256": bases[version]}
    )
    with tarfile.open(sdist) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("/" + SJR) and m.name.count("/") == 4)
        return tar.extractfile(member).read().decode()


def heartbeat_callback_type_patch(tmp: Path) -> str:
    """The 3.1.8 -> 3.3.2 change of the heartbeat-timeout callback type, as a patch onto 3.1.8."""
    old, new = source("3.1.8"), source("3.3.2")
    assert "task_callback_type=task_callback_type" not in old[old.index(PURGE) :]
    # The 3.3.2 block choosing the type: from its comment down to the request it feeds.
    purge = new.index(PURGE)
    start = new.index("            # ti.task isn't loaded in this purge path", purge)
    block = new[start : new.index(CALLBACK, start)]
    assert "is_eligible_to_retry()" in block and "TaskInstanceState.UP_FOR_RETRY" in block
    at = old.index(CALLBACK, old.index(PURGE))
    patched = old[:at] + block + old[at:]
    at = patched.index(MSG, at) + len(MSG)
    patched = patched[:at] + "                task_callback_type=task_callback_type,\n" + patched[at:]
    a, b = tmp / "a" / "airflow-core" / SJR, tmp / "b" / "airflow-core" / SJR
    for path, text in ((a, old), (b, patched)):
        path.parent.mkdir(parents=True)
        path.write_text(text)
    diff = subprocess.run(
        ["git", "diff", "--no-index", "-U1", "a/airflow-core", "b/airflow-core"],
        cwd=tmp,
        capture_output=True,
        text=True,
    ).stdout
    assert diff.count("\n@@ ") == 2, diff
    return MESSAGE + diff.replace("a/a/airflow-core", "a/airflow-core").replace(
        "b/b/airflow-core", "b/airflow-core"
    )


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    (root / "patches").mkdir(parents=True)
    (root / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    (root / "patches" / "hb-callback-type.patch").write_text(heartbeat_callback_type_patch(tmp_path))
    (root / "patches" / "series").write_text("hb-callback-type.patch\n")
    return root


def test_real_upstream_change_is_contained_in_332_and_applies_to_318(project: Path):
    assert set(series_status.status_bases(project)) == {"3.3.2", "3.2.2", "3.1.8", "3.4.0b2"}
    header, rows, ok = series_status.status(project)
    assert ok  # the pinned base is 3.3.2: "already contained" is not a failure to apply
    row = dict(zip(header, rows[0]))
    assert row["on 3.3.2"] == "already contained"
    assert row["on 3.1.8"] == "applies"
    assert row["upstream issue"] == "#42553"
    assert row["upstream status"] == "forwarded: no"
    assert row["files"] == "jobs/scheduler_job_runner.py"


def test_cli_names_conflict_and_fails_on_the_pinned_base(project: Path):
    # A patch whose context exists in neither release (a line it expects was changed).
    text = (project / "patches" / "hb-callback-type.patch").read_text()
    (project / "patches" / "hb-callback-type.patch").write_text(
        text.replace(MSG.rstrip("\n"), "                msg=None,")
    )
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "ci" / "series_status.py"), "--root", str(project)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1
    assert "a patch conflicts with the pinned base 3.3.2" in proc.stderr
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| hb-callback-type.patch |"))
    assert row.count(f"CONFLICT ({SJR}") == len(series_status.status_bases(project)), row  # one per base


def test_older_base_lists_the_default_patches_it_does_not_carry(tmp_path: Path, monkeypatch):
    root = tmp_path / "project"
    (root / "patches" / "3.1.8").mkdir(parents=True)
    (root / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    (root / "patches" / "series").write_text("# default queue\na.patch\nb.patch\n")
    (root / "patches" / "3.1.8" / "series").write_text("# queue of 3.1.8\n# - a.patch: already in 3.1.8\n")
    monkeypatch.setenv("USE_AIRFLOW_VERSION", "3.1.8")
    assert series_status.not_carried(root) == [
        ("a.patch", "already in 3.1.8"),
        ("b.patch", "no reason recorded in its series"),
    ]
    monkeypatch.delenv("USE_AIRFLOW_VERSION")
    assert series_status.not_carried(root) == []
