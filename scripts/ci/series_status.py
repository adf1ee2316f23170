#!/usr/bin/env python3
"""
Print the series' status: each patch's upstream issue and status, and how it fares on each base release.

One markdown table: patch, subject, upstream issue (``Bug:``), upstream status (``Forwarded:`` /
``Applied-Upstream:``), files touched, and one column per release in ``[tool.airflow-series]
bases`` of ``pyproject.toml`` (version = sdist sha256); the queue is the selected base's
(``USE_AIRFLOW_VERSION``, default: ``version`` in pyproject.toml, ``patches/series``):

* ``applies``           the patch applies cleanly (``git apply --check``);
* ``already contained`` it does not, but its reverse does: the release has the change, drop the patch;
* ``CONFLICT (...)``    neither: the patch needs a rebase; the first file/line git rejected is named.

Patches are tried in series order, each onto the release plus the earlier patches that applied, as a
rebase would. Sdists are fetched and sha256-checked like the pinned base (``tree.py``).
Exits 1 if a patch conflicts with the pinned base (the series itself is broken).

Usage: ``series_status.py [--root ROOT]``
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import trailers  # noqa: E402
import tree  # noqa: E402

APPLIES, CONTAINED = "applies", "already contained"


def status_bases(root: Path) -> dict[str, str]:
    """Release -> sdist sha256 of every supported base (``[tool.airflow-series.bases]``)."""
    return dict(tree.read_config(root)["bases"])


NOT_CARRIED = re.compile(r"^#\s*-\s*(\S+\.patch):\s*(.+)$")


def not_carried(root: Path) -> list[tuple[str, str]]:
    """For a base other than the default: (patch, reason) for each patch of the default queue
    (``patches/series``) its own queue does not carry; the reason is its queue's comment line
    ``# - NAME.patch: reason`` (behaviour already there, not needed, not ported yet)."""
    if tree.is_default(root):
        return []
    ours = {p.name for p in tree.series(root)}
    reasons = {}
    for line in (tree.patches_dir(root) / "series").read_text().splitlines():
        if m := NOT_CARRIED.match(line.strip()):
            reasons[m.group(1)] = m.group(2).strip()
    default = [
        line.split("#", 1)[0].strip() for line in (root / "patches" / "series").read_text().splitlines()
    ]
    return [(n, reasons.get(n, "no reason recorded in its series")) for n in default if n and n not in ours]


def files_touched(patch: Path) -> list[str]:
    """Paths a patch changes, relative to ``airflow-core/``."""
    found = re.findall(r"^diff --git a/(\S+) b/", patch.read_text(errors="replace"), flags=re.M)
    return [p.removeprefix("airflow-core/") for p in found]


def try_on(release_tree: Path, patches: list[Path]) -> list[str]:
    """Apply ``patches`` in order to the git repository ``release_tree``; return each one's verdict."""
    verdicts = []
    for patch in patches:
        forward = tree.git(release_tree, "apply", "--check", "-p2", str(patch), check=False)
        if not forward.returncode:
            tree.git(release_tree, "apply", "-p2", str(patch))
            verdicts.append(APPLIES)
        elif not tree.git(release_tree, "apply", "--check", "-R", "-p2", str(patch), check=False).returncode:
            verdicts.append(CONTAINED)
        else:
            m = re.search(r"error: (?:patch failed: )?(.+)", forward.stderr)
            verdicts.append(f"CONFLICT ({m.group(1).strip() if m else forward.stderr.strip()})")
    return verdicts


def release_tree(package: str, version: str, sha256: str, dest: Path, files: set[str]) -> Path:
    """Unpack ``files`` of the sha256-checked sdist of ``version`` at ``dest``, a git repository."""
    sdist = tree.fetch_sdist({"package": package, "version": version, "sdist-sha256": sha256})
    tree.unpack_sdist(sdist, dest, only=files)
    tree.git(dest, "init", "-q")
    return dest


def status(root: Path) -> tuple[list[str], list[list[str]], bool]:
    """Return (header, rows, whether no patch conflicts with the pinned base)."""
    cfg = tree.base_config(root)
    patches = tree.series(root)
    bases = status_bases(root)
    files = {f for p in patches for f in files_touched(p)}
    columns = {}
    with tempfile.TemporaryDirectory(prefix="series-status.") as tmp:
        for version, sha in bases.items():
            rt = release_tree(cfg["package"], version, sha, Path(tmp) / version, files)
            columns[version] = try_on(rt, patches)
    rows = []
    for i, patch in enumerate(patches):
        msg = trailers.read_message(patch)
        issues = ", ".join("#" + m for b in msg.values("Bug") for m in trailers.ISSUE.findall(b)) or "-"
        state = "forwarded: " + (", ".join(msg.values("Forwarded")) or "?")
        for applied in msg.values("Applied-Upstream"):
            if applied.startswith("main, "):
                state += (
                    f"; merged on upstream main ({applied.removeprefix('main, ')}), in no release yet: "
                    "drop when rebasing onto the first release that has it"
                )
            else:
                state += f"; applied upstream: {applied}"
        touched = ", ".join(f.removeprefix("src/airflow/") for f in files_touched(patch))
        row = [patch.name, msg.subject, issues, state, touched]
        rows.append(row + [columns[v][i] for v in bases])
    header = ["patch", "subject", "upstream issue", "upstream status", "files", *(f"on {v}" for v in bases)]
    pinned = columns.get(cfg["version"], [APPLIES] * len(patches))
    return header, rows, not any(v.startswith("CONFLICT") for v in pinned)


def table(header: list[str], rows: list[list[str]]) -> str:
    cells = [[c.replace("|", "\\|") for c in row] for row in [header, *rows]]
    lines = ["| " + " | ".join(row) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("---" for _ in header) + "|")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=tree.PROJECT, help="project root (default: %(default)s)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    try:
        header, rows, ok = status(root)
    except tree.TreeError as e:
        print(f"series_status.py: {e}", file=sys.stderr)
        return 1
    except subprocess.CalledProcessError as e:
        print(f"series_status.py: `{' '.join(e.cmd)}` failed:\n{e.stdout}{e.stderr}", file=sys.stderr)
        return 1
    print(table(header, rows))
    contained = {v for row in rows for v, c in zip(header[5:], row[5:]) if c == CONTAINED}
    for v in sorted(contained):
        names = [row[0] for row in rows if row[header.index(v)] == CONTAINED]
        print(f"\n{v[3:]} already contains: {', '.join(names)} (drop them when rebasing onto it)")
    base = tree.base_config(root)["version"]
    if missing := not_carried(root):
        print(f"\nthe {base} queue does not carry these patches of the default queue (patches/series):")
        for name, why in missing:
            print(f"- {name}: {why}")
    if not ok:
        print(
            f"\na patch conflicts with the pinned base {tree.base_config(root)['version']}", file=sys.stderr
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
