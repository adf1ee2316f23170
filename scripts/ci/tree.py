#!/usr/bin/env python3
"""
Materialise ``airflow-core/`` from the pinned PyPI sdist and the patch series, and write it back.

``airflow-core/`` is a git repository (the patch-queue workflow): its first commit, tagged ``base``, is
the pristine release; each patch in ``patches/series`` is one commit on branch ``series`` above it.

Commands (run from anywhere; ``--root`` is the project root, default: this file's project):

* ``prepare``   download the sdist (pip, package index only), check its sha256, unpack it in upstream
  layout and ``git am`` the series. Idempotent: a tree already built from the same sdist and series is
  left alone. A tree with work not yet written back (commits above the series, or uncommitted edits)
  is refused, never overwritten; so is a tree with a rebase/am/cherry-pick/merge in
  progress (``checkout`` too). On any error the previous ``airflow-core/`` is left exactly as it was.
* ``checkout K`` put the tree at base + the first K patches (``all`` for the whole series); cheap, the
  editable install follows the working tree.
* ``refresh``   rewrite ``patches/`` and ``patches/series`` from the commits ``base..HEAD``. HEAD must be
  the tip of branch ``series`` or above it, with no rebase/am/cherry-pick/merge in progress, and
  ``patches/`` must be what the tree was built (or last refreshed) from; the comment
  lines of ``patches/series`` are kept and only the files of the old series are replaced or removed.

A rebuild refuses to drop anything the tree holds beyond the series (uncommitted or untracked files,
commits, other branches or tags, stashes) and a repository it did not make. Commands that move the tree
take a lock of that base's tree (``.airflow-core.lock``, ``.airflow-core-<version>.lock``): a second one waits up to ``SERIES_LOCK_TIMEOUT`` seconds (120), then
refuses. SIGTERM/SIGHUP unwind like Ctrl-C: no temporary folder is left, and ``refresh`` holds them
while it writes ``patches/`` (all old or all new); one left by a killed run
(SIGKILL) is removed by the next ``prepare``.

Errors exit with status 1 and a one-line message naming the cause (patch, file, hunk; expected vs got
sha256; the pyproject.toml key).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import tomllib
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[2]
# Fixed identity and dates make the base commit (and so every patch commit) reproducible.
GIT_ENV = {
    "GIT_AUTHOR_NAME": "airflow-core-series",
    "GIT_AUTHOR_EMAIL": "series@localhost",
    "GIT_COMMITTER_NAME": "airflow-core-series",
    "GIT_COMMITTER_EMAIL": "series@localhost",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z",
}
STAMP = "series-stamp"
STAMP_HEAD = "series-head"  # the commit patches/ was last built from or written back from
TEMP_MARK = ".made-by-tree-py"  # in our airflow-core.XXXX/ build folders: a killed run's is ours to remove
LOCK_ENV = "AIRFLOW_SERIES_TREE_LOCK"  # set while this process (or a parent) holds the lock: its path
KEYS = ("package", "version", "bases", "pins")
SELECT_ENV = "USE_AIRFLOW_VERSION"  # breeze's variable: which supported base to build and test
VERSION = re.compile(r"\d+(\.\d+)+((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?")  # as on PyPI: 3.3.2, 3.1.0rc1
SERIES_HEADER = (
    "# The patch series, applied in this order onto the pinned base (quilt format: one file per line).\n"
)


class TreeError(Exception):
    """A refusal with a message that names its cause."""


def read_config(root: Path) -> dict:
    """Return ``[tool.airflow-series]`` of ``root/pyproject.toml``, checked: known keys, release numbers,
    a sha256 per base, the default ``version`` among the ``bases``."""
    try:
        data = tomllib.loads((root / "pyproject.toml").read_text())
    except FileNotFoundError:
        raise TreeError(f"{root / 'pyproject.toml'} not found") from None
    except tomllib.TOMLDecodeError as e:
        raise TreeError(f"pyproject.toml is not valid TOML: {e}") from None
    cfg = data.get("tool", {}).get("airflow-series")
    if not isinstance(cfg, dict):
        raise TreeError("pyproject.toml has no [tool.airflow-series] table")
    where = "pyproject.toml [tool.airflow-series]"
    for key in cfg:
        if key not in KEYS:
            raise TreeError(f"{where}: unknown key `{key}` (known: {', '.join(KEYS)})")
    for key in KEYS[:2]:
        if not isinstance(cfg.get(key), str):
            raise TreeError(f"{where}: `{key}` is missing or not a string")
    pins = cfg.get("pins", {})
    if not isinstance(pins, dict) or any(
        v not in cfg.get("bases", {}) or not isinstance(r, list) or not all(isinstance(x, str) for x in r)
        for v, r in pins.items()
    ):
        raise TreeError(f"{where}: `pins` maps a base to a list of requirement strings: {pins!r}")
    if not isinstance(cfg.get("bases"), dict) or not cfg["bases"]:
        raise TreeError(f"{where}: `bases` (release = sdist sha256) is missing or empty")
    for version, sha in {cfg["version"]: cfg["bases"].get(cfg["version"], ""), **cfg["bases"]}.items():
        if not VERSION.fullmatch(version):
            raise TreeError(f"{where}: version {version!r} is not a release number like '3.3.2'")
        if not re.fullmatch(r"[0-9a-f]{64}", str(sha)):
            raise TreeError(f"{where}: the sha256 of {version} is not 64 hex digits: {sha!r}")
    return cfg


def base_config(root: Path) -> dict[str, str]:
    """The base under test: package, version, sdist-sha256 (``USE_AIRFLOW_VERSION``, else the default)."""
    cfg = read_config(root)
    version = os.environ.get(SELECT_ENV) or cfg["version"]
    if version not in cfg["bases"]:
        raise TreeError(
            f"{SELECT_ENV}={version} is not a supported base; supported: {', '.join(cfg['bases'])} "
            f"(default {cfg['version']}; pyproject.toml [tool.airflow-series.bases])"
        )
    return {"package": cfg["package"], "version": version, "sdist-sha256": cfg["bases"][version]}


def cfg_version(root: Path) -> str:
    return base_config(root)["version"]


def is_default(root: Path) -> bool:
    return base_config(root)["version"] == read_config(root)["version"]


def core_dir(root: Path) -> Path:
    """The generated tree of the selected base: ``airflow-core/`` (default base), ``airflow-core-<v>/``."""
    return root / ("airflow-core" if is_default(root) else f"airflow-core-{base_config(root)['version']}")


def patches_dir(root: Path) -> Path:
    """The queue of the selected base: ``patches/`` (default base), ``patches/<version>/``."""
    return root / "patches" if is_default(root) else root / "patches" / base_config(root)["version"]


def series_names(root: Path) -> list[tuple[int, str]]:
    """(line number, name) of each patch line of ``patches/series`` (quilt format, ``#`` comments)."""
    path = patches_dir(root) / "series"
    if not path.is_file():
        raise TreeError(f"{path} not found")
    lines = path.read_text().splitlines()
    return [
        (n, line.split("#", 1)[0].strip()) for n, line in enumerate(lines, 1) if line.split("#", 1)[0].strip()
    ]


def patch_file_problem(patch: Path) -> str | None:
    """Why ``patch`` cannot be a ``git format-patch`` file (empty, CRLF line ends), or None."""
    data = patch.read_bytes()
    if not data.strip():
        return "the file is empty"
    if data.split(b"\n", 1)[0].endswith(b"\r"):
        return "CRLF line ends (saved on Windows?): convert it back, e.g. `sed -i 's/\\r$//' FILE`"
    return None


def series(root: Path) -> list[Path]:
    """Return the patch files named in ``patches/series`` in order; refuse duplicates, missing or bad files."""
    seen: dict[str, int] = {}
    for n, name in series_names(root):
        if name in seen:
            raise TreeError(f"patches/series: {name} is listed twice (lines {seen[name]} and {n})")
        seen[name] = n
    queue = patches_dir(root)
    missing = [n for n in seen if not (queue / n).is_file()]
    if missing:
        raise TreeError(f"patches/series names {', '.join(missing)}, not found in patches/")
    others = sorted(queue.glob("*.patch"))
    if not seen and others:
        raise TreeError(
            f"patches/series lists no patch, but patches/ holds {len(others)} .patch file(s): "
            "restore it (`git checkout patches/series`) or delete the patches you mean to drop"
        )
    for name in seen:
        if why := patch_file_problem(queue / name):
            raise TreeError(f"{queue.relative_to(root)}/{name}: {why}")
    return [queue / n for n in seen]


def lock_file(root: Path) -> Path:
    """The lock of the selected base's tree: ``.airflow-core.lock``, ``.airflow-core-<v>.lock`` (bases apart)."""
    return root / f".{core_dir(root).name}.lock"


@contextlib.contextmanager
def locked(root: Path, purpose: str):
    """Hold the tree lock of ``root`` (waiting up to SERIES_LOCK_TIMEOUT s); no-op if a parent holds it."""
    root = root.resolve()
    path = lock_file(root)
    if os.environ.get(LOCK_ENV) == str(path):
        yield
        return
    with open(path, "a+") as f:
        timeout, deadline = float(os.environ.get("SERIES_LOCK_TIMEOUT", "120")), None
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = path.read_text().strip() or "another process"
                if deadline is None:
                    deadline = time.monotonic() + timeout
                    print(f"{path.stem[1:]}/ is in use by {holder}; waiting up to {timeout:.0f} s "
                          "(SERIES_LOCK_TIMEOUT)", file=sys.stderr, flush=True)  # fmt: skip
                elif time.monotonic() > deadline:
                    raise TreeError(
                        f"{path.stem[1:]}/ is in use by {holder}: not touched; run again when it has finished"
                    ) from None
                time.sleep(0.2)  # polling a lock, bounded by the deadline
        f.truncate(0)
        f.write(f"{purpose} (pid {os.getpid()})\n")
        f.flush()
        os.environ[LOCK_ENV] = str(path)
        try:
            yield
        finally:
            del os.environ[LOCK_ENV]
            f.truncate(0)


def exit_on_hangup() -> None:
    """Make SIGTERM and SIGHUP act like Ctrl-C: SIGINT to our child processes (as a terminal sends it to
    the whole process group), KeyboardInterrupt here, so ``finally`` clean-ups run and no child outlives us."""

    def interrupt(signum, frame):
        for children in Path("/proc/self/task").glob("*/children"):  # Linux
            for pid in children.read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGINT)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupt)


def stop_processes_with(variable: str, timeout: float = 30) -> None:
    """Interrupt and wait (bounded) for every process whose environment holds ``variable`` (``NAME=value``).

    A signal that lands while nox starts a command can leave that command running without nox knowing it;
    called before a session's temporary folder is removed, so that nothing writes into it afterwards.
    """
    deadline = time.monotonic() + timeout
    sig = signal.SIGINT
    while True:
        pids = []
        for environ in Path("/proc").glob("[0-9]*/environ"):  # Linux
            with contextlib.suppress(OSError):
                if variable.encode() in environ.read_bytes().split(b"\0"):
                    pids.append(int(environ.parent.name))
        if not pids:
            return
        if time.monotonic() > deadline + 10:
            print(
                f"processes {pids} survive SIGKILL (using {variable}); not waiting for them", file=sys.stderr
            )
            return
        if time.monotonic() > deadline:
            sig = signal.SIGKILL
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        time.sleep(0.2)  # polling for the processes to exit; bounded by the deadline and SIGKILL


def git(tree: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **GIT_ENV}
    return subprocess.run(
        ["git", "-C", str(tree), *args], env=env, text=True, capture_output=True, check=check
    )


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "airflow-core-series"


def fetch_sdist(cfg: dict[str, str]) -> Path:
    """Return the path of the sha256-checked sdist, downloading it with pip if it is not cached."""
    dest = cache_dir()
    dest.mkdir(parents=True, exist_ok=True)
    name = cfg["package"].replace("-", "_")
    found = sorted(dest.glob(f"{name}-{cfg['version']}.tar.gz"))
    if not found:
        spec = f"{cfg['package']}=={cfg['version']}"
        # A venv made by uv has no pip: use uv's ephemeral pip there.
        pip = [sys.executable, "-m", "pip"] if importlib.util.find_spec("pip") else ["uvx", "pip"]
        # the sdist of the package only: its build backend comes as wheels (":all:" builds those from source too)
        cmd = [*pip, "download", "--no-deps", "--no-binary", cfg["package"], "-d", str(dest)]
        proc = subprocess.run([*cmd, spec], text=True, capture_output=True)
        found = sorted(dest.glob(f"{name}-{cfg['version']}.tar.gz"))
        if proc.returncode or not found:
            raise TreeError(
                f"could not download the sdist of {spec} (pip download): {pip_error(proc.stderr)}"
            )
    sdist = found[0]
    got = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if got != cfg["sdist-sha256"]:
        raise TreeError(
            f"sha256 mismatch for {sdist.name}: expected {cfg['sdist-sha256']} (pyproject.toml), got {got}; "
            "refusing to use it, nothing was changed"
        )
    return sdist


def pip_error(stderr: str) -> str:
    """pip's error in one line: its last ERROR, and why the package index could not be reached (if so)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line.removeprefix("ERROR: ") for line in lines if line.startswith("ERROR:")]
    last = errors[-1] if errors else (lines[-1] if lines else "(no output)")
    network = re.compile(
        r"(Failed to establish a new connection: [^'\"]*|Name or service not known"
        r"|Temporary failure in name resolution|Read timed out|Connection refused)"
    )
    cause = next((m[1].rstrip(") ") for line in lines if (m := network.search(line))), None)
    return f"{last} (the package index is not reachable: {cause})" if cause else last


def stamp_of(cfg: dict[str, str], patches: list[Path]) -> str:
    h = hashlib.sha256(cfg["sdist-sha256"].encode())
    for p in patches:
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


IN_PROGRESS = {
    "rebase-merge": ("a rebase", "rebase"),
    "rebase-apply": ("a rebase or `git am`", "rebase"),
    "CHERRY_PICK_HEAD": ("a cherry-pick", "cherry-pick"),
    "MERGE_HEAD": ("a merge", "merge"),
    "REVERT_HEAD": ("a revert", "revert"),
}


def in_progress(tree: Path) -> str | None:
    """Return "<a rebase> is in progress ... (finish or abort it)" if git is in the middle of one, or None."""
    for name, (what, cmd) in IN_PROGRESS.items():
        if (tree / ".git" / name).exists():
            return (
                f"{what} is in progress in {tree.name}/: finish it (`git {cmd} --continue`) or abort it "
                f"(`git {cmd} --abort`) first"
            )
    return None


def pending_work(tree: Path) -> str | None:
    """Return why ``tree`` holds work that ``refresh`` has not written back, or None.

    A rebase/am/cherry-pick/merge in progress counts: moving HEAD under it would break it.
    """
    if why := in_progress(tree):
        return why
    if git(tree, "status", "--porcelain", "--untracked-files=no").stdout.strip():
        return "it has uncommitted changes"
    if git(tree, "rev-parse", "-q", "--verify", "series", check=False).returncode:
        return None
    above = git(tree, "rev-list", "series..HEAD").stdout.split()
    if above:
        return f"it has {len(above)} commit(s) above the series not written back"
    stamped = (
        (tree / ".git" / STAMP_HEAD).read_text().strip() if (tree / ".git" / STAMP_HEAD).is_file() else None
    )
    if stamped and git(tree, "rev-parse", "series").stdout.strip() != stamped:
        return "its branch series has commits that `refresh` has not written back to patches/"
    return None


def would_lose(tree: Path) -> list[str]:
    """What deleting ``tree`` would lose, beyond the series it was built from (empty: nothing)."""
    if not (tree / ".git" / STAMP).is_file():
        return ["it was not made by this tool (no .git/series-stamp): move it away yourself"]
    lost = [why] if (why := pending_work(tree)) else []
    untracked = git(tree, "ls-files", "--others", "--exclude-standard").stdout.split()
    if untracked:
        lost.append(
            f"untracked: {', '.join(untracked[:5])}"
            + (f" and {len(untracked) - 5} more" if len(untracked) > 5 else "")
        )
    refs = git(tree, "for-each-ref", "--format=%(refname)", "refs/heads", "refs/tags").stdout.split()
    branches = [
        r.removeprefix("refs/heads/")
        for r in refs
        if r.startswith("refs/heads/") and r != "refs/heads/series"
    ]
    tags = [
        r.removeprefix("refs/tags/") for r in refs if r.startswith("refs/tags/") and r != "refs/tags/base"
    ]
    lost += [f"branch: {', '.join(branches)}"] if branches else []
    lost += [f"tag: {', '.join(tags)}"] if tags else []
    stashes = len(git(tree, "stash", "list").stdout.splitlines())
    lost += [f"stash: {stashes} entr{'y' if stashes == 1 else 'ies'}"] if stashes else []
    return lost


def explain_am_failure(patch: Path, output: str) -> str:
    """Turn ``git am`` output into "patch P: file F, hunk H" (the hunk whose old start line failed)."""
    m = re.search(r"error: patch failed: (\S+):(\d+)", output)
    if not m:
        m2 = re.search(r"error: (\S+): (does not exist in index|No such file or directory)", output)
        detail = f"file {m2.group(1)} does not exist in the base" if m2 else output.strip()
        return f"patch {patch.name} does not apply: {detail}"
    path, line = "airflow-core/" + m.group(1), int(m.group(2))
    hunk, current = "?", None
    for text in patch.read_text(errors="replace").splitlines():
        if text.startswith("+++ "):
            current = text[4:].split("/", 1)[-1]
        elif text.startswith("@@") and current == path:
            start = int(re.match(r"@@ -(\d+)", text).group(1))
            if start == line or hunk == "?":
                hunk = text
            if start == line:
                break
    return f"patch {patch.name} does not apply: file {path}, hunk {hunk}"


def unpack_sdist(sdist: Path, dest: Path, only: set[str] | None = None) -> None:
    """Unpack ``sdist`` into ``dest`` (created; must not exist) without its top-level directory.

    ``only``: the paths (relative to that directory) to unpack; default: all.
    """
    dest.mkdir()
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/", 1)[0]
        for member in tar.getmembers():
            parts = member.name.split("/", 1)
            if len(parts) == 2 and parts[0] == top and (only is None or parts[1] in only):
                member.name = parts[1]
                tar.extract(member, dest, filter="data")


def build(root: Path, cfg: dict[str, str], patches: list[Path], dest: Path) -> None:
    """Build base + series as a git repository at ``dest`` (which must not exist)."""
    unpack_sdist(fetch_sdist(cfg), dest)
    # git am needs a repository whose paths match the patches' upstream layout (airflow-core/...):
    # the repository root is the directory above, shared with nothing else, so make a private one.
    git(dest, "init", "-q", "-b", "series")
    git(dest, "config", "core.autocrlf", "false")
    # What running the tests writes into the tree is not work to keep (would_lose).
    (dest / ".git" / "info" / "exclude").write_text("__pycache__/\n*.py[co]\n*.egg-info/\n.pytest_cache/\n")
    git(dest, "add", "-A")
    env_date = {"GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z"}
    subprocess.run(
        ["git", "-C", str(dest), "commit", "-q", "-m", f"{cfg['package']} {cfg['version']} (pristine sdist)"],
        env={**os.environ, **GIT_ENV, **env_date},
        check=True,
    )
    git(dest, "tag", "base")
    for patch in patches:
        proc = git(
            dest, "am", "-q", "--keep-cr", "-p2", "--committer-date-is-author-date", str(patch), check=False
        )
        if proc.returncode:
            raise TreeError(explain_am_failure(patch, proc.stdout + proc.stderr))
    (dest / ".git" / STAMP).write_text(stamp_of(cfg, patches))
    (dest / ".git" / STAMP_HEAD).write_text(git(dest, "rev-parse", "HEAD").stdout)


def prepare(root: Path) -> str:
    cfg = base_config(root)
    patches = series(root)
    tree = core_dir(root)
    name = f"{tree.name}/"
    with locked(root, "tree.py prepare"):
        # left by a killed run (SIGKILL): ours, unused (we hold the lock)
        for stale in root.glob(f"{tree.name}.*"):
            if (stale / TEMP_MARK).is_file():
                shutil.rmtree(stale, ignore_errors=True)
        if tree.exists() or tree.is_symlink():
            if (tree / ".git" / STAMP).is_file() and (why := in_progress(tree)):
                raise TreeError(f"{name} not touched: {why}")
            stamp = tree / ".git" / STAMP
            if stamp.is_file() and stamp.read_text() == stamp_of(cfg, patches) and not pending_work(tree):
                git(tree, "checkout", "-q", "series")
                return f"{name} is up to date: {cfg['version']} + {len(patches)} patch(es)"
            lost = would_lose(tree)
            if lost:
                raise TreeError(
                    f"{name} not rebuilt, it holds what a rebuild would lose: {'; '.join(lost)}. To keep "
                    f"changes and commits: commit them in {name} and run `nox -s refresh`; to keep the rest, move it out of {name}; to drop it all: "
                    f"`rm -rf {tree.name}` (it is generated; the sdist is cached)"
                )
        work = Path(tempfile.mkdtemp(prefix=f"{tree.name}.", dir=root))
        try:
            (work / TEMP_MARK).write_text("a build folder of scripts/ci/tree.py prepare\n")
            build(root, cfg, patches, work / "airflow-core")
            with signals_held():  # the old tree or the new one, never none
                if tree.exists():
                    tree.rename(work / "old")
                (work / "airflow-core").rename(tree)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return f"{name} built: {cfg['package']} {cfg['version']} + {len(patches)} patch(es)"


def checkout(root: Path, k: str) -> str:
    tree = core_dir(root)
    if not (tree / ".git" / STAMP).is_file():
        raise TreeError(
            f"{tree.name}/ does not exist or was not made by this tool: `nox -s prepare` builds it"
        )
    n = len(git(tree, "rev-list", "base..series").stdout.split())
    if k == "all":
        k = str(n)
    if not k.isdigit() or int(k) > n:
        raise TreeError(f"checkout takes 0..{n} or 'all', got {k!r}")
    with locked(root, f"tree.py checkout {k}"):
        why = pending_work(tree)
        if why:
            raise TreeError(f"{tree.name}/ not moved: {why}")
        target = "series" if int(k) == n else f"series~{n - int(k)}"
        git(tree, "checkout", "-q", *([] if target == "series" else ["--detach"]), target)
    return f"{tree.name}/ at base + {k} of {n} patch(es)"


def refresh(root: Path) -> str:
    tree = core_dir(root)
    if not (tree / ".git" / STAMP).is_file():
        raise TreeError(
            f"{tree.name}/ does not exist or was not made by this tool: `nox -s prepare` builds it"
        )
    with locked(root, "tree.py refresh"):
        return _refresh(root, tree)


def _refresh(root: Path, tree: Path) -> str:
    if why := in_progress(tree):
        raise TreeError(f"{why}, then refresh")
    rel = patches_dir(root).relative_to(root)
    try:
        current = stamp_of(base_config(root), series(root))
    except TreeError:
        current = None  # a patch file of the series is missing or unreadable: changed too
    if (tree / ".git" / STAMP).read_text() != current:
        raise TreeError(
            f"{rel}/ changed since {tree.name}/ was built from it (a patch edited, added or removed, or "
            f"a pull): refresh would overwrite that with {tree.name}/'s patches; to keep the change, "
            f"`nox -s prepare` rebuilds {tree.name}/ from {rel}/ (save work in {tree.name}/ first); to drop "
            f"it, `git checkout {rel}/`"
        )
    if git(tree, "status", "--porcelain", "--untracked-files=no").stdout.strip():
        raise TreeError(f"{tree.name}/ has uncommitted changes: commit them first (one commit per patch)")
    if git(tree, "merge-base", "--is-ancestor", "series", "HEAD", check=False).returncode:
        raise TreeError(
            f"{tree.name}/ HEAD is not on top of the full series (branch series): refresh would drop the patches "
            "above it; `tree.py checkout all` and commit there, or rebase your commits onto series"
        )
    queue = patches_dir(root)
    old = [name for _, name in series_names(root)]
    if not git(tree, "rev-list", "base..HEAD").stdout.split() and old:
        raise TreeError(
            f"no commit above base in {tree.name}/: refusing to write an empty series ({len(old)} patch(es) now)"
        )
    out = Path(tempfile.mkdtemp(prefix="patches.", dir=root))
    try:
        git(
            tree,
            "format-patch",
            *("-q", "-N", "--zero-commit", "--no-signature", "--filename-max-length=100"),
            "--src-prefix=a/airflow-core/",
            *("--dst-prefix=b/airflow-core/", "-o", str(out), "base..HEAD"),
        )
        names = []
        for f in sorted(out.glob("*.patch")):
            name = re.sub(r"^\d{4}-", "", f.name)
            if name in names:
                raise TreeError(f"two patches would both be named {name}: give one a different subject")
            if name not in old and (queue / name).exists():
                raise TreeError(
                    f"{queue.relative_to(root)}/{name} exists and is not in its series: move it away, then refresh"
                )
            names.append(name)
        # From the first patch replaced to the stamp: all or nothing for Ctrl-C/SIGTERM/SIGHUP (held until
        # the end), so that an interrupted refresh never leaves patches/ half-rewritten.
        with signals_held():
            for f, name in zip(sorted(out.glob("*.patch")), names):
                os.replace(f, queue / name)
            for name in set(old) - set(names):  # only patches of the old series
                (queue / name).unlink(missing_ok=True)
            write_series(queue / "series", names)
            git(tree, "checkout", "-q", "-B", "series", "HEAD")
            (tree / ".git" / STAMP).write_text(stamp_of(base_config(root), series(root)))
            (tree / ".git" / STAMP_HEAD).write_text(git(tree, "rev-parse", "HEAD").stdout)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return f"{queue.relative_to(root)}/ rewritten from {tree.name}/ ({cfg_version(root)}): {len(names)} patch(es)"


@contextlib.contextmanager
def signals_held():
    """Hold SIGINT, SIGTERM and SIGHUP (also for the commands started meanwhile); deliver them afterwards.

    The mask holds them in this thread and its children; a signal sent to the process can still be taken by
    another thread, so (in the main thread) a handler records it too, and it is raised again at the end.
    """
    held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    got: list[int] = []
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        handlers = {sig: signal.signal(sig, lambda signum, _frame: got.append(signum)) for sig in held}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)  # a pending one is recorded here
        for sig, handler in handlers.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        for sig in dict.fromkeys(got):
            signal.raise_signal(sig)


def write_series(path: Path, names: list[str]) -> None:
    """Write ``names`` to ``path``, keeping its comment lines: those above a patch stay above it (or
    above the patch at the same position if it was renamed); the others stay at the end."""
    blocks, comments = [], []  # blocks: (comment lines above, name, its own line)
    for line in path.read_text().splitlines() if path.is_file() else [SERIES_HEADER.strip()]:
        name = line.split("#", 1)[0].strip()
        if name:
            blocks.append((comments, name, line))
            comments = []
        else:
            comments.append(line)
    if not blocks and names:  # no patch yet: the comments are the header, above the first patch
        blocks, comments = [(comments, names[0], names[0])], []
    unused = dict(enumerate(blocks))
    lines = []
    for i, name in enumerate(names):
        match = next((j for j, b in unused.items() if b[1] == name), None)
        if match is None and i in unused and unused[i][1] not in names:
            match = i
        above, old, line = unused.pop(match) if match is not None else ([], name, name)
        lines += [*above, line.replace(old, name)]
    lines += [c for _, (above, _, _) in sorted(unused.items()) for c in above] + comments
    path.write_text("".join(f"{line}\n" for line in lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=PROJECT, help="project root (default: %(default)s)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("prepare", help="build airflow-core/ from the sdist and patches/series")
    sub.add_parser("refresh", help="rewrite patches/ from the commits in airflow-core/")
    co = sub.add_parser("checkout", help="put airflow-core/ at base + first K patches")
    co.add_argument("k", help="number of patches, or 'all'")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    exit_on_hangup()
    try:
        if args.command == "prepare":
            print(prepare(root))
        elif args.command == "refresh":
            print(refresh(root))
        else:
            print(checkout(root, args.k))
    except TreeError as e:
        print(f"tree.py {args.command}: {e}", file=sys.stderr)
        return 1
    except subprocess.CalledProcessError as e:
        print(f"tree.py {args.command}: `{' '.join(e.cmd)}` failed:\n{e.stdout}{e.stderr}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        print(
            f"tree.py {args.command}: interrupted ({e or 'SIGINT'}); temporary folders removed",
            file=sys.stderr,
        )
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
