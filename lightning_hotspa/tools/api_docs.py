"""The API reference: HTML from the docstrings of the public classes, built with pdoc (`make docs`).

The modules are found from the public names (`lightning_hotspa.HotSPaStrategy`, ...), so a class
that moves to another module is still documented. Any warning pdoc raises (a docstring it cannot
parse, a name it cannot resolve) is reported and fails the build.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings
from pathlib import Path

#: (import path, name) of every class the reference documents
PUBLIC = (
    ("lightning_hotspa", "HotSPaStrategy"),
    ("lightning_hotspa", "HotSPaDataModule"),
    ("lightning_hotspa.planner", "Planner"),
    ("lightning_hotspa.planner", "CostModelPlanner"),
    ("lightning_hotspa", "Layout"),
    ("lightning_hotspa.models", "LlamaLM"),
)


def public_modules(public: tuple[tuple[str, str], ...] = PUBLIC) -> list[str]:
    """The modules that define the public classes, in the order first named.

    Args:
        public: (import path, name) pairs, e.g. `("lightning_hotspa", "Layout")`.
    """
    modules: list[str] = []
    for where, name in public:
        module = getattr(importlib.import_module(where), name).__module__
        if module not in modules:
            modules.append(module)
    return modules


def build(out_dir: Path, modules: list[str] | None = None) -> list[str]:
    """Write the HTML reference into `out_dir`; return pdoc's warnings (empty: a clean build).

    Args:
        out_dir: the output folder (created; existing files are overwritten).
        modules: module names to document (default: those defining `PUBLIC`).
    """
    import pdoc
    import pdoc.render

    if modules is None:
        modules = public_modules()
    for module in modules:  # imported before recording: only pdoc's own warnings count
        importlib.import_module(module)
    pdoc.render.configure(docformat="google", show_source=False, search=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pdoc.pdoc(*modules, output_directory=Path(out_dir))
    return [f"{w.category.__name__}: {w.message}" for w in caught]


def main(argv: list[str] | None = None) -> int:
    """Build the reference; exit 1 if pdoc warned.

    Args:
        argv: command-line arguments (default `sys.argv[1:]`): the output folder.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default="build/api", type=Path)
    args = parser.parse_args(argv)
    problems = build(args.out_dir)
    for problem in problems:
        print(f"api docs: {problem}", file=sys.stderr)
    print(f"api docs: {args.out_dir}/index.html, {len(problems)} warning(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
