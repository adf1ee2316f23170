# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
The database: the schema made once by Airflow itself (:func:`airflow.utils.db.resetdb`, never
hand-written) and emptied around every test (:func:`clear_db`), sessions and independent engines, and
what the server does (:func:`dialect_locks_rows`, :func:`server_version`, :func:`schema_revisions`).

Fixtures: ``session``, ``other_session``, ``backend`` and the autouse ``_initialize_db`` / ``_clean_db``.
"""

from __future__ import annotations

from tests.unit.harness.env import BACKEND  # first: sets the environment before airflow is imported

import contextlib
import os
from collections.abc import Generator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from airflow import settings
from sqlalchemy import delete, select, text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import sessionmaker

from tests.unit.harness.series import PROJECT_ROOT

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine
    from sqlalchemy.orm import Session


def report_header() -> list[str]:
    """pytest_report_header: the airflow under test, the backend and its server."""
    import sys

    import airflow

    sys.path.insert(0, str(PROJECT_ROOT / "scripts" / "ci"))
    import dbserver

    # Not SQLAlchemy's hide_password: it leaves a password given in the query string (?password=...).
    url = dbserver.masked(settings.SQL_ALCHEMY_CONN)
    lines = [
        f"airflow {airflow.__version__} from {Path(airflow.__file__).parent}",
        f"backend {BACKEND}: {url}",
    ]
    try:
        with settings.engine.connect() as conn:
            lines.append(f"server version: {_server_version(conn)}")
    except SQLAlchemyError as e:  # The DB fixtures report the real error.
        lines.append(f"server version: <unreachable: {type(e).__name__}>")
    return lines


def _server_version(conn) -> str:
    name = conn.dialect.name
    if name == "sqlite":
        return "SQLite " + conn.execute(text("select sqlite_version()")).scalar_one()
    if name == "postgresql":
        return conn.execute(text("select version()")).scalar_one()
    if name == "mysql":
        version = conn.execute(text("select version()")).scalar_one()
        flavour = "MariaDB" if "mariadb" in version.lower() else "MySQL"
        return f"{flavour} {version}"
    return f"{name} {conn.dialect.server_version_info}"


def server_version(session: Session) -> str:
    """Human-readable server version, e.g. ``'PostgreSQL 15.8 ...'``, ``'MariaDB 10.11.6-MariaDB...'``."""
    return _server_version(session.connection())


def schema_revisions(session: Session) -> tuple[str | None, tuple[str, ...]]:
    """``(revision stamped in alembic_version, heads of Airflow's migration scripts)``."""
    from airflow.utils.db import _get_current_revision, _get_script_object

    return _get_current_revision(session), tuple(_get_script_object().get_heads())


def dialect_locks_rows(session: Session) -> bool:
    """
    Whether ``airflow.utils.sqlalchemy.with_row_locks`` really emits ``FOR UPDATE`` here.

    False on sqlite (no row locks at all) and on MariaDB: Airflow only locks on the mysql
    dialect when ``dialect.supports_for_update_of`` (MySQL >= 8), which MariaDB never has
    (https://jira.mariadb.org/browse/MDEV-13115), so ``with_row_locks`` returns the query
    unchanged there.
    """
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.sqlalchemy import with_row_locks

    stmt = with_row_locks(select(TaskInstance.id), session=session)
    sql = str(stmt.compile(dialect=session.get_bind().dialect))
    return "FOR UPDATE" in sql.upper() or "FOR NO KEY UPDATE" in sql.upper()


def no_row_locks_reason(session: Session) -> str:
    """Skip reason to use when :func:`dialect_locks_rows` is False."""
    if BACKEND == "mysql":
        return (
            f"Airflow's with_row_locks emits no FOR UPDATE on {server_version(session)} "
            "(MariaDB / MySQL < 8 lack supports_for_update_of; Airflow does not support MariaDB)"
        )
    return f"Airflow's with_row_locks emits no row lock on {BACKEND}"


def make_engine() -> Engine:
    """
    A new, independent Engine on the test DSN, built like ``airflow.settings.configure_orm``.

    Same engine args (MySQL READ COMMITTED, pool settings), connect args and event handlers
    (sqlite foreign keys + WAL, MySQL UTC time zone). The caller must ``dispose()`` it; the
    ``other_session`` fixture does so.
    """
    from airflow.utils.orm_event_handlers import setup_event_handlers

    connect_args = dict(settings._get_connect_args("sync"))
    if settings.SQL_ALCHEMY_CONN.startswith("sqlite"):
        connect_args["check_same_thread"] = False
    if hasattr(settings, "create_metadata_engine"):
        engine = settings.create_metadata_engine(
            settings.SQL_ALCHEMY_CONN,
            engine_args=settings.prepare_engine_args(),
            connect_args=connect_args,
        )
    else:  # compat 3.1.x: settings.configure_orm() calls create_engine itself
        from sqlalchemy import create_engine

        engine = create_engine(
            settings.SQL_ALCHEMY_CONN,
            connect_args=connect_args,
            **settings.prepare_engine_args(),
            future=True,
        )
    setup_event_handlers(engine)
    return engine


def make_session_factory(engine: Engine) -> sessionmaker:
    """A sessionmaker configured like Airflow's (no autoflush, no expire on commit)."""
    return sessionmaker(bind=engine, autoflush=False, expire_on_commit=False)


# Tables whose rows come from initdb itself and must survive cleaning.
_KEEP_TABLES = {"alembic_version", "log_template"}


def clear_db(session: Session | None = None) -> None:
    """
    Delete the rows tests create (upstream ``clear_db_*`` helpers, in one go).

    Every Airflow table is emptied with a Core ``DELETE`` in reverse foreign-key order
    (dag runs, TIs, TI history, task_reschedule, callback, job, dag, serialized_dag,
    dag_version, dag_bundle, log, xcom, assets, ...), except ``alembic_version`` and
    ``log_template``; ``slot_pool`` keeps only the default pool. The schema is untouched.
    """
    from airflow.models.base import Base
    from airflow.models.pool import Pool

    own = session is None
    if own:
        session = settings.NonScopedSession()
    try:
        session.rollback()
        if session.get_bind().dialect.name == "postgresql":
            # A test that leaked a row lock makes cleaning fail loudly instead of hanging.
            session.execute(text("SET LOCAL lock_timeout = '30s'"))
        for table in reversed(Base.metadata.sorted_tables):
            if table.name in _KEEP_TABLES:
                continue
            if table.name == Pool.__tablename__:
                session.execute(delete(table).where(table.c.pool != Pool.DEFAULT_POOL_NAME))
            else:
                session.execute(delete(table))
        session.commit()
    finally:
        if own:
            session.close()


# ======================================================================================
# Fixtures: database
# ======================================================================================
@pytest.fixture(scope="session", autouse=True)
def _initialize_db() -> Generator[None, None, None]:
    """
    Create the schema once with Airflow's own code (``airflow db reset``).

    A database holding Airflow data (rows in ``dag``, ``connection``, ...) is refused unless ``DB_RESET=true``
    (breeze's ``--db-reset``): every test empties all tables. The nox sessions set it for their throwaway
    databases.

    A database already stamped at the migration head (a previous run, e.g. the steps of verify-series:
    the series changes no schema) is kept; ``clear_db`` empties it around every test.
    """
    import sys

    from airflow.models import import_all_models
    from airflow.utils import db

    sys.path.insert(0, str(PROJECT_ROOT / "scripts" / "ci"))
    import dbserver  # the nox sessions run its check first; this covers pytest run directly

    import_all_models()
    with settings.NonScopedSession() as s:
        held = dbserver.airflow_data(s.connection())
        if held and os.environ.get("DB_RESET", "").lower() != "true":
            pytest.exit(dbserver.refusal(held), returncode=4)
        stamped, heads = schema_revisions(s)
    if stamped is None or (stamped,) != heads:
        db.resetdb()
    settings.Session.remove()
    yield
    settings.Session.remove()
    settings.engine.dispose()


@pytest.fixture(autouse=True)
def _clean_db(_initialize_db) -> Generator[None, None, None]:
    clear_db()
    yield
    settings.Session.remove()
    clear_db()


@pytest.fixture
def backend() -> str:
    """``'sqlite'``, ``'postgres'`` or ``'mysql'`` (MariaDB counts as mysql)."""
    return BACKEND


@pytest.fixture
def session() -> Generator[Session, None, None]:
    """
    Upstream's ``session``: ``create_session()`` (the thread's scoped ``settings.Session()``, i.e. the very
    session ``@provide_session`` code called without ``session=`` uses), rolled back at teardown.
    """
    from airflow.utils.session import create_session

    with create_session() as session:
        yield session
        session.rollback()
    settings.Session.remove()


@pytest.fixture
def other_session() -> Generator[Session, None, None]:
    """A session on a second, independent Engine (its own connection) for concurrency tests."""
    engine = make_engine()
    session = make_session_factory(engine)()
    try:
        yield session
    finally:
        with contextlib.suppress(Exception):
            session.rollback()
        session.close()
        engine.dispose()
