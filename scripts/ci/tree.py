#!/usr/bin/env python3
"""
Materialise ``airflow-core/`` from the pinned PyPI sdist and the patch series, and write it back.

``airflow-core/`` is a git repository (the patch-queue workflow): its first commit, tagged ``base``, is
the pristine release; each patch in ``patches/series`` is one commit on branch ``series`` above it.

Commands (run from anywhere; ``--root`` is the project root, default: this file's project):

* ``prepare``   download the sdist (pip, package index only), check its sha256, unpack it in upstream
  layout and ``git am`` the series. Idempotent: a tree already built from the same sdist and series is
  left alone. A tree with work not yet written back (commits above the series, or uncommitted edits)
  is refused, never overwritten. On any error the previous ``airflow-core/`` is left exactly as it was.
* ``checkout K`` put the tree at base + the first K patches (``all`` for the whole series); cheap, the
  editable install follows the working tree.
* ``refresh``   rewrite ``patches/`` and ``patches/series`` from the commits ``base..HEAD``.

Errors exit with status 1 and a message naming the cause (patch, file, hunk; expected vs got sha256).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
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


class TreeError(Exception):
    """A refusal with a message that names its cause."""


def base_config(root: Path) -> dict[str, str]:
    """Return ``[tool.airflow-series]`` from ``root/pyproject.toml``: package, version, sdist-sha256."""
    cfg = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["airflow-series"]
    return {k: cfg[k] for k in ("package", "version", "sdist-sha256")}


def series(root: Path) -> list[Path]:
    """Return the patch files named in ``patches/series`` in order (quilt format, ``#`` comments)."""
    names = []
    for line in (root / "patches" / "series").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(line)
    missing = [n for n in names if not (root / "patches" / n).is_file()]
    if missing:
        raise TreeError(f"patches/series names {', '.join(missing)}, not found in patches/")
    return [root / "patches" / n for n in names]


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
        cmd = [*pip, "download", "--no-deps", "--no-binary", ":all:", "-d", str(dest)]
        proc = subprocess.run([*cmd, spec], text=True, capture_output=True)
        found = sorted(dest.glob(f"{name}-{cfg['version']}.tar.gz"))
        if proc.returncode or not found:
            raise TreeError(f"could not download the sdist of {spec}:\n{proc.stderr.strip()}")
    sdist = found[0]
    got = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if got != cfg["sdist-sha256"]:
        raise TreeError(
            f"sha256 mismatch for {sdist.name}: expected {cfg['sdist-sha256']} (pyproject.toml), got {got}; "
            "refusing to use it, nothing was changed"
        )
    return sdist


def stamp_of(cfg: dict[str, str], patches: list[Path]) -> str:
    h = hashlib.sha256(cfg["sdist-sha256"].encode())
    for p in patches:
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def pending_work(tree: Path) -> str | None:
    """Return why ``tree`` holds work that ``refresh`` has not written back, or None."""
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
    tree = root / "airflow-core"
    if tree.exists():
        stamp = tree / ".git" / STAMP
        if stamp.is_file() and stamp.read_text() == stamp_of(cfg, patches):
            why = pending_work(tree)
            if why is None:
                git(tree, "checkout", "-q", "series")
                return f"airflow-core/ is up to date: {cfg['version']} + {len(patches)} patch(es)"
        why = pending_work(tree) if (tree / ".git").is_dir() else "it is not a tree made by this tool"
        if why:
            raise TreeError(
                f"airflow-core/ not rebuilt: {why}. To keep the work: commit it in airflow-core/ "
                "(one commit per patch), then `nox -s refresh`; to drop it: `rm -rf airflow-core` "
                "(it is generated; the sdist is cached)"
            )
    work = Path(tempfile.mkdtemp(prefix="airflow-core.", dir=root))
    try:
        build(root, cfg, patches, work / "airflow-core")
        if tree.exists():
            old = work / "old"
            tree.rename(old)
        (work / "airflow-core").rename(tree)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return f"airflow-core/ built: {cfg['package']} {cfg['version']} + {len(patches)} patch(es)"


def checkout(root: Path, k: str) -> str:
    tree = root / "airflow-core"
    n = len(git(tree, "rev-list", "base..series").stdout.split())
    if k == "all":
        k = str(n)
    if not k.isdigit() or int(k) > n:
        raise TreeError(f"checkout takes 0..{n} or 'all', got {k!r}")
    why = pending_work(tree)
    if why:
        raise TreeError(f"airflow-core/ not moved: {why}")
    target = "series" if int(k) == n else f"series~{n - int(k)}"
    git(tree, "checkout", "-q", *([] if target == "series" else ["--detach"]), target)
    return f"airflow-core/ at base + {k} of {n} patch(es)"


def refresh(root: Path) -> str:
    tree = root / "airflow-core"
    if git(tree, "status", "--porcelain", "--untracked-files=no").stdout.strip():
        raise TreeError("airflow-core/ has uncommitted changes: commit them first (one commit per patch)")
    head, top = (git(tree, "rev-parse", ref).stdout.strip() for ref in ("HEAD", "series"))
    if head != top and not git(tree, "merge-base", "--is-ancestor", "HEAD", "series", check=False).returncode:
        raise TreeError("airflow-core/ is checked out below the top of the series: run `checkout all` first")
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
            names.append(name)
        for old in (root / "patches").glob("*.patch"):
            old.unlink()
        for f, name in zip(sorted(out.glob("*.patch")), names):
            shutil.move(f, root / "patches" / name)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    header = (
        "# The patch series, applied in this order onto the pinned base (quilt format: one file per line).\n"
    )
    (root / "patches" / "series").write_text(header + "".join(f"{n}\n" for n in names))
    git(tree, "checkout", "-q", "-B", "series", "HEAD")
    (tree / ".git" / STAMP).write_text(stamp_of(base_config(root), series(root)))
    (tree / ".git" / STAMP_HEAD).write_text(git(tree, "rev-parse", "HEAD").stdout)
    return f"patches/ rewritten from airflow-core/: {len(names)} patch(es)"


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
    return 0


if __name__ == "__main__":
    sys.exit(main())
