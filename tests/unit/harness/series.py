# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""
The patch series under test: the base (``USE_AIRFLOW_VERSION``), its queue (``patches/series``), the
``proves`` / ``guard`` markers and the selection the options ``--proves``, ``--guards`` and
``--proves-last`` make (the conftest's hooks call it), the modules a base's queue does not collect.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.harness.env import BACKEND, KNOWN_BACKENDS

PROJECT_ROOT = Path(__file__).resolve().parents[3]


def _base_queue() -> tuple[str, Path, Path]:
    """The base under test (USE_AIRFLOW_VERSION, as the nox sessions select it), its patches/series and
    its generated tree."""
    import sys

    sys.path.insert(0, str(PROJECT_ROOT / "scripts" / "ci"))
    import tree

    root = PROJECT_ROOT
    return tree.base_config(root)["version"], tree.patches_dir(root) / "series", tree.core_dir(root)


# A test marked proves(P) for a patch of the newest base's queue (patches/series) that another base's queue
# does not carry (not ported, or not needed there: see `nox -s series-status`) is skipped on that base.
BASE_VERSION, SERIES_FILE, CORE_DIR = _base_queue()
DEFAULT_SERIES_FILE = PROJECT_ROOT / "patches" / "series"


def _release(version: str) -> tuple[int, ...]:
    """``(3, 4, 0)`` for ``3.4.0`` and for a pre-release such as ``3.4.0b2``."""
    import re

    return tuple(int(re.match(r"\d+", part).group()) for part in version.split(".")[:3])


# Every queue is series v3 (the scheduler owns its transaction). A test marked with a v2 patch proves, on a v3 queue,
# the v3 patch that carries that change (docs/series-v3.md). The v2 patches missing in v3 (background listeners, held
# FAILED events, SQLite's write lock, giving up on an event) have their tests skipped; killed-runner callbacks are the
# 3.3.2 queue's operator tail patch.
V3_PATCH_OF = {
    "Row-lock-the-heartbeat-timeout-scan.patch": "Fail-heartbeat-timed-out-tries-in-the-same-pass.patch",
    "Revalidate-heartbeat-timeouts-under-the-row-lock.patch": "Fail-heartbeat-timed-out-tries-in-the-same-pass.patch",
    "Derive-heartbeat-timeout-callback-type-from-the-task.patch": "Fail-heartbeat-timed-out-tries-in-the-same-pass.patch",
    "Call-on_task_instance_failed-listeners-after-the-failure-is-committed.patch": (
        "Fail-a-task-instance-in-the-caller-s-transaction.patch"
    ),
    "Delete-task-reschedules-of-a-retried-TI-right-before-its-id-changes.patch": (
        "Lock-the-task-instance-row-when-handling-its-failure.patch"
    ),
    "Serialise-TI-failure-handling-with-the-execution-API-via-the-row-lock.patch": (
        "Lock-the-task-instance-row-when-handling-its-failure.patch"
    ),
    "Keep-the-scheduler-running-when-one-executor-event-fails-in-the-DB.patch": (
        "Keep-executor-events-until-the-scheduler-s-transaction-commits-them.patch"
    ),
    "Keep-executor-events-until-their-effects-are-committed.patch": (
        "Keep-executor-events-until-the-scheduler-s-transaction-commits-them.patch"
    ),
}


# The v2 tail patches that no queue carries since every base is on series v3: their tests skip ("not in the series").
V2_TAIL = (
    "Hold-a-failed-executor-event-until-the-running-try-s-heartbeat-decides.patch",
    "Read-a-failing-task-instance-under-SQLite-s-write-lock.patch",
    "Give-up-on-an-executor-event-whose-handling-keeps-failing-in-the-DB.patch",
)


def queue_name(patch: str, series: list[str] | None = None) -> str:
    """``patch`` as the queue of the base under test names it: its v3 patch on a v3 queue."""
    series = read_series(SERIES_FILE) if series is None else series
    if series is not None and patch not in series and V3_PATCH_OF.get(patch) in series:
        return V3_PATCH_OF[patch]
    return patch


def carries(patch: str) -> bool:
    """Whether the queue of the base under test carries ``patch`` (for tests that need a later patch)."""
    return queue_name(patch) in (read_series(SERIES_FILE) or ())


def _in_other_queue(patch: str) -> bool:
    """Whether another base's queue (``patches/<base>/series``) lists ``patch``."""
    return any(patch in (read_series(f) or ()) for f in (PROJECT_ROOT / "patches").glob("*/series"))


# Test modules about one patch of the 3.3.2 queue (its regression tests and the guards written with
# it), added after the older bases' queues were made: not collected on a base whose queue does not
# carry that patch (they import or rely on what only it brings). README: "Bases".
_MODULE_OF_PATCH = {
    "jobs/test_scheduler_executor_events_kept.py": "Keep-executor-events-until-their-effects-are-committed.patch",
    "jobs/test_scheduler_failure_from_queued_history.py": (
        "Record-TaskInstanceHistory-when-a-task-fails-from-a-non-running-state.patch"
    ),
    "jobs/test_scheduler_stuck_in_queued_recheck.py": "Re-check-task-instances-stuck-in-queued-under-the-row-lock.patch",
    "jobs/test_scheduler_killed_task_runner_callback.py": (
        "Request-the-failure-callback-of-a-last-try-whose-task-runner-was-killed.patch"
    ),
    "executors/test_local_executor_runner_exit.py": (
        "Request-the-failure-callback-of-a-last-try-whose-task-runner-was-killed.patch"
    ),
    "jobs/test_killed_task_runner_real_supervisor.py": (
        "Request-the-failure-callback-of-a-last-try-whose-task-runner-was-killed.patch"
    ),
    "jobs/test_task_runner_startup_failure_real_supervisor.py": (
        "Request-the-failure-callback-of-a-last-try-whose-task-runner-was-killed.patch"
    ),
    "jobs/test_scheduler_killed_runner_running_try_review.py": (
        "Fail-a-running-try-at-the-event-of-its-killed-task-runner.patch"
    ),
    "jobs/test_scheduler_failure_listeners_background.py": (
        "Call-on_task_instance_failed-listeners-in-a-background-thread.patch"
    ),
    "jobs/test_scheduler_failure_listeners_background_reads.py": (
        "Call-on_task_instance_failed-listeners-in-a-background-thread.patch"
    ),
    "jobs/test_scheduler_failure_listeners_background_openlineage.py": (
        "Call-on_task_instance_failed-listeners-in-a-background-thread.patch"
    ),
    "models/test_taskinstance_sqlite_write_lock.py": "Read-a-failing-task-instance-under-SQLite-s-write-lock.patch",
    "models/test_taskinstance_sqlite_write_lock_busy.py": "Read-a-failing-task-instance-under-SQLite-s-write-lock.patch",
    "models/test_taskinstance_sqlite_write_lock_order.py": "Read-a-failing-task-instance-under-SQLite-s-write-lock.patch",
    "models/test_taskinstance_sqlite_write_lock_skip.py": "Read-a-failing-task-instance-under-SQLite-s-write-lock.patch",
    "api_fastapi/execution_api/versions/head/test_task_instances_heartbeat_lock_order.py": (
        "Serialise-TI-failure-handling-with-the-execution-API-via-the-row-lock.patch"
    ),
}


def guard_since(version: str, patch: str):
    """Marker: a guard on bases from ``version`` on, which already behave so; on an older base, where a
    patch of its queue brings the behaviour, a regression test of ``patch`` (compat across bases)."""
    return pytest.mark.guard if _release(BASE_VERSION) >= _release(version) else pytest.mark.proves(patch)


def read_series(path: Path = SERIES_FILE) -> list[str] | None:
    """Patch file names listed in ``patches/series`` (quilt format), or None if there is no file."""
    if not path.is_file():
        return None
    names = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(line.split()[0])
    return names


# On a v3 queue: tests of what only the v2 queues have are skipped (``pytest.mark.skipif(V3, reason=...)``).
V3 = carries("Fail-a-task-instance-in-the-caller-s-transaction.patch")


def _proves_args(item: pytest.Item, series: list[str] | None) -> tuple[str, tuple[str, ...]] | None:
    marker = item.get_closest_marker("proves")
    if marker is None:
        return None
    where = f"{item.nodeid}: @pytest.mark.proves"
    if len(marker.args) != 1 or not isinstance(marker.args[0], str):
        raise pytest.UsageError(f"{where} takes exactly one patch file name, got {marker.args!r}")
    unknown_kw = set(marker.kwargs) - {"base_ok_on"}
    if unknown_kw:
        raise pytest.UsageError(f"{where}: unknown keyword(s) {sorted(unknown_kw)}")
    patch = marker.args[0]
    if not patch.endswith(".patch"):
        raise pytest.UsageError(f"{where}({patch!r}): expected a '*.patch' file name")
    known = {*(read_series(DEFAULT_SERIES_FILE) or ()), *V3_PATCH_OF, *V2_TAIL}
    if series is not None and patch not in series and patch not in known and not _in_other_queue(patch):
        raise pytest.UsageError(f"{where}({patch!r}): not listed in {SERIES_FILE}")
    patch = queue_name(patch, series)
    base_ok_on = marker.kwargs.get("base_ok_on", ())
    if isinstance(base_ok_on, str):
        base_ok_on = (base_ok_on,)
    bad = set(base_ok_on) - set(KNOWN_BACKENDS)
    if bad:
        raise pytest.UsageError(f"{where}: base_ok_on has unknown backend(s) {sorted(bad)}")
    return patch, tuple(base_ok_on)


def select_items(config: pytest.Config, items: list[pytest.Item]) -> None:
    """pytest_collection_modifyitems: skip, mark and select the tests by the series and the options."""
    series = read_series()
    wanted = config.getoption("--proves")
    last = config.getoption("--proves-last")
    if last is not None:
        wanted = [*(wanted or ()), last]
    guards = config.getoption("--guards")
    selected, deselected, tail = [], [], set()
    for item in items:
        proves = _proves_args(item, series)
        unqueued = config.getoption("--run-unqueued") and proves is not None and proves[0] not in V2_TAIL
        if proves is not None and series is not None and proves[0] not in series and not unqueued:
            why = f"{proves[0]} is not in the {BASE_VERSION} series ({SERIES_FILE.relative_to(PROJECT_ROOT)})"
            item.add_marker(pytest.mark.skip(reason=why))
        if proves is not None:
            patch, base_ok_on = proves
            # Exposed to --junitxml / reports for the verify-series tool.
            item.user_properties.append(("proves", patch))
            item.user_properties.append(("base_ok", BACKEND in base_ok_on))
        is_guard = item.get_closest_marker("guard") is not None
        if is_guard:
            item.user_properties.append(("guard", True))

        backend_marker = item.get_closest_marker("backend")
        if backend_marker is not None:
            bad = set(backend_marker.args) - set(KNOWN_BACKENDS)
            if bad or not backend_marker.args:
                raise pytest.UsageError(
                    f"{item.nodeid}: @pytest.mark.backend{backend_marker.args!r}: "
                    f"expected names from {KNOWN_BACKENDS}"
                )
            if BACKEND not in backend_marker.args:
                why = backend_marker.kwargs.get("reason")
                item.add_marker(
                    pytest.mark.skip(
                        reason=f"backend {BACKEND!r} not in {', '.join(backend_marker.args)}"
                        + (f": {why}" if why else "")
                    )
                )

        everything = wanted is None and not guards
        proves_wanted = (
            wanted is not None
            and proves is not None
            and (
                proves[0] in wanted or V3_PATCH_OF.get(proves[0]) in wanted  # --run-unqueued: the v3 name
            )
        )
        if everything or proves_wanted or (guards and is_guard):
            selected.append(item)
            if proves is not None and proves[0] == last:
                tail.add(item)
        else:
            deselected.append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
    # --proves-last: its tests after all others, so that what they leave behind when they fail cannot
    # disturb the others.
    items[:] = [i for i in selected if i not in tail] + [i for i in selected if i in tail]


def not_collected(unqueued: bool = False) -> list[str]:
    """
    The conftest's ``collect_ignore``: the modules of patches the queue under test does not carry; with
    ``--run-unqueued`` (``unqueued``) only those of the v2 tail, which no queue carries.
    """
    if unqueued:
        return [module for module, patch in _MODULE_OF_PATCH.items() if patch in V2_TAIL]
    return [module for module, patch in _MODULE_OF_PATCH.items() if not carries(patch)]


def check_options(config: pytest.Config) -> None:
    """``--proves`` / ``--proves-last`` name patches of the queue under test."""
    series = read_series()
    if config.getoption("--run-unqueued"):
        series = [*(series or ()), *(read_series(DEFAULT_SERIES_FILE) or ()), *V3_PATCH_OF]
    last = config.getoption("--proves-last")
    for option, wanted in (("--proves", config.getoption("--proves") or []), ("--proves-last", [last])):
        unknown = [w for w in wanted if w is not None and series is not None and w not in series]
        if unknown:
            raise pytest.UsageError(f"{option} {', '.join(unknown)}: not listed in {SERIES_FILE}")
