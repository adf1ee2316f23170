"""scripts/ci/tree.py refuses bad input and leaves airflow-core/ as it was (needs git and the sdist)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TREE = ROOT / "scripts" / "ci" / "tree.py"
HEADER = "# test series\n"


def run_tree(root: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(TREE), "--root", str(root), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )


def snapshot(tree: Path) -> tuple[str, str]:
    head = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout
    status = subprocess.run(["git", "-C", str(tree), "status", "--porcelain"], capture_output=True, text=True)
    return head, status.stdout


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A project root with the real pinned base and an empty series."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "patches").mkdir()
    (tmp_path / "patches" / "series").write_text(HEADER)
    return tmp_path


def test_wrong_sha256_is_refused(project: Path):
    text = (project / "pyproject.toml").read_text()
    expected = text.split('"3.3.2" = "')[1].split('"')[0]
    (project / "pyproject.toml").write_text(text.replace(expected, "0" * 64))
    proc = run_tree(project, "prepare")
    assert proc.returncode == 1
    assert "sha256 mismatch" in proc.stderr
    assert "expected " + "0" * 64 in proc.stderr and f"got {expected}" in proc.stderr
    assert not (project / "airflow-core").exists()


def test_broken_patch_names_patch_file_hunk_and_leaves_tree(project: Path):
    assert run_tree(project, "prepare").returncode == 0
    tree = project / "airflow-core"
    before = snapshot(tree)
    # A patch whose context no longer matches the release (as after a rebase onto another version).
    target = "src/airflow/callbacks/database_callback_sink.py"
    lines = (tree / target).read_text().splitlines()
    n = next(i for i, line in enumerate(lines) if "session.add(db_callback)" in line)
    patch = (
        "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
        "From: Tester <t@example.com>\nDate: Sun, 29 Nov 2026 00:00:00 +0000\nSubject: [PATCH] Broken\n\n---\n"
        f"diff --git a/airflow-core/{target} b/airflow-core/{target}\n"
        f"--- a/airflow-core/{target}\n+++ b/airflow-core/{target}\n"
        f"@@ -{n + 1},1 +{n + 1},2 @@\n-        session.add(no_such_line)\n+        pass\n+        pass\n"
    )
    (project / "patches" / "broken.patch").write_text(patch)
    (project / "patches" / "series").write_text(HEADER + "broken.patch\n")
    proc = run_tree(project, "prepare")
    assert proc.returncode == 1
    assert f"patch broken.patch does not apply: file airflow-core/{target}, hunk @@ -{n + 1},1" in proc.stderr
    assert snapshot(tree) == before
    assert sorted(p.name for p in project.iterdir() if p.name != ".airflow-core.lock") == [
        "airflow-core",
        "patches",
        "pyproject.toml",
    ]


def test_unknown_patch_in_series_is_named(project: Path):
    (project / "patches" / "series").write_text(HEADER + "missing.patch\n")
    proc = run_tree(project, "prepare")
    assert proc.returncode == 1
    assert "missing.patch" in proc.stderr


def test_unknown_base_is_refused_listing_the_supported_ones(project: Path):
    proc = run_tree(project, "prepare", env={"USE_AIRFLOW_VERSION": "3.0.9"})
    assert proc.returncode == 1
    assert "USE_AIRFLOW_VERSION=3.0.9 is not a supported base; supported: 3.3.2, 3.2.2, 3.1.8" in proc.stderr
    assert not list(project.glob("airflow-core*"))


def test_each_base_has_its_own_tree_and_queue(project: Path):
    """USE_AIRFLOW_VERSION=3.1.8 builds airflow-core-3.1.8/ from patches/3.1.8/series; airflow-core/ stays."""
    assert run_tree(project, "prepare").returncode == 0
    before = snapshot(project / "airflow-core")
    (project / "patches" / "3.1.8").mkdir()
    (project / "patches" / "3.1.8" / "series").write_text(HEADER)
    proc = run_tree(project, "prepare", env={"USE_AIRFLOW_VERSION": "3.1.8"})
    assert proc.returncode == 0, proc.stderr
    assert "airflow-core-3.1.8/ built: apache-airflow-core 3.1.8" in proc.stdout
    log = ["git", "-C", str(project / "airflow-core-3.1.8"), "log", "--format=%s", "base"]
    assert subprocess.run(log, capture_output=True, text=True).stdout.startswith("apache-airflow-core 3.1.8")
    assert snapshot(project / "airflow-core") == before
    assert "up to date: 3.3.2" in run_tree(project, "prepare").stdout


def test_checkout_without_a_tree_is_one_line(project: Path):
    """Before: git's two-line `fatal: cannot change to ...` (issue 31)."""
    proc = run_tree(project, "checkout", "1")
    assert proc.returncode == 1 and proc.stderr == (
        "tree.py checkout: airflow-core/ does not exist or was not made by this tool: `nox -s prepare` builds it\n"
    )


def test_refresh_names_the_tree_of_the_selected_base(project: Path):
    """Before: "airflow-core/ has uncommitted changes" for an edit in airflow-core-3.4.0b2/ (issue 31)."""
    (project / "patches" / "3.4.0b2").mkdir()
    (project / "patches" / "3.4.0b2" / "series").write_text(HEADER)
    other = {"USE_AIRFLOW_VERSION": "3.4.0b2"}
    assert run_tree(project, "prepare", env=other).returncode == 0
    readme = project / "airflow-core-3.4.0b2" / "README.md"
    readme.write_text(readme.read_text() + "# local edit\n")
    proc = run_tree(project, "refresh", env=other)
    assert proc.returncode == 1
    assert proc.stderr.startswith("tree.py refresh: airflow-core-3.4.0b2/ has uncommitted changes"), (
        proc.stderr
    )
