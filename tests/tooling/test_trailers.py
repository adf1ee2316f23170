"""scripts/ci/trailers.py rejects patches whose status trailers or message shape are wrong (needs git)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "ci"))
import trailers  # noqa: E402

DIFF = """---
 src/airflow/x.py | 1 +
 1 file changed, 1 insertion(+)

diff --git a/airflow-core/src/airflow/x.py b/airflow-core/src/airflow/x.py
--- a/airflow-core/src/airflow/x.py
+++ b/airflow-core/src/airflow/x.py
@@ -1 +1,2 @@
 a = 1
+b = 2
--
2.39.5
"""
GOOD_TRAILERS = "Bug: https://github.com/apache/airflow/issues/42553\nOrigin: self\nForwarded: no\n"


def write_patch(tmp_path: Path, subject: str, body: str, name: str = "the.patch") -> Path:
    head = "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\nFrom: T <t@example.com>\n"
    head += f"Date: Sun, 29 Nov 2026 00:00:00 +0000\nSubject: [PATCH] {subject}\n\n"
    path = tmp_path / name
    path.write_text(head + body + DIFF)
    return path


def problems(tmp_path: Path, subject: str, body: str) -> list[str]:
    return trailers.check([write_patch(tmp_path, subject, body)])


def test_good_patch_passes(tmp_path: Path):
    body = "The sink commits the caller's session; flush instead.\n\ncloses: #42553\n\n" + GOOD_TRAILERS
    assert problems(tmp_path, "Write callback requests in the caller's transaction", body) == []


def test_applied_upstream_on_main_only_is_accepted(tmp_path: Path):
    body = (
        "What and why.\n\nrelated: #42553\n\nBug: https://github.com/apache/airflow/issues/42553\n"
        "Origin: self\nForwarded: no\nApplied-Upstream: main, https://github.com/apache/airflow/pull/68008\n"
    )
    assert problems(tmp_path, "Row-lock the heartbeat-timeout scan", body) == []


def test_all_fields_and_forms_accepted(tmp_path: Path):
    body = (
        "What and why.\n\nrelated: #71172\n\n"
        "Bug: https://github.com/apache/airflow/issues/71172\nBug: https://github.com/apache/airflow/issues/72716\n"
        "Origin: upstream, https://github.com/apache/airflow/pull/73001\n"
        "Forwarded: https://github.com/apache/airflow/pull/73001\nApplied-Upstream: 3.3.3\n"
    )
    msg = trailers.read_message(write_patch(tmp_path, "Ignore stale executor events of an earlier try", body))
    assert msg.values("Bug") == [
        "https://github.com/apache/airflow/issues/71172",
        "https://github.com/apache/airflow/issues/72716",
    ]
    assert msg.body.splitlines()[-1] == "related: #71172"
    assert trailers.message_problems(msg) == []


def test_missing_trailer_is_rejected_naming_the_patch(tmp_path: Path):
    body = "What and why.\n\ncloses: #42553\n\nBug: https://github.com/apache/airflow/issues/42553\nOrigin: self\n"
    assert problems(tmp_path, "Fix the scan", body) == [
        "patches/the.patch: missing trailer `Forwarded:` "
        "(`no`, `not-needed` or a PR URL https://github.com/apache/airflow/pull/N)"
    ]


@pytest.mark.parametrize(
    ("trailer", "expected"),
    [
        (
            "Bug: https://github.com/apache/airflow/pull/1",
            "malformed trailer `Bug: https://github.com/apache/airflow/pull/1`",
        ),
        ("Bug: #42553", "malformed trailer `Bug: #42553`"),
        ("Forwarded: yes", "malformed trailer `Forwarded: yes`"),
        ("Applied-Upstream: soon", "malformed trailer `Applied-Upstream: soon`"),
    ],
)
def test_malformed_trailer_is_rejected(tmp_path: Path, trailer: str, expected: str):
    key = trailer.split(":")[0]
    kept = [line for line in GOOD_TRAILERS.splitlines() if not line.startswith(key)]
    body = "What and why.\n\ncloses: #42553\n\n" + "\n".join([*kept, trailer]) + "\n"
    found = problems(tmp_path, "Fix the scan", body)
    assert len(found) == 1 and found[0].startswith(f"patches/the.patch: {expected}"), found


def test_trailers_not_in_the_last_paragraph_are_missing(tmp_path: Path):
    body = "What and why.\n" + GOOD_TRAILERS + "\ncloses: #42553\n"
    found = problems(tmp_path, "Fix the scan", body)
    assert any("missing trailer `Bug:`" in p and "a `Bug:` line is in the body" in p for p in found), found


@pytest.mark.parametrize(
    ("subject", "expected"),
    [
        ("Fixed the scan", "'Fixed' is past tense"),
        ("Fixes the scan", "'Fixes' is third person"),
        ("Fixing the scan", "subject is not imperative ('Fixing')"),
        ("Fix the scan.", "subject ends with a period"),
        ("fix the scan", "capitalised imperative verb"),
        ("Fix " + "x" * 70, "subject is 74 characters, at most 72"),
    ],
)
def test_subject_must_be_imperative_and_short(tmp_path: Path, subject: str, expected: str):
    found = problems(tmp_path, subject, "What and why.\n\ncloses: #42553\n\n" + GOOD_TRAILERS)
    assert len(found) == 1 and expected in found[0], found


@pytest.mark.parametrize("subject", ["Process stale events once", "Embed the reason", "Bring back the lock"])
def test_imperatives_that_look_inflected_pass(tmp_path: Path, subject: str):
    assert problems(tmp_path, subject, "What and why.\n\ncloses: #42553\n\n" + GOOD_TRAILERS) == []


def test_body_must_end_with_closes_or_related(tmp_path: Path):
    found = problems(tmp_path, "Fix the scan", "What and why.\n\n" + GOOD_TRAILERS)
    assert found == [
        "patches/the.patch: the body must end with `closes: #N` or `related: #N` before the trailers, "
        "got 'What and why.'"
    ]
    found = problems(tmp_path, "Fix the scan", "closes: #42553\n\n" + GOOD_TRAILERS)
    assert found == [
        "patches/the.patch: the body must say what the patch changes and why, before `closes:`/`related:`"
    ]


def test_cli_exits_1_and_names_each_bad_patch(tmp_path: Path):
    good = write_patch(tmp_path, "Fix the scan", "Why.\n\ncloses: #1\n\n" + GOOD_TRAILERS, "good.patch")
    bad = write_patch(
        tmp_path, "Fix the scan", "Why.\n\ncloses: #1\n\nOrigin: self\nForwarded: no\n", "bad.patch"
    )
    cmd = [sys.executable, str(ROOT / "scripts" / "ci" / "trailers.py"), str(good), str(bad)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 1
    assert "patches/bad.patch: missing trailer `Bug:`" in proc.stdout
    assert "good.patch" not in proc.stdout.replace("2 patch(es)", "")
    assert "trailers: 2 patch(es) checked, 1 problem(s)" in proc.stdout


def test_empty_patch_is_named(tmp_path: Path):
    empty = tmp_path / "empty.patch"
    empty.write_text("")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/ci/trailers.py"), str(empty)],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "patches/empty.patch: the file is empty" in proc.stdout


def test_crlf_patch_is_named(tmp_path: Path):
    good = write_patch(tmp_path, "Fix the thing", "Why.\n\ncloses: #42553\n\n" + GOOD_TRAILERS)
    crlf = tmp_path / "crlf.patch"
    crlf.write_bytes(good.read_bytes().replace(b"\n", b"\r\n"))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/ci/trailers.py"), str(crlf)],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "patches/crlf.patch: CRLF line ends" in proc.stdout
