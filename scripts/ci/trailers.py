#!/usr/bin/env python3
"""
Check every patch's commit message: imperative subject, body ending in ``closes:``/``related:``, DEP-3 trailers.

A patch in ``patches/`` (``git format-patch`` output) must carry, as git trailers (so ``git am`` and
``format-patch`` keep them), the status fields modelled on Debian's DEP-3:

* ``Bug:`` the upstream issue, ``https://github.com/apache/airflow/issues/N`` (one or more);
* ``Origin:`` ``self``, or the upstream PR / commit URL (optionally ``upstream, URL`` / ``backport, URL``);
* ``Forwarded:`` the upstream PR URL, ``no`` or ``not-needed``;
* ``Applied-Upstream:`` (optional) the release (``3.3.3``) or commit URL that contains the change, or
  ``main, <PR URL>`` when the PR is merged on upstream main but in no release yet.

The subject is an imperative sentence as upstream asks (``Fix ...``, not ``Fixed``/``Fixes``/``Fixing``),
at most 72 characters, no trailing period. The last line before the trailers is ``closes: #N`` or
``related: #N`` (upstream's PR convention). The message is taken apart with git itself
(``git mailinfo``, ``git interpret-trailers --parse``).

Usage: ``trailers.py [--root ROOT] [PATCH ...]`` (default: every patch in ``patches/series``). Prints one
line per problem, ``patches/NAME: what is wrong``, and exits 1 if there is any.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import tree  # noqa: E402

AIRFLOW = "https://github.com/apache/airflow"
ISSUE = re.compile(rf"{AIRFLOW}/issues/(\d+)")
PULL = rf"{AIRFLOW}/pull/\d+"
COMMIT = rf"{AIRFLOW}/commit/[0-9a-f]{{7,40}}"
FIELDS = {
    # key: (value pattern, what it must be, may repeat, required)
    "Bug": (ISSUE.pattern, f"an upstream issue URL {AIRFLOW}/issues/N", True, True),
    "Origin": (
        rf"self|((upstream|backport), )?({PULL}|{COMMIT})",
        "`self` or an upstream PR/commit URL",
        False,
        True,
    ),
    "Forwarded": (rf"no|not-needed|{PULL}", f"`no`, `not-needed` or a PR URL {AIRFLOW}/pull/N", False, True),
    "Applied-Upstream": (
        rf"\d+\.\d+\.\d+\S*|{COMMIT}|main, {PULL}",
        "a release (3.3.3), a commit URL, or `main, <PR URL>` (merged on main, in no release yet)",
        False,
        False,
    ),
}
REFERENCE = re.compile(r"(closes|related): #\d+")
# Subject words that look like verbs but are imperative already.
NOT_PAST = {"embed", "feed", "need", "seed", "shed", "speed", "proceed", "exceed", "succeed", "shred"}
NOT_GERUND = {"bring", "string", "ping", "ring", "sing", "swing", "wing", "sting"}
NOT_THIRD = {
    "process",
    "pass",
    "bypass",
    "focus",
    "access",
    "address",
    "express",
    "suppress",
    "bias",
    "alias",
}


@dataclass
class Message:
    """A patch's commit message: subject, body (without trailers) and trailers (key, value) in order."""

    subject: str
    body: str
    trailers: list[tuple[str, str]] = field(default_factory=list)

    def values(self, key: str) -> list[str]:
        return [v for k, v in self.trailers if k.lower() == key.lower()]


def git_stdin(args: list[str], text: str, cwd: Path | None = None) -> str:
    return subprocess.run(
        ["git", *args], input=text, text=True, capture_output=True, check=True, cwd=cwd
    ).stdout


def read_message(patch: Path) -> Message:
    """Split a ``git format-patch`` file into subject, body and trailers using git."""
    with tempfile.TemporaryDirectory() as tmp:
        msg, diff = Path(tmp) / "msg", Path(tmp) / "diff"
        info = git_stdin(
            ["mailinfo", "-k", str(msg), str(diff)], patch.read_text(errors="replace"), Path(tmp)
        )
        body = msg.read_text()
    subject = next((line[9:] for line in info.splitlines() if line.startswith("Subject: ")), "")
    subject = re.sub(r"^\[PATCH[^\]]*\]\s*", "", subject).strip()
    parsed = git_stdin(["interpret-trailers", "--parse"], f"{subject}\n\n{body}")
    trailers = [tuple(s.strip() for s in line.split(":", 1)) for line in parsed.splitlines() if ":" in line]
    # The body proper: drop the trailing lines that are the trailers git found.
    lines = body.rstrip("\n").splitlines()
    keys = {k.lower() for k, _ in trailers}
    while lines and (
        not lines[-1].strip() or lines[-1].split(":", 1)[0].strip().lower() in keys - {"closes", "related"}
    ):
        lines.pop()
    return Message(
        subject, "\n".join(lines), [t for t in trailers if t[0].lower() not in {"closes", "related"}]
    )


def subject_problems(subject: str) -> list[str]:
    problems = []
    if not subject:
        return ["no subject"]
    if len(subject) > 72:
        problems.append(f"subject is {len(subject)} characters, at most 72: {subject!r}")
    if subject.endswith("."):
        problems.append(f"subject ends with a period: {subject!r}")
    first = subject.split()[0]
    word = first.lower()
    if not first[0].isupper():
        problems.append(f"subject must start with a capitalised imperative verb, got {first!r}")
    elif word.endswith("ed") and word not in NOT_PAST:
        problems.append(f"subject is not imperative ({first!r} is past tense): write e.g. 'Fix ...'")
    elif word.endswith("ing") and word not in NOT_GERUND:
        problems.append(f"subject is not imperative ({first!r}): write e.g. 'Fix ...'")
    elif word.endswith("s") and not word.endswith(("ss", "us", "is")) and word not in NOT_THIRD:
        problems.append(f"subject is not imperative ({first!r} is third person): write e.g. 'Fix ...'")
    return problems


def message_problems(msg: Message) -> list[str]:
    """Everything wrong with a commit message, as sentences; empty if it is fine."""
    problems = subject_problems(msg.subject)
    body = [line for line in msg.body.splitlines() if line.strip()]
    if not body or not REFERENCE.fullmatch(body[-1].strip()):
        got = repr(body[-1].strip()) if body else "an empty body"
        problems.append(
            f"the body must end with `closes: #N` or `related: #N` before the trailers, got {got}"
        )
    elif len(body) < 2:
        problems.append("the body must say what the patch changes and why, before `closes:`/`related:`")
    for key, (pattern, what, repeat, required) in FIELDS.items():
        values = msg.values(key)
        if required and not values:
            stray = any(line.lower().startswith(f"{key.lower()}:") for line in body)
            where = " (a `{key}:` line is in the body: trailers go in the last paragraph, after a blank line)"
            problems.append(f"missing trailer `{key}:` ({what})" + (where.format(key=key) if stray else ""))
        if len(values) > 1 and not repeat:
            problems.append(f"trailer `{key}:` given {len(values)} times, at most once")
        for value in values:
            if not re.fullmatch(pattern, value):
                problems.append(f"malformed trailer `{key}: {value}`: must be {what}")
    return problems


def check(patches: list[Path]) -> list[str]:
    """Return ``patches/NAME: problem`` lines for every patch."""
    found = []
    for p in patches:
        try:
            problems = [why] if (why := tree.patch_file_problem(p)) else message_problems(read_message(p))
        except (OSError, subprocess.CalledProcessError) as e:
            problems = [f"cannot be read as a patch: {(getattr(e, 'stderr', '') or str(e)).strip()}"]
        found += [f"patches/{p.name}: {problem}" for problem in problems]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=tree.PROJECT, help="project root (default: %(default)s)")
    parser.add_argument("patches", nargs="*", type=Path, help="patch files (default: patches/series)")
    args = parser.parse_args(argv)
    try:
        patches = args.patches or tree.series(args.root.resolve())
    except tree.TreeError as e:
        print(f"trailers.py: {e}", file=sys.stderr)
        return 1
    problems = check(patches)
    for line in problems:
        print(line)
    print(f"trailers: {len(patches)} patch(es) checked, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
