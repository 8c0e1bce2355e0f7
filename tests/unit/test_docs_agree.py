"""The docs say what the code has: one table of figures (BENCHMARKS.md, the README links it and
states no figure that is not in it), only registered attention kernels named as backends, the
registered cp kinds listed exactly."""

from __future__ import annotations

import ast
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


#: what is not prose: fenced code blocks, inline code spans, link targets, dates, a DOI, and versions
#: (a number after Python, torch, PyTorch, CUDA, Lightning or transformers, or dotted three times)
_NOT_PROSE = re.compile(r"```.*?```|`[^`\n]*`|\]\([^)]*\)|\b\d{4}-\d{2}-\d{2}\b|\bDOI \S+"
                        r"|\b(?:Python|torch|PyTorch|CUDA|Lightning|transformers)(?:\s+|==)\d[\d.]*"
                        r"|\b\d+\.\d+\.\d+\b", re.S)
#: a number standing alone (not part of a name such as dp8, H100, 7B or llama3), with its unit if any
_NUMBER = re.compile(r"(?<![\w.'/])(\d+(?:,\d{3})*(?:\.\d+)?(?:e-?\d+)?)(x|\s?%|\s?(?:ms|s|min|GiB|MiB|GB|MB))?"
                     r"(?![\w.]*\d|\w)")


def readme_figures(text: str) -> list[tuple[str, str]]:
    """The figures in a README's prose, in order: (number as written, unit or ``""``), e.g.
    ``("1.0187", "x")``, ``("357", "s")``, ``("5.7254", "")``.

    A figure is a number in the prose (tables and lists included) that has a decimal part (``0.534``,
    ``43.5``), is written in scientific notation (``8.2e-08``), or carries a unit of measure right
    after it (``0.75x``, ``357 s``, ``15 %``, ``12 ms``, ``2 min``, ``5 GiB``). Not figures: bare
    integers, which count or configure things (``4`` CPU processes, ``40`` steps, ``§5``, ``0-255``);
    numbers inside names (``dp8``, ``H100``, ``7B``, ``SOSP'24``); and everything :data:`_NOT_PROSE`
    removes first: fenced code blocks and inline code (commands and their arguments, code), link
    targets (paths), dates (``YYYY-MM-DD``), the paper's DOI, and versions. BENCHMARKS.md must hold
    the number as a whole number (``1.018`` is not in ``1.0187``) and, for a unit other than ``x``,
    with that unit after it (``43.5 s``; ratios are written there with and without the ``x``).

    Args:
        text: the Markdown text.
    """
    prose = _NOT_PROSE.sub(" ", text)
    return [(m.group(1), (m.group(2) or "").strip()) for m in _NUMBER.finditer(prose)
            if "." in m.group(1) or "e" in m.group(1) or m.group(2)]


def _in(figure: tuple[str, str], table: str) -> bool:
    """``figure`` (number, unit) occurs in ``table``: the number whole, with the unit unless it is x."""
    number, unit = figure
    after = rf"\s?{re.escape(unit)}(?!\w)" if unit not in ("", "x") else r"(?![\d]|[.,]\d)"
    return re.search(rf"(?<![\d.,]){re.escape(number)}{after}", table) is not None


def test_every_readme_figure_is_in_benchmarks() -> None:
    """One figure per fact, kept in one place: every figure the README states (:func:`readme_figures`)
    appears in BENCHMARKS.md."""
    figures = readme_figures((ROOT / "README.md").read_text(encoding="utf-8"))
    assert len(figures) >= 5, figures  # the make train and suite figures at least
    table = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    assert [f for f in figures if not _in(f, table)] == []


def test_the_readme_figure_rule() -> None:
    text = ("Loss 5.7254 -> 3.0572 (0.534x) in 43.5 s; suite 357 s, 15 % off, 2 min, 8.2e-08; 4 CPU processes, "
            "40 steps, dp4xtp2, H100, 7B-70B on 8-64 ranks, SOSP'24, §5, ids 0-255, 8,192 tokens, 2026-12-06, "
            "Python 3.10, torch==2.13.0, DOI 10.1145/3694715.3695969, `lr=3e-4`, [x](benchmarks/2026-12-06-a.md)"
            "\n```bash\nmake train  # 60.5 s\n```\n")
    assert readme_figures(text) == [("5.7254", ""), ("3.0572", ""), ("0.534", "x"), ("43.5", "s"), ("357", "s"),
                                    ("15", "%"), ("2", "min"), ("8.2e-08", "")]
    assert _in(("1.0187", "x"), "ours 1.0150 -> **1.0187** (ceiling") and not _in(("1.018", ""), "ours 1.0187")
    assert not _in(("43.5", "s"), "143.5 s") and not _in(("3.5", ""), "43.5")
    assert _in(("43.5", "s"), "41.6 -> 43.5 s)") and not _in(("60", "s"), "all 60 cells")


_BACKEND_NAMED = re.compile(r"attention_backend\s*[=:]\s*[\"']?([\w-]+)")


def test_docs_and_configs_name_only_registered_attention_kernels() -> None:
    """Every ``attention_backend=...`` in the docs, the README and the Hydra configs names a registered
    ``documents`` kernel (or "auto"), and docs/extending.md's kernel table lists the registry exactly."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "configs").rglob("*.yaml"))]
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


def test_the_readme_reads_in_five_minutes() -> None:
    """At most 180 lines, status rows of at most 160 characters, and the documentation table links
    every page under docs/."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 180
    status = _section(readme, "Status")
    rows = [line for line in status.splitlines() if line.startswith("| ") and not line.startswith("| feature")]
    assert len(rows) >= 10 and [r for r in rows if len(r) > 160] == []
    table = _section(readme, "Documentation")
    assert [p.name for p in sorted((ROOT / "docs").glob("*.md")) if f"](docs/{p.name})" not in table] == []


# ------------------------------------------------------- BENCHMARKS.md: one row per figure
def _cells(row: str) -> list[str]:
    """The cells of one Markdown table row (``\\|`` inside a cell is not a separator)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", row.strip())[1:-1]]


def figure_problems(table: str) -> list[str]:
    """What breaks "one row per figure" in a BENCHMARKS.md text.

    A figure is named by its row's first two cells, the recipe and the figure, compared without case,
    spaces and ``([details](...))`` links. No name may occur twice in the file (an earlier value of a
    figure goes to a dated note under benchmarks/); the long-context grid (rows whose recipe names
    ``--grid long``) takes at most 3 rows; and the prose outside the table states no figure
    (:func:`readme_figures`: a figure's value lives in its row only).

    Args:
        table: the text of BENCHMARKS.md.
    """
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| recipe | figure")]
    names = [" ".join(re.sub(r"\(\[details\]\([^)]*\)\)", "", c).lower().split()) for r in rows
             for c in [" | ".join(_cells(r)[:2])]]
    problems = [f"figure twice: {n}" for n in sorted({n for n in names if names.count(n) > 1})]
    grid = [r for r in rows if "--grid long" in _cells(r)[0]]
    if len(grid) > 3:
        problems.append(f"the long grid takes {len(grid)} rows (at most 3)")
    prose = "\n".join(line for line in table.splitlines() if not line.startswith("|"))
    problems += [f"figure outside the table: {n}{u}" for n, u in readme_figures(prose)]
    return problems


def test_benchmarks_states_each_figure_once() -> None:
    table = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    assert len(_FIGURE_ROW.findall(table)) >= 20
    assert figure_problems(table) == []


def test_the_figure_rule_catches_a_repeated_figure() -> None:
    table = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    row = next(line for line in table.splitlines() if line.startswith("| `make train` | loss"))
    older = row.replace("5.7254", "5.9999")  # an earlier value of the same figure, planted
    assert figure_problems(table + "\n" + older + "\n") == [f"figure twice: {' '.join(_cells(row)[0:1]).lower()}"
                                                            f" | {' '.join(_cells(row)[1].lower().split())}"]
    grid = "| `hotspa simulate --grid long` | geomean x{} | 1.0 | - | yes | abc | 2026-12-06 | simulated |\n"
    assert any("long grid" in p for p in figure_problems("".join(grid.format(i) for i in range(4))))
    assert figure_problems("Loss went 5.7254 -> 3.0572.\n") == ["figure outside the table: 5.7254",
                                                                "figure outside the table: 3.0572"]


# ------------------------------------------------------------------ README's floor line
def architecture_floors() -> dict[str, int]:
    """The ``FLOORS`` table of tests/unit/test_architecture.py, read from its source (a test file never
    imports another)."""
    tree = ast.parse((ROOT / "tests" / "unit" / "test_architecture.py").read_text(encoding="utf-8"))
    value = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                 and [getattr(t, "id", None) for t in node.targets] == ["FLOORS"])
    return ast.literal_eval(value)


def readme_floors(text: str) -> dict[str, int]:
    """The floors README's **Floors** paragraph states: ``N `name` `name`; N ...`` -> {name: N}.

    Args:
        text: the README.
    """
    start = text.index("**Floors**")
    paragraph = text[start:text.find("\n\n", start)].split(":", 1)[1]
    return {name: int(floor) for floor, names in re.findall(r"(?<![\w`])(\d) ((?:`\w+`\s*)+)", paragraph)
            for name in re.findall(r"`(\w+)`", names)}


def test_the_readme_floor_line_is_the_architecture_tests_table() -> None:
    floors = architecture_floors()
    assert floors["models"] == 1 and len(floors) > 20  # the table was read
    assert readme_floors((ROOT / "README.md").read_text(encoding="utf-8")) == floors


def test_the_floor_line_check_sees_a_stale_line() -> None:
    line = "**Floors** (x): 0 `checks` `layout`;\n1 `models`; 2 `engine`.\n\nnext"
    assert readme_floors(line) == {"checks": 0, "layout": 0, "models": 1, "engine": 2}
    assert readme_floors(line.replace("2 `engine`", "1 `engine`")) != readme_floors(line)





# ----------------------------------------------------------------------------- doc sizes
def test_the_docs_stay_short() -> None:
    """docs/DESIGN.md at most 500 lines and every page under docs/ (sub-folders included) at most 1,800
    together: history goes to dated notes under benchmarks/, mechanisms to module docstrings."""
    design = len((ROOT / "docs/DESIGN.md").read_text(encoding="utf-8").splitlines())
    total = sum(len(p.read_text(encoding="utf-8").splitlines()) for p in (ROOT / "docs").rglob("*.md"))
    assert design <= 500, f"docs/DESIGN.md has {design} lines"
    assert total <= 1800, f"docs/ has {total} lines of Markdown"
