"""scripts/ci/build.py: reproducible wheel + sdist with the series recorded; refusals (issue 31, item 1).

Builds a throwaway project's series with upstream's own backend (needs git, the sdist and `uv` with access to
the package index for hatchling); each build takes about 10 s.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from seriesproject import ROOT, SINK, add_flush, make_project, message  # noqa: E402

BUILD = ROOT / "scripts" / "ci" / "build.py"
INFO = ROOT / "scripts" / "ci" / "series_info.py"
MARKER = "# --- operator tail ---"
SCHEDULER = "src/airflow/jobs/scheduler_job_runner.py"


def run(root: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k != "USE_AIRFLOW_VERSION"}
    return subprocess.run([sys.executable, str(BUILD), "--root", str(root), *args], capture_output=True,
                          text=True, env={**clean, **env}, timeout=600)  # fmt: skip


def one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("build.py: "), proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    comment = lambda text: "# a second patch of the test series\n" + text  # noqa: E731
    return make_project(
        tmp_path_factory.mktemp("build") / "project",
        [
            ({SINK: add_flush}, message("Flush the callback row in the caller's session")),
            ({SCHEDULER: comment}, message("Add a comment to the scheduler")),
        ],
    )


def test_two_builds_are_byte_identical_and_carry_version_and_series(project: Path, tmp_path: Path):
    first, second = tmp_path / "one", tmp_path / "two"
    assert run(project, "--dist", str(first)).returncode == 0
    proc = run(project, "--dist", str(second))
    assert proc.returncode == 0, proc.stderr
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir()) and len(names) == 2
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    version = re.fullmatch(r"apache_airflow_core-(3\.3\.2\+series\.2\.[0-9a-gz]+)\.tar\.gz", names[1])[1]
    wheel = zipfile.ZipFile(first / names[0])
    assert names[0] == f"apache_airflow_core-{version}-py3-none-any.whl"
    assert f'__version__ = "{version}"' in wheel.read("airflow/__init__.py").decode()
    record = json.loads(
        wheel.read(f"apache_airflow_core-{version}.dist-info/extra_metadata/airflow-core-series.json")
    )
    assert [p["name"] for p in record["patches"]] == [p.strip() for p in (project / "patches" / "series")
                                                      .read_text().splitlines() if not p.startswith("#")]  # fmt: skip
    assert record["patches"][0]["bug"] == ["https://github.com/apache/airflow/issues/42553"]
    assert "session.flush()" in wheel.read("airflow/callbacks/database_callback_sink.py").decode()
    with tarfile.open(first / names[1]) as sdist:
        info = sdist.extractfile(f"apache_airflow_core-{version}/PKG-INFO").read().decode()
    assert f"\nVersion: {version}\n" in info
    shown = subprocess.run([sys.executable, str(INFO), str(first / names[0])], capture_output=True, text=True)
    assert shown.returncode == 0 and f"{version}: 3.3.2 + 2 patch(es)" in shown.stdout
    assert "Flush the callback row in the caller's session" in shown.stdout


def test_core_tier_is_the_patches_above_the_marker(project: Path, tmp_path: Path):
    series = project / "patches" / "series"
    text = series.read_text()
    assert one_line_error(run(project, "--core", "--dist", str(tmp_path))).endswith(
        f"has no `{MARKER}` line: its tiers are not marked yet, so --core cannot be built "
        "(build without --core for the whole series)"
    )
    lines = text.splitlines()
    series.write_text("\n".join([*lines[:-1], MARKER, lines[-1]]) + "\n")
    try:
        proc = run(project, "--core", "--dist", str(tmp_path))
    finally:
        series.write_text(text)
    assert proc.returncode == 0, proc.stderr
    wheel = next(tmp_path.glob("*.whl"))
    assert re.fullmatch(r"apache_airflow_core-3\.3\.2\+series\.core\.1\.\w+-py3-none-any\.whl", wheel.name)
    scheduler = zipfile.ZipFile(wheel).read("airflow/jobs/scheduler_job_runner.py").decode()
    assert "# a second patch" not in scheduler


@pytest.mark.parametrize("case", ["edited", "untracked", "partial", "other-base", "no-series-head"])
def test_a_tree_that_is_not_exactly_the_series_is_refused(project: Path, tmp_path: Path, case: str):
    core = project / "airflow-core"
    git = ["git", "-C", str(core)]
    stamps = {f: (core / ".git" / f).read_bytes() for f in ("series-stamp", "series-head")}
    if case == "edited":
        (core / SINK).write_text((core / SINK).read_text() + "# local edit\n")
    elif case == "untracked":
        (core / "notes.txt").write_text("mine\n")
    elif case == "other-base":  # as tree.py stamps a tree of another base (its sdist's sha256 differs)
        (core / ".git" / "series-stamp").write_text("0" * 64)
    elif case == "no-series-head":  # a tree made before tree.py wrote .git/series-head
        (core / ".git" / "series-head").unlink()
    else:
        subprocess.run([*git, "checkout", "-q", "--detach", "series~1"], check=True)
    try:
        error = one_line_error(run(project, "--dist", str(tmp_path / "dist")))
    finally:
        subprocess.run([*git, "checkout", "-q", "-f", "series"], check=True)
        (core / "notes.txt").unlink(missing_ok=True)
        for f, data in stamps.items():
            (core / ".git" / f).write_bytes(data)
    assert {
        "edited": f"airflow-core/ has uncommitted changes ({SINK})",
        "untracked": "airflow-core/ has untracked files (notes.txt)",
        "partial": "airflow-core/ is a partial checkout (base + 1 of 2 patches)",
        "other-base": "airflow-core/ was not built from 3.3.2 + patches/series (another base's tree",
        "no-series-head": "airflow-core/ has no .git/series-head (made by an older tree.py)",
    }[case] in error
    assert not (tmp_path / "dist").exists()


def test_an_unknown_base_is_refused(project: Path, tmp_path: Path):
    error = one_line_error(run(project, "--dist", str(tmp_path / "dist"), USE_AIRFLOW_VERSION="9.9.9"))
    assert "USE_AIRFLOW_VERSION=9.9.9 is not a supported base; supported: 3.3.2" in error
    assert not (tmp_path / "dist").exists()


def test_no_network_to_the_package_index_is_one_line_and_leaves_the_tree_alone(project: Path, tmp_path: Path):
    closed = "http://127.0.0.1:9/simple"  # nothing listens on port 9 (discard); hatchling is fetched from it
    git_dir = project / "airflow-core" / ".git"
    before = (git_dir.stat().st_mtime_ns, (git_dir / "index").read_bytes())
    proc = run(project, "--dist", str(tmp_path / "dist"), UV_DEFAULT_INDEX=closed, UV_INDEX_URL=closed)
    error = one_line_error(proc)
    assert "`uv build` failed: Failed to fetch: http://127.0.0.1:9/simple/" in error
    assert error.endswith("Connection refused (os error 111)")
    assert not (tmp_path / "dist").exists()
    # the check of airflow-core/ neither rewrote its index nor took its index.lock
    assert (git_dir.stat().st_mtime_ns, (git_dir / "index").read_bytes()) == before


def test_no_network_for_the_base_sdist_is_one_line_naming_the_index(project: Path, tmp_path: Path):
    """An sdist not cached yet (a new base, a fresh machine) and no package index: pip's output was printed
    whole (warnings, two ERROR lines) after the message (issue 31)."""
    closed = "http://127.0.0.1:9/simple"
    pip_env = {
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_FIND_LINKS": "",
        "PIP_EXTRA_INDEX_URL": "",
        "PIP_RETRIES": "1",
    }
    proc = run(project, "--dist", str(tmp_path / "dist"), XDG_CACHE_HOME=str(tmp_path / "cache"),
               PIP_INDEX_URL=closed, **pip_env)  # fmt: skip
    error = one_line_error(proc)
    assert "could not download the sdist of apache-airflow-core==3.3.2 (pip download): No matching" in error
    assert error.endswith("(the package index is not reachable: Failed to establish a new connection: "
                          "[Errno 111] Connection refused)")  # fmt: skip
    assert not (tmp_path / "dist").exists()


@pytest.mark.parametrize("arg", ["missing.whl", "README.md", "--help"])
def test_series_info_names_a_bad_argument_in_one_line(arg: str):
    """A missing file, a file that is not a wheel, an option: a traceback before (issue 31)."""
    proc = subprocess.run([sys.executable, str(INFO), arg], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode in (1, 2) and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("series_info.py: " if arg != "--help" else "usage: series_info.py [WHEEL]")


def test_a_bad_source_date_epoch_is_named(project: Path, tmp_path: Path):
    """Before: "`uv build` failed: hint: Build failures usually indicate a problem with the package or the
    build environment" (uv -q hid hatchling's ValueError) (issue 31)."""
    error = one_line_error(run(project, "--dist", str(tmp_path / "dist"), SOURCE_DATE_EPOCH="abc"))
    assert error == "build.py: SOURCE_DATE_EPOCH='abc' is not a number of seconds since 1970"
    assert not (tmp_path / "dist").exists()


def test_a_build_backend_failure_names_its_exception_not_uvs_hint():
    sys.path.insert(0, str(ROOT / "scripts" / "ci"))
    import build

    stderr = (
        'Traceback (most recent call last):\n  File "<string>", line 11, in <module>\n'
        "ValueError: invalid literal for int() with base 10: 'abc'\n"
        "error: Failed to build `/tmp/x/apache_airflow_core-3.3.2+series.1.abc/`\n"
        "  cause: The build backend returned an error\n"
        "  cause: Call to `hatchling.build.build_sdist` failed (exit status: 1)\n\n"
        "hint: Build failures usually indicate a problem with the package or the build environment\n"
    )
    assert build.uv_error(stderr) == (
        "Call to `hatchling.build.build_sdist` failed (exit status: 1): "
        "ValueError: invalid literal for int() with base 10: 'abc'"
    )


def test_series_info_shows_a_backports_origin(tmp_path: Path):
    """Patch 7 (backport of merged PR #67372) has no patches/upstream.toml entry: series_info printed no
    upstream status for it at all, though the wheel records its Origin (issue 31)."""
    entry = {"name": "p.patch", "subject": "Record history", "bug": [], "forwarded": ["not-needed"],
             "applied-upstream": [], "origin": ["backport, https://github.com/apache/airflow/pull/67372"],
             "upstream-status": None}  # fmt: skip
    record = {"distribution": "apache-airflow-core", "version": "3.3.2+series.1.abc", "base": "3.3.2",
              "tier": "all", "patches": [entry, {**entry, "origin": ["self"]}]}  # fmt: skip
    wheel = tmp_path / "apache_airflow_core-3.3.2+series.1.abc-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("apache_airflow_core-3.3.2+series.1.abc.dist-info/extra_metadata/airflow-core-series.json",
                   json.dumps(record))  # fmt: skip
    shown = subprocess.run([sys.executable, str(INFO), str(wheel)], capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[1].endswith("origin: backport, https://github.com/apache/airflow/pull/67372]"), lines
    assert "origin" not in lines[2]
