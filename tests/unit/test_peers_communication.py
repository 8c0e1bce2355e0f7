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
