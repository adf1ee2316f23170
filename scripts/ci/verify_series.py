#!/usr/bin/env python3
"""
Prove the series patch by patch: every regression test fails before its patch and passes with it.

For patch k of ``patches/series`` (run with the test session's Python, database configured in the
environment as for ``pytest``):

1. ``airflow-core/`` at base + patches 1..k-1: the tests marked ``proves(k)`` must fail; one that
   passes is reported as "does not prove" (tests whose ``base_ok_on`` names this backend are only
   checked for passing, as the base is not vulnerable there);
2. at base + 1..k: the same tests must pass, and so must the tests of patches 1..k plus the guards
   (bisectability).

One pytest run per tree state does both: at base + 1..k it runs step k's tests and then, last
(``--proves-last``), the tests of patch k+1 for step 1 of the next patch; n + 1 runs for n patches.
pytest reports a session fixture's failing teardown on the run's last test, one of patch k+1's: a test
that fails only in teardown is no proof (a WRONG cell naming it), never a silent "fails before".

Skips are counted and shown, never passed off as proof: a patch whose tests all skip on this backend
(e.g. a row-lock change where Airflow takes no row locks) shows "ok 0 (N skipped)"; a patch with no
test at all is a wrong cell. Prints a
table patch x (fails before, passes after, suite green) and exits 1 if any cell is wrong. The tree is
moved with ``git checkout`` only (the editable install follows) and is put back at the full series
afterwards, also on error or Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import tree  # noqa: E402

ROOT = tree.PROJECT


@dataclass
class Outcome:
    """One test's result in one pytest run: ``passed`` | ``failed`` | ``skipped``, plus its marker data.

    ``teardown_only``: failed only by an error in teardown. pytest reports the teardown of session (and
    last-module) fixtures on the run's last test, which in a merged run is a fail-before test of the next
    patch: such an error is no proof of that test (see :func:`judge_before`).
    """

    result: str
    proves: str | None = None
    base_ok: bool = False
    teardown_only: bool = False
    guard: bool = False
    setup_only: bool = False


def outcomes(junit: Path) -> dict[str, Outcome]:
    """Read a pytest ``--junitxml`` file: nodeid-ish name -> Outcome (errors count as failed)."""
    found = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        tags = {child.tag for child in case}
        result = "failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"
        failures = [child for child in case if child.tag in ("failure", "error")]
        teardown_only = bool(failures) and all(
            f.tag == "error" and (f.get("message") or "").startswith("failed on teardown") for f in failures
        )
        setup_only = bool(failures) and all(
            f.tag == "error" and (f.get("message") or "").startswith("failed on setup") for f in failures
        )
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        found[name] = Outcome(
            result,
            props.get("proves"),
            props.get("base_ok") == "True",
            teardown_only,
            props.get("guard") == "True",
            setup_only,
        )
    return found


def run_pytest(args: list[str], pytest_args: list[str]) -> dict[str, Outcome]:
    """Run pytest in a subprocess with ``args``; return its outcomes (empty if nothing was collected)."""
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        # -v: pytest names each test before running it, so the output of a run that dies (a crash, os._exit,
        # a signal) ends with the test that killed it.
        # --tb=native: pytest's own traceback rendering (ast.parse) raised SystemError "AST constructor
        # recursion depth mismatch" on CPython 3.11.7 (fixed in 3.11.8) and lost the whole step's report.
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-v",
            "--tb=native",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
        ]
        proc = subprocess.run(
            [*cmd, *args, *pytest_args, "tests/unit"], cwd=ROOT, capture_output=True, text=True
        )
        if proc.returncode not in (0, 1, 5) or not junit.exists():
            raise RuntimeError(
                f"pytest {' '.join(args)} could not run (exit {proc.returncode}, no junit report; the last "
                f"test named below is the one it was running when it died):\n{_tail(proc.stdout)}\n"
                f"stderr:\n{_tail(proc.stderr)}"
            )
        return outcomes(junit)


def _tail(text: str, lines: int = 40) -> str:
    kept = text.rstrip().splitlines()[-lines:]
    return "\n".join(kept)


@dataclass
class Cell:
    """One table cell: the counts behind it and what is wrong with it."""

    ok: int = 0
    skipped: int = 0
    problems: list[str] = field(default_factory=list)
    in_setup: int = 0  # of ``ok`` in a "fails before" cell: failed in setup, not in the test itself

    def __str__(self) -> str:
        text = ("ok" if not self.problems else "WRONG") + f" {self.ok}"
        notes = [f"{self.skipped} skipped"] * bool(self.skipped) + [f"{self.in_setup} in setup"] * bool(
            self.in_setup
        )
        return text + (f" ({', '.join(notes)})" if notes else "")


def judge_before(results: dict[str, Outcome]) -> Cell:
    """Tests proving a patch, run without it: each must fail (or pass where its base is not vulnerable)."""
    cell = Cell()
    for name, o in results.items():
        if o.result == "skipped":
            cell.skipped += 1
        elif o.teardown_only:
            cell.problems.append(
                f"{name}: passes, then an error in teardown (pytest reports a session fixture's teardown on "
                "the run's last test): not a proof; see the error in the pytest output"
            )
        elif o.base_ok:
            cell.ok += o.result == "passed"
            if o.result != "passed":
                cell.problems.append(f"{name}: fails where base_ok_on says the base is not vulnerable")
        elif o.result == "failed":
            cell.ok += 1
            # Shown, not judged: in the merged run a fixture can fail in setup because of what the step's suite
            # left behind (a separate run would not see it); "N in setup" says to look at that test's error.
            cell.in_setup += o.setup_only
        else:
            cell.problems.append(f"{name}: passes without its patch: does not prove it")
    if not cell.ok and not cell.skipped:
        cell.problems.append("no test proves this patch")
    return cell


def judge_passing(results: dict[str, Outcome], what: str) -> Cell:
    """Every test that ran must pass."""
    cell = Cell()
    for name, o in results.items():
        cell.skipped += o.result == "skipped"
        cell.ok += o.result == "passed"
        if o.result == "failed":
            cell.problems.append(f"{name}: fails {what}")
    if not cell.ok and not cell.skipped:
        cell.problems.append(f"no test ran {what}")
    return cell


def judge_run(
    results: dict[str, Outcome], j: int, after_of: str | None, before_of: str | None
) -> tuple[Cell | None, Cell | None, Cell | None]:
    """
    Judge the one pytest run at base + 1..j: (patch j's "passes after", step j's "suite green", patch j+1's
    "fails before"); None where there is no such patch. The tests proving ``before_of`` (run last) are judged
    as patch j+1's "before" and, if also a guard (as a separate run of the step's suite selected it), in step
    j's suite; every other test as step j's suite.
    """
    step = {name: o for name, o in results.items() if before_of is None or o.proves != before_of or o.guard}
    after = suite = before = None
    if after_of:
        after = judge_passing({name: o for name, o in step.items() if o.proves == after_of}, "with its patch")
        suite = judge_passing(step, f"at base + {j} patches")
    if before_of:
        before = judge_before({name: o for name, o in results.items() if o.proves == before_of})
    return after, suite, before


def verify(pytest_args: list[str]) -> int:
    patches = [p.name for p in tree.series(ROOT)]
    backend = os.environ.get("BACKEND", "sqlite")
    rows = []
    with tree.locked(ROOT, "verify_series.py"), contextlib.ExitStack() as back:
        back.callback(lambda: print(tree.checkout(ROOT, "all")))
        # One pytest run per tree state, n + 1 for n patches: at base + 1..j, the tests of patches 1..j plus
        # the guards (patch j's "after" and step j's suite), and then, run last, the tests of patch j + 1
        # (its "before", at base + 1..j as above).
        before = None
        for j in range(len(patches) + 1 if patches else 0):
            started = time.monotonic()
            after_of = patches[j - 1] if j else None
            before_of = patches[j] if j < len(patches) else None
            print(f"[{j}/{len(patches)}] base + {j}: {after_of or 'the base'}", flush=True)
            tree.checkout(ROOT, str(j))
            scope = [a for p in patches[:j] for a in ("--proves", p)] + (["--guards"] if j else [])
            results = run_pytest([*scope, *(["--proves-last", before_of] if before_of else [])], pytest_args)
            after, suite, next_before = judge_run(results, j, after_of, before_of)
            if after_of:
                rows.append((after_of, before, after, suite))
            before = next_before
            print(f"    step done in {time.monotonic() - started:.0f} s", flush=True)
    width = max(len(p) for p in patches) if patches else 5
    base = tree.base_config(ROOT)["version"]
    print(f"\nverify-series on {backend}, base apache-airflow-core {base} ({len(patches)} patch(es))\n")
    print(f"| {'patch':<{width}} | fails before | passes after | suite green at this step |")
    print(f"|{'-' * (width + 2)}|--------------|--------------|--------------------------|")
    for patch, *cells in rows:
        print(
            f"| {patch:<{width}} | "
            + " | ".join(f"{str(c):<12}" for c in cells[:2])
            + f" | {cells[2]!s:<24} |"
        )
    problems = [f"{patch}: {p}" for patch, *cells in rows for c in cells for p in c.problems]
    for p in problems:
        print(f"WRONG: {p}")
    wrong = {p.split(":")[0] for p in problems}
    proven = sum(1 for patch, before, *_ in rows if before.ok and patch not in wrong)
    skipped = sum(1 for patch, before, *_ in rows if not before.ok and patch not in wrong)
    print(
        f"\n{proven} of {len(rows)} patches proven on {backend} (base {base}); {skipped} with every test "
        "skipped here"
    )
    return 1 if problems or not rows else 0


def main(argv: list[str]) -> int:
    try:
        return verify(argv)
    except KeyboardInterrupt:
        # The tree was put back by verify()'s clean-up (its line is printed above); if a second Ctrl-C cut
        # that short, the next session's prepare puts it back at the full series.
        print(
            "verify_series.py: interrupted; no verdict (the table is only printed for a complete run): "
            "run the session again",
            file=sys.stderr,
        )
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
