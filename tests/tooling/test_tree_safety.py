"""tree.py never loses work: refresh, prepare, signals, bad input and the lock (issue 15, cases 2, 3, 7, 8, 9).

Each test builds a throwaway project with a real series on the pinned base (needs git and the sdist).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from seriesproject import ROOT, SINK, TREE, add_flush, make_project, message  # noqa: E402

ENV = ["-c", "user.name=Tester", "-c", "user.email=t@example.com"]


def weight_2(text: str) -> str:
    return text.replace("priority_weight=1)", "priority_weight=2)")


def comment_line(text: str) -> str:
    return text.replace(
        "        session.add(db_callback)\n", "        # stored below\n        session.add(db_callback)\n"
    )


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """Three patches: flush, weight 2, a comment; patches/series with the user's own comments."""
    root = make_project(
        tmp_path / "project",
        [
            ({SINK: add_flush}, message("Flush the callback row")),
            ({SINK: weight_2}, message("Give the callback row weight 2")),
            ({SINK: comment_line}, message("Comment the callback row")),
        ],
    )
    series = root / "patches" / "series"
    lines = series.read_text().splitlines()
    series.write_text(
        "\n".join([lines[0], "# mine: keep this note", *lines[1:3], "# before the third", lines[3]]) + "\n"
    )
    tree(root, "refresh")  # writes the same series back (and must keep the comments)
    return root


def tree(root: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(TREE), "--root", str(root), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


def git(repo: Path, *args: str, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(repo), *ENV, *args], capture_output=True, text=True, **kw)


def patches_state(root: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted((root / "patches").iterdir())}


def listing(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name != ".airflow-core.lock")  # the tree lock stays


def one_line_error(proc: subprocess.CompletedProcess[str], *expected: str) -> None:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    for text in expected:
        assert text in proc.stderr, proc.stderr


# --- case 2: refresh ---------------------------------------------------------------------------


def test_refresh_keeps_comment_lines_of_the_series(project: Path):
    text = (project / "patches" / "series").read_text()
    assert "# mine: keep this note\n" in text and "# before the third\n" in text
    core = project / "airflow-core"
    git(core, "commit", "-q", "--amend", "-m", message("Comment the callback row in the sink"))
    assert tree(project, "refresh").returncode == 0
    lines = (project / "patches" / "series").read_text().splitlines()
    assert lines[1] == "# mine: keep this note"
    assert lines[-2:] == ["# before the third", "Comment-the-callback-row-in-the-sink.patch"]


def test_refresh_refuses_a_head_off_the_series_and_changes_nothing(project: Path):
    before = patches_state(project)
    core = project / "airflow-core"
    assert tree(project, "checkout", "1").returncode == 0
    (core / SINK).write_text((core / SINK).read_text() + "\n# more\n")
    git(core, "commit", "-q", "-a", "-m", message("Add a note"))
    series_tip = git(core, "rev-parse", "series").stdout
    proc = tree(project, "refresh")
    one_line_error(proc, "not on top of the full series")
    assert patches_state(project) == before
    assert git(core, "rev-parse", "series").stdout == series_tip


def test_refresh_refuses_during_a_rebase_and_the_rebase_can_continue(project: Path):
    before = patches_state(project)
    core = project / "airflow-core"
    editor = {"GIT_SEQUENCE_EDITOR": "sed -i '1s/^pick/edit/'"}
    assert git(core, "rebase", "-i", "base", env={**os.environ, **editor}).returncode == 0
    git(core, "commit", "-q", "--amend", "-m", message("Flush the callback row at once"))
    proc = tree(project, "refresh")
    one_line_error(proc, "a rebase is in progress")
    assert patches_state(project) == before
    done = git(core, "rebase", "--continue", env={**os.environ, "GIT_EDITOR": "true"})
    assert done.returncode == 0, done.stderr
    assert tree(project, "refresh").returncode == 0
    assert "Flush-the-callback-row-at-once.patch" in (project / "patches" / "series").read_text()


@pytest.mark.parametrize("command", [["prepare"], ["checkout", "0"]])
def test_prepare_and_checkout_refuse_during_a_rebase_and_the_rebase_can_continue(project: Path, command):
    # Stopped at `edit` with nothing changed yet: no uncommitted change, no commit above the series; moving
    # HEAD to the series here (as prepare did) made `git rebase --continue` re-apply patches onto themselves.
    core = project / "airflow-core"
    editor = {"GIT_SEQUENCE_EDITOR": "sed -i '2s/^pick/edit/'"}
    assert git(core, "rebase", "-i", "base", env={**os.environ, **editor}).returncode == 0
    head = git(core, "rev-parse", "HEAD").stdout
    proc = tree(project, *command)
    one_line_error(proc, "a rebase is in progress in airflow-core/", "git rebase --continue")
    assert git(core, "rev-parse", "HEAD").stdout == head
    assert (core / ".git" / "rebase-merge").is_dir()
    git(core, "commit", "-q", "--amend", "-m", message("Give the callback row weight 2 at once"))
    done = git(core, "rebase", "--continue", env={**os.environ, "GIT_EDITOR": "true"})
    assert done.returncode == 0, done.stderr
    assert tree(project, "refresh").returncode == 0
    assert "Give-the-callback-row-weight-2-at-once.patch" in (project / "patches" / "series").read_text()


@pytest.mark.parametrize("change", ["edit", "pull"])
def test_refresh_refuses_to_overwrite_patches_changed_since_the_tree_was_built(project: Path, change):
    # A patch edited by hand in patches/ (or a pulled series) after airflow-core/ was built: refresh writes
    # the tree's older patches back over it. It must refuse and leave patches/ alone.
    queue = project / "patches"
    first = (project / "patches" / "series").read_text().splitlines()[2]
    patch = queue / first
    if change == "edit":
        patch.write_text(patch.read_text().replace("Subject: [PATCH] Flush", "Subject: [PATCH] Flush now"))
    else:
        series = queue / "series"
        series.write_text("\n".join(series.read_text().splitlines()[:-1]) + "\n")
    before = patches_state(project)
    proc = tree(project, "refresh")
    one_line_error(proc, "patches/ changed since airflow-core/ was built from it")
    assert patches_state(project) == before


@pytest.fixture
def python_sigint():
    """Ctrl-C raises KeyboardInterrupt here, also where the session was started with SIGINT ignored
    (``nohup nox ... &``: Python then installs no handler of its own)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
def another_thread():
    """A second thread that does not hold signals: the kernel may give a process-directed signal to it."""
    done = threading.Event()
    thread = threading.Thread(target=done.wait, args=(60,), daemon=True)
    thread.start()
    yield
    done.set()
    thread.join(timeout=10)


def test_ctrl_c_during_refresh_leaves_patches_all_old_or_all_new(
    project: Path, monkeypatch, python_sigint, another_thread
):
    sys.path.insert(0, str(TREE.parent))
    import tree as tree_py

    core = project / "airflow-core"
    editor = {"GIT_SEQUENCE_EDITOR": "sed -i '2s/^pick/edit/'"}
    assert git(core, "rebase", "-i", "base", env={**os.environ, **editor}).returncode == 0
    git(core, "commit", "-q", "--amend", "-m", message("Give the callback row weight 2", body="A new body."))
    assert git(core, "rebase", "--continue", env={**os.environ, "GIT_EDITOR": "true"}).returncode == 0
    replace, calls = os.replace, []

    def interrupted_replace(src, dst):  # Ctrl-C lands between the first and the second patch written
        calls.append(dst)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        replace(src, dst)

    monkeypatch.setattr(tree_py.os, "replace", interrupted_replace)
    with pytest.raises(KeyboardInterrupt):
        tree_py.refresh(project)
    monkeypatch.undo()
    assert len(calls) == 3  # every patch was written before the interrupt was delivered
    assert "A new body." in (project / "patches" / "Give-the-callback-row-weight-2.patch").read_text()
    proc = tree(project, "refresh")  # the tree's stamp matches patches/: a rerun finds it consistent
    assert proc.returncode == 0, proc.stderr


def test_refresh_never_deletes_a_file_that_is_not_a_patch_of_the_series(project: Path):
    (project / "patches" / "my-draft.patch").write_text("not in the series yet\n")
    core = project / "airflow-core"
    git(core, "commit", "-q", "--amend", "-m", message("Comment the callback row in the sink"))
    assert tree(project, "refresh").returncode == 0
    assert (project / "patches" / "my-draft.patch").read_text() == "not in the series yet\n"
    assert not (project / "patches" / "Comment-the-callback-row.patch").exists()  # the old series' patch


def test_refresh_refuses_to_write_an_empty_series(project: Path):
    before = patches_state(project)
    core = project / "airflow-core"
    git(core, "reset", "-q", "--hard", "base")  # on branch series: the series itself now ends at base
    one_line_error(tree(project, "refresh"), "no commit above base")
    assert patches_state(project) == before


# --- case 3: rebuilding airflow-core/ ------------------------------------------------------------


def make_untracked(core: Path) -> str:
    (core / "notes.txt").write_text("my notes\n")
    return "untracked: notes.txt"


def make_branch(core: Path) -> str:
    git(core, "branch", "experiment", "series~1")
    return "branch: experiment"


def make_stash(core: Path) -> str:
    (core / SINK).write_text((core / SINK).read_text() + "\n# wip\n")
    git(core, "stash", "-q")
    return "stash: 1 entry"


@pytest.mark.parametrize(
    "make", [make_untracked, make_branch, make_stash], ids=["untracked", "branch", "stash"]
)
def test_rebuild_refuses_to_drop_work_and_names_it(project: Path, make):
    core = project / "airflow-core"
    what = make(core)
    state = (
        git(core, "rev-parse", "HEAD").stdout,
        git(core, "stash", "list").stdout,
        git(core, "branch").stdout,
    )
    # The series changed (e.g. after a pull): the tree must be rebuilt, but it holds work.
    series = project / "patches" / "series"
    series.write_text("\n".join(series.read_text().splitlines()[:-1]) + "\n")
    proc = tree(project, "prepare")
    one_line_error(proc, "airflow-core/ not rebuilt", what)
    assert state == (
        git(core, "rev-parse", "HEAD").stdout,
        git(core, "stash", "list").stdout,
        git(core, "branch").stdout,
    )
    if what.startswith("untracked"):
        assert (core / "notes.txt").read_text() == "my notes\n"


def test_prepare_refuses_a_git_repository_it_did_not_make(tmp_path: Path):
    root = make_project(tmp_path / "project", [])
    core = root / "airflow-core"
    subprocess.run(["rm", "-rf", str(core)], check=True)
    core.mkdir()
    git(core, "init", "-q")
    (core / "mine.py").write_text("x = 1\n")
    git(core, "add", "-A")
    git(core, "commit", "-q", "-m", "my own work")
    one_line_error(tree(root, "prepare"), "not made by this tool")
    assert (core / "mine.py").read_text() == "x = 1\n"
    assert git(core, "log", "--format=%s").stdout == "my own work\n"


# --- case 7: signals during prepare -------------------------------------------------------------


def start_prepare_and_wait_for_its_temp_dir(root: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, str(TREE), "--root", str(root), "prepare"], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    deadline = time.monotonic() + 60
    while not list(root.glob("airflow-core.*/airflow-core")):
        assert proc.poll() is None and time.monotonic() < deadline, "prepare never made its temp dir"
        time.sleep(0.05)  # polling for a file another process creates, bounded
    return proc


@pytest.fixture
def base_project(tmp_path: Path) -> Path:
    root = make_project(tmp_path / "project", [])
    subprocess.run(["rm", "-rf", str(root / "airflow-core")], check=True)
    return root


def test_sigterm_during_prepare_leaves_no_temp_dir(base_project: Path):
    proc = start_prepare_and_wait_for_its_temp_dir(base_project)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert listing(base_project) == ["patches", "pyproject.toml"]


def test_a_later_prepare_removes_the_temp_dir_of_a_killed_one_and_nothing_else(base_project: Path):
    proc = start_prepare_and_wait_for_its_temp_dir(base_project)
    proc.kill()
    proc.communicate(timeout=60)
    (base_project / "airflow-core.mine").mkdir()  # a user's folder that only looks like ours
    (base_project / "airflow-core.mine" / "keep.txt").write_text("keep\n")
    assert tree(base_project, "prepare").returncode == 0
    assert listing(base_project) == ["airflow-core", "airflow-core.mine", "patches", "pyproject.toml"]


# --- case 8: bad input, one clear line ----------------------------------------------------------


def test_ctrl_c_between_the_old_tree_moved_away_and_the_new_one_moved_in_keeps_a_tree(
    project: Path, monkeypatch, python_sigint
):
    sys.path.insert(0, str(TREE.parent))
    import tree as tree_py

    series = project / "patches" / "series"  # the series changed (a pull): prepare rebuilds the tree
    series.write_text("\n".join(series.read_text().splitlines()[:-1]) + "\n")
    rename = Path.rename

    def interrupted_rename(self, target):  # Ctrl-C right after the old tree is moved away
        result = rename(self, target)
        if self == project / "airflow-core":
            os.kill(os.getpid(), signal.SIGINT)
        return result

    monkeypatch.setattr(Path, "rename", interrupted_rename)
    with pytest.raises(KeyboardInterrupt):
        tree_py.prepare(project)
    monkeypatch.undo()
    core = project / "airflow-core"
    assert git(core, "log", "-1", "--format=%s").stdout == "Give the callback row weight 2\n"  # the new tree
    assert not list(project.glob("airflow-core.*"))


def test_duplicate_series_line_is_named(project: Path):
    series = project / "patches" / "series"
    first = (project / "patches" / "series").read_text().splitlines()[2]
    series.write_text(series.read_text() + first + "\n")
    one_line_error(tree(project, "prepare"), f"{first} is listed twice")
    status = subprocess.run([sys.executable, str(ROOT / "scripts/ci/series_status.py"), "--root", str(project)],
                            capture_output=True, text=True)  # fmt: skip
    one_line_error(status, f"{first} is listed twice")


def test_crlf_patch_is_named(project: Path):
    series = project / "patches" / "series"
    first = series.read_text().splitlines()[2]
    patch = project / "patches" / first
    patch.write_bytes(patch.read_bytes().replace(b"\n", b"\r\n"))
    subprocess.run(["rm", "-rf", str(project / "airflow-core")], check=True)
    one_line_error(tree(project, "prepare"), f"patches/{first}: CRLF line ends")


def test_empty_series_beside_patches_is_refused(project: Path):
    (project / "patches" / "series").write_text("# emptied by a bad merge\n")
    one_line_error(tree(project, "prepare"), "patches/series lists no patch", "3 .patch file(s)")


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ('version = "3.3.2"', 'verison = "3.3.2"', "unknown key `verison`"),
        ('version = "3.3.2"', 'version = "3.3.2', "pyproject.toml is not valid TOML"),
        ('version = "3.3.2"', 'version = "v3.3.2"', "'v3.3.2' is not a release number"),
    ],
    ids=["unknown-key", "toml-syntax", "version-typo"],
)
def test_pyproject_mistakes_are_one_line_errors(
    project: Path, tmp_path: Path, old: str, new: str, expected: str
):
    pyproject = project / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace(old, new, 1))
    cache = tmp_path / "cache"
    one_line_error(tree(project, "prepare", env={"XDG_CACHE_HOME": str(cache)}), expected)
    assert not cache.exists() or not list(cache.rglob("*.tar.gz"))  # nothing downloaded


def test_refresh_without_a_tree_says_so(project: Path):
    subprocess.run(["rm", "-rf", str(project / "airflow-core")], check=True)
    one_line_error(tree(project, "refresh"), "airflow-core/ does not exist")


# --- case 9: the lock ---------------------------------------------------------------------------


def test_tree_is_not_moved_while_another_session_holds_it(project: Path):
    core = project / "airflow-core"
    head = git(core, "rev-parse", "HEAD").stdout
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, tree; from pathlib import Path\n"
         "with tree.locked(Path(sys.argv[1]), 'nox -s verify-series-postgres'):\n"
         "    print('held', flush=True); sys.stdin.read()", str(project)],
        cwd=ROOT / "scripts" / "ci", stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        proc = tree(project, "checkout", "1", env={"SERIES_LOCK_TIMEOUT": "1"})
        assert proc.returncode == 1
        assert "airflow-core/ is in use by nox -s verify-series-postgres" in proc.stderr
        assert git(core, "rev-parse", "HEAD").stdout == head
        assert tree(project, "refresh", env={"SERIES_LOCK_TIMEOUT": "1"}).returncode == 1
    finally:
        holder.communicate("", timeout=30)
    assert tree(project, "checkout", "1").returncode == 0


LOCK_IN_ANOTHER_PROCESS = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import tree
with tree.locked(Path(sys.argv[2]), "the other process"):
    print("locked")
"""


def test_each_base_locks_its_own_tree(tmp_path: Path, monkeypatch):
    """.ci/run tests the bases at once: a session of one base must not wait for (and fail on) another's lock."""
    import tomllib

    sys.path.insert(0, str(TREE.parent))
    import tree as tree_py

    (tmp_path / "pyproject.toml").write_bytes((ROOT / "pyproject.toml").read_bytes())
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["airflow-series"]
    other = next(version for version in cfg["bases"] if version != cfg["version"])
    for name in ("USE_AIRFLOW_VERSION", "AIRFLOW_SERIES_TREE_LOCK"):
        monkeypatch.delenv(name, raising=False)
    env = {**os.environ, "SERIES_LOCK_TIMEOUT": "0"}
    cmd = [sys.executable, "-c", LOCK_IN_ANOTHER_PROCESS, str(TREE.parent), str(tmp_path)]
    with tree_py.locked(tmp_path, "this test"):
        same = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
        another = subprocess.run(
            cmd, env={**env, "USE_AIRFLOW_VERSION": other}, capture_output=True, text=True, timeout=60
        )
    assert same.returncode == 1 and "airflow-core/ is in use by this test" in same.stderr
    assert another.returncode == 0 and another.stdout == "locked\n", another.stderr
