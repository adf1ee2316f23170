"""A throwaway project with a real series: the pinned base from the sdist plus commits made in its tree.

Helper for the tooling tests (not collected: no ``test_`` prefix). Needs git and the sdist (pip, cached).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TREE = ROOT / "scripts" / "ci" / "tree.py"
SINK = "src/airflow/callbacks/database_callback_sink.py"
TRAILERS = "Bug: https://github.com/apache/airflow/issues/42553\nOrigin: self\nForwarded: no\n"


def message(
    subject: str, body: str = "Say what and why.", ref: str = "closes: #42553", trailers: str = TRAILERS
):
    return f"{subject}\n\n{body}\n\n{ref}\n\n{trailers}"


def run_tree(root: Path, *args: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(TREE), "--root", str(root), *args], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


def make_project(root: Path, commits: list[tuple[dict[str, Callable[[str], str]], str]]) -> Path:
    """Build ``root``: base + one patch per (edits: path -> old text -> new text, commit message)."""
    (root / "patches").mkdir(parents=True)
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    (root / "patches" / "series").write_text("# test series\n")
    run_tree(root, "prepare")
    core = root / "airflow-core"
    env = ["-c", "user.name=Tester", "-c", "user.email=t@example.com"]
    for edits, msg in commits:
        for path, edit in edits.items():
            target = core / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(edit(target.read_text() if target.exists() else ""))
        subprocess.run(["git", "-C", str(core), "add", "-A"], check=True)
        subprocess.run(
            ["git", "-C", str(core), *env, "commit", "-q", "-F", "-"], input=msg, text=True, check=True
        )
    run_tree(root, "refresh")
    return root


def add_flush(text: str) -> str:
    """A clean change: flush the callback row in the caller's session."""
    return text.replace(
        "        session.add(db_callback)\n", "        session.add(db_callback)\n        session.flush()\n"
    )
