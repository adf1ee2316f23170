"""scripts/ci/export.py output is what an upstream PR needs, and ``git am`` takes it onto the pristine base.

A real series on the pinned base (two patches to the callback sink, the second building on the first)
with regression tests marked ``proves``; each export is ``git am``-ed onto a fresh repository holding
the untouched sdist at ``airflow-core/`` (upstream's monorepo layout). Needs git and the sdist.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from seriesproject import ROOT, SINK, add_flush, make_project, message  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts" / "ci"))
import tree  # noqa: E402

FIRST = "Flush-the-callback-row-in-the-caller-s-session.patch"
SECOND = "Give-the-callback-row-a-priority-weight-of-2.patch"
TESTS = f"""from __future__ import annotations

import pytest

pytestmark = [pytest.mark.db_test, pytest.mark.proves("{FIRST}")]


@pytest.mark.backend("postgres", "mysql")
def test_row_is_flushed(session, dag_maker):
    assert session is not None


@pytest.mark.guard
def test_guard_kept(session):
    assert True
"""
MIXED = f"""from __future__ import annotations

import pytest


@pytest.mark.proves("{SECOND}", base_ok_on=("sqlite",))
def test_weight(session, create_task_instance):
    assert True


@pytest.mark.proves("{FIRST}")
def test_of_the_other_patch(session):
    assert True


def helper():
    return 2
"""
VERIFY_LOG = f"""database server: PostgreSQL 17.2
[1/2] {FIRST}
verify-series on postgres

| patch | fails before | passes after | suite green at this step |
|---|---|---|---|
| {FIRST} | ok 1         | ok 1         | ok 2                     |
| {SECOND} | ok 1         | ok 1         | ok 3                     |
"""


def weight_2(text: str) -> str:
    return text.replace("priority_weight=1)", "priority_weight=2)")


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = make_project(
        tmp_path_factory.mktemp("export") / "project",
        [
            ({SINK: add_flush}, message("Flush the callback row in the caller's session")),
            (
                {SINK: weight_2},
                message("Give the callback row a priority weight of 2", ref="related: #42553"),
            ),
        ],
    )
    (root / "tests" / "unit" / "callbacks").mkdir(parents=True)
    (root / "tests" / "unit" / "callbacks" / "test_sink_flush.py").write_text(TESTS)
    (root / "tests" / "unit" / "callbacks" / "test_sink_weight.py").write_text(MIXED)
    (root / "verify-postgres.log").write_text(VERIFY_LOG)
    return root


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An upstream-like repository: the untouched 3.3.2 sdist at airflow-core/, one commit."""
    repo = tmp_path_factory.mktemp("upstream")
    tree.unpack_sdist(tree.fetch_sdist(tree.base_config(ROOT)), repo / "airflow-core")
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "apache-airflow-core 3.3.2")
    return repo


def git(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = ["git", "-C", str(repo), "-c", "user.name=T", "-c", "user.email=t@example.com", *args]
    return subprocess.run(cmd, capture_output=True, text=True)


def export(project: Path, patch: str, *extra: str) -> Path:
    cmd = [sys.executable, str(ROOT / "scripts" / "ci" / "export.py"), "--root", str(project), patch, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return project / "export" / patch.removesuffix(".patch")


def git_am(pristine: Path, out: Path) -> Path:
    """``git am`` the export onto a fresh clone of the pristine base; return the clone."""
    clone = Path(tempfile.mkdtemp(prefix=f"am-{out.name}-", dir=pristine.parent)) / "repo"
    assert git(pristine, "clone", "-q", str(pristine), str(clone)).returncode == 0
    proc = git(clone, "am", *sorted(str(p) for p in out.glob("*.patch")))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return clone


def test_export_git_ams_onto_the_pristine_base_with_its_tests(project: Path, pristine: Path):
    out = export(project, FIRST, "--verify", str(project / "verify-postgres.log"))
    assert sorted(p.name for p in out.glob("*.patch")) == [f"0001-{FIRST}"]
    clone = git_am(pristine, out)
    assert "session.flush()" in (clone / "airflow-core" / SINK).read_text()
    log = git(clone, "log", "-1", "--format=%s%n%b").stdout
    assert log.startswith("Flush the callback row in the caller's session\n")
    assert (
        "closes: #42553" in log
        and "Forwarded: no" in log
        and "Bug: https://github.com/apache/airflow/issues/42553" in log
    )
    # Its regression tests, at upstream paths, without project-only markers or other patches' tests.
    flush = (clone / "airflow-core/tests/unit/callbacks/test_sink_flush.py").read_text()
    assert "proves" not in flush and "guard" not in flush.replace("test_guard_kept", "")
    assert (
        "pytestmark = [pytest.mark.db_test]" in flush and '@pytest.mark.backend("postgres", "mysql")' in flush
    )
    weight = (clone / "airflow-core/tests/unit/callbacks/test_sink_weight.py").read_text()
    # The other patch's test goes, and with it the helper only it used.
    assert "def test_of_the_other_patch" in weight and "def test_weight" not in weight
    assert "def helper" not in weight
    assert (out / "airflow-core/tests/unit/callbacks/test_sink_flush.py").read_text() == flush


def test_export_writes_pr_description_and_no_newsfragment_of_its_own(project: Path):
    out = export(project, FIRST, "--verify", str(project / "verify-postgres.log"))
    # A patch without a newsfragment of its own gets none: upstream wants one for significant changes.
    assert not (out / "airflow-core" / "newsfragments").exists()
    pr = (out / "PR.md").read_text()
    assert "no newsfragment: upstream asks for one for significant" in pr
    assert pr.startswith(
        "# Flush the callback row in the caller's session\n\nSay what and why.\n\ncloses: #42553\n"
    )
    assert "- `airflow-core/tests/unit/callbacks/test_sink_flush.py`" in pr
    assert "| postgres (PostgreSQL 17.2) | ok 1 | ok 1 | ok 2 |" in pr
    assert "- Forwarded: no" in pr


def test_dependent_patch_exports_its_prerequisite_and_still_git_ams(project: Path, pristine: Path):
    out = export(project, SECOND)
    assert sorted(p.name for p in out.glob("*.patch")) == [f"0001-{FIRST}", f"0002-{SECOND}"]
    clone = git_am(pristine, out)
    assert "priority_weight=2" in (clone / "airflow-core" / SINK).read_text()
    weight = (clone / "airflow-core/tests/unit/callbacks/test_sink_weight.py").read_text()
    assert (
        "def test_weight(session, create_task_instance)" in weight and "test_of_the_other_patch" not in weight
    )
    pr = (out / "PR.md").read_text()
    assert f"depends on {FIRST}" in pr
    assert "Not recorded here" in pr  # no --verify log given


# --- issue 20: tests found however they name their patch (pytest's own collection); project-only names ---
CONFTEST = """import pytest


def make_engine():
    return ENGINE_NAME


ENGINE_NAME = "engine"


@pytest.fixture
def scheduler_job_runner():
    return make_engine()


@pytest.fixture
def session():
    return "session"
"""
HELPERS = """from tests.unit.conftest import make_engine


def helper_from_module(n):
    return make_engine() * n
"""
FORMS = f"""from __future__ import annotations

import pytest

from tests.unit import conftest
from tests.unit.helpers import helper_from_module

P_FIRST = "{FIRST}"
P_SECOND = "{SECOND}"

pytestmark = [pytest.mark.db_test, pytest.mark.proves(P_SECOND)]


@pytest.mark.proves(P_FIRST)
def test_constant(scheduler_job_runner, session):
    assert conftest.make_engine() == scheduler_job_runner


@pytest.mark.parametrize(
    "order",
    [
        pytest.param("first", marks=pytest.mark.proves(P_FIRST)),
        pytest.param("second", marks=pytest.mark.guard),
        pytest.param("third", marks=[pytest.mark.proves(P_SECOND)]),
    ],
)
def test_param_marks(order, session):
    assert helper_from_module(2)


@pytest.mark.parametrize("dag_id, n", [("a", 1)])
def test_module_mark_and_parametrize_arguments(dag_id, n, session):
    assert dag_id


def test_needs_an_unknown_fixture(not_defined_anywhere):
    pass
"""


@pytest.fixture
def forms(project: Path):
    unit = project / "tests" / "unit"
    files = {
        project / "tests" / "__init__.py": "",
        unit / "__init__.py": "",
        unit / "callbacks" / "__init__.py": "",
        unit / "conftest.py": CONFTEST,
        unit / "helpers.py": HELPERS,
        unit / "callbacks" / "test_forms.py": FORMS,
    }
    for path, text in files.items():
        path.write_text(text)
    yield project
    for path in files:
        path.unlink()


def test_constants_lists_and_params_are_found_and_helpers_inlined(forms: Path, pristine: Path):
    out = export(forms, FIRST)
    text = (out / "airflow-core/tests/unit/callbacks/test_forms.py").read_text()
    # A constant in a decorator and in a pytest.param's marks: found; the module-level mark names another.
    assert "def test_constant(" in text and "def test_param_marks(" in text
    assert "test_module_mark_and_parametrize_arguments" not in text and "test_needs_an_unknown" not in text
    # Cases whose closest proves marker names the other patch go ("second": the module's pytestmark).
    assert 'pytest.param("first")' in text and '"second"' not in text and '"third"' not in text
    assert "proves" not in text and "guard" not in text and "P_FIRST" not in text
    assert "pytestmark = [pytest.mark.db_test]" in text
    # Project helpers and fixtures are inlined (with what they use); upstream-named fixtures are not.
    assert "tests.unit" not in text and "conftest." not in text
    for inlined in ("def make_engine(", 'ENGINE_NAME = "engine"', "def scheduler_job_runner(",
                    "def helper_from_module("):  # fmt: skip
        assert inlined in text, inlined
    assert "def session(" not in text
    compile(text, "test_forms.py", "exec")
    pr = (out / "PR.md").read_text()
    assert "project-only names left: none" in pr
    clone = git_am(pristine, out)
    assert (clone / "airflow-core/tests/unit/callbacks/test_forms.py").read_text() == text


def test_parametrize_arguments_are_not_reported_as_fixtures(forms: Path):
    out = export(forms, SECOND)
    text = (out / "airflow-core/tests/unit/callbacks/test_forms.py").read_text()
    assert "def test_module_mark_and_parametrize_arguments(dag_id, n, session)" in text
    assert 'pytest.param("second")' in text and 'pytest.param("third")' in text and '"first"' not in text
    pr = (out / "PR.md").read_text()
    assert "dag_id" not in pr.split("## Tests")[1].split("## Verification")[0]
    # A fixture nobody defines is what is left, by name.
    assert "project-only names left: fixture not_defined_anywhere" in pr


def test_all_writes_every_patch_in_order_with_an_index(forms: Path):
    proc = run_export(forms, "--all")
    assert proc.returncode == 0, proc.stderr
    index = (forms / "export" / "README.md").read_text()
    rows = [line for line in index.splitlines() if line.startswith("| 1 ") or line.startswith("| 2 ")]
    assert rows[0].startswith(f"| 1 | `{FIRST}` | - |") and rows[1].startswith(f"| 2 | `{SECOND}` | 1 |")
    assert (forms / "export" / SECOND.removesuffix(".patch") / "PR.md").read_text().count(FIRST) >= 1


def test_all_keeps_an_index_the_user_edited(forms: Path):
    assert run_export(forms, "--all").returncode == 0
    index = forms / "export" / "README.md"
    edited = index.read_text() + "\nOpened PR 1 on 2026-12-01.\n"
    index.write_text(edited)
    proc = run_export(forms, "--all")
    assert proc.returncode == 1
    assert f"{index} changed since export.py --all wrote it" in proc.stderr
    assert index.read_text() == edited
    index.unlink()


def test_unknown_patch_is_refused(project: Path):
    cmd = [sys.executable, str(ROOT / "scripts" / "ci" / "export.py"), "--root", str(project), "nope.patch"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 1 and "nope.patch is not in patches/series" in proc.stderr


# --- issue 15, case 1: never delete what the tool did not create; nothing half-written ----------------


def run_export(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(ROOT / "scripts" / "ci" / "export.py"), "--root", str(project), *args]
    return subprocess.run(cmd, capture_output=True, text=True)


@pytest.mark.parametrize("where", ["folder", "project"])
def test_out_that_is_not_an_export_is_refused_and_kept(project: Path, tmp_path: Path, where: str):
    out = tmp_path / "mine" if where == "folder" else project
    out.mkdir(exist_ok=True)
    (out / "keep.txt").write_text("my work\n")
    before = sorted(p.name for p in out.iterdir())
    proc = run_export(project, FIRST, "--out", str(out))
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"export.py: {out} exists and is not an export made by export.py")
    assert sorted(p.name for p in out.iterdir()) == before
    assert (out / "keep.txt").read_text() == "my work\n"
    (out / "keep.txt").unlink()


def test_missing_verify_log_changes_nothing(project: Path):
    out = export(project, FIRST, "--verify", str(project / "verify-postgres.log"))
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    proc = run_export(project, FIRST, "--verify", str(project / "no-such.log"))
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"export.py: --verify {project / 'no-such.log'}: no such file"
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temp folder left beside it


def test_reexport_replaces_its_own_export(project: Path):
    out = export(project, FIRST)
    # A file an earlier export wrote (listed in its marker) that this export no longer writes.
    (out / "0009-stale.patch").write_text("from an earlier export\n")
    with (out / ".series-export").open("a") as marker:
        marker.write("0009-stale.patch\n")
    out = export(project, FIRST)
    assert sorted(p.name for p in out.glob("*.patch")) == [f"0001-{FIRST}"]


def test_reexport_keeps_a_file_the_user_added(project: Path):
    out = export(project, FIRST)
    (out / "NOTES.md").write_text("mine\n")
    proc = run_export(project, FIRST, "--out", str(out))
    assert proc.returncode == 1
    assert "holds files export.py did not write (NOTES.md)" in proc.stderr
    assert (out / "NOTES.md").read_text() == "mine\n"
    (out / "NOTES.md").unlink()


def test_reexport_keeps_a_file_the_user_edited(project: Path):
    out = export(project, FIRST)
    edited = (out / "PR.md").read_text() + "\nMy review notes.\n"
    (out / "PR.md").write_text(edited)
    proc = run_export(project, FIRST, "--out", str(out))
    assert proc.returncode == 1
    assert f"{out}: PR.md changed since export.py wrote it: refusing to replace it" in proc.stderr
    assert (out / "PR.md").read_text() == edited
    (out / "PR.md").unlink()  # as if the user had saved it elsewhere: the export is then replaced
    assert run_export(project, FIRST, "--out", str(out)).returncode == 0
    assert "My review notes." not in (out / "PR.md").read_text()


def test_out_that_is_a_symlink_is_refused_and_kept(project: Path, tmp_path: Path):
    out = export(project, FIRST)
    link = tmp_path / "link"
    link.symlink_to(out)
    proc = run_export(project, FIRST, "--out", str(link))
    assert proc.returncode == 1
    assert "symbolic link" in proc.stderr
    assert link.is_symlink() and (out / ".series-export").is_file()


def test_a_patch_calling_what_an_earlier_patch_defines_depends_on_it(project: Path, tmp_path: Path):
    """A later patch that touches other files but calls a function an earlier one adds needs it too."""
    sys.path.insert(0, str(ROOT / "scripts" / "ci"))
    import export as exporter

    def patch(name: str, path: str, line: str) -> Path:
        text = (
            f"From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\nSubject: [PATCH] {name}\n\n"
            f"---\ndiff --git a/airflow-core/{path} b/airflow-core/{path}\n--- a/airflow-core/{path}\n"
            f"+++ b/airflow-core/{path}\n@@ -0,0 +1 @@\n+{line}\n"
        )
        (tmp_path / f"{name}.patch").write_text(text)
        return tmp_path / f"{name}.patch"

    first = patch("Add-helper", "src/airflow/new_helper.py", "def _series_helper_xyz(): return 1")
    other = patch("Other", "src/airflow/other.py", "X = 1")
    second = patch("Use-helper", "src/airflow/user.py", "from airflow.new_helper import _series_helper_xyz")
    repo = project / "airflow-core"
    assert exporter.prerequisites(repo, [first, other, second], second) == [first]
    assert exporter.prerequisites(repo, [first, other, second], other) == []


CARRIES = """from __future__ import annotations

import pytest

from tests.unit.conftest import carries
from tests.unit.helpers import FIRST_NAME, SECOND_NAME

OTHER = "Other.patch"


@pytest.mark.proves("Mine.patch")
@pytest.mark.skipif(not carries(OTHER), reason="needs Other.patch")
def test_needs_the_other_patch(session):
    assert (FIRST_NAME, SECOND_NAME) == (1, 2)
"""
CARRIES_HELPERS = """def _pair():
    return 1, 2


FIRST_NAME, SECOND_NAME = _pair()
"""


def _project(tmp_path: Path, module_text: str, files: dict[str, str]) -> Path:
    """A project tree with packages ``tests`` and ``tests.unit``, ``files`` in ``tests/unit`` and the test
    module ``tests/unit/test_mine.py``; returns the module's path."""
    for pkg in ("tests", "tests/unit"):
        (tmp_path / pkg).mkdir(exist_ok=True)
        (tmp_path / pkg / "__init__.py").write_text("")
    for name, text in files.items():
        (tmp_path / "tests/unit" / name).write_text(text)
    module = tmp_path / "tests/unit/test_mine.py"
    module.write_text(module_text)
    return module


def _find_one(tmp_path: Path, module: Path, func: str) -> tuple[str, list[str], list[str]]:
    """``export.find_tests`` for one test of ``module`` proving ``Mine.patch``: its (text, inlined, left)."""
    import export

    items = [
        {
            "file": str(module),
            "cls": None,
            "func": func,
            "proves": "Mine.patch",
            "indices": {},
            "fixtures": {"session": {"file": None}},
        }
    ]
    return export.find_tests(tmp_path, "Mine.patch", items)["airflow-core/tests/unit/test_mine.py"]


def test_skipif_on_carries_is_dropped_and_a_tuple_assignment_inlined_once(tmp_path: Path):
    """An export holds the patches its tests need: the conftest's carries() is not inlined (it reads the
    project's series file); a helper binding two names is copied once, not once per name."""
    import export

    module = _project(
        tmp_path,
        CARRIES,
        {"conftest.py": "def carries(patch):\n    return True\n", "helpers.py": CARRIES_HELPERS},
    )
    items = [{"cls": None, "func": "test_needs_the_other_patch", "proves": "Mine.patch", "indices": {}}]
    text, found = export.for_upstream(CARRIES, "Mine.patch", items)
    assert found and "skipif" not in text and "proves" not in text
    text, inlined, left = export.Inliner(tmp_path).inline(text, module, set())
    assert left == []
    assert "carries" not in text
    assert text.count("FIRST_NAME, SECOND_NAME = _pair()") == 1
    assert "def _pair():" in text


PROJECT_FILE = """from __future__ import annotations

import pytest

from tests.unit.conftest import BASE_VERSION


@pytest.mark.proves("Mine.patch")
@pytest.mark.skipif(BASE_VERSION.startswith("3.2."), reason="not on 3.2")
def test_not_on_32(session):
    assert True
"""
PROJECT_FILE_CONFTEST = """from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def _base_version() -> str:
    return (PROJECT_ROOT / "pyproject.toml").read_text().split()[0]


BASE_VERSION = _base_version()
"""


def test_a_helper_computing_a_path_from_its_file_is_a_name_left(tmp_path: Path):
    """A conftest constant read from the project's files (a path from the conftest's ``__file__``) names
    another place once copied into the upstream module: reported as left, not inlined as if runnable."""
    import export

    module = _project(tmp_path, PROJECT_FILE, {"conftest.py": PROJECT_FILE_CONFTEST})
    items = [{"cls": None, "func": "test_not_on_32", "proves": "Mine.patch", "indices": {}}]
    text, found = export.for_upstream(PROJECT_FILE, "Mine.patch", items)
    assert found
    text, inlined, left = export.Inliner(tmp_path).inline(text, module, set())
    assert left == ["PROJECT_ROOT (from tests/unit/conftest.py: a path from its __file__)"]
    assert "__file__" not in text


APPLIED_LAST = """from __future__ import annotations

import pytest

from tests.unit.conftest import read_series

PATCH = "Mine.patch"
OTHER = "Other.patch"


def _applied_last(*patches: str) -> str:
    series = read_series()
    return max(patches, key=series.index)


@pytest.mark.proves(_applied_last(PATCH, OTHER))
def test_proved_by_whichever_comes_last(session):
    assert True
"""
APPLIED_LAST_CONFTEST = """from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def _base_queue():
    return "3.3.2", PROJECT_ROOT / "patches" / "series"


BASE_VERSION, SERIES_FILE = _base_queue()


def read_series():
    return SERIES_FILE.read_text().split()
"""


def test_a_helper_only_a_dropped_marker_used_is_not_inlined_nor_its_names_left(tmp_path: Path):
    """``@pytest.mark.proves(_applied_last(PATCH, OTHER))`` (the stale-event module's form): the marker
    goes, so does the module helper only it called, and with it the conftest's series reader: nothing
    of it (nor the path from the conftest's ``__file__`` it reads) is inlined or reported left."""

    module = _project(tmp_path, APPLIED_LAST, {"conftest.py": APPLIED_LAST_CONFTEST})
    text, inlined, left = _find_one(tmp_path, module, "test_proved_by_whichever_comes_last")
    assert left == []
    assert inlined == []
    for gone in ("_applied_last", "read_series", "_base_queue", "SERIES_FILE", "PROJECT_ROOT", "__file__"):
        assert gone not in text
    assert "def test_proved_by_whichever_comes_last(session):" in text


GUARD_SINCE = """from __future__ import annotations

import pytest

from tests.unit.conftest import guard_since

PATCH = "Mine.patch"


@pytest.mark.parametrize(
    "state",
    [
        pytest.param("queued", marks=guard_since("3.4.0", PATCH)),
        pytest.param("running", marks=pytest.mark.proves(PATCH)),
    ],
)
def test_cases(state, session):
    assert state
"""


def test_a_guard_since_marker_goes_like_proves_and_guard(tmp_path: Path):
    """``pytest.param(..., marks=guard_since(version, PATCH))`` (the stale-event module's 3.4 form): the harness's
    marker factory goes as its markers do, so neither it nor the series reader behind it is inlined or left."""
    module = _project(tmp_path, GUARD_SINCE, {"conftest.py": APPLIED_LAST_CONFTEST + GUARD_SINCE_CONFTEST})
    text, inlined, left = _find_one(tmp_path, module, "test_cases")
    assert left == []
    assert inlined == []
    for gone in ("guard_since", "BASE_VERSION", "PROJECT_ROOT", "__file__", "proves"):
        assert gone not in text
    assert 'pytest.param("queued")' in text and 'pytest.param("running")' in text


GUARD_SINCE_CONFTEST = """

def guard_since(version, patch):
    import pytest

    return pytest.mark.guard if BASE_VERSION >= version else pytest.mark.proves(patch)
"""


def test_prune_drops_an_unused_tuple_assignment_and_what_only_it_used():
    import export

    text = export.prune(
        "def _pair():\n    return 1, 2\n\n\nA, B = _pair()\nC, D = _pair()\n\n\ndef test_x():\n    assert C\n"
    )
    assert "A, B" not in text and "C, D = _pair()" in text and "def _pair" in text


PLAIN_IMPORT = """import pytest

import tests.unit.helpers


@pytest.mark.proves("Mine.patch")
def test_dotted(session):
    assert tests.unit.helpers.helper_mod(1) == 2
"""


def test_a_plain_import_of_a_project_module_used_dotted_is_a_name_left(tmp_path: Path):
    """``import tests.unit.helpers`` then ``tests.unit.helpers.helper_mod(...)``: the import goes (it is
    the project's) and nothing is inlined for the dotted use, so the module needs ``tests``: a name left,
    not "none"."""

    module = _project(tmp_path, PLAIN_IMPORT, {"helpers.py": "def helper_mod(n):\n    return n * 2\n"})
    text, inlined, left = _find_one(tmp_path, module, "test_dotted")
    assert "tests.unit.helpers.helper_mod(1)" in text
    assert left == ["tests (import tests.unit.helpers: a dotted use is not inlined)"]


SHADOWED_IMPORT = """from datetime import timezone

import pytest

from airflow._shared.timezones import timezone as tz
from tests.unit.helpers import stamp


@pytest.mark.proves("Mine.patch")
def test_stamped(session):
    assert stamp(tz.utcnow()).tzinfo is timezone.utc
"""
SHADOWED_HELPERS = """from airflow._shared.timezones import timezone


def stamp(when):
    return timezone.coerce(when)
"""


def test_a_helper_import_the_module_binds_otherwise_is_a_name_left(tmp_path: Path):
    """The module's ``timezone`` is datetime's; the helper's is airflow's: the copied helper would call the
    module's (``datetime.timezone.utcnow`` in the 3.4 export of the heartbeat purge's test: AttributeError).
    Reported as a name left, not "none"."""

    module = _project(tmp_path, SHADOWED_IMPORT, {"helpers.py": SHADOWED_HELPERS})
    text, inlined, left = _find_one(tmp_path, module, "test_stamped")
    assert "def stamp(when):" in text
    assert left == [
        "timezone (the module binds another: the inlined helpers use "
        "from airflow._shared.timezones import timezone)"
    ]


LAZY_FIXTURE = """from __future__ import annotations

import pytest


@pytest.mark.proves("Mine.patch")
def test_uses_the_api(api):
    assert api.ping() == "pong"
"""
LAZY_CONFTEST = """import pytest


@pytest.fixture(scope="session")
def api():
    from tests.unit.helpers import ExecutionApi

    return ExecutionApi()
"""
LAZY_HELPERS = """class ExecutionApi:
    def ping(self) -> str:
        return "pong"
"""


def test_a_fixture_importing_a_helper_in_its_body_is_inlined_with_the_helper(tmp_path: Path):
    """A project fixture that imports a project helper inside its body (the conftest's session-scoped
    ``api``): the export inlines the fixture and the helper, and keeps no ``from tests.unit...`` import
    (it had left one, reported as project-only, in every export whose tests use the fixture)."""
    import export

    module = _project(tmp_path, LAZY_FIXTURE, {"conftest.py": LAZY_CONFTEST, "helpers.py": LAZY_HELPERS})
    items = [{"cls": None, "func": "test_uses_the_api", "proves": "Mine.patch", "indices": {}}]
    text, found = export.for_upstream(LAZY_FIXTURE, "Mine.patch", items)
    assert found
    conftest = tmp_path / "tests/unit/conftest.py"
    text, inlined, left = export.Inliner(tmp_path).inline(text, module, {(conftest, "api")})
    assert left == []
    assert "tests.unit" not in text
    assert "class ExecutionApi:" in text and "def api():" in text
    namespace: dict = {}
    exec(compile(text, "exported", "exec"), namespace)  # the export's module runs as written
    assert namespace["api"].__wrapped__().ping() == "pong"


# --- issue 31 item 4: the harness by concern (tests/unit/harness/), its fixtures registered by the conftest ---
HARNESS_DB = """import pytest

ENGINE_NAME = "engine"


def make_engine():
    return ENGINE_NAME


@pytest.fixture
def other_session():
    return make_engine()
"""
HARNESS_CONFTEST = """# The fixtures, registered here for every test under tests/unit.
from tests.unit.harness.db import other_session  # noqa: F401
"""
HARNESS_TESTS = f"""from __future__ import annotations

import pytest

from tests.unit.harness import db


@pytest.mark.proves("{FIRST}")
def test_uses_the_harness(other_session, session):
    assert db.make_engine() == other_session
"""


@pytest.fixture
def harness_layout(project: Path):
    unit = project / "tests" / "unit"
    (unit / "harness").mkdir(parents=True, exist_ok=True)
    files = {
        project / "tests" / "__init__.py": "",
        unit / "__init__.py": "",
        unit / "callbacks" / "__init__.py": "",
        unit / "harness" / "__init__.py": "",
        unit / "harness" / "db.py": HARNESS_DB,
        unit / "conftest.py": HARNESS_CONFTEST,
        unit / "callbacks" / "test_harness_layout.py": HARNESS_TESTS,
    }
    for path, text in files.items():
        path.write_text(text)
    yield project
    for path in files:
        path.unlink()
    (unit / "harness").rmdir()


def test_a_fixture_of_a_harness_module_registered_by_the_conftest_is_inlined(harness_layout: Path):
    """A fixture defined in a harness module and registered in the conftest by importing it (the project's
    layout since the conftest was split by concern) is inlined from the module that defines it, and so is
    a helper the test reaches through ``from tests.unit.harness import db`` (``db.make_engine()``)."""
    out = export(harness_layout, FIRST)
    text = (out / "airflow-core/tests/unit/callbacks/test_harness_layout.py").read_text()
    assert "tests.unit" not in text and "db.make_engine" not in text
    for inlined in (
        "def other_session(",
        "def make_engine(",
        'ENGINE_NAME = "engine"',
        "assert make_engine() ==",
    ):
        assert inlined in text, inlined
    compile(text, "test_harness_layout.py", "exec")
    pr = (out / "PR.md").read_text()
    assert "other_session (from tests/unit/harness/db.py)" in pr
    assert "project-only names left: none" in pr


def test_pr_says_what_it_was_made_against_and_what_main_has(project: Path):
    """The PR names the code it was made against (the base's entry in patches/upstream.toml, else the
    release) and, where the patch has one, what upstream main has of it."""
    pr = (export(project, FIRST) / "PR.md").read_text()
    assert "## Made against\n\napache-airflow-core 3.3.2 (PyPI sdist).\n" in pr
    notes = project / "patches" / "upstream.toml"
    notes.write_text(
        '[bases."3.3.2"]\nmade-against = "the 3.3.2 release; main is 3.4.0b2\'s code."\n'
        f'[patches."{FIRST}"]\non-main = "a backport: main has it since #68008."\n'
    )
    try:
        pr = (export(project, FIRST) / "PR.md").read_text()
    finally:
        notes.unlink()
    assert (
        "## Made against\n\nthe 3.3.2 release; main is 3.4.0b2's code.\n\n"
        "**On upstream main:** a backport: main has it since #68008.\n" in pr
    )


def test_a_base_queue_reads_its_own_needs(tmp_path: Path):
    """``needs`` of a patch in a base's own queue (``patches/<base>/``) come from its ``bases."<base>"`` table;
    the default queue keeps the shared ones."""
    import export

    (tmp_path / "patches").mkdir()
    (tmp_path / "patches" / "upstream.toml").write_text(
        '[patches."b.patch"]\nneeds = ["x.patch"]\nstatus = "s"\n'
        '[patches."b.patch".bases."3.4.0b2"]\nneeds = ["a.patch"]\n'
    )
    default = export.patch_notes(tmp_path, tmp_path / "patches" / "b.patch")
    assert (default["needs"], default["status"]) == (["x.patch"], "s")
    base = [tmp_path / "patches" / "3.4.0b2" / name for name in ("a.patch", "b.patch")]
    assert export.declared_needs(tmp_path, base, base[1]) == [base[0]]
    assert export.patch_notes(tmp_path, base[1])["status"] == "s"


GUARDED = """import pytest

from tests.unit.helpers import make_callback


@pytest.mark.proves("Mine.patch")
def test_callback(session):
    assert make_callback()
"""
GUARDED_HELPERS = """HAS_CALLBACKS = True

if HAS_CALLBACKS:
    from airflow.models.callback import ExecutorCallback
else:
    ExecutorCallback = None


def make_callback():
    return ExecutorCallback()
"""


def test_a_helper_using_a_name_bound_in_a_module_level_block_reports_it_left(tmp_path: Path):
    """The helper's module binds ``ExecutorCallback`` only inside ``if HAS_CALLBACKS:``, which is not copied: the
    inlined helper would raise NameError upstream, so the export reports the name left instead of nothing."""
    module = _project(tmp_path, GUARDED, {"helpers.py": GUARDED_HELPERS})
    text, inlined, left = _find_one(tmp_path, module, "test_callback")
    assert "def make_callback():" in text
    assert left == ["ExecutorCallback (from tests/unit/helpers.py: bound in a module-level block)"]
