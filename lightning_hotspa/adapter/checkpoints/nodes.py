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
size, layouts, and the size and sha256 of every file of the node's copy: each rank hashes the
shards it wrote) and renames the folder into place. ``latest:<dir>`` resumes from the newest step
every rank has committed (read from the JSON markers only; the steps are gathered and
intersected: one collective); none is an error unless asked for with ``latest_or_scratch:<dir>``.
A node-local checkpoint holds only its node's shards, so it loads only into the same world size,
layouts and rank -> node map; anything else is refused before training starts.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import shutil
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import DefaultSavePlanner

from .dcp_metadata import safe_dcp_save
from .dcp_state import (
    COMMIT_FILE,
    DCP_METADATA,
    LATEST_PREFIX,
    META_FILE,
    CheckpointError,
    RecordingWriter,
    encoded_meta_or_problem,
    is_complete_checkpoint,
    resolve_checkpoint,
    save_distributed_checkpoint,
    scan_checkpoints,
)
from .dcp_state import all_gather_objects as _all_gather
from .node_merge import merge_node_copies
from .trust import (
    KIND_NODE_LOCAL,
    KIND_SHARED,
    file_entries,
    read_marker,
    write_fsync,
    write_marker,
)

__all__ = ["NODE_FIELD", "LATEST_PREFIX", "LATEST_OR_SCRATCH_PREFIX", "COMMIT_FILE", "CheckpointPlacement",
           "expand_node", "gather_node_map", "merge_node_copies", "tp_groups_across_nodes"]

log = logging.getLogger(__name__)

NODE_FIELD = "{node}"  # in a checkpoint path: this rank's node rank (one folder per node)
LATEST_OR_SCRATCH_PREFIX = "latest_or_scratch:"  # the same, starting from scratch when there is none
SHARED, NODE_LOCAL = KIND_SHARED, KIND_NODE_LOCAL


def expand_node(path: str | os.PathLike, node: int) -> str:
    """``path`` with ``{node}`` replaced by ``node``.

    Args:
        path: a checkpoint path, maybe with ``{node}`` in it.
        node: this rank's node rank.
    """
    return str(path).replace(NODE_FIELD, str(node))


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


class _PerNodeWriter(RecordingWriter):
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


def is_committed(path: str | os.PathLike) -> bool:
    """A node's part of a node-local checkpoint is complete: DCP metadata, meta.pt and its marker.

    Args:
        path: the folder (nothing in it is read).
    """
    return is_complete_checkpoint(path)


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
        raise CheckpointError(f"checkpoint folder {str(folder)!r} is neither shared by all ranks nor local to each "
                              f"node: {seen_by}; use one shared folder, or one per node (a node-local disk, or a "
                              f"path with {NODE_FIELD} in it)")

    # ------------------------------------------------------------------ save
    def save(self, checkpoint: dict[str, Any], filepath: str | os.PathLike, layouts: Sequence[str]) -> None:
        parent = Path(filepath).parent
        try:
            mode = self.mode(parent)
        except CheckpointError as exc:
            raise CheckpointError(f"cannot write a checkpoint to {str(filepath)!r}: {exc}") from None
        if mode == SHARED:
            save_distributed_checkpoint(checkpoint, expand_node(filepath, self.node), is_rank_zero=self.rank == 0,
                                        barrier=self.barrier, broadcast=self.broadcast, gather=_all_gather)
            return
        self._save_node_local(checkpoint, self.local(filepath), list(layouts))

    def _save_node_local(self, checkpoint: dict[str, Any], path: Path, layouts: list[str]) -> None:
        from .dcp_state import _PARTIAL_SUFFIXES, _prepare

        if path.name.endswith(_PARTIAL_SUFFIXES):
            raise CheckpointError(f"checkpoint path {str(path)!r} ends in {path.suffix!r}, a name reserved for "
                                  f"checkpoints being written or replaced; choose another name")
        tmp = path.with_name(path.name + ".tmp")
        meta_bytes, problem = encoded_meta_or_problem(checkpoint, path) if self.rank == 0 else (None, None)
        if problem is None and self.is_node_leader:
            problem = _prepare(tmp)
            problem = problem and f"cannot write a checkpoint to {str(path)!r} (node {self.node}): {problem}"
        problems = [p for p in _all_gather(problem) if p]
        if problems:
            raise CheckpointError(problems[0])
        state = {"model": checkpoint.pop("state_dict")}
        for i, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
            state[f"optimizer_{i}"] = optimizer_state
        writer = _PerNodeWriter(str(tmp), self.node_map)
        safe_dcp_save(state, path, storage_writer=writer, planner=_PerNodePlanner(self.node_map))
        per_node = self.broadcast(writer.per_node if self.rank == 0 else None)  # rank 0's metadata to every node
        meta_bytes = self.broadcast(meta_bytes)
        hashed = _all_gather(file_entries(tmp, writer.written))  # each rank hashes the shards it wrote
        if self.is_node_leader:
            write_fsync(tmp / DCP_METADATA, per_node[self.node])
            write_fsync(tmp / META_FILE, meta_bytes)
            files = {name: entry for r in self.node_ranks for name, entry in hashed[r].items()}
            files.update(file_entries(tmp, [DCP_METADATA, META_FILE]))
            write_marker(tmp, {"kind": NODE_LOCAL, "node": self.node, "ranks": self.node_ranks,
                               "world_size": self.world_size, "node_map": list(self.node_map),
                               "global_step": checkpoint.get("global_step"), "layouts": layouts}, files)
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
        """This rank's folder to load: ``latest:<dir>`` picks the newest step every rank has (none:
        an error), ``latest_or_scratch:<dir>`` the same or None (start from scratch); a node-local
        checkpoint must fit this run. Reads the JSON commit markers only.

        Args:
            spec: ``ckpt_path``.
            layouts: this run's layout names.
        """
        spec = str(spec)
        prefix = next((p for p in (LATEST_PREFIX, LATEST_OR_SCRATCH_PREFIX) if spec.startswith(p)), None)
        if prefix is not None:
            directory = spec[len(prefix):]
            if not directory:
                raise CheckpointError(f"ckpt_path={spec!r}: give the folder after {prefix!r}")
            path = self._agreed_latest(directory, strict=prefix == LATEST_PREFIX)
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

    def _agreed_latest(self, directory: str, *, strict: bool) -> Path | None:
        """The newest step every rank has committed in ``directory`` (markers only; one all-gather)."""
        folder = self.local(directory)
        found, skipped = scan_checkpoints(folder)
        steps: dict[int, str] = {}
        for name, (step, _) in sorted(found.items(), key=lambda kv: kv[1][1], reverse=True):
            steps.setdefault(step, name)  # the newest marker of a step
        everyone = _all_gather((sorted(steps), skipped, folder.is_dir()))
        if self.rank == 0 and any(s for _, s, _ in everyone):
            named = sorted({f"{x}" for _, s, _ in everyone for x in s})
            log.warning("hotspa: latest: skipping checkpoint folder(s) in %s: %s", directory, "; ".join(named))
        common = set(everyone[0][0]).intersection(*(set(e[0]) for e in everyone[1:]))
        if not common:
            absent = [r for r, (_, _, is_dir) in enumerate(everyone) if not is_dir]
            if not any(e[0] for e in everyone):
                where = "" if len(absent) == len(everyone) else f" on ranks {absent}"
                what = f"no complete checkpoint in {directory!r}" + ("" if not absent else f" (no such folder{where})")
            else:
                newest = {r: (e[0][-1] if e[0] else None) for r, e in enumerate(everyone)}
                what = f"no checkpoint step in {directory!r} that every rank has (newest per rank: {newest})"
            if strict:
                raise CheckpointError(f"ckpt_path={LATEST_PREFIX}{directory}: {what}. To start from scratch when "
                                      f"there is none, ask for it: {LATEST_OR_SCRATCH_PREFIX}{directory} (Hydra: "
                                      f"ckpt_path=latest_or_scratch)")
            if self.rank == 0:
                log.warning("hotspa: %s: %s; starting from scratch", LATEST_OR_SCRATCH_PREFIX.rstrip(":"), what)
            return None
        step = max(common)
        if self.rank == 0 and any(e[0] and e[0][-1] != step for e in everyone):
            log.warning("hotspa: resuming from step %d, the newest every node has committed in %s (newest per "
                        "rank: %s)", step, directory, [e[0][-1] if e[0] else None for e in everyone])
        return folder / steps[step]

    def verify_share(self, path: Path) -> tuple[int, int]:
        """This rank's share of a folder's file checks: over the ranks that see the folder (its
        node's for a node-local copy, every rank for a shared one).

        Args:
            path: a resolved checkpoint folder.
        """
        return (self.node_ranks.index(self.rank), len(self.node_ranks)) if self.mode_of(path) == NODE_LOCAL \
            else (self.rank, self.world_size)

    def mode_of(self, path: Path) -> str:
        """``node-local`` when the folder's marker says so, else ``shared`` (a bad marker: checked later).

        Args:
            path: a checkpoint folder.
        """
        try:
            return NODE_LOCAL if read_marker(path).get("kind") == NODE_LOCAL else SHARED
        except CheckpointError:
            return SHARED

    def _check_fits(self, path: Path, layouts: Sequence[str]) -> None:
        """A node-local checkpoint (its marker says so) loads only into the ranks that wrote it."""
        problem = None
        try:
            marker = read_marker(path)
        except CheckpointError:
            marker = {}  # named by the integrity check that follows, on every rank alike
        if marker.get("kind") == NODE_LOCAL:
            saved = (marker.get("world_size"), list(marker.get("layouts") or []), marker.get("node_map"))
            if saved != (self.world_size, list(layouts), list(self.node_map)) or \
                    self.rank not in (marker.get("ranks") or []):
                problem = (f"node {self.node}'s copy {str(path)!r} holds the shards of ranks {marker.get('ranks')} "
                           f"only, written by {marker.get('world_size')} ranks on nodes {marker.get('node_map')} with "
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


class _NoCheckpoint(dict):
    """Empty (so Lightning skips every restore step) yet carrying the version key its migration reads."""

    def __len__(self) -> int:
        return 0


def no_checkpoint() -> dict[str, Any]:
    """What ``load_checkpoint`` returns when ``latest:<dir>`` finds no step every rank has."""
    import lightning

    return _NoCheckpoint({"pytorch-lightning_version": lightning.__version__})


def placement_for(strategy: Any) -> CheckpointPlacement:
    """The rank -> node map (one all-gather of each rank's node rank), said once at DEBUG; a warning when a
    layout's tp groups span nodes (the world mesh puts tp on consecutive ranks, which torchrun and
    SLURM place on one node)."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_debug, rank_zero_warn

    node_map = gather_node_map(strategy.node_rank)
    shape = strategy.mesh_shape
    groups = {str(x): sorted({shape.group_ranks(r, shape.tp_dims(x)) for r in range(shape.world_size)})
              for x in shape.layouts if x.tp > 1}
    rank_zero_debug(f"hotspa: {len(set(node_map))} node(s), rank -> node map {list(node_map)}; tp groups "
                   f"{ {k: [list(g) for g in v] for k, v in groups.items()} }")
    crossing = tp_groups_across_nodes(shape, node_map)
    if crossing:
        rank_zero_warn(f"hotspa: tensor parallelism crosses nodes ({'; '.join(crossing)}): keep tp*cp within a "
                       f"node's ranks (layouts with a smaller tp, or more processes per node)")
    return CheckpointPlacement(strategy.global_rank, node_map, broadcast=strategy.broadcast,
                               barrier=strategy.barrier)
