"""Ours against the peers' published runs, same configuration, predicted (issue 51): before and after in one run.

Every row of :func:`lightning_hotspa.planner.cost.peer_rows.rows` (torchtitan, Megatron-LM, NeMo) is priced on
OUR runtime description in the peer's own layout, model, GPU count, sequence, batch, precision and hardware
profile, and divided by the peer's PUBLISHED tokens/s/GPU. Two columns, side by side from the same cost model:

- ``ours_over_peer``: ours with the options its users turn on for that configuration (``ours_options``: the
  fastest attention kernel ours runs on that GPU, torch.compile per block where the peer compiled (or fused, as
  Transformer Engine does), torchao
  FP8 tensorwise where the peer ran FP8; selective checkpointing priced as ours, the attention core);
- ``ours_over_peer_before``: ours as main described it before issue 51 (FlashAttention-2, eager, bf16);
- ``ours_over_peer_without_fp8``: the same options with ``strategy.fp8`` off (bf16), so the FP8 term reads
  side by side in one run;
- ``ours_over_peer_conservative``: the same options, FA3 priced at the fitted FA2 value x FA3 / FA2 of the
  kernels' own benchmarks (``hardware.FA3_OVER_FA2``) instead of the profile's entry (anchored on the cuDNN
  value fitted on NeMo's rows): the two fitted anchors disagree, so both are shown.

The communication issue's rows (Megatron-LM's H100 tp1-tp8 rows, torchtitan's 70B 2D row with async TP:
:func:`lightning_hotspa.tools.peers_communication.communication_peer_rows`) are priced by that module's own path
(ours' default overlaps, checkpointing only where needed, FA2, eager) and join the same keys; their ``before`` is
the same runtime with tp and dp communication fully exposed, and they have no conservative column.

Predicted only: no GPU ran any of it. The last line printed is ONE JSON object: ``ours_over_peer``,
``ours_over_peer_before``, ``ours_options`` ({name: flags}), ``runs`` ({name: per-run detail}), ``targets``
({name: {value, target, met}}).

    python recipes/benchmark_peers.py           # every row
    python recipes/benchmark_peers.py --smoke   # two rows (the test's)
"""

from __future__ import annotations

import argparse
import json

from lightning_hotspa.planner.cost.peer_rows import BEFORE, price_row, rows
from lightning_hotspa.tools.peers_communication import communication_peer_rows

SMOKE_ROWS = ("torchtitan-8b-fsdp-compile-float8", "nemo-7b-fp8-long-min")


def main(argv: list[str] | None = None) -> dict:
    """Prices the rows, prints a table and the JSON line; returns the JSON object."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help=f"only {', '.join(SMOKE_ROWS)}")
    args = parser.parse_args(argv)
    selected = [r for r in rows() if not args.smoke or r.name in SMOKE_ROWS]
    out: dict = {"ours_over_peer": {}, "ours_over_peer_before": {}, "ours_over_peer_conservative": {},
                 "ours_over_peer_without_fp8": {},
                 "ours_options": {}, "runs": {}, "targets": {}}
    print(f"{'row':40s} {'before':>7s} {'after':>7s} {'conserv':>7s}  options (after)")
    for row in selected:
        after, before, low = price_row(row), price_row(row, BEFORE), price_row(row, conservative=True)
        out["ours_over_peer"][row.name] = round(after["ratio"], 4)
        out["ours_over_peer_before"][row.name] = round(before["ratio"], 4)
        out["ours_over_peer_conservative"][row.name] = round(low["ratio"], 4)
        out["ours_over_peer_without_fp8"][row.name] = round(price_row(row, fp8=False)["ratio"], 4)
        out["ours_options"][row.name] = after["options"]
        out["runs"][row.name] = after["runs"]
        if row.target is not None:
            out["targets"][row.name] = {"value": round(after["ratio"], 4), "target": f">= {row.target}",
                                        "met": after["ratio"] >= row.target,
                                        "conservative": round(low["ratio"], 4)}
        print(f"{row.name:40s} {before['ratio']:7.3f} {after['ratio']:7.3f} {low['ratio']:7.3f}  {after['options']}"
              + ("" if all(r["fits_ours"] for r in after["runs"]) else "  (ours' memory model: does not fit)"))
    if not args.smoke:
        before, after = communication_peer_rows(before=True), communication_peer_rows()
        for name, row in after.items():
            out["ours_over_peer"][name] = round(row["ours_over_peer"], 4)
            out["ours_over_peer_before"][name] = round(before[name]["ours_over_peer"], 4)
            out["ours_options"][name] = row["ours_options"]
            target = 1.0 if name.startswith("torchtitan") else 0.9
            out["targets"][name] = {"value": round(row["ours_over_peer"], 4), "target": f">= {target}",
                                    "met": row["ours_over_peer"] >= target}
            print(f"{name:40s} {before[name]['ours_over_peer']:7.3f} {row['ours_over_peer']:7.3f} {'-':>7s}  "
                  f"{row['ours_options']}")
    for name, t in out["targets"].items():
        print(f"target {name}: {t['value']} (want {t['target']}): {'met' if t['met'] else 'NOT met'}")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
