"""Every repository path a Markdown file names exists: `lightning_hotspa/...`, `recipes/...`,
`tests/...`, `docs/...`, `benchmarks/...`, package-relative ones such as `planner/cost/cost_model.py`,
and relative link targets (`[text](docs/layouts.md)`)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: top-level folders of the repository whose paths are checked from the root
_ROOTS = ("lightning_hotspa", "recipes", "tests", "docs", "benchmarks", "configs", ".ci")
#: sub-packages that docs name without the `lightning_hotspa/` prefix (checked under the package)
_PACKAGE_PARTS = ("engine", "parallel", "models", "data", "planner", "adapter", "tools", "testing")
_TOKEN = r"[^\s`'\"()\[\],;:|#]*"
_ROOT_PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(map(re.escape, _ROOTS))})/{_TOKEN})")
_PACKAGE_PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(_PACKAGE_PARTS)})/[\w/.-]*\.(?:py|yaml))")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
#: characters and words that mark a placeholder, not a real path (`benchmarks/YYYY-MM-DD-<recipe>.md`)
_PLACEHOLDER = re.compile(r"[<>{}*$]|YYYY|NNN")


def markdown_files(root: Path = ROOT) -> list[Path]:
    """The repository's tracked Markdown files.

    Args:
        root: the repository root (a git work tree; without git every `*.md` under it).
    """
    try:
        names = subprocess.run(["git", "ls-files", "*.md"], cwd=root, capture_output=True, text=True,
                               check=True, timeout=60).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        names = [str(p.relative_to(root)) for p in root.rglob("*.md") if ".git" not in p.parts]
    return [root / n for n in names if (root / n).is_file()]


def missing_paths(path: Path, root: Path = ROOT) -> list[str]:
    """`file:line: path` for every path named in one Markdown file that does not exist.

    Args:
        path: the Markdown file.
        root: the repository root that root-relative paths resolve against.
    """
    problems = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        named = [(m, root) for m in _ROOT_PATH.findall(line)]
        named += [(m, root / "lightning_hotspa") for m in _PACKAGE_PATH.findall(line)]
        for target in _LINK.findall(line):
            if not re.match(r"[a-z]+:|#", target):  # not a URL, not an anchor in the same page
                named.append((target.split("#")[0], path.parent))
        seen = set()
        for name, base in named:
            name = name.rstrip("./")
            if name in seen or not name or _PLACEHOLDER.search(name):
                continue
            seen.add(name)
            if not (base / name).exists():
                problems.append(f"{path.relative_to(root)}:{n}: {name}")
    return problems


def test_every_path_named_in_the_markdown_files_exists() -> None:
    files = markdown_files()
    assert any(p.name == "README.md" for p in files)
    problems = [p for f in files for p in missing_paths(f)]
    assert problems == [], "paths that do not exist:\n" + "\n".join(problems)


def test_the_path_check_catches_missing_paths(tmp_path: Path) -> None:
    (tmp_path / "lightning_hotspa" / "engine").mkdir(parents=True)
    (tmp_path / "lightning_hotspa" / "engine" / "switch.py").write_text("")
    (tmp_path / "pages").mkdir()
    (tmp_path / "pages" / "a.md").write_text("")
    page = tmp_path / "README.md"
    page.write_text("the switch (`lightning_hotspa/switch.py`) and `engine/switch.py`\n"
                    "see [a](pages/a.md), [b](pages/b.md#x), [web](https://x.org), [top](#top)\n"
                    "`engine/nope.py`, `tests/test_x.py::test_y`, `benchmarks/YYYY-MM-DD-<recipe>.md`\n")
    assert missing_paths(page, tmp_path) == [
        "README.md:1: lightning_hotspa/switch.py", "README.md:2: pages/b.md",
        "README.md:3: tests/test_x.py", "README.md:3: engine/nope.py"]
