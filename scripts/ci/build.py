#!/usr/bin/env python3
"""
Build the patched apache-airflow-core wheel and sdist into ``dist/`` (``nox -s build``).

The base (``USE_AIRFLOW_VERSION``, default ``version`` in pyproject.toml) is unpacked from its sha256-checked
sdist and the series applied in a temporary folder (``tree.py``'s own build, so ``airflow-core/`` is never moved), then
upstream's build backend (hatchling, pinned in the sdist's ``[build-system]``) builds it with ``uv build``:
the sdist, then the wheel from that sdist. Three build-time edits, all in the temporary copy:

* the version, in ``pyproject.toml`` and ``src/airflow/__init__.py`` (``airflow version`` prints the latter):
  ``<base>+series.<n>.<hash>`` (``+series.core.<n>.<hash>`` with ``--core``), ``<hash>`` the first 8 hex digits
  of the tree's stamp (sha256 of the base sdist's sha256 and the included patch files, in order);
* ``airflow-core-series.json`` (the patches and their upstream status) is added to the sdist and, as
  hatchling's ``extra-metadata``, to the wheel's ``.dist-info/extra_metadata/`` (``series_info.py`` prints it);
* the sdist's ``force-include`` table, which names upstream monorepo paths (``../shared/...``) whose files the
  sdist already carries under ``src/airflow/_shared/``, is dropped.

``SOURCE_DATE_EPOCH`` is the newest included patch's date (or the environment's), so two builds from the
same inputs give byte-identical files. ``--core`` builds the patches above the ``# --- operator tail ---``
line of the series file (the upstream-core tier). ``airflow-core/``, when it exists, must be exactly the
series: uncommitted or untracked edits, commits not written back, a partial checkout and a tree built from
other patches or another base are refused, so that nobody believes their edit is in the build. Errors: one line naming the cause, exit 1.

Usage: ``build.py [--root ROOT] [--dist DIR] [--core]``
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import trailers  # noqa: E402
import tree  # noqa: E402

TAIL_MARKER = "# --- operator tail ---"
RECORD = "airflow-core-series.json"  # in the sdist's root and the wheel's .dist-info/extra_metadata/


def tiers(root: Path) -> tuple[list[Path], list[Path] | None]:
    """(all patches, the upstream-core tier or None): the core tier is the patches above the marker line."""
    patches = tree.series(root)
    lines = (tree.patches_dir(root) / "series").read_text().splitlines()
    marker = next((n for n, line in enumerate(lines, 1) if line.strip() == TAIL_MARKER), None)
    if marker is None:
        return patches, None
    above = {name for n, name in tree.series_names(root) if n < marker}
    return patches, [p for p in patches if p.name in above]


def tree_problem(root: Path, cfg: dict[str, str], patches: list[Path]) -> str | None:
    """Why the existing airflow-core/ is not exactly the series ``patches`` of base ``cfg``, or None (also if
    absent)."""
    core, n = tree.core_dir(root), len(patches)
    name = f"{core.name}/"
    if not core.exists():
        return None
    if not (core / ".git" / tree.STAMP).is_file():
        return f"{name} was not made by scripts/ci/tree.py (no .git/{tree.STAMP}): move it away"
    if why := tree.in_progress(core):
        return why
    if (core / ".git" / tree.STAMP).read_text() != tree.stamp_of(cfg, patches):
        return (
            f"{name} was not built from {cfg['version']} + {tree.patches_dir(root).relative_to(root)}/series "
            "(another base's tree, or the patches changed since): `nox -s prepare` rebuilds it"
        )
    # --no-optional-locks: status does not refresh (rewrite) the tree's index, nor take its lock
    changed = tree.git(core, "--no-optional-locks", "status", "--porcelain", "--untracked-files=no").stdout
    changed = changed.split("\n")
    changed = [line[3:] for line in changed if line.strip()]
    if changed:
        return (
            f"{name} has uncommitted changes ({', '.join(changed[:3])}): the build takes patches/ only; "
            "commit them and `nox -s refresh`, or drop them"
        )
    untracked = tree.git(core, "ls-files", "--others", "--exclude-standard").stdout.split()
    if untracked:
        return f"{name} has untracked files ({', '.join(untracked[:3])}): the build takes patches/ only"
    head = tree.git(core, "rev-parse", "HEAD").stdout.strip()
    tip = tree.git(core, "rev-parse", "-q", "--verify", "series", check=False).stdout.strip()
    if not (core / ".git" / tree.STAMP_HEAD).is_file():
        return (
            f"{name} has no .git/{tree.STAMP_HEAD} (made by an older tree.py), so commits not written back "
            "cannot be told apart: `nox -s refresh` records it"
        )
    stamped = (core / ".git" / tree.STAMP_HEAD).read_text().strip()
    if tip != stamped:
        return f"{name} branch series has commits not written back to patches/ (`nox -s refresh`)"
    if head != tip:
        if tree.git(core, "merge-base", "--is-ancestor", "HEAD", "series", check=False).returncode == 0:
            k = len(tree.git(core, "rev-list", "base..HEAD").stdout.split())
            holder = tree.lock_file(root).read_text().strip() if tree.lock_file(root).is_file() else ""
            return (
                f"{name} is a partial checkout (base + {k} of {n} patches)"
                + (f", in use by {holder}" if holder else "")
                + ": `python scripts/ci/tree.py checkout all` first"
            )
        return (
            f"{name} HEAD is not the series (commits above or beside it): commit and `nox -s refresh` first"
        )
    return None


def uv_error(stderr: str) -> str:
    """uv's error in one line: the last cause, and the URL it failed to fetch (hatchling, from the index) or
    the build backend's exception (its traceback's last line; uv's closing ``hint:`` says nothing)."""
    lines = [line.strip().removeprefix("cause: ") for line in stderr.splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("hint: ")]
    last = lines[-1] if lines else "(no output)"
    fetch = next((line for line in lines if line.startswith("Failed to fetch:")), None)
    if fetch and fetch != last:
        return f"{fetch}: {last}"
    raised = next(
        (line for line in reversed(lines) if re.match(r"[A-Za-z_][\w.]*(Error|Exception): ", line)), None
    )
    return f"{last}: {raised}" if raised else last


def local_version(cfg: dict[str, str], patches: list[Path], core: bool) -> str:
    digest = tree.stamp_of(cfg, patches)[:8]
    if digest.isdigit():  # PEP 440 reads an all-digit segment as a number (leading zeros dropped)
        digest = "g" + digest
    return f"{cfg['version']}+series.{'core.' if core else ''}{len(patches)}.{digest}"


def record(root: Path, cfg: dict[str, str], patches: list[Path], version: str, core: bool) -> dict:
    """The series as the wheel records it: each patch, its trailers and its upstream status."""
    upstream_toml = root / "patches" / "upstream.toml"
    upstream = tomllib.loads(upstream_toml.read_text()).get("patches", {}) if upstream_toml.is_file() else {}
    entries = []
    for p in patches:
        msg = trailers.read_message(p)
        entries.append(
            {
                "name": p.name,
                "subject": msg.subject,
                "bug": msg.values("Bug"),
                "origin": msg.values("Origin"),
                "forwarded": msg.values("Forwarded"),
                "applied-upstream": msg.values("Applied-Upstream"),
                "upstream-status": upstream.get(p.name, {}).get("status"),
                "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
            }
        )
    return {
        "distribution": cfg["package"],
        "version": version,
        "base": cfg["version"],
        "base-sdist-sha256": cfg["sdist-sha256"],
        "tier": "upstream core (above the operator-tail marker)" if core else "all",
        "patches": entries,
    }


def edit(path: Path, old: str, new: str, what: str) -> None:
    text = path.read_text()
    if old not in text:
        raise tree.TreeError(f"{path.name}: {what} ({old.strip()!r}) not found; the base's layout changed")
    path.write_text(text.replace(old, new, 1))


def prepare_source(src: Path, version: str, base: str, data: dict) -> None:
    """The three build-time edits of the module docstring, in the temporary copy ``src``."""
    pyproject = src / "pyproject.toml"
    edit(pyproject, f'\nversion = "{base}"\n', f'\nversion = "{version}"\n', "the [project] version")
    edit(src / "src" / "airflow" / "__init__.py", f'__version__ = "{base}"', f'__version__ = "{version}"',
         "__version__")  # fmt: skip
    text = pyproject.read_text()
    text = re.sub(r"\n\[tool\.hatch\.build\.targets\.sdist\.force-include\]\n(?:\"[^\n]*\n)*", "\n", text)
    pyproject.write_text(text)
    edit(pyproject, "[tool.hatch.build.targets.sdist]\ninclude = [\n",
         f'[tool.hatch.build.targets.sdist]\ninclude = [\n    "{RECORD}",\n', "the sdist's include list")  # fmt: skip
    edit(pyproject, "[tool.hatch.build.targets.wheel]\n",
         f'[tool.hatch.build.targets.wheel.extra-metadata]\n"{RECORD}" = "{RECORD}"\n\n'
         "[tool.hatch.build.targets.wheel]\n", "the wheel target")  # fmt: skip
    (src / RECORD).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def build(root: Path, dist: Path, core: bool) -> list[Path]:
    cfg = tree.base_config(root)
    patches, core_tier = tiers(root)
    if core and core_tier is None:
        raise tree.TreeError(
            f"{tree.patches_dir(root).relative_to(root)}/series has no `{TAIL_MARKER}` line: its tiers are "
            "not marked yet, so --core cannot be built (build without --core for the whole series)"
        )
    if why := tree_problem(root, cfg, patches):
        raise tree.TreeError(f"not built: {why}")
    chosen = core_tier if core else patches
    version = local_version(cfg, chosen, core)
    uv = shutil.which("uv")
    if not uv:
        raise tree.TreeError("uv is not on PATH (`pip install uv`): it runs upstream's build backend")
    with tempfile.TemporaryDirectory(prefix="airflow-series-build.") as tmp:
        work = Path(tmp) / "tree"
        tree.build(root, cfg, chosen, work)
        dates = tree.git(work, "log", "--format=%ct", "base..HEAD").stdout.split() or [
            tree.git(work, "log", "-1", "--format=%ct", "base").stdout.strip()
        ]
        epoch = os.environ.get("SOURCE_DATE_EPOCH") or str(max(int(d) for d in dates))
        if not epoch.isdigit():
            raise tree.TreeError(f"SOURCE_DATE_EPOCH={epoch!r} is not a number of seconds since 1970")
        src = Path(tmp) / f"apache_airflow_core-{version}"
        archive = subprocess.run(["git", "-C", str(work), "archive", "HEAD"], capture_output=True, check=True)
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(src, filter="data")
        prepare_source(src, version, cfg["version"], record(root, cfg, chosen, version, core))
        out = Path(tmp) / "out"
        env = {**os.environ, "SOURCE_DATE_EPOCH": epoch}
        proc = subprocess.run([uv, "build", "--no-config", "-o", str(out), str(src)],
                              env=env, capture_output=True, text=True)  # fmt: skip
        if proc.returncode:
            raise tree.TreeError(f"`uv build` failed: {uv_error(proc.stderr)}")
        dist.mkdir(parents=True, exist_ok=True)
        built = []
        for f in sorted(out.glob("apache_airflow_core-*")):
            # A copy cut short (Ctrl-C, a full disk) leaves no file under the final name.
            part = dist / f".{f.name}.part"
            shutil.copyfile(f, part)
            os.replace(part, dist / f.name)
            built.append(dist / f.name)
    print(
        f"{cfg['package']} {version}: {cfg['version']} + {len(chosen)} patch(es); SOURCE_DATE_EPOCH={epoch}"
    )
    return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=tree.PROJECT, help="project root (default: %(default)s)")
    parser.add_argument("--dist", type=Path, help="output folder (default: ROOT/dist)")
    parser.add_argument("--core", action="store_true", help="the upstream-core tier only")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    tree.exit_on_hangup()
    try:
        for f in build(root, args.dist or root / "dist", args.core):
            print(f"{hashlib.sha256(f.read_bytes()).hexdigest()}  {f}")
    except tree.TreeError as e:
        print(f"build.py: {e}", file=sys.stderr)
        return 1
    except subprocess.CalledProcessError as e:
        why = (e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr or "").strip().splitlines()
        print(f"build.py: `{' '.join(map(str, e.cmd))}` failed: {why[-1] if why else ''}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("build.py: interrupted; temporary folders removed", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
