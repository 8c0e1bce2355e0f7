"""Our runtime against the communication-bound peer rows (issue 52): Megatron-LM's H100 scaling table
without pp and torchtitan's 70B FSDP 32 x TP 8 with async TP, priced before and after the issue's terms."""

from __future__ import annotations

import pytest

from lightning_hotspa.planner.cost.peer_rows import (
    OursOptions,
    communication_rows,
    matching_options,
    option_space,
    price_ours,
    price_row,
    resolve_runs,
)
from lightning_hotspa.planner.cost.published_runs import PUBLISHED_RUNS, megatron_flops_per_token
from lightning_hotspa.tools.peers_communication import PEERS, communication_peer_rows

NAMES = ["megatron-h100-tp1", "megatron-h100-tp2", "megatron-h100-tp4", "megatron-h100-tp8",
         "torchtitan-70b-fsdp32-tp8"]


@pytest.fixture(scope="module")
def rows():
    return communication_peer_rows(), communication_peer_rows(before=True)


def test_every_peer_name_has_a_ratio_our_options_and_a_cited_figure(rows):
    after, before = rows
    assert list(after) == list(before) == NAMES
    for name in NAMES:
        row = after[name]
        assert row["ours_over_peer"] > 0 and row["peer_tokens_per_s_per_gpu"] > 0
        assert " @ " in row["source"], row["source"]  # repository @ commit
        assert {"attention_backend", "compile_blocks", "tp_overlap", "tp_regather"} <= set(row["ours_options"])
        assert row["checkpointing"] in ("none", "selective", "full")
    assert after["torchtitan-70b-fsdp32-tp8"]["peer_tokens_per_s_per_gpu"] == 652.4  # the async TP column
    assert "Async TP" in after["torchtitan-70b-fsdp32-tp8"]["source"]


def test_the_communication_terms_raise_ours_more_as_tp_grows(rows):
    """Before (tp collectives and the dp reduction fully exposed, main's model) the ratio falls with tp;
    issue 52's terms alone (tp overlap, the reduction priced as it runs; FA2, eager, the re-gather: nothing
    else changed) raise it, the more the wider tp is."""
    after, before = rows
    comm = {row.name: price_row(row, OursOptions())["ratio"] for row in communication_rows()}
    gains = [comm[n] / before[n]["ours_over_peer"] for n in NAMES[:4]]
    assert [before[n]["ours_over_peer"] for n in NAMES[:4]] == sorted((before[n]["ours_over_peer"]
                                                                       for n in NAMES[:4]), reverse=True)
    assert gains == sorted(gains) and gains[0] >= 1.0 and gains[-1] > 1.3, gains
    assert comm[NAMES[4]] > before[NAMES[4]]["ours_over_peer"]
    assert not before[NAMES[3]]["ours_options"]["tp_overlap"]
    # the priced options are the best of what ours may run: never below the communication terms alone
    assert all(after[n]["ours_over_peer"] >= comm[n] for n in NAMES)


def test_one_pricing_compile_is_never_priced_with_tp_overlap():
    """The strategy builds tp's plain collectives under compile_blocks: no priced option has both, and a row's
    ratio is the best of its option space (the faster of compiled and eager with tp overlap)."""
    for row in communication_rows():
        run = resolve_runs(row)[0]
        space = option_space(run)
        assert all(not (o.compiled and o.tp_overlap) for o in space)
        assert {o.compiled for o in space} == ({True, False} if matching_options(run).compiled else {False})
        best = max(price_ours(run, o).predicted for o in space if o.tp_regather or price_ours(run, o).fits_ours)
        assert price_row(row)["ratio"] == pytest.approx(best / run.tokens_per_s_per_gpu, rel=1e-12)


def test_megatron_rows_are_the_tables_figures_in_tokens():
    """tokens/s/GPU = the table's teraFLOP/s over Megatron's model-FLOPs formula (1.7B: 408.8 TFLOP/s)."""
    run = {r.id: r for r in PUBLISHED_RUNS}["megatron-h100-tp1"]
    assert run.tokens_per_s_per_gpu == pytest.approx(408.8e12 / megatron_flops_per_token(2048, 24, 4096, 131072))
    assert PEERS["megatron-h100-tp8"].tp == 8 and PEERS["megatron-h100-tp8"].world == 384
    # the formula: 72 l h^2 (1 + s/6h + V/12lh), e.g. 24 layers of width 2048 at 4K with a 128K vocabulary
    assert megatron_flops_per_token(2048, 24, 4096, 131072) == pytest.approx(
        72 * 24 * 2048**2 * (1 + 4096 / (6 * 2048) + 131072 / (12 * 24 * 2048)))


def test_the_long_grid_before_issue_52_prices_ours_with_every_communication_term_exposed_and_restores_it():
    from lightning_hotspa.planner.cost.cost_model import AnalyticCostModel
    from lightning_hotspa.planner.cost.runtime_profile import HOTSPA, RUNTIME_PROFILES
    from lightning_hotspa.tools.long_grid_communication import BEFORE_52, ours_described_as

    assert not (BEFORE_52.tp_comm_overlap or BEFORE_52.cp_comm_overlap or BEFORE_52.dp_reduce_overlap)
    assert BEFORE_52.kv_gather_recomputes_attention and HOTSPA.tp_comm_overlap and HOTSPA.dp_reduce_overlap
    shipped = RUNTIME_PROFILES["hotspa"]
    with ours_described_as(BEFORE_52):
        inside = AnalyticCostModel("llama7b", "H100", 8).runtime
    assert inside.name == "hotspa" and not inside.tp_comm_overlap and inside.kv_gather_recomputes_attention
    assert RUNTIME_PROFILES["hotspa"] is shipped
    with pytest.raises(RuntimeError, match="boom"), ours_described_as(BEFORE_52):
        raise RuntimeError("boom")
    assert RUNTIME_PROFILES["hotspa"] is shipped  # restored on an error too


def test_the_long_grid_smoke_cell_before_and_after_issue_52_moves_only_ours(tmp_path):
    from lightning_hotspa.tools.long_grid_communication import main

    out = main(["--grid", "smoke", "--batches", "1", "--out", str(tmp_path / "smoke")])
    before, after = out["before"], out["after"]
    assert (tmp_path / "smoke-before.json").is_file() and (tmp_path / "smoke-after.json").is_file()
    for k in ("megatron-te", "torchtitan"):  # the user's layouts on the peers' own runtime: only ours moved
        assert after["competent_user_static"][k] != before["competent_user_static"][k]
    import json

    full = {s: json.loads((tmp_path / f"smoke-{s}.json").read_text())["cells"][0] for s in ("before", "after")}
    for k in ("megatron-te", "torchtitan"):
        peer = [full[s]["competent_user_static"][k]["seconds_on_peer_runtime"] for s in ("before", "after")]
        assert peer[0] == peer[1]
    assert full["before"]["ours_s"] > full["after"]["ours_s"]  # exposed communication costs ours time
