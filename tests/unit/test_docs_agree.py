"""The docs say what the code has: one table of figures (BENCHMARKS.md, the README links it), and
only registered attention kernels named as backends, the registered cp kinds listed exactly."""

from __future__ import annotations

import re
from pathlib import Path

from lightning_hotspa.cp_kinds import CP_KINDS
from lightning_hotspa.models.attention_kernels import BACKENDS, KERNELS

ROOT = Path(__file__).resolve().parents[2]
_FIGURE_ROW = re.compile(r"^\|.*\|\s*(?:yes|no)(?:\s*\([^|]*\))?\s*\|", re.M)  # a row with a "met?" cell


def _section(text: str, title: str) -> str:
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def test_the_readme_copies_no_figure_and_links_the_one_table() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    headline = _section(readme, "Headline results")
    assert "[BENCHMARKS.md](BENCHMARKS.md)" in headline
    assert not _FIGURE_ROW.search(readme), _FIGURE_ROW.search(readme).group(0)
    table = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    assert "| recipe | figure | latest value | target | met? | commit | date | machine |" in table
    assert len(_FIGURE_ROW.findall(table)) >= 20  # the figures are there, one row each


def test_the_figure_check_sees_a_copied_row() -> None:
    assert _FIGURE_ROW.search("| planner time | 36.7 ms | <= 50 ms | yes | f1ca3c0, 2026-12-01 |\n")


_BACKEND_NAMED = re.compile(r"attention_backend\s*[=:]\s*[\"']?([\w-]+)")


def test_docs_and_configs_name_only_registered_attention_kernels() -> None:
    """Every ``attention_backend=...`` in the docs, the README and the Hydra configs names a registered
    ``documents`` kernel (or "auto"), and docs/extending.md's kernel table lists the registry exactly."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "lightning_hotspa" / "configs").rglob("*.yaml"))]
    named = {(f.name, m.group(1)) for f in files for m in _BACKEND_NAMED.finditer(f.read_text(encoding="utf-8"))}
    assert named, "the check must see the configs' attention_backend"
    assert {(f, n) for f, n in named if n not in {"auto", *BACKENDS}} == set()
    extending = (ROOT / "docs" / "extending.md").read_text(encoding="utf-8")
    listed = re.findall(r"^\| `([\w-]+)` \| (documents|chunks|priced) \|", extending, re.M)
    assert sorted(listed) == sorted((k.name, k.role) for k in KERNELS.values())


def test_the_cp_kind_table_lists_the_registry_exactly() -> None:
    """docs/extending.md's cp-kind table: one row per registered kind, its name as a layout writes it."""
    extending = _section((ROOT / "docs" / "extending.md").read_text(encoding="utf-8"),
                         "A context-parallel kind: one record in the registry")
    listed = re.findall(r"^\| `(\w+)` \| `cp<n>([^`]*)` \| (.+) \|$", extending, re.M)
    assert listed == [(k.name, k.suffix, k.summary) for k in CP_KINDS.values()]
