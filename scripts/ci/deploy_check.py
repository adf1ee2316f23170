#!/usr/bin/env python3
"""
Install the built wheel the way an operator does, check it, and undo it (``nox -s deploy-check-<db>``).

In a new venv (a temporary folder): the released ``apache-airflow==<base>`` with the ``--with``
requirements (the providers, the database driver) from the package index, then ``pip install --no-deps``
the wheel. Checked, each a numbered line of the transcript: ``pip check`` is clean; ``airflow version`` is
the wheel's version and ``series_info.py`` lists its patches; the migration scripts are the release's
(same files, same alembic head); ``airflow db migrate`` on a fresh throwaway database (sqlite file, or a
PostgreSQL / MariaDB server of its own, ``dbserver.py``) reaches that head; ``airflow db check-migrations``
passes. Rollback: ``pip install --force-reinstall --no-deps apache-airflow-core==<base>`` (a plain
``==<base>`` is satisfied by the installed ``<base>+series...``), then the release is back (version, no
series, ``pip check``) and the database is untouched (alembic revision, tables and row counts, with Airflow's default connections
added after the migration).

Nothing is written outside its temporary folders (and the package caches of pip/uv). Errors: one line
naming the step and the cause, exit 1.

Usage: ``deploy_check.py --backend sqlite|postgres|mysql --wheel WHEEL [--with REQ ...]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import dbserver  # noqa: E402
import tree  # noqa: E402

INFO = Path(__file__).with_name("series_info.py")
PROVIDER_MODULES = {
    "apache-airflow-providers-celery": "airflow.providers.celery.executors.celery_executor",
    "apache-airflow-providers-openlineage": "airflow.providers.openlineage.plugins.listener",
}
# Run with the venv's Python: the migration scripts' alembic head and digest, the database's revision,
# tables and row counts (the DSN comes from the environment, as Airflow reads it).
PROBE = r"""
import hashlib, json, os, pathlib
import airflow
from sqlalchemy import create_engine, inspect, text
from airflow.utils.db import _get_script_object
mig = pathlib.Path(airflow.__file__).parent / "migrations"
digest = hashlib.sha256()
for f in sorted(p for p in mig.rglob("*.py") if "__pycache__" not in p.parts):
    digest.update(str(f.relative_to(mig)).encode() + b"\0" + f.read_bytes())
out = {"heads": sorted(_get_script_object().get_heads()), "migrations": digest.hexdigest()[:12]}
engine = create_engine(os.environ["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"])
with engine.connect() as c:
    tables = sorted(inspect(c).get_table_names())
    q = c.dialect.identifier_preparer.quote
    out["tables"] = {t: c.execute(text(f"SELECT COUNT(*) FROM {q(t)}")).scalar() for t in tables}
    if "alembic_version" in tables:
        out["revision"] = sorted(r[0] for r in c.execute(text("SELECT version_num FROM alembic_version")))
print(json.dumps(out))
"""


class CheckFailed(Exception):
    """A step failed; the message names it and the cause."""


def run(cmd: list[str], env: dict[str, str], step: str, timeout: float = 900) -> str:
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise CheckFailed(f"{step}: no answer in {timeout:.0f} s") from None
    if proc.returncode:
        lines = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
        cause = next((line for line in reversed(lines) if re.search(r"error|Error|ERROR", line)), None)
        cause = (cause or (lines or ["no output"])[-1]).strip().removeprefix("cause: ")
        fetch = next((line.strip() for line in lines if "Failed to fetch:" in line), None)  # uv, no index
        if fetch:
            cause = f"{fetch.removeprefix('cause: ')}: {cause}"
        raise CheckFailed(f"{step}: exit {proc.returncode}: {cause}")
    return proc.stdout.strip()


def operator_env(home: Path) -> dict[str, str]:
    """The environment of the commands run in the venv: ours without Airflow's settings, a new AIRFLOW_HOME."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "VIRTUAL_ENV"))}
    env.update(
        AIRFLOW_HOME=str(home), AIRFLOW__CORE__LOAD_EXAMPLES="False", PIP_DISABLE_PIP_VERSION_CHECK="1"
    )
    return env


def release_venv(venv: Path, base: str, extra: list[str], env: dict[str, str]) -> tuple[str, str]:
    """A new venv at ``venv`` with the released ``apache-airflow==base`` and ``extra``; (python, pip) paths.

    uv installs the release's dependencies (fast, from its cache); pip itself is in the venv for the operator's
    steps that follow (``pip install --no-deps``, ``pip check``).
    """
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
    py, pip = str(venv / "bin" / "python"), str(venv / "bin" / "pip")
    uv = shutil.which("uv")
    installer = [uv, "pip", "install", "--python", py] if uv else [pip, "install", "-q"]
    run([*installer, f"apache-airflow=={base}", *extra], env,
        f"[1] install the released apache-airflow=={base} from the package index")  # fmt: skip
    return py, pip


def import_providers(py: str, extra: list[str], env: dict[str, str], step: str, say) -> None:
    """pip check reads metadata only: import what the providers' executors and listeners import."""
    for module in [m for p, m in PROVIDER_MODULES.items() if any(e.startswith(p) for e in extra)]:
        run([py, "-c", f"import {module}"], env, f"{step} import {module}")
        say(f"    import {module}: ok")


def wheel_version(wheel: Path) -> str:
    try:
        with zipfile.ZipFile(wheel) as z:
            meta = next((n for n in z.namelist() if n.endswith(".dist-info/METADATA")), None)
            found = meta and re.search(r"^Version: (\S+)$", z.read(meta).decode(errors="replace"), re.M)
    except (OSError, zipfile.BadZipFile) as e:
        raise CheckFailed(f"{wheel}: not a wheel ({e})") from None
    if not found:
        raise CheckFailed(f"{wheel}: not a wheel (no .dist-info/METADATA with a Version)")
    return found[1]


@contextlib.contextmanager
def fresh_database(backend: str, tmp: Path):
    if backend == "sqlite":
        yield f"sqlite:///{tmp}/airflow.db"
    else:
        try:
            with dbserver.throwaway(backend) as dsn:
                yield dsn
        except dbserver.ServerError as e:
            raise CheckFailed(f"throwaway {backend} server: {str(e).splitlines()[0]}") from None


def check(backend: str, wheel: Path, extra: list[str]) -> None:
    version = wheel_version(wheel)
    base = version.split("+", 1)[0]
    say = lambda text: print(text, flush=True)  # noqa: E731
    say(f"deploy-check {backend}: apache-airflow=={base} from the package index, then {wheel.name}")
    with tempfile.TemporaryDirectory(prefix="deploy-check.") as tmp_name:
        tmp = Path(tmp_name)
        venv, home = tmp / "venv", tmp / "home"
        home.mkdir()
        env = operator_env(home)
        started = time.monotonic()
        py, pip = release_venv(venv, base, extra, env)
        airflow = str(venv / "bin" / "airflow")
        core = run([py, "-c", "import airflow; print(airflow.__version__)"], env, "[1] airflow")
        say(f"[1] released apache-airflow=={base} + {' '.join(extra)} installed in "
            f"{time.monotonic() - started:.0f} s: apache-airflow-core {core}")  # fmt: skip
        with fresh_database(backend, tmp) as dsn:
            env[dbserver.DSN_ENV] = dsn
            probe = lambda step: json.loads(run([py, "-c", PROBE], env, step).splitlines()[-1])  # noqa: E731
            release = probe("[1] probe the release")
            import_providers(py, extra, env, "[1]", say)
            say(
                f"    release's migrations: alembic head {release['heads']}, scripts sha256 {release['migrations']}"
            )
            run([pip, "install", "--no-deps", str(wheel)], env, "[2] pip install --no-deps the wheel")
            say(f"[2] pip install --no-deps {wheel.name}: ok")
            say(f"[3] pip check: {run([pip, 'check'], env, '[3] pip check')}")
            shown = run([airflow, "version"], env, "[4] airflow version").splitlines()[-1]
            if shown != version:
                raise CheckFailed(f"[4] airflow version printed {shown!r}, the wheel is {version}")
            carried = run([py, str(INFO)], env, "[4] series_info.py").splitlines()[0]
            say(f"[4] airflow version: {shown}; series_info.py: {carried}")
            import_providers(py, extra, env, "[4]", say)
            series = probe("[4] probe the series")
            if (series["heads"], series["migrations"]) != (release["heads"], release["migrations"]):
                raise CheckFailed(f"[4] the series changes the migrations: {series} vs the release {release}")
            say(
                "    series' migrations: the release's (same alembic head, same scripts): it adds no migration"
            )
            run([airflow, "db", "migrate"], env, "[5] airflow db migrate")
            # Some rows of the operator's kind, for the rollback to leave alone.
            run([airflow, "connections", "create-default-connections"], env, "[5] create-default-connections")
            migrated = probe("[5] probe after migrate")
            if migrated.get("revision") != release["heads"]:
                raise CheckFailed(
                    f"[5] alembic_version is {migrated.get('revision')}, not {release['heads']}"
                )
            rows = sum(migrated["tables"].values())
            say(f"[5] airflow db migrate on a fresh {backend} database: alembic_version {migrated['revision']}"
                f" = the release's head; {len(migrated['tables'])} tables, {rows} rows with the default connections")  # fmt: skip
            run([airflow, "db", "check-migrations", "-t", "60"], env, "[6] airflow db check-migrations")
            say("[6] airflow db check-migrations: ok")
            pristine = f"apache-airflow-core=={base}"
            run(
                [pip, "install", "--force-reinstall", "--no-deps", pristine], env, f"[7] reinstall {pristine}"
            )
            back = run([airflow, "version"], env, "[7] airflow version").splitlines()[-1]
            info = subprocess.run([py, str(INFO)], env=env, capture_output=True, text=True, timeout=120)
            if back != base or info.returncode != 1:
                raise CheckFailed(
                    f"[7] after the rollback: airflow version {back}, series_info.py {info.stdout}"
                )
            say(f"[7] rollback: pip install --force-reinstall --no-deps {pristine}: airflow version {back}; "
                f"{info.stderr.strip().removeprefix('series_info.py: ')}")  # fmt: skip
            say(f"    pip check: {run([pip, 'check'], env, '[7] pip check')}")
            after = probe("[7] probe after the rollback")
            if (after["revision"], after["tables"]) != (migrated["revision"], migrated["tables"]):
                raise CheckFailed(f"[7] the database changed: {migrated} -> {after}")
            run([airflow, "db", "check-migrations", "-t", "60"], env, "[7] airflow db check-migrations")
            say(f"    database untouched: alembic_version {after['revision']}, {len(after['tables'])} tables "
                f"and {sum(after['tables'].values())} rows as before; db check-migrations: ok")  # fmt: skip
    say(f"deploy-check {backend}: PASSED")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", required=True, choices=("sqlite", "postgres", "mysql"))
    parser.add_argument("--wheel", required=True, type=Path)
    parser.add_argument("--with", dest="extra", action="append", default=[], help="another requirement")
    args = parser.parse_args(argv)
    tree.exit_on_hangup()
    try:
        if not args.wheel.is_file():
            raise CheckFailed(f"{args.wheel}: no such wheel (`nox -s build` makes it)")
        check(args.backend, args.wheel.resolve(), args.extra)
    except CheckFailed as e:
        print(f"deploy_check.py: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("deploy_check.py: interrupted; temporary folders removed", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
