"""Ours against the peers' published runs, same configuration, predicted (issue 51): before and after in one run.

Every row of :func:`lightning_hotspa.planner.cost.peer_rows.rows` (torchtitan, Megatron-LM, NeMo) is priced on
OUR runtime description in the peer's own layout, model, GPU count, sequence, batch, precision and hardware
profile, and divided by the peer's PUBLISHED tokens/s/GPU. Two columns, side by side from the same cost model:

- ``ours_over_peer``: ours with the options its users turn on for that configuration (``ours_options``: the
  fastest attention kernel ours runs on that GPU, torch.compile per block where the peer compiled (or fused, as
  Transformer Engine does), torchao
  FP8 tensorwise where the peer ran FP8; selective checkpointing priced as ours, the attention core);
- ``ours_over_peer_before``: ours as main described it before issue 51 (FlashAttention-2, eager, bf16);
- ``ours_over_peer_without_fp8``: the same options with ``strategy.runtime.fp8`` off (bf16), so the FP8 term reads
  side by side in one run;
- ``ours_over_peer_conservative``: the same options, FA3 priced at the fitted FA2 value x FA3 / FA2 of the
  kernels' own benchmarks (``hardware.FA3_OVER_FA2``) instead of the profile's entry (anchored on the cuDNN
  value fitted on NeMo's rows): the two fitted anchors disagree, so both are shown.

Every row, the compute issue's and the communication issue's (Megatron-LM's H100 tp1-tp8 rows, torchtitan's
70B 2D row with async TP) alike, is priced by ONE function (``peer_rows.price_ours``: checkpointing only as ours
needs it, ours' own optimizer step, compile offered where the peer compiled or fused and priced without tp
overlap as the strategy builds it, the faster of compiled and eager taken). ``peer_model_ratio``: the PEER's own
run on its runtime description over its published figure (the published-runs benchmark's number for that row, the
same ``price_run``; null for a column that table does not hold), so a ratio far from 1 can be read as the model's
error on the peer or ours' difference.

Predicted only: no GPU ran any of it. The last line printed is ONE JSON object: ``ours_over_peer``,
``ours_over_peer_before``, ``ours_options`` ({name: flags}), ``runs`` ({name: per-run detail}), ``targets``
({name: {value, target, met}}).

    python recipes/benchmark_peers.py           # every row
    python recipes/benchmark_peers.py --smoke   # two rows (the test's)
"""

from __future__ import annotations

import argparse
import json

from lightning_hotspa.planner.cost.peer_rows import BEFORE, peer_model_ratio, price_row, resolve_runs, rows

SMOKE_ROWS = ("torchtitan-8b-fsdp-compile-float8", "nemo-7b-fp8-long-min")


def main(argv: list[str] | None = None) -> dict:
    """Prices the rows, prints a table and the JSON line; returns the JSON object."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help=f"only {', '.join(SMOKE_ROWS)}")
    args = parser.parse_args(argv)
    selected = [r for r in rows() if not args.smoke or r.name in SMOKE_ROWS]
    out: dict = {"ours_over_peer": {}, "ours_over_peer_before": {}, "ours_over_peer_conservative": {},
                 "ours_over_peer_without_fp8": {}, "ours_options": {}, "peer_model_ratio": {}, "runs": {},
                 "targets": {}}
    print(f"{'row':40s} {'before':>7s} {'after':>7s} {'conserv':>7s} {'peer_mdl':>8s}  options (after)")
    for row in selected:
        after, before, low = price_row(row), price_row(row, BEFORE), price_row(row, conservative=True)
        worst = min(after["runs"], key=lambda r: r["ratio"])["id"]
        model = peer_model_ratio(next(r for r in resolve_runs(row) if r.id == worst))
        out["ours_over_peer"][row.name] = round(after["ratio"], 4)
        out["ours_over_peer_before"][row.name] = round(before["ratio"], 4)
        out["ours_over_peer_conservative"][row.name] = round(low["ratio"], 4)
        out["ours_over_peer_without_fp8"][row.name] = round(price_row(row, fp8=False)["ratio"], 4)
        out["ours_options"][row.name] = after["options"]
        out["peer_model_ratio"][row.name] = None if model is None else round(model, 4)
        out["runs"][row.name] = after["runs"]
        if row.target is not None:
            out["targets"][row.name] = {"value": round(after["ratio"], 4), "target": f">= {row.target}",
                                        "met": after["ratio"] >= row.target,
                                        "conservative": round(low["ratio"], 4)}
        print(f"{row.name:40s} {before['ratio']:7.3f} {after['ratio']:7.3f} {low['ratio']:7.3f} "
              f"{'-' if model is None else f'{model:.3f}':>8s}  {after['options']}"
              + ("" if all(r["fits_ours"] for r in after["runs"]) else "  (ours' memory model: does not fit)"))
    for name, t in out["targets"].items():
        print(f"target {name}: {t['value']} (want {t['target']}): {'met' if t['met'] else 'NOT met'}")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
