"""One door for collectives: the package issues every ``torch.distributed`` collective through a
group's collectives object (``lightning_hotspa/group_collectives.py``), checked by an AST scan.

The rule (docs/DESIGN.md §8, "One door for collectives"): outside ``group_collectives.py`` and ``testing/``, no
module of the package names (calls, passes or imports)

- a communicating function of ``torch.distributed`` / ``torch.distributed.distributed_c10d``
  (:data:`COLLECTIVES`: the reductions, gathers, scatters, all-to-alls, broadcasts, barriers,
  point-to-point and the ``*_object`` calls), however the module is aliased;
- the functional collectives or symmetric memory (``torch.distributed._functional_collectives``,
  ``torch.distributed._symmetric_memory``, ``torch.ops.symm_mem``, ``torch.ops._c10d_functional``).

Process-group creation and queries (``new_group``, ``split_group``, ``get_rank``,
``get_world_size``, ``get_backend``, ``is_initialized``, ``ReduceOp`` ...) are not collectives and
stay where they are. What torch's own machinery issues inside itself (DTensor redistribution,
distributed checkpointing, pipelining schedules, the symmetric-memory ops' internals) is torch's.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch.distributed.distributed_c10d as c10d

import lightning_hotspa

PACKAGE = Path(lightning_hotspa.__file__).resolve().parent
DOOR = PACKAGE / "group_collectives.py"
EXEMPT_DIRS = (PACKAGE / "testing",)

#: the communicating functions of torch.distributed (and c10d), by name
COLLECTIVES = frozenset({
    "all_reduce", "all_reduce_coalesced", "all_reduce_multigpu", "all_gather", "all_gather_into_tensor",
    "all_gather_coalesced", "all_gather_object", "all_gather_single", "all_gather_multigpu", "_all_gather_base",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "reduce_scatter_multigpu",
    "_reduce_scatter_base", "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list",
    "broadcast_multigpu", "reduce", "reduce_multigpu", "gather", "gather_object", "scatter", "scatter_object_list",
    "barrier", "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv", "P2POp",
    "send_object_list", "recv_object_list",
})
#: whole modules / op namespaces that are collectives
FORBIDDEN_PREFIXES = ("torch.distributed._functional_collectives", "torch.distributed._symmetric_memory",
                      "torch.ops.symm_mem", "torch.ops._c10d_functional")
_DIST = ("torch.distributed", "torch.distributed.distributed_c10d")
#: c10d's public lower-case names that do not communicate (creation, queries, constants)
_NOT_COLLECTIVES_PREFIXES = ("get_", "is_", "new_", "init_", "destroy_", "split_", "shrink_")
_NOT_COLLECTIVES = {"group", "reduce_op", "default_pg_timeout", "supports_complex", "record_comm"}


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> dotted module/attribute path, from every import in the module (nested ones too)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    names[a.asname] = a.name
                else:
                    names[a.name.split(".")[0]] = a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in aliases:
        return None
    return ".".join([aliases[node.id], *reversed(parts)])


def _is_forbidden(path: str) -> bool:
    if path.startswith(FORBIDDEN_PREFIXES):
        return True
    head, _, last = path.rpartition(".")
    return head in _DIST and last in COLLECTIVES


def violations(source: str, where: str) -> list[str]:
    """Every forbidden name in ``source`` as ``where:line: dotted.name``."""
    tree = ast.parse(source)
    aliases = _aliases(tree)
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}  # judged with the outer one
    found = []
    for node in ast.walk(tree):
        paths: list[str] = []
        if isinstance(node, ast.Import):
            paths = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            paths = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute) and id(node) not in inner:
            path = _dotted(node, aliases)
            paths = [path] if path else []
        found += [f"{where}:{node.lineno}: {p}" for p in paths if _is_forbidden(p)]
    return sorted(set(found))


def _package_files() -> list[Path]:
    return [f for f in sorted(PACKAGE.rglob("*.py"))
            if f != DOOR and not any(d in f.parents for d in EXEMPT_DIRS)]


def test_every_collective_goes_through_the_group_collectives_object() -> None:
    files = _package_files()
    assert len(files) > 100, "the scan must see the package's modules"
    found = [v for f in files for v in violations(f.read_text(), str(f.relative_to(PACKAGE)))]
    assert found == [], ("torch.distributed collectives outside group_collectives.py (add a thin method "
                         "there and call it through the group's .comm / world_collectives()):\n" + "\n".join(found))


def test_the_door_check_catches_planted_collectives() -> None:
    planted = (
        "import torch\nimport torch.distributed as dist\nfrom torch import distributed as d2\n"
        "from torch.distributed import distributed_c10d as c10d, barrier\n"
        "import torch.distributed._functional_collectives as funcol\n"
        "def f(x, g):\n"
        "    dist.all_reduce(x, group=g)\n"
        "    torch.distributed.all_gather_object([None], x)\n"
        "    d2.barrier()\n"
        "    ops = [dist.P2POp(c10d.isend, x, 1)]\n"
        "    torch.ops.symm_mem.fused_all_gather_matmul(x, [x], 0, 'g')\n"
        "    return dist.get_rank(), dist.ReduceOp.MAX, dist.new_group([0]), d2.get_world_size()\n"
    )
    found = {v.split(": ", 1)[1] for v in violations(planted, "planted.py")}
    assert found == {
        "torch.distributed.barrier", "torch.distributed._functional_collectives",
        "torch.distributed.all_reduce", "torch.distributed.all_gather_object", "torch.distributed.P2POp",
        "torch.distributed.distributed_c10d.isend", "torch.ops.symm_mem.fused_all_gather_matmul",
    }, found
    assert violations("import torch.distributed as dist\nn = dist.get_world_size()\n", "clean.py") == []


def test_every_c10d_function_is_classified() -> None:
    """A torch that adds a communicating function must have it named in :data:`COLLECTIVES`."""
    public = [n for n in getattr(c10d, "__all__", ()) if n[:1].islower()]
    unknown = [n for n in public if n not in COLLECTIVES and n not in _NOT_COLLECTIVES
               and not n.startswith(_NOT_COLLECTIVES_PREFIXES)]
    assert unknown == [], f"classify these torch.distributed functions as collective or not: {unknown}"
