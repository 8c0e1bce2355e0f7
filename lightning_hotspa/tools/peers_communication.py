"""Our runtime against peers' published runs whose speed is mostly communication (issue 52).

For each peer row (Megatron-LM's H100 scaling table without pp, torchtitan's Llama 3 70B on FSDP 32 x
TP 8 with async TP: :mod:`~lightning_hotspa.planner.cost.published_runs`) this prices OUR runtime on
the same GPU, model, layout and global batch, with the options our users would turn on (the planner's
defaults: tp overlap and the overlapped dp reduction as the runtime runs them; activation checkpointing
only where the peer's micro-batch does not fit our memory without it, or where the peer runs it too),
end to end as the peers measure (our optimizer step included: Adam on the fp32 home shard, which is
split over the whole world), and divides by the peer's published tokens/s/GPU. ``before=True`` prices
the same with the terms issue 52 added switched off (tp collectives and the dp reduction fully
exposed): main's model, for the before / after table.

    python -m lightning_hotspa.tools.peers_communication
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from ..planner.cost.cost_model import AnalyticCostModel
from ..planner.cost.published_pricing import optimizer_seconds, parallelism_of, price_run
from ..planner.cost.published_runs import PUBLISHED_RUNS, TORCHTITAN_ASYNC_TP, PublishedRun
from ..planner.cost.runtime_profile import HOTSPA, RuntimeProfile

__all__ = ["PEERS", "communication_peer_rows", "ours_over_peer"]

_RUNS = {r.id: r for r in PUBLISHED_RUNS}
#: torchtitan's 2D row with async TP on (the same table's 'Async TP tokens/sec' column)
TITAN_70B_ASYNC_TP = dataclasses.replace(
    _RUNS["titan-70b-fsdp32-tp8"], id="titan-70b-fsdp32-tp8-async-tp", tokens_per_s_per_gpu=652.4,
    source=TORCHTITAN_ASYNC_TP.replace("Vanilla TP", "Async TP").format(
        table="Llama3 70b on 256 H100s table", size="70b") + " ('Async TP tokens/sec' 652.4)")

#: name -> the peer's published run
PEERS: dict[str, PublishedRun] = {
    **{f"megatron-h100-tp{tp}": _RUNS[f"megatron-h100-tp{tp}"] for tp in (1, 2, 4, 8)},
    "torchtitan-70b-fsdp32-tp8": TITAN_70B_ASYNC_TP,
}


def _runtime(before: bool) -> RuntimeProfile:
    """Ours, or ours with issue 52's terms off (main's model: tp and dp communication fully exposed)."""
    if not before:
        return HOTSPA
    return dataclasses.replace(HOTSPA, name="hotspa-before-52", tp_comm_overlap=False, dp_reduce_overlap=False)


def ours_over_peer(peer: PublishedRun, before: bool = False) -> tuple[float, dict[str, Any]]:
    """(our predicted tokens/s/GPU over the peer's published figure, the options we priced): the faster
    of keeping the gathered region inputs (``HotSPaStrategy(tp_regather=False)``, where the peer's
    micro-batch still fits our memory) and the default re-gather.

    Args:
        peer: the peer's run.
        before: price with issue 52's terms off (main's model: the re-gather always).
    """
    options = [_priced(peer, _runtime(before))]
    if not before and peer.tp > 1:
        kept = _priced(peer, dataclasses.replace(HOTSPA, tp_regather=False))
        if kept[1]["fits_our_memory"]:
            options.append(kept)
    return max(options, key=lambda o: o[0])


def _priced(peer: PublishedRun, runtime: RuntimeProfile) -> tuple[float, dict[str, Any]]:
    """:func:`ours_over_peer` for one runtime description."""
    cm = AnalyticCostModel(peer.model, peer.gpu, peer.world, runtime=runtime)
    par = parallelism_of(peer)
    tokens = peer.micro_batch * peer.seq_len
    ac = "full" if peer.checkpointing == "full" or cm.capacity(par, False) < tokens else "none"
    ours = dataclasses.replace(peer, system="hotspa", checkpointing=ac)
    priced = price_run(ours, lambda _: cm)
    # our optimizer: the fp32 home shard over the whole world (price_run charges the replicated copy's over tp)
    own_optimizer = cm.params / peer.world * runtime.optimizer_bytes_per_param / cm.hardware.hbm_bandwidth
    step = priced.step_s - optimizer_seconds(ours, cm) + own_optimizer
    predicted = peer.dp * peer.grad_accum * tokens / (step * peer.world)
    options = {"layout": par.name, "activation_checkpointing": ac, "micro_batch_tokens": tokens,
               "fits_our_memory": cm.capacity(par, ac == "full") >= tokens, "tp_overlap": runtime.tp_comm_overlap,
               "dp_reduce_overlap": runtime.dp_reduce_overlap, "tp_regather": runtime.tp_regather,
               "attention": runtime.attention_kernel}
    return predicted / peer.tokens_per_s_per_gpu, options


def communication_peer_rows(before: bool = False) -> dict[str, dict[str, Any]]:
    """``{name: {"ours_over_peer": float, "ours_options": dict, "peer_tokens_per_s_per_gpu": float,
    "source": str}}`` for every name of :data:`PEERS`.

    Args:
        before: price with issue 52's terms off (main's model).
    """
    out = {}
    for name, peer in PEERS.items():
        ratio, options = ours_over_peer(peer, before)
        out[name] = {"ours_over_peer": ratio, "ours_options": options,
                     "peer_tokens_per_s_per_gpu": peer.tokens_per_s_per_gpu, "source": peer.source}
    return out


if __name__ == "__main__":
    before, after = communication_peer_rows(before=True), communication_peer_rows()
    for name in PEERS:
        print(f"{name:28s} before {before[name]['ours_over_peer']:.3f}  after {after[name]['ours_over_peer']:.3f}  "
              f"{after[name]['ours_options']}")
    print(json.dumps({name: {"before": before[name]["ours_over_peer"], "after": after[name]["ours_over_peer"]}
                      for name in PEERS}))
