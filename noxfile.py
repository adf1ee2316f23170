"""
Sessions of the patch series for apache-airflow-core (see README.md for the flow).

``nox -s tests-sqlite|tests-postgres|tests-mysql`` materialises ``airflow-core/`` (sdist + series),
installs it editable with the backend's driver and the test tools, gets a database (the DSN in
``AIRFLOW__DATABASE__SQL_ALCHEMY_CONN`` when set, else a throwaway server) and runs pytest; posargs go
to pytest.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import nox

ROOT = Path(__file__).parent
sys.path.insert(0, str(ROOT / "scripts" / "ci"))
import dbserver  # noqa: E402
import tree  # noqa: E402

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


def prepare_tree() -> None:
    try:
        print(tree.prepare(ROOT))
    except tree.TreeError as e:
        raise nox.command.CommandFailed(str(e)) from None


def install(session: nox.Session, backend: str) -> None:
    """Install the patched tree (editable), the backend's driver and the test tools; reuses the venv."""
    pkg = ["pkg-config", "--exists", "mysqlclient"]
    if backend == "mysql" and (not shutil.which("pkg-config") or subprocess.run(pkg).returncode):
        session.error("mysqlclient needs pkg-config and Debian's default-libmysqlclient-dev to build")
    session.install("--no-sources", "-e", "airflow-core", *DRIVERS[backend], *TEST_DEPS)
    # PyPI's task-sdk reads core's config_templates from site-packages/airflow/, which an editable
    # install of airflow-core does not create (upstream's monorepo finds it by relative path instead).
    purelib = session.run("python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                          silent=True).strip()  # fmt: skip
    link = Path(purelib) / "airflow" / "config_templates"
    if not link.exists():
        link.symlink_to(ROOT / "airflow-core" / "src" / "airflow" / "config_templates")


@contextlib.contextmanager
def database(session: nox.Session, backend: str):
    """Yield the DSN to test on: the one given like breeze does, or a throwaway server's."""
    given = os.environ.get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN")
    if backend == "sqlite":
        with tempfile.TemporaryDirectory(prefix="airflow-series-sqlite.") as tmp:
            yield given or f"sqlite:///{tmp}/airflow.db"
    elif given and os.environ.get("BACKEND", backend) == backend:
        yield given
    else:
        try:
            with dbserver.throwaway(backend) as dsn:
                yield dsn
        except dbserver.ServerError as e:
            session.error(str(e))


def in_database(session: nox.Session, backend: str, *command: str) -> None:
    """Prepare and install the tree, then run ``command`` with the backend's database configured."""
    prepare_tree()
    install(session, backend)
    series = tree.series(ROOT)
    session.log(f"base: apache-airflow-core {tree.base_config(ROOT)['version']}; {len(series)} patch(es):")
    for p in series:
        session.log(f"  {p.name}")
    with database(session, backend) as dsn, tempfile.TemporaryDirectory(prefix="airflow-home.") as home:
        env = {"AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": dsn, "BACKEND": backend, "AIRFLOW_HOME": home}
        session.run("python", "scripts/ci/dbserver.py", "check", dsn, env=env)
        session.run(*command, env=env)


def backend_sessions(prefix: str, doc: str, command: tuple[str, ...]) -> None:
    """Define ``<prefix>-<backend>`` for every backend, running ``command`` + posargs in its database."""
    for backend in DRIVERS:

        def run(session: nox.Session, backend: str = backend) -> None:
            in_database(session, backend, *command, *session.posargs)

        run.__doc__ = doc.format(backend=backend)
        nox.session(name=f"{prefix}-{backend}")(run)


backend_sessions("tests", "Run the tests on {backend} against the patched airflow-core.", ("pytest",))
backend_sessions(
    "verify-series",
    "Prove each patch on {backend}: its tests fail before it, pass with it, the suite stays green.",
    ("python", "scripts/ci/verify_series.py"),
)


@nox.session(venv_backend="none")
def prepare(session: nox.Session) -> None:
    """Build airflow-core/ from the pinned sdist (sha256-checked) and apply patches/series."""
    prepare_tree()


@nox.session(venv_backend="none")
def refresh(session: nox.Session) -> None:
    """Rewrite patches/ and patches/series from the commits above base in airflow-core/."""
    try:
        session.log(tree.refresh(ROOT))
    except tree.TreeError as e:
        session.error(str(e))
