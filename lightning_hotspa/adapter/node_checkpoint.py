"""Checkpoints on several nodes, with or without a shared filesystem.

Which kind a checkpoint folder is gets measured, not configured: every rank drops a probe file
into it and reports whose probes it sees. Everyone sees everyone: one shared folder (rank 0 writes
``meta.pt`` and renames, :mod:`.checkpoint`). Each rank sees exactly its own node's ranks: a folder
local to each node (a node-local disk; on one machine, a path with ``{node}`` in it, which every
rank replaces by its node rank). Anything else is an error that names who sees whom.

Node-local save: each node writes its own ranks' shards into its own ``<name>.tmp``; torch DCP's
de-duplication of replicated tensors is done per node (every node keeps a copy of what its ranks
read back); DCP's ``.metadata``, made by the coordinator (rank 0) only, is split per node (each
lists the shard files on that node) and reaches every node over the process group; each node's
first rank then writes ``meta.pt`` and its marker ``commit.json`` (node, its ranks, step, world
size, layouts) and renames the folder into place. ``latest:<dir>`` resumes from the newest step
every rank has committed (the steps are gathered and intersected: one collective). A node-local
checkpoint holds only its node's shards, so it loads only into the same world size, layouts and
rank -> node map; anything else is refused before training starts.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import shutil
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

from .checkpoint import (
    DCP_METADATA,
    META_FILE,
    CheckpointError,
    is_complete_checkpoint,
    resolve_checkpoint,
    save_distributed_checkpoint,
)
from .nccl_runtime import objects_to_cpu

__all__ = ["NODE_FIELD", "LATEST_PREFIX", "COMMIT_FILE", "CheckpointPlacement", "expand_node", "gather_node_map",
           "merge_node_copies",            "tp_groups_across_nodes"]

log = logging.getLogger(__name__)

NODE_FIELD = "{node}"  # in a checkpoint path: this rank's node rank (one folder per node)
LATEST_PREFIX = "latest:"  # ckpt_path="latest:<dir>": the newest step every rank has in <dir>
COMMIT_FILE = "commit.json"  # a node-local checkpoint's marker: this node's part is complete
SHARED, NODE_LOCAL = "shared", "node-local"


def expand_node(path: str | os.PathLike, node: int) -> str:
    return str(path).replace(NODE_FIELD, str(node))


def _all_gather(obj: Any) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, objects_to_cpu(obj))  # no CUDA tensor in a pickle (it lands on cuda:0)
    return out


def gather_node_map(node_rank: int) -> tuple[int, ...]:
    """The node of every global rank, as each rank's launcher told it (torchrun: ``GROUP_RANK``,
    SLURM: ``SLURM_NODEID``); one all-gather."""
    return tuple(int(x) for x in _all_gather(int(node_rank)))


def tp_groups_across_nodes(shape: Any, node_map: Sequence[int]) -> list[str]:
    """Layouts whose tp groups span nodes (tp traffic crosses the network every micro-batch)."""
    problems = []
    for layout in shape.layouts:
        dims = list(shape.tp_dims(layout))
        for rank in range(shape.world_size):
            ranks = shape.group_ranks(rank, dims)
            nodes = sorted({node_map[r] for r in ranks})
            if len(nodes) > 1:
                problems.append(f"{layout}: tp group {list(ranks)} spans nodes {nodes}")
                break
    return problems


# ------------------------------------------------------------------ DCP pieces for node-local saves
class _PerNodePlanner(DefaultSavePlanner):
    """De-duplicates replicated items globally for the metadata, then gives every node that lacks
    a copy of an item one back (on its lowest rank holding it), under the same metadata index."""

    def __init__(self, node_map: Sequence[int]) -> None:
        super().__init__()
        self.node_map = tuple(node_map)

    def _create_global_plan(self, all_plans):  # noqa: ANN001, ANN202 - torch's types
        global_plan, metadata = super()._create_global_plan(all_plans)
        final = {(item.index.fqn, item.index.offset): item.index for plan in global_plan for item in plan.items}
        kept = [{(i.index.fqn, i.index.offset) for i in plan.items} for plan in global_plan]
        on_node: dict[int, set] = {}
        for rank, keys in enumerate(kept):
            on_node.setdefault(self.node_map[rank], set()).update(keys)
        extra: list[list[Any]] = [[] for _ in global_plan]
        for rank, plan in enumerate(all_plans):  # ranks in order: the lowest holder gets the copy
            node = self.node_map[rank]
            for item in plan.items:
                key = (item.index.fqn, item.index.offset)
                if key not in on_node[node] and key in final:
                    extra[rank].append(dataclasses.replace(item, index=final[key]))
                    on_node[node].add(key)
        global_plan = [dataclasses.replace(p, items=list(p.items) + e) if e else p for p, e in zip(global_plan, extra)]
        return global_plan, metadata


class _PerNodeWriter(FileSystemWriter):
    """On the coordinator, keeps one ``.metadata`` per node (each listing that node's shard files)
    instead of writing the global one; :meth:`CheckpointPlacement.save` ships them to the nodes."""

    def __init__(self, path: str, node_map: Sequence[int]) -> None:
        super().__init__(path)
        self.node_map = tuple(node_map)
        self.per_node: dict[int, bytes] = {}

    def finish(self, metadata, results) -> None:  # noqa: ANN001 - torch's types
        from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_meta = self.storage_meta()
        for node in sorted(set(self.node_map)):
            storage = {wr.index: wr.storage_data for rank, wrs in enumerate(results)
                       if self.node_map[rank] == node for wr in wrs}
            self.per_node[node] = pickle.dumps(dataclasses.replace(metadata, storage_data=storage))


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def is_committed(path: str | os.PathLike) -> bool:
    """A node's part of a node-local checkpoint is complete: DCP metadata, meta.pt and its marker."""
    return is_complete_checkpoint(path) and (Path(path) / COMMIT_FILE).is_file()


class CheckpointPlacement:
    """Where this rank's checkpoints live and how they are written, read and removed.

    ``node_map[r]`` is the node of global rank ``r``; ``broadcast(obj)`` returns rank 0's ``obj``
    on every rank; ``barrier()`` waits for all. Every method is a collective except :meth:`remove`.
    """

    def __init__(self, rank: int, node_map: Sequence[int], *, broadcast: Callable[[Any], Any],
                 barrier: Callable[[], None]) -> None:
        self.rank, self.node_map = rank, tuple(node_map)
        self.node = self.node_map[rank]
        self.world_size = len(self.node_map)
        self.node_ranks = [r for r, n in enumerate(self.node_map) if n == self.node]
        self.is_node_leader = rank == self.node_ranks[0]
        self.broadcast, self.barrier = broadcast, barrier
        self._modes: dict[str, str] = {}

    def local(self, path: str | os.PathLike) -> Path:
        return Path(expand_node(path, self.node))

    # ------------------------------------------------------------------ what kind of folder
    def mode(self, directory: str | os.PathLike) -> str:
        """``shared`` or ``node-local`` for a checkpoint folder (measured once per folder)."""
        key = str(directory)
        if key not in self._modes:
            self._modes[key] = self._probe(self.local(directory))
        return self._modes[key]

    def _probe(self, folder: Path) -> str:
        nonce = self.broadcast(uuid.uuid4().hex[:12])
        mine = folder / f".hotspa-probe-{nonce}-{self.rank}"
        problem = None
        try:
            folder.mkdir(parents=True, exist_ok=True)
            mine.write_bytes(b"")
        except OSError as exc:
            problem = f"rank {self.rank}: cannot write to {str(folder)!r}: {type(exc).__name__}: {exc}"
        self.barrier()
        prefix = f".hotspa-probe-{nonce}-"
        seen = sorted(int(p.name[len(prefix):]) for p in folder.glob(prefix + "*")) if problem is None else []
        reports = _all_gather((seen, problem))
        if problem is None:
            mine.unlink(missing_ok=True)
        problems = [p for _, p in reports if p]
        if problems:
            raise CheckpointError("; ".join(problems))
        everyone = list(range(self.world_size))
        if all(s == everyone for s, _ in reports):
            return SHARED
        if all(s == [r for r, n in enumerate(self.node_map) if n == self.node_map[rank]]
               for rank, (s, _) in enumerate(reports)):
            return NODE_LOCAL
        seen_by = "; ".join(f"rank {r} (node {self.node_map[r]}) sees ranks {s}" for r, (s, _) in enumerate(reports))
        raise CheckpointError(f"checkpoint folder {str(folder)!r} is neither shared by all ranks nor local to each node: "
                              f"{seen_by}; use one shared folder, or one per node (a node-local disk, or a path with "
                              f"{NODE_FIELD} in it)")

    # ------------------------------------------------------------------ save
    def save(self, checkpoint: dict[str, Any], filepath: str | os.PathLike, layouts: Sequence[str]) -> None:
        parent = Path(filepath).parent
        try:
            mode = self.mode(parent)
        except CheckpointError as exc:
            raise CheckpointError(f"cannot write a checkpoint to {str(filepath)!r}: {exc}") from None
        if mode == SHARED:
            save_distributed_checkpoint(checkpoint, expand_node(filepath, self.node), is_rank_zero=self.rank == 0,
                                        barrier=self.barrier, broadcast=self.broadcast)
            return
        self._save_node_local(checkpoint, self.local(filepath), list(layouts))

    def _save_node_local(self, checkpoint: dict[str, Any], path: Path, layouts: list[str]) -> None:
        from .checkpoint import _PARTIAL_SUFFIXES, _prepare

        if path.name.endswith(_PARTIAL_SUFFIXES):
            raise CheckpointError(f"checkpoint path {str(path)!r} ends in {path.suffix!r}, a name reserved for "
                                  f"checkpoints being written or replaced; choose another name")
        tmp = path.with_name(path.name + ".tmp")
        problems = [p for p in _all_gather(_prepare(tmp) if self.is_node_leader else None) if p]
        if problems:
            raise CheckpointError(f"cannot write a checkpoint to {str(path)!r} (node {self.node}): {problems[0]}")
        state = {"model": checkpoint.pop("state_dict")}
        for i, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
            state[f"optimizer_{i}"] = optimizer_state
        writer = _PerNodeWriter(str(tmp), self.node_map)
        dcp.save(state, storage_writer=writer, planner=_PerNodePlanner(self.node_map))
        per_node = self.broadcast(writer.per_node if self.rank == 0 else None)  # rank 0's metadata to every node
        meta = self.broadcast(checkpoint if self.rank == 0 else None)
        if self.is_node_leader:
            _fsync_write(tmp / DCP_METADATA, per_node[self.node])
            torch.save(meta, tmp / META_FILE)
            marker = {"node": self.node, "ranks": self.node_ranks, "world_size": self.world_size,
                      "node_map": list(self.node_map), "global_step": meta.get("global_step"), "layouts": layouts}
            _fsync_write(tmp / COMMIT_FILE, json.dumps(marker).encode())
            old = path.with_name(path.name + ".old")
            if path.exists():
                shutil.rmtree(old, ignore_errors=True)
                os.replace(path, old)
            os.replace(tmp, path)  # this node's commit
            shutil.rmtree(old, ignore_errors=True)
        self.barrier()

    def remove(self, filepath: str | os.PathLike) -> None:
        """Rank 0 removes a shared checkpoint, each node's first rank its node's copy."""
        parent = str(Path(filepath).parent)
        node_local = self._modes.get(parent) == NODE_LOCAL
        if (self.is_node_leader if node_local else self.rank == 0):
            path = self.local(filepath)
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ load
    def resolve(self, spec: str, layouts: Sequence[str]) -> Path | None:
        """This rank's folder to load: ``latest:<dir>`` picks the newest step every rank has
        (None: there is none, start from scratch); a node-local checkpoint must fit this run."""
        spec = str(spec)
        if spec.startswith(LATEST_PREFIX):
            directory = spec[len(LATEST_PREFIX):]
            if not directory:
                raise CheckpointError(f"ckpt_path={spec!r}: give the folder after {LATEST_PREFIX!r}")
            path = self._agreed_latest(directory)
        else:
            path = self.local(spec)
            found = _all_gather(path.exists() or path.with_name(path.name + ".old").exists())
            missing = [r for r, f in enumerate(found) if not f]
            if missing and len(missing) < len(found):
                raise CheckpointError(self._reshape_message(path, f"ranks {missing} find no {str(path)!r}"))
            path = resolve_checkpoint(path)
        if path is not None:
            self._check_fits(path, layouts)
        return path

    def _agreed_latest(self, directory: str) -> Path | None:
        folder = self.local(directory)
        steps: dict[int, str] = {}
        for entry in sorted(folder.iterdir()) if folder.is_dir() else []:
            if entry.name.endswith(".tmp") or not is_complete_checkpoint(entry):
                continue  # an interrupted save
            if entry.name.endswith(".old") and entry.with_name(entry.name[:-4]).exists():
                continue  # its replacement arrived
            steps.setdefault(_step_of(entry), entry.name)
        everyone = _all_gather(sorted(steps))
        common = set(everyone[0]).intersection(*map(set, everyone[1:]))
        if not common:
            if self.rank == 0 and not any(everyone):
                log.warning("hotspa: latest: no complete checkpoint in %s; starting from scratch", directory)
            elif self.rank == 0:
                newest = {r: (s[-1] if s else None) for r, s in enumerate(everyone)}
                log.warning("hotspa: no checkpoint step in %s that every rank has (newest per rank: %s); "
                            "starting from scratch", directory, newest)
            return None
        step = max(common)
        if self.rank == 0 and any(s and s[-1] != step for s in everyone):
            log.warning("hotspa: resuming from step %d, the newest every node has committed in %s (newest per "
                        "rank: %s)", step, directory, [s[-1] if s else None for s in everyone])
        return folder / steps[step]

    def _check_fits(self, path: Path, layouts: Sequence[str]) -> None:
        """A node-local checkpoint (it has a marker) loads only into the ranks that wrote it."""
        problem = None
        marker_file = path / COMMIT_FILE
        if marker_file.is_file():
            marker = json.loads(marker_file.read_text())
            saved = (marker.get("world_size"), list(marker.get("layouts", [])), marker.get("node_map"))
            if saved != (self.world_size, list(layouts), list(self.node_map)) or self.rank not in marker["ranks"]:
                problem = (f"node {self.node}'s copy {str(path)!r} holds the shards of ranks {marker['ranks']} only, "
                           f"written by {marker.get('world_size')} ranks on nodes {marker.get('node_map')} with "
                           f"layouts {marker.get('layouts')}; this run: {self.world_size} ranks on nodes "
                           f"{list(self.node_map)} with layouts {list(layouts)}")
        problems = [p for p in _all_gather(problem) if p]
        if problems:
            raise CheckpointError(self._reshape_message(path, problems[0]))

    def _reshape_message(self, path: Path, problem: str) -> str:
        return (f"cannot resume from the node-local checkpoint {str(path)!r}: {problem}. A resume at another world "
                f"size, layouts or rank -> node map reads other ranks' shards, so it needs a checkpoint on a shared "
                f"filesystem: resume at the same shape, or copy every node's folder into one shared folder first "
                f"and pass that")


def _step_of(path: Path) -> int:
    marker = path / COMMIT_FILE
    if marker.is_file():
        try:
            return int(json.loads(marker.read_text()).get("global_step", -1))
        except (ValueError, TypeError):
            return -1
    try:
        return int(torch.load(path / META_FILE, map_location="cpu", weights_only=False).get("global_step", -1))
    except Exception:  # noqa: BLE001 - unreadable: a poor candidate, not fatal
        return -1


def merge_node_copies(folders: Sequence[str | os.PathLike], output: str | os.PathLike) -> Path:
    """One shared checkpoint (loadable at any world size) from every node's copy of a node-local
    one, once they are reachable from one machine: shard files copied, per-node metadata merged.
    Runs in one process, without a process group."""
    folders = [resolve_checkpoint(f) for f in folders]
    markers = []
    for folder in folders:
        if not (folder / COMMIT_FILE).is_file():
            raise CheckpointError(f"{str(folder)!r} has no {COMMIT_FILE}: not one node's copy of a node-local checkpoint")
        markers.append(json.loads((folder / COMMIT_FILE).read_text()))
    world = markers[0]["world_size"]
    covered = sorted(r for m in markers for r in m["ranks"])
    if covered != list(range(world)) or len({m["global_step"] for m in markers}) != 1:
        raise CheckpointError(f"the copies {[str(f) for f in folders]} do not add up to one checkpoint of {world} ranks: "
                              f"they hold ranks {covered} of steps {sorted({m['global_step'] for m in markers})}")
    output = Path(output)
    tmp = output.with_name(output.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    merged = None
    for folder in folders:
        metadata = pickle.loads((folder / DCP_METADATA).read_bytes())
        if merged is None:
            merged = metadata
        else:
            merged.storage_data.update(metadata.storage_data)
        for shard in folder.glob("*.distcp"):
            shutil.copy2(shard, tmp / shard.name)
    shutil.copy2(folders[0] / META_FILE, tmp / META_FILE)
    _fsync_write(tmp / DCP_METADATA, pickle.dumps(merged))
    os.replace(tmp, output)
    return output


class _NoCheckpoint(dict):
    """Empty (so Lightning skips every restore step) yet carrying the version key its migration reads."""

    def __len__(self) -> int:
        return 0


def no_checkpoint() -> dict[str, Any]:
    """What ``load_checkpoint`` returns when ``latest:<dir>`` finds no step every rank has."""
    import lightning

    return _NoCheckpoint({"pytorch-lightning_version": lightning.__version__})


def placement_for(strategy: Any) -> CheckpointPlacement:
    """The rank -> node map (one all-gather of each rank's node rank), said once; a warning when a
    layout's tp groups span nodes (the world mesh puts tp on consecutive ranks, which torchrun and
    SLURM place on one node)."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

    node_map = gather_node_map(strategy.node_rank)
    shape = strategy.mesh_shape
    groups = {str(x): sorted({shape.group_ranks(r, shape.tp_dims(x)) for r in range(shape.world_size)})
              for x in shape.layouts if x.tp > 1}
    rank_zero_info(f"hotspa: {len(set(node_map))} node(s), rank -> node map {list(node_map)}; tp groups "
                   f"{ {k: [list(g) for g in v] for k, v in groups.items()} }")
    crossing = tp_groups_across_nodes(shape, node_map)
    if crossing:
        rank_zero_warn(f"hotspa: tensor parallelism crosses nodes ({'; '.join(crossing)}): keep tp*cp within a "
                       f"node's ranks (layouts with a smaller tp, or more processes per node)")
    return CheckpointPlacement(strategy.global_rank, node_map, broadcast=strategy.broadcast,
                               barrier=strategy.barrier)
