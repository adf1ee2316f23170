# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
The test environment, set when this module is first imported: before anything imports airflow (airflow
reads its config and builds its engine at import time). Every harness module that imports airflow imports
this one first; the conftest imports it before the others.

Environment (all optional):

``AIRFLOW__DATABASE__SQL_ALCHEMY_CONN``
    DSN of the test database. Default: a sqlite file in ``AIRFLOW_HOME``.
``BACKEND``
    ``sqlite`` | ``postgres`` | ``mysql``. Default: derived from the DSN.
``AIRFLOW_HOME``
    Default: a fresh temporary directory.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

if not os.environ.get("AIRFLOW_HOME"):
    import atexit
    import shutil

    os.environ["AIRFLOW_HOME"] = tempfile.mkdtemp(prefix="airflow-tests-home-")
    atexit.register(shutil.rmtree, os.environ["AIRFLOW_HOME"], ignore_errors=True)
_AIRFLOW_HOME = Path(os.environ["AIRFLOW_HOME"])
(_AIRFLOW_HOME / "dags").mkdir(parents=True, exist_ok=True)

if not os.environ.get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"):
    os.environ["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = f"sqlite:///{_AIRFLOW_HOME / 'unittests.db'}"

_TEST_ENV = {
    # Loads airflow/config_templates/unit_tests.cfg (random fernet key / jwt secret, ...);
    # the AIRFLOW__* variables below still take precedence over it.
    "AIRFLOW__CORE__UNIT_TEST_MODE": "True",
    "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
    "AIRFLOW__CORE__DAGS_FOLDER": str(_AIRFLOW_HOME / "dags"),
    "AIRFLOW__CORE__PLUGINS_FOLDER": str(_AIRFLOW_HOME / "plugins"),
    "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
    "AIRFLOW__DATABASE__LOAD_DEFAULT_CONNECTIONS": "False",
    "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(_AIRFLOW_HOME / "logs"),
    # dag_maker rewrites a DAG right away when a test changes it (default: at most every 30 s).
    "AIRFLOW__CORE__MIN_SERIALIZED_DAG_UPDATE_INTERVAL": "0",
}
for _key, _value in _TEST_ENV.items():
    os.environ[_key] = _value
os.environ.setdefault("AIRFLOW__CORE__FERNET_KEY", "Y2FjYTJhZWQ4ZjFmMzY1NTQ5ZTMxNDM2NjljNGQ4YmQ=")
os.environ.setdefault("AIRFLOW__API_AUTH__JWT_SECRET", "airflow-patch-series-tests-not-a-secret")

KNOWN_BACKENDS = ("sqlite", "postgres", "mysql")


def _backend_from_dsn(dsn: str) -> str:
    scheme = dsn.split(":", 1)[0].split("+", 1)[0].lower()
    return {"postgresql": "postgres", "postgres": "postgres", "mysql": "mysql", "mariadb": "mysql"}.get(
        scheme, scheme
    )


BACKEND = os.environ.get("BACKEND") or _backend_from_dsn(os.environ["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"])
os.environ["BACKEND"] = BACKEND

# airflow.settings also builds an async engine at import time, deriving its DSN from the sync
# one (postgresql+asyncpg / mysql+aiomysql / sqlite+aiosqlite) unless SQL_ALCHEMY_CONN_ASYNC is
# set; without the driver `import airflow` dies with a bare ModuleNotFoundError. Say why instead.
if not os.environ.get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC"):
    import importlib.util

    _async_driver = {"postgres": "asyncpg", "mysql": "aiomysql", "sqlite": "aiosqlite"}.get(BACKEND)
    if _async_driver and importlib.util.find_spec(_async_driver) is None:
        raise ImportError(
            f"airflow.settings creates its async engine with {_async_driver!r} for BACKEND={BACKEND}: "
            f"install {_async_driver} (or set AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC)"
        )

if BACKEND not in KNOWN_BACKENDS:
    raise pytest.UsageError(f"BACKEND={BACKEND!r}; expected one of {', '.join(KNOWN_BACKENDS)}")
