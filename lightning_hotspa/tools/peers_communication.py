"""Our runtime against peers' published runs whose speed is mostly communication (issue 52): the rows of
:func:`lightning_hotspa.planner.cost.peer_rows.communication_rows`, priced by the one peer pricing
(:func:`~lightning_hotspa.planner.cost.peer_rows.price_row`, as ``recipes/benchmark_peers.py`` prices them).

``before=True`` prices ours as main described it before issues 51 and 52 (``peer_rows.BEFORE``).

    python -m lightning_hotspa.tools.peers_communication
"""

from __future__ import annotations

import json
from typing import Any

from ..planner.cost.peer_rows import BEFORE, communication_rows, price_row

__all__ = ["PEERS", "communication_peer_rows"]

def _runs() -> dict:
    from ..planner.cost.published_runs import PUBLISHED_RUNS

    known = {r.id: r for r in PUBLISHED_RUNS}
    return {row.name: known[row.run_ids[0]] if isinstance(row.run_ids[0], str) else row.run_ids[0]
            for row in communication_rows()}


#: name -> the peer's published run
PEERS = _runs()


def communication_peer_rows(before: bool = False) -> dict[str, dict[str, Any]]:
    """``{name: {"ours_over_peer", "ours_options", "checkpointing", "peer_tokens_per_s_per_gpu", "source"}}`` for
    every name of :data:`PEERS` (``before``: ours as main described it before issues 51 and 52)."""
    out = {}
    for row in communication_rows():
        priced = price_row(row, BEFORE if before else None)
        run = PEERS[row.name]
        out[row.name] = {"ours_over_peer": priced["ratio"], "ours_options": priced["options"],
                         "checkpointing": priced["runs"][0]["checkpointing"],
                         "peer_tokens_per_s_per_gpu": run.tokens_per_s_per_gpu, "source": run.source}
    return out


if __name__ == "__main__":
    before, after = communication_peer_rows(before=True), communication_peer_rows()
    for name in PEERS:
        print(f"{name:28s} before {before[name]['ours_over_peer']:.3f}  after {after[name]['ours_over_peer']:.3f}  "
              f"{after[name]['ours_options']}")
    print(json.dumps({name: {"before": before[name]["ours_over_peer"], "after": after[name]["ours_over_peer"]}
                      for name in PEERS}))
