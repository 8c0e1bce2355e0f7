"""The API reference (`make docs`) builds with pdoc without a warning and documents every public class."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("pdoc")

from lightning_hotspa.tools.api_docs import PUBLIC, build  # noqa: E402


def test_the_api_reference_builds_without_warnings_and_names_every_public_class(tmp_path: Path) -> None:
    assert build(tmp_path) == []
    pages = "".join(p.read_text(encoding="utf-8") for p in tmp_path.rglob("*.html"))
    missing = [name for _, name in PUBLIC if f'id="{name}"' not in pages]
    assert missing == []


def test_a_pdoc_warning_fails_the_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "api_docs_probe.py").write_text('"""A probe."""\n__all__ = ["not_defined"]\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "api_docs_probe", raising=False)
    problems = build(tmp_path / "out", ["api_docs_probe"])
    assert len(problems) == 1 and "not_defined" in problems[0], problems
