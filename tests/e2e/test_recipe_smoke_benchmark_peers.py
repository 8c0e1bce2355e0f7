"""recipes/benchmark_peers.py --smoke: its JSON keys, before / after / conservative side by side, the options
named per row, and a row provider's rows priced beside the compute rows (the communication issue's hook)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("benchmark_peers", ROOT / "recipes" / "benchmark_peers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_prints_one_json_line_with_the_issue_keys(bench, capsys):
    out = bench.main(["--smoke"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == json.loads(json.dumps(out))
    names = set(bench.SMOKE_ROWS)
    for key in ("ours_over_peer", "ours_over_peer_before", "ours_over_peer_conservative", "ours_over_peer_without_fp8",
                "ours_options", "peer_model_ratio"):
        assert set(out[key]) == names, key
    assert set(out["targets"]) == names and all({"value", "target", "met"} <= set(t) for t in out["targets"].values())
    flags = out["ours_options"]["torchtitan-8b-fsdp-compile-float8"]
    # ours turns strategy.runtime.fp8 on against the peer's Float8 run; FP8 is what separates it from the bf16 column
    assert flags["fp8"] == "tensorwise" and flags["attention_backend"] == "fa3_varlen", flags
    for name in names:
        assert out["ours_over_peer_without_fp8"][name] < out["ours_over_peer"][name], name
    # the peer's own run on its runtime over its published figure: the published-runs benchmark's number
    assert 0.5 < out["peer_model_ratio"]["torchtitan-8b-fsdp-compile-float8"] < 2
    # before: FA2, eager, bf16, communication exposed: the options move the ratio; the conservative FA3 between
    row = "torchtitan-8b-fsdp-compile-float8"
    assert out["ours_over_peer_before"][row] < out["ours_over_peer_conservative"][row] < out["ours_over_peer"][row]
    # the long-sequence minimum is the minimum over NeMo's >= 16K rows
    runs = out["runs"]["nemo-7b-fp8-long-min"]
    assert len(runs) == 7 and out["ours_over_peer"]["nemo-7b-fp8-long-min"] == round(min(r["ratio"] for r in runs), 4)


def test_a_row_provider_adds_rows_and_bad_rows_name_the_value(bench, monkeypatch):
    from lightning_hotspa.planner.cost import peer_rows
    from lightning_hotspa.planner.cost.peer_rows import OursOptions, PeerRow

    def extra():
        return [PeerRow("extra-eager-fa2", ("titan-8b-fsdp8",), options=lambda run: OursOptions())]

    monkeypatch.setattr(peer_rows, "ROW_PROVIDERS", [*peer_rows.ROW_PROVIDERS, extra])
    assert "extra-eager-fa2" in {r.name for r in peer_rows.rows()}
    priced = peer_rows.price_row(PeerRow("x", ("titan-8b-fsdp8",), options=lambda run: OursOptions()))
    assert priced["ratio"] == peer_rows.price_row(PeerRow("y", ("titan-8b-fsdp8",)), peer_rows.BEFORE)["ratio"]
    with pytest.raises(ValueError, match="unknown published runs \\['nope'\\]"):
        peer_rows.price_row(PeerRow("bad", ("nope",)))
    monkeypatch.setattr(peer_rows, "ROW_PROVIDERS", [*peer_rows.ROW_PROVIDERS, extra, extra])
    with pytest.raises(ValueError, match="repeat names \\['extra-eager-fa2'\\]"):
        peer_rows.rows()
