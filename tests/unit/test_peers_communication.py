"""Our runtime against the communication-bound peer rows (issue 52): Megatron-LM's H100 scaling table
without pp and torchtitan's 70B FSDP 32 x TP 8 with async TP, priced before and after the issue's terms."""

from __future__ import annotations

import pytest

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
        assert {"layout", "activation_checkpointing", "tp_overlap", "tp_regather"} <= set(row["ours_options"])
    assert after["torchtitan-70b-fsdp32-tp8"]["peer_tokens_per_s_per_gpu"] == 652.4  # the async TP column
    assert "Async TP" in after["torchtitan-70b-fsdp32-tp8"]["source"]


def test_the_communication_terms_raise_ours_more_as_tp_grows(rows):
    """Before (tp collectives and the dp reduction fully exposed, main's model) the ratio falls with tp;
    the issue's terms (tp overlap, the reduction priced as it runs, the kept gathered inputs) raise it,
    the more the wider tp is."""
    after, before = rows
    gains = [after[n]["ours_over_peer"] / before[n]["ours_over_peer"] for n in NAMES[:4]]
    assert [before[n]["ours_over_peer"] for n in NAMES[:4]] == sorted((before[n]["ours_over_peer"]
                                                                       for n in NAMES[:4]), reverse=True)
    assert gains == sorted(gains) and gains[0] >= 1.0 and gains[-1] > 1.3, gains
    assert after[NAMES[4]]["ours_over_peer"] > before[NAMES[4]]["ours_over_peer"]
    assert not before[NAMES[3]]["ours_options"]["tp_overlap"] and after[NAMES[3]]["ours_options"]["tp_overlap"]


def test_megatron_rows_are_the_tables_figures_in_tokens():
    """tokens/s/GPU = the table's teraFLOP/s over Megatron's model-FLOPs formula (1.7B: 408.8 TFLOP/s)."""
    run = {r.id: r for r in PUBLISHED_RUNS}["megatron-h100-tp1"]
    assert run.tokens_per_s_per_gpu == pytest.approx(408.8e12 / megatron_flops_per_token(2048, 24, 4096, 131072))
    assert PEERS["megatron-h100-tp8"].tp == 8 and PEERS["megatron-h100-tp8"].world == 384
    # the formula: 72 l h^2 (1 + s/6h + V/12lh), e.g. 24 layers of width 2048 at 4K with a 128K vocabulary
    assert megatron_flops_per_token(2048, 24, 4096, 131072) == pytest.approx(
        72 * 24 * 2048**2 * (1 + 4096 / (6 * 2048) + 131072 / (12 * 24 * 2048)))
