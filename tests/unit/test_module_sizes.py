"""Small modules with one job (issue 57): no module of the package exceeds 500 lines, and the job scripts a
test launches (tests/*_job.py and any other non-test file beside them) share code through tests/helpers.py
only, never by importing a test module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lightning_hotspa

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(lightning_hotspa.__file__).resolve().parent
TESTS = ROOT / "tests"
MOST_LINES = 500
#: the files under tests/ that are neither a test module nor a job script
_SHARED = {"conftest.py", "helpers.py", "__init__.py"}

pytestmark = pytest.mark.fast


def _long_modules(package: Path, most: int) -> list[str]:
    """``path: lines`` of every .py under ``package`` longer than ``most`` lines."""
    out = []
    for path in sorted(package.rglob("*.py")):
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > most:
            out.append(f"{path.relative_to(package.parent)}: {lines}")
    return out


def _test_module_imports(path: Path, local: set[str]) -> list[str]:
    """The modules ``path`` imports (anywhere in it, absolute imports) that are a test module
    (``test_*``) or a module of the tests tree other than helpers (``local``: their names)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        found += [n for n in names if n.split(".")[0].startswith("test_") or n.split(".")[0] in local]
    return found


def _job_scripts(tests: Path) -> list[Path]:
    return sorted(p for p in tests.rglob("*.py") if not p.name.startswith("test_") and p.name not in _SHARED)


def test_no_package_module_exceeds_500_lines() -> None:
    assert _long_modules(PACKAGE, MOST_LINES) == []


def test_job_scripts_import_no_test_module() -> None:
    jobs = _job_scripts(TESTS)
    assert any(p.name == "mixed_kill_job.py" for p in jobs), "the job scripts were not found"
    local = {p.stem for p in TESTS.rglob("*.py")} - {"helpers"}
    found = {str(p.relative_to(ROOT)): _test_module_imports(p, local) for p in jobs}
    assert {k: v for k, v in found.items() if v} == {}


def test_the_checks_catch_a_long_module_and_a_test_import(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "short.py").write_text("x = 1\n" * 3)
    (pkg / "long.py").write_text("x = 1\n" * 4)
    assert _long_modules(pkg, 3) == ["pkg/long.py: 4"]
    tests = tmp_path / "tests"
    tests.mkdir()
    for name in ("helpers.py", "conftest.py", "test_blocks.py"):
        (tests / name).write_text("")
    job = tests / "some_job.py"
    job.write_text("import os\nfrom helpers import deal\nfrom test_blocks import block_plans\n"
                   "def f():\n    import other_job\n")
    assert _job_scripts(tests) == [job]
    assert _test_module_imports(job, {"other_job"}) == ["test_blocks", "other_job"]
