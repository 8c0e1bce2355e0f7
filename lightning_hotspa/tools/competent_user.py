"""A competent user's static layout for a long-grid cell, and its step priced on the user's own runtime (issue 51).

The long grid (:mod:`.long_grid`) compares ours with the layout a competent user of a peer writes for the cell's
batch (:func:`competent_user_layouts`), priced on that peer's runtime description (:data:`PEER_RUNTIMES`,
:func:`user_model`) and on ours, with checkpointing only where a stage needs it (:func:`user_seconds`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..activation_checkpointing import Checkpointing
from ..layout import Layout, LayoutError
from ..planner.cost.cost_model import AnalyticCostModel, CostModelError
from ..planner.cost.hardware import get_profile
from ..planner.cost.published_pricing import compiled
from ..planner.cost.runtime_profile import get_runtime
from ..planner.solve.solver import CostModelPlanner

__all__ = ["COMPILING_PEERS", "PEER_RUNTIMES", "competent_user_layouts", "nemo_tp", "user_model", "user_seconds"]

#: the runtime description each competent user's layout is priced on (planner/cost/runtime_profile.py)
PEER_RUNTIMES = {"megatron-te": "nemo-te", "torchtitan": "torchtitan"}
#: the users who turn on torch.compile where ours compiles (torchtitan's ``compile``; Transformer Engine fuses
#: without it, and the nemo-te description is fitted to NeMo's own runs as they ran)
COMPILING_PEERS = ("torchtitan",)


def nemo_tp(context: int) -> int:
    """The tp NeMo's LLAMA2-7B long-sequence table runs at a sequence length (tp 1 at 4K, 2 at 16K-32K, 4 at
    64K-256K, 8 at 512K-1M: planner/cost/published_runs.py's NEMO_LONG rows)."""
    return 1 if context <= 8192 else 2 if context <= 32768 else 4 if context <= 262144 else 8


def competent_user_layouts(cm: AnalyticCostModel, context: int, tokens: int) -> dict[str, Layout]:
    """The static layout a competent user of each peer writes for a ``tokens``-token batch whose longest
    document is ``context`` (issue 51), checkpointing only where a stage needs it ("auto"):

    * every dp group holds at least one context row of the batch: ``tp * cp >= world * context / tokens``
      (else dp groups idle), and the layout holds the context (with or without full checkpointing);
    * ``torchtitan``: FSDP over the world, all-gather-KV (ring-like) cp, the smallest such cp;
    * ``megatron-te``: tp x ring-like cp with a replicated copy, tp from NeMo's long-sequence table
      (:func:`nemo_tp`, raised where the model does not fit, within a node), the smallest such cp.

    A kind without such a layout is left out."""
    world, node = cm.world_size, cm.hardware.devices_per_node
    need = max(1, math.ceil(world * context / max(tokens, 1)))
    out: dict[str, Layout] = {}

    def first(tps: Sequence[int], fsdp: bool) -> Layout | None:
        for tp in tps:
            if world % tp or node % tp:
                continue
            cp = 1
            while world % (tp * cp) == 0:
                lay = Layout(dp=world // (tp * cp), tp=tp, cp=cp, cp_kv=cp, fsdp=fsdp and world > 1)
                if tp * cp >= need and any(_holds(cm, lay, ac, context) for ac in (Checkpointing.NONE,
                                                                                   Checkpointing.FULL)):
                    return lay
                cp *= 2
        return None

    titan = first((1,), fsdp=True)
    if titan is not None:
        out["torchtitan"] = titan
    tps = [t for t in (1, 2, 4, 8, 16) if nemo_tp(context) <= t <= node]
    megatron = first(tps, fsdp=False)
    if megatron is not None:
        out["megatron-te"] = megatron
    return out


def _holds(cm: AnalyticCostModel, lay: Layout, ac: Checkpointing, context: int) -> bool:
    try:
        cm.check(lay)
        return cm.option(lay, ac).max_doc_length >= context
    except (CostModelError, LayoutError):
        return False


def user_model(cm: AnalyticCostModel, hardware: str, kind: str, compiles: bool) -> AnalyticCostModel:
    """The cost model a competent ``kind`` user's layout is priced on: the peer's runtime description
    (:data:`PEER_RUNTIMES`) on the cell's plain hardware profile, its GEMM side at the peer's own compile rate where
    ours compiles and the peer is one whose users compile (:data:`COMPILING_PEERS`): both sides turn on what
    their users would.

    Args:
        cm: ours' cost model (its model and world); hardware: the cell's profile name; kind: a user kind;
        compiles: whether ours runs compiled.
    """
    runtime = get_runtime(PEER_RUNTIMES[kind])
    profile = get_profile(hardware)
    if compiles and kind in COMPILING_PEERS:
        profile = compiled(profile, runtime)
    return AnalyticCostModel(cm.model, profile, cm.world_size, runtime=runtime)


def user_seconds(cm: AnalyticCostModel, lay: Layout, lengths: np.ndarray, planners: dict, runtime: str) -> float:
    """A user-written static layout's step on ``cm``'s runtime description and hardware profile, the planner's
    own checkpointing choice per stage (only where it must), the same packing and balancing as ours.

    Args:
        cm: the cost model to price on (:func:`user_model`, or ours'); lay: the user's layout; lengths: the
        batch's document lengths; planners: the cell's planner cache; runtime: the name ``cm`` is priced as in the
        cell (a peer's runtime or ``"hotspa"``: one cost model per name in a cell), the cache's key with ``lay``.
    """
    key = (lay, "user", runtime)
    if key not in planners:
        planners[key] = CostModelPlanner([lay], model=cm.model, hardware=cm.hardware, activation_checkpointing="auto",
                                         ladder=False, runtime=cm.runtime)
    return planners[key].solve(lengths)[0]
