"""The shape of the package: no import cycles, dependencies point down (between the package's parts
and between adapter/'s sub-packages), the planner and the layouts load without Lightning, the strategy
name is registered in either import order, and the docs the project cites are in the repository
(docs/DESIGN.md section 5 draws the floors checked here)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_hotspa
from lightning_hotspa.testing.import_graph import find_cycles, import_graph

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(lightning_hotspa.__file__).resolve().parent

#: floor of each part of the package: a module may import its own floor and the floors below
FLOORS = {
    "checks": 0, "activation_checkpointing": 0, "torch_compat": 0, "host": 0, "host_facts": 0, "layout": 0, "mesh": 0,
    "placements": 0, "plan": 0, "micro_batch": 0, "collective_names": 0, "group_collectives": 0, "shard_rows": 0,
    "model_shape": 0, "cp_kinds": 0, "paths": 0, "pipeline_split": 0, "op_handles": 0,
    "models": 1, "planner": 1, "data": 1, "testing": 1,
    "parallel": 2, "engine": 2,
    "adapter": 3,
    "tools": 4, "configs": 4,
}


#: floors inside a part folded into sub-packages: adapter/'s Lightning seam (lightning/) may import its
#: checkpoints/ and observability/, never the reverse (they read what they need through protocols or
#: from the ground floor); the Hydra glue (recipes/) sits on top
SUB_FLOORS = {"adapter": {"checkpoints": 0, "observability": 0, "lightning": 1, "recipes": 2}}


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _sub_part(module: str) -> str:
    """``adapter.lightning`` for a module of adapter/lightning/; "" for a module outside a folded part
    or for the folded part's own ``__init__``."""
    parts = module.split(".")
    return f"{parts[1]}.{parts[2]}" if len(parts) > 2 and parts[1] in SUB_FLOORS else ""


def _floor_of(part: str) -> int | None:
    """A part's floor: ``FLOORS`` for a top-level part, ``SUB_FLOORS`` for ``adapter.<sub>``."""
    top, _, sub = part.partition(".")
    return SUB_FLOORS.get(top, {}).get(sub) if sub else FLOORS.get(top)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``module -> target`` for every import of a higher floor: between the package's parts (``FLOORS``)
    and, inside a folded part, between its sub-packages (``SUB_FLOORS``)."""
    def above(mine: str, theirs: str) -> bool:
        return bool(mine and theirs) and _floor_of(theirs) > _floor_of(mine)

    return sorted(f"{module} -> {target}" for module, targets in graph.items() for target in targets
                  if above(_part(module), _part(target))
                  or _part(module) == _part(target) and above(_sub_part(module), _sub_part(target)))


def test_no_import_cycle_among_the_package_modules() -> None:
    graph = import_graph(PACKAGE)
    assert "lightning_hotspa.planner.solve.solver" in graph, "the graph must see the package's modules"
    assert find_cycles(graph) == []


def test_the_cycle_finder_sees_deferred_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import x\n    return x\n")
    (pkg / "c.py").write_text("from .b import f\n")
    assert find_cycles(import_graph(pkg)) == [["pkg.a", "pkg.b"]]


def test_dependencies_point_down() -> None:
    """No module imports a higher floor: neither between the package's parts nor, inside adapter/,
    between its sub-packages (``lightning -> checkpoints`` may be, ``checkpoints -> lightning`` not)."""
    graph = import_graph(PACKAGE)
    unknown = sorted({p for m in graph for p in (_part(m), _sub_part(m)) if p and _floor_of(p) is None})
    assert not unknown, f"give these parts of the package a floor in FLOORS or SUB_FLOORS: {unknown}"
    assert upward_imports(graph) == []


def test_the_floor_check_catches_an_upward_import(tmp_path: Path) -> None:
    """Planted violations, fed to the same checker as the package: a sub-package of adapter/ that imports
    the Lightning seam (one deferred, one absolute) and a ground-floor module that imports adapter/."""
    sources = {
        "__init__.py": "from .adapter.lightning import strategy\n",  # the package __init__: exempt
        "layout.py": "from .adapter.checkpoints import hooks\n",
        "adapter/__init__.py": "from .lightning import strategy\n",  # a folded part's own __init__: exempt
        "adapter/lightning/__init__.py": "",
        "adapter/lightning/reliability.py": "from ...layout import x\n",
        "adapter/lightning/strategy.py": "from ..checkpoints import hooks\nfrom ..observability.callbacks import y\n",
        "adapter/checkpoints/__init__.py": "",
        "adapter/checkpoints/hooks.py": "def f():\n    from ..lightning.reliability import StepTracker\n",
        "adapter/observability/__init__.py": "",
        "adapter/observability/callbacks.py": "import lightning_hotspa.adapter.lightning.strategy\n",
        "adapter/recipes/__init__.py": "",
        "adapter/recipes/hydra_recipe.py": "from ..lightning.strategy import S\nfrom ..checkpoints import hooks\n",
    }
    root = tmp_path / "lightning_hotspa"
    for name, text in sources.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    assert upward_imports(import_graph(root)) == [
        "lightning_hotspa.adapter.checkpoints.hooks -> lightning_hotspa.adapter.lightning.reliability",
        "lightning_hotspa.adapter.observability.callbacks -> lightning_hotspa.adapter.lightning.strategy",
        "lightning_hotspa.layout -> lightning_hotspa.adapter.checkpoints.hooks",
    ]


def test_no_two_package_modules_share_a_file_name() -> None:
    """One name per idea: a file name means one module in the package (``__init__`` aside), so a
    newcomer who reads ``timeline.py`` in a traceback knows which one it is."""
    names: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "__init__.py":
            names.setdefault(path.name, []).append(str(path.relative_to(PACKAGE)))
    assert {name: paths for name, paths in names.items() if len(paths) > 1} == {}


def test_adapter_is_folded_by_job() -> None:
    """adapter/ holds sub-packages only (the Lightning seam, checkpoints, observability, recipes)."""
    adapter = PACKAGE / "adapter"
    assert sorted(p.name for p in adapter.glob("*.py")) == ["__init__.py"]
    assert sorted(p.name for p in adapter.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(
        SUB_FLOORS["adapter"]) == ["checkpoints", "lightning", "observability", "recipes"]


def test_observability_reads_the_strategy_through_a_protocol() -> None:
    """observability/ names what it reads of the strategy (``MonitoredStrategy``), not the class it may
    not import: ``HotSPaStrategy`` is one, Lightning's own strategies are not (so a monitor on them
    logs no HotSPa records instead of failing)."""
    import torch
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    from lightning_hotspa import HotSPaStrategy
    from lightning_hotspa.adapter.observability.callbacks import MonitoredStrategy

    assert isinstance(HotSPaStrategy(), MonitoredStrategy)
    assert not isinstance(SingleDeviceStrategy(torch.device("cpu")), MonitoredStrategy)
    assert not isinstance(DDPStrategy(), MonitoredStrategy)


def test_the_planner_reads_a_model_description_not_a_model_class() -> None:
    """planner/ (solver, candidates, the cost model and its published rows) imports no model class: it
    reads a ModelShape (lightning_hotspa/model_shape.py), filled from a preset, a LlamaConfig or a
    Hugging Face config, so a new model family needs no planner edit. Of models/ it reads only the
    attention-kernel registry's records (their memory and cost terms)."""
    graph = import_graph(PACKAGE)
    into_models = sorted(f"{m} -> {t}" for m, targets in graph.items() if _part(m) == "planner"
                         for t in targets if _part(t) == "models" and t != "lightning_hotspa.models.attention_kernels")
    assert into_models == []
    assert "lightning_hotspa.model_shape" in graph["lightning_hotspa.planner.cost.terms"]


def test_the_folders_import_each_other_without_a_loop() -> None:
    """Two parts of one floor may import each other's modules only one way round (no folder loop, as
    ``parallel -> models.vocab`` beside ``models.loss_head -> parallel.collectives`` was); so may two
    sub-packages of adapter/ (checkpoints/ and observability/ share a floor)."""
    graph = import_graph(PACKAGE)
    for part_of in (_part, _sub_part):  # the package's parts; adapter/'s sub-packages
        parts: dict[str, set[str]] = {}
        for module, targets in graph.items():
            if part_of(module):
                others = {part_of(t) for t in targets} - {"", part_of(module)}
                parts.setdefault(part_of(module), set()).update(others)
        assert find_cycles(parts) == []
    assert FLOORS["models"] < FLOORS["parallel"], "docs/DESIGN.md §5: the model is written for one device"


#: a test of the process-group backend or of the device type (docs/DESIGN.md §8-9: one collectives
#: object per group, chosen once in group_collectives; kernels per device in the attention-kernel registry)
_BACKEND_OR_DEVICE_TEST = re.compile(r"_is_gloo|backend\s*[!=]=|get_backend\(|device\.type\s*[!=]=|\.type\s*[!=]=\s*"
                                     r"[\"'](?:cpu|cuda)|\.is_cuda\b|\bweakref\b")


def test_the_runtime_asks_no_backend_or_device_type() -> None:
    """parallel/ and engine/ run the same path on every backend and device: no test of either there
    (and no weak reference into another op's state in parallel/)."""
    hits = [f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}"
            for folder in ("parallel", "engine") for path in sorted((PACKAGE / folder).rglob("*.py"))
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if _BACKEND_OR_DEVICE_TEST.search(line.split("#")[0])]
    assert hits == []


_CHECK_NO_LIGHTNING = """
import sys
import lightning_hotspa.layout, lightning_hotspa.planner, lightning_hotspa.plan
import lightning_hotspa.models, lightning_hotspa.data, lightning_hotspa.engine.switch
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("lightning", "pytorch_lightning"))
assert not loaded, loaded[:5]
import lightning_hotspa.models as models, lightning_hotspa.data as data
assert models.LlamaLM.__module__ == "lightning_hotspa.models.lightning_module"
assert data.HotSPaDataModule.__module__ == "lightning_hotspa.data.datamodule"
assert "lightning" in sys.modules  # the lazy names are real: they load Lightning when asked for
print("ok")
"""


def _python(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_planner_layouts_models_and_data_load_without_lightning() -> None:
    assert _python(_CHECK_NO_LIGHTNING).strip().endswith("ok")


_TRAINER = ("t = L.Trainer(strategy='hotspa', accelerator='cpu', devices=1, logger=False, "
            "enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)\n"
            "print(type(t.strategy).__name__)\n")


@pytest.mark.parametrize("imports", [
    "import lightning_hotspa; import lightning",
    "import lightning; import lightning_hotspa",
    "from lightning_hotspa import HotSPaStrategy",  # our strategy's own import loads Lightning
])
def test_trainer_finds_hotspa_after_a_bare_import_in_either_order(imports: str) -> None:
    code = (f"{imports}\nimport lightning as L\n" + _TRAINER
            + "import sys\n"
            "assert not [f for f in sys.meta_path if getattr(f, 'hotspa_registration_hook', 0)]\n"
            "assert type(sys.modules['lightning'].__loader__).__name__ != '_RegisterAfterExec'\n"
            "from lightning_hotspa.adapter.lightning import registration\n"
            "registration.install(); registration.install(); registration.register_strategy()\n" + _TRAINER)
    assert _python(code).strip().splitlines()[-2:] == ["HotSPaStrategy", "HotSPaStrategy"]


def test_no_test_file_imports_another_test_file() -> None:
    """The tests' shared helpers live in tests/helpers.py: a test module never imports a ``test_*``
    module (nor a helper file other than that one); job scripts (tests/mixed_kill_job.py) included."""
    import ast

    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            found += [f"{path.relative_to(ROOT)}: {n}" for n in names
                      if n.split(".")[0].startswith("test_") or n in ("strategy_helpers", "hf_helpers")]
    assert found == []


# --------------------------------------------------------------------------------------- docs
_OUTSIDE = re.compile(r"\.\./" + "shared|/work/" + "shared")
_BARE = re.compile(r"(?<![\w/])(?:DESIGN|REFERENCE)\.md")  # outside docs/ these must say docs/...
_DOC = re.compile(r"\bdocs/([\w.-]+\.md)(?:\s*§(\d+))?(?:,? trap \"([^\"]+)\")?")


def _tracked_text_files() -> list[Path]:
    try:
        names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                               check=True, timeout=60).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        names = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts]
    keep = (".py", ".md", ".toml", ".yaml", ".yml", ".cfg", ".txt", "Makefile", ".sh", ".ini")
    return [ROOT / n for n in names if n.endswith(keep) and (ROOT / n).is_file()]


def _doc_problems(files: list[Path], docs: Path) -> list[str]:
    problems = []
    for path in files:
        if path.name in ("test_architecture.py", "test_docs_paths.py"):
            continue  # their own patterns and fixtures
        text = path.read_text(encoding="utf-8", errors="replace")
        for n, line in enumerate(text.splitlines(), 1):
            where = f"{path.name}:{n}"
            bare = path.parent.name != "docs" and _BARE.search(re.sub(r"docs/\w+\.md", "", line))
            if _OUTSIDE.search(line) or bare:
                problems.append(f"{where}: refers to a file outside the repository: {line.strip()[:90]}")
            for name, section, trap in _DOC.findall(line):
                doc = docs / name
                if not doc.is_file():
                    problems.append(f"{where}: docs/{name} does not exist")
                    continue
                body = doc.read_text(encoding="utf-8")
                if section and not re.search(rf"^## {section}\. ", body, re.M):
                    problems.append(f"{where}: docs/{name} has no section {section}")
                if trap and trap.lower() not in body.lower():
                    problems.append(f"{where}: docs/{name} names no trap {trap!r}")
    return problems


def test_every_reference_to_the_docs_points_into_the_repository() -> None:
    files = _tracked_text_files()
    assert any(p.name == "README.md" for p in files)
    assert _doc_problems(files, ROOT / "docs") == []


def test_the_docs_check_catches_bad_references(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "DESIGN.md").write_text("## 7. Traps\n- **Uneven shards.** ...\n")
    bad = tmp_path / "src" / "x.py"
    bad.parent.mkdir()
    bad.write_text('"""see ../' + 'shared/DESIGN.md"""\n# docs/DESIGN.md §9\n# docs/NOPE.md\n'
                   '# docs/DESIGN.md §7, trap "closure order"\n# DESIGN' + '.md §4\n'
                   '# docs/DESIGN.md §7, trap "uneven shards"\n')
    problems = _doc_problems([bad], docs)
    assert len(problems) == 5, problems
