"""The long-context grid's invariants, the frozen hardware profiles it prices, and how the cost
model prices the context-parallel kinds."""

import itertools
import json
import math

import numpy as np
import pytest

from lightning_hotspa.layout import Layout
from lightning_hotspa.planner.cost.cost_model import AnalyticCostModel, CostModelError
from lightning_hotspa.planner.cost.hardware import PROFILES
from lightning_hotspa.planner.cost.peer_rows import OursOptions
from lightning_hotspa.planner.solve.oracle_bound import exclusive_seconds, oracle_assignment
from lightning_hotspa.planner.solve.solver import CostModelPlanner
from lightning_hotspa.tools.competent_user import PEER_RUNTIMES, competent_user_layouts, nemo_tp
from lightning_hotspa.tools.long_grid import (
    SMOKE_GRID,
    candidate_summary,
    guarded_bound,
    long_cell,
    long_grid,
    oracle_seconds,
    token_batch,
)
from lightning_hotspa.tools.long_grid_options import SIDES, side_by_side
from lightning_hotspa.tools.oracles import LADDER, charged_oracle

# Frozen before the long grid was first run: the simulator must not be tuned to its own targets. Changing a
# number here needs a before/after table (BENCHMARKS.md). Re-frozen when the cost model was calibrated: the GEMM
# curve and attention efficiency FITTED to published runs (recipes/benchmark_published.py, docs/cost-model.md),
# the NIC count read into the inter-node bandwidth (HardwareProfile.bandwidth). 2026-12-02: gemm_half_width 478
# -> 476, the refit once the published rows' optimizer step was priced (before/after long grid:
# benchmarks/2026-12-02-published.md). 2026-12-03: a cuDNN (Transformer Engine) entry added for the NeMo cp rows;
# the long grid prices fa2, so it is unmoved (before/after: benchmarks/2026-12-03-published-cp.md). 2026-12-06: an
# FA3 entry (issue 51, the FA3 paper's FA3 / cuDNN ratio); ours prices fa2 by default, so the grid is unmoved by it.
# Then cuDNN 0.578 -> 0.585 and FA3 0.636 -> 0.644 (x 1.10), refitted once the dp reduction (only what the
# last backward cannot hide) and the KV ring (its last dK / dV shift exposed) were priced (fa2 unmoved).
# 2026-12-07: attention priced by call length (half lengths from the FA3 paper's curves); the refit moved the GEMM
# curve 0.507 / 476 -> 0.508 / 409, cuDNN 0.585 -> 0.591, FA3 = cuDNN x 1.11 = 0.656 (before/after long grid:
# benchmarks/2026-12-07-attention-length.md).
_HOPPER = dict(peak_flops=989e12, dense_efficiency=0.508, gemm_half_width=409.0, attention_efficiency=0.175,
               attention_kernels=(("fa2", 128, 0.175), ("cudnn", 128, 0.591), ("fa3", 128, 0.656)),
               attention_half_lengths=(("fa2", 314.0), ("cudnn", 392.0), ("fa3", 493.0)), attention_half_length=314.0,
               intra_node_bw=360e9, inter_node_bw=45e9, devices_per_node=8)
FROZEN = {
    "H100": dict(**_HOPPER, memory_bytes=80 * 2**30),
    "H200": dict(**_HOPPER, memory_bytes=141e9),
}


@pytest.mark.parametrize("name", sorted(FROZEN))
def test_hardware_profiles_are_frozen(name):
    profile = PROFILES[name]
    assert {k: getattr(profile, k) for k in FROZEN[name]} == FROZEN[name]


def test_smoke_grid_cells_respect_the_oracle_bound():
    result = long_grid(SMOKE_GRID, batches=1, breakdown=True)
    for key in ("cells", "geomean_where_oracle_ge_1_4", "min_captured", "seconds"):
        assert key in result
    (cell,) = result["cells"]
    assert cell["feasible"]
    for key in ("model", "gpus", "context", "data", "ours_over_static", "oracle_over_static", "captured"):
        assert key in cell
    # the oracle relaxes every constraint a real plan has: it is never slower than ours or static
    assert cell["oracle_over_static"] >= max(1.0, cell["ours_over_static"]) - 1e-9
    assert cell["megatron_rows_s"] >= cell["oracle_s"]
    # the ladder tightens one relaxation at a time down to the real plans (speed-ups over static)
    b = cell["breakdown"]
    assert b["oracle"] == pytest.approx(cell["oracle_over_static"], rel=1e-12)
    steps = [b[k] for k in (*LADDER, "ours_margin0")]
    assert all(x >= y * (1 - 1e-9) for x, y in zip(steps, steps[1:])), b
    assert b["ours_margin0"] >= b["ours"] * (1 - 1e-9) and b["ours"] == pytest.approx(cell["ours_over_static"])
    # no guarded plan beats the guarded bound; it is never above the bound it guards
    assert b["ours"] <= b["guarded_bound"] * (1 + 1e-9) and b["guarded_bound"] <= b["exclusive"] * (1 + 1e-9)
    assert set(result["breakdown_summary"]) == set(b)
    assert result["geomean_ours"] == pytest.approx(b["ours"])
    assert result["geomean_bound_candidates"] == pytest.approx(b["candidates"])
    assert set(result["captured_of_candidates"]) <= {"H100 llama3-8b 16 64K github"}


def _two_level_optimum(world_s: np.ndarray, half_s: np.ndarray) -> float:
    """The best plan of documents that each run on the whole world (``world_s`` seconds, alone) or
    on one of its two halves (``half_s``, the halves side by side): every assignment tried."""
    best = math.inf
    for where in itertools.product((0, 1, 2), repeat=world_s.size):
        where = np.array(where)
        halves = [float(half_s[where == h].sum()) for h in (1, 2)]
        best = min(best, float(world_s[where == 0].sum()) + max(halves))
    return best


def test_the_exclusive_bound_is_a_lower_bound_that_sees_world_wide_documents_run_alone():
    """:func:`exclusive_seconds`: a document on a one-group (world-wide) layout runs while nothing
    else does. A 10 s document only the world finishes in time and a 5 s (world) / 8 s (half) one:
    the oracle overlaps them (14 s), a plan cannot (15 s). On random two-level instances it is
    never above the best plan (brute force) and never below the oracle; without a one-group layout
    it is the oracle."""
    alone = np.array([[10.0, 5.0], [30.0, 8.0]])  # rows: world (dp 1), half (dp 2)
    dp = np.array([1.0, 2.0])
    assert oracle_assignment(alone / dp[:, None], dp)[0] == pytest.approx(14.0)
    assert exclusive_seconds(alone / dp[:, None], dp) == pytest.approx(15.0)
    rng = np.random.default_rng(0)
    tighter = 0
    for _ in range(200):
        n = int(rng.integers(1, 6))
        world_s = rng.uniform(1.0, 10.0, n)
        half_s = world_s * rng.uniform(1.2, 4.0, n)  # a half is slower, at most 4x
        half_s[rng.random(n) < 0.2] = np.inf  # some only the whole world holds
        rates = np.stack([world_s, half_s / 2])
        bound, loose = exclusive_seconds(rates, dp), oracle_assignment(rates, dp)[0]
        assert loose <= bound * (1 + 1e-9) and bound <= _two_level_optimum(world_s, half_s) * (1 + 1e-6)
        tighter += bound > loose * (1 + 1e-6)
    assert tighter > 20  # it is tighter in many of them
    halves = np.array([[4.0, 6.0, 1.0]]) / 2
    assert exclusive_seconds(halves, np.array([2.0])) == oracle_assignment(halves, np.array([2.0]))[0]


def test_the_guarded_bound_is_the_bound_only_where_it_clears_the_margin():
    assert guarded_bound(10.0, 12.0, 0.138) == 10.0  # a plan at the bound gains 20 %: it may run
    assert guarded_bound(10.0, 11.0, 0.138) == 11.0  # at most 10 %, under 13.8 %: the single layout runs
    assert guarded_bound(10.0, 11.0, 0.0) == 10.0


def test_candidate_summary_says_what_ours_captures_of_its_own_candidates_bound():
    """Per cell whose candidates bound is >= 1.05x: (ours - 1) / (bound - 1); geomeans over every
    cell; the worst of ours over the candidate set's best static layout."""
    def cell(hw, bound, ours, own_static):
        return {"hardware": hw, "model": "m", "gpus": 8, "context": 32768, "data": "d",
                "breakdown": {"candidates": bound, "ours": ours, "candidate_static": own_static}}

    out = candidate_summary([cell("H100", 1.2, 1.1, 1.0), cell("H200", 1.04, 1.0, 0.98), cell("A100", 1.1, 1.08, 1.0)])
    assert out["captured_of_candidates"] == pytest.approx({"H100 m 8 32K d": 0.5, "A100 m 8 32K d": 0.8})
    assert out["mean_captured_of_candidates"] == pytest.approx(0.65)
    assert out["geomean_ours"] == pytest.approx((1.1 * 1.0 * 1.08) ** (1 / 3))
    assert out["geomean_bound_candidates"] == pytest.approx((1.2 * 1.04 * 1.1) ** (1 / 3))
    assert out["min_ours_over_candidate_static"] == pytest.approx(1.0 / 0.98)


def test_the_charged_oracle_bounds_a_single_layout_plan():
    """One layout: the step is at least its documents' balanced work (or its longest document on one
    dp group), then its gradient reduction; the real plan of that layout is no faster."""
    cm = AnalyticCostModel("llama7b", "H100", 32)
    work_bound = token_batch("commoncrawl", 131072, 32 * 16384, 0)
    one_long = np.concatenate([[120000], np.full(100, 1000)])  # the 120K document sets the step
    for name, lengths in (("dp16xtp2", work_bound), ("dp4xtp4xcp2", work_bound), ("dp4xtp4xcp2", one_long)):
        lay = Layout.parse(name)
        bound = charged_oracle(cm, lengths, [lay], switches=False)
        assert bound == pytest.approx(oracle_seconds(cm, lengths, [lay], fixed=0.0) + cm.grad_reduce_seconds(lay))
        with_switch = charged_oracle(cm, lengths, [lay], switches=True)
        assert with_switch == pytest.approx(bound + cm.switch_seconds(None, lay))
        real = CostModelPlanner([lay], model="llama7b", hardware="H100").solve(lengths)[0]
        assert with_switch <= real * (1 + 1e-9) and real <= with_switch * 1.05  # within 5 %: packing only


def test_cost_model_prices_the_kv_ring_against_ulysses():
    """The KV ring re-runs no attention (the same quadratic as Ulysses) and hides its exchange behind
    each ring step's attention: a 128K document pays none of it, a 2K one some (max(0, x s - h s^2));
    Ulysses' all-to-alls are never hidden. Per rank the ring receives (cp-1)/cp of the sequence's K/V
    three times (forward, and K/V plus dK/dV backward) where Ulysses moves (cp-1)/cp of s/cp x (2 h + 2 kv)
    twice: with 8 kv heads of 32 the ring moves fewer bytes at small cp (here 2). cp beyond the heads:
    KV part only."""
    cm = AnalyticCostModel("llama3-8b", "H100", 64)
    ulysses = cm.option(Layout(dp=2, tp=2, cp=16), False)
    kv = cm.option(Layout(dp=2, tp=2, cp=16, cp_kv=16), False)
    hybrid = cm.option(Layout(dp=2, tp=2, cp=16, cp_kv=4), False)
    assert kv.quadratic == ulysses.quadratic == hybrid.quadratic  # nothing recomputed in backward
    assert kv.ring_exchange > 0 and ulysses.ring_exchange == 0
    # the exchanges (linear less the short-call attention term): the ring's cheapest, Ulysses' dearest
    assert kv.linear - kv.attention_linear < hybrid.linear - hybrid.attention_linear < \
        ulysses.linear - ulysses.attention_linear
    # while a ring splits a document's query rows cp_kv ways: cp_kv x the short-call attention term
    assert kv.attention_linear == pytest.approx(16 * ulysses.attention_linear) == \
        pytest.approx(4 * hybrid.attention_linear)
    long, short = np.array([131072.0]), np.array([2048.0])
    assert kv.doc_seconds(long) == pytest.approx((kv.quadratic * long + kv.linear) * long)  # hidden
    assert kv.doc_seconds(short) > (kv.quadratic * short + kv.linear) * short  # short: partly exposed
    # its exchange hidden, the ring beats Ulysses' exposed all-to-alls, but its 16-way split of the query rows
    # (8K-row calls at 128K: ~4 % below the kernel's long-sequence rate) costs more than they do here
    gap = kv.doc_seconds(long) - ulysses.doc_seconds(long)
    assert gap - (kv.attention_linear - ulysses.attention_linear) * long < 0 < gap
    small_u, small_kv = (cm.option(Layout(dp=4, tp=8, cp=2, cp_kv=k), False) for k in (1, 2))  # crosses nodes
    # linear = attention (== quadratic, + its short-call term) + dense + comm
    comm_u = small_u.linear - small_u.quadratic - small_u.attention_linear
    comm_kv = small_kv.linear - small_kv.quadratic - small_kv.attention_linear + small_kv.ring_exchange  # hidden or not
    assert comm_kv < comm_u  # cp=2: the ring moves fewer bytes
    cm70 = AnalyticCostModel("llama3-70b", "H100", 128)
    cm70.check(Layout(tp=8, cp=16, cp_kv=16))  # 64 heads: tp8 x cp16 only works without Ulysses
    with pytest.raises(CostModelError, match="Ulysses part of cp"):
        cm70.check(Layout(tp=8, cp=16))


@pytest.mark.parametrize("model,gpus,context", [("llama3-8b", 16, 65536), ("llama3-8b", 32, 131072),
                                                ("llama7b", 8, 32768), ("llama3-70b", 64, 131072)])
def test_a_competent_user_gives_every_dp_group_a_context_row(model, gpus, context):
    """Issue 51: the user's static layout has at most as many dp groups as the batch has context rows (none
    idles), holds the context, and Megatron-like runs NeMo's tp for that length (or more where the model
    needs it) with a replicated copy; torchtitan-like is FSDP x ring-like cp without tp."""
    cm = AnalyticCostModel(model, "H100", gpus)
    tokens = max(16384 * gpus, 2 * context)
    users = competent_user_layouts(cm, context, tokens)
    # 70B replicated within a node's tp does not fit: Megatron would add pp and its distributed optimizer,
    # which this grid does not express, so the kind is left out there
    assert set(users) == (set(PEER_RUNTIMES) if model != "llama3-70b" else {"torchtitan"})
    assert set(PEER_RUNTIMES) == {"megatron-te", "torchtitan"}
    for kind, lay in users.items():
        assert lay.dp <= tokens // context and lay.world_size == gpus, (kind, lay)
        assert lay.cp_kv == lay.cp and max(cm.option(lay, ac).max_doc_length for ac in (False, True)) >= context
    titan, mega = users["torchtitan"], users.get("megatron-te")
    assert titan.tp == 1 and titan.fsdp
    assert mega is None or (mega.tp >= nemo_tp(context) and not mega.fsdp and mega.tp <= 8)
    assert [nemo_tp(k * 1024) for k in (4, 16, 32, 64, 256, 512)] == [1, 2, 2, 4, 4, 8]


def test_the_competent_user_is_priced_on_the_peers_runtime_and_on_ours():
    """The smoke cell reports each user layout on its peer's runtime (torchtitan's, NeMo / TE's) and on ours,
    and the grid's geomeans are over those cells."""
    result = long_grid(SMOKE_GRID, batches=1)
    (cell,) = result["cells"]
    users = cell["competent_user_static"]
    for kind, row in users.items():
        assert row["peer_runtime"] == PEER_RUNTIMES[kind]
        assert row["ours_over"] == pytest.approx(row["seconds_on_peer_runtime"] / cell["ours_s"])
        assert row["ours_over_on_ours_runtime"] == pytest.approx(row["seconds_on_ours"] / cell["ours_s"])
    # NeMo / TE's runtime runs cuDNN attention (0.571 of peak) where ours runs FA2 (0.175): cheaper on its own
    assert users["megatron-te"]["seconds_on_peer_runtime"] < users["megatron-te"]["seconds_on_ours"]
    assert result["competent_user_static"] == {k: pytest.approx(v["ours_over"]) for k, v in users.items()}


def test_ours_with_its_users_options_moves_ours_and_the_compiling_peer_only(tmp_path):
    """``--ours-options matching`` (FA3 + compile_blocks) prices ours, its statics and the users' layouts on ours
    faster; Megatron-TE's layout on its own runtime not at all (priced on the plain profile, not ours' compiled
    one); torchtitan's faster (its users compile where ours does); FA3 priced conservatively sits in between.
    The three sides come from one run of tools/long_grid_options.py."""
    out = side_by_side(SMOKE_GRID, batches=1, out=str(tmp_path / "grid"))
    assert set(out["sides"]) == set(SIDES) and out["sides"]["default"]["ours_options"] == "default"
    assert out["sides"]["matching-conservative"]["ours_options"]["fa3_priced"] == "conservative"
    plain, matching, cons = (json.loads((tmp_path / f"grid-{side}.json").read_text())["cells"][0]
                             for side in ("default", "matching", "matching-conservative"))
    assert matching["ours_s"] < cons["ours_s"] < plain["ours_s"]
    assert matching["static_s"] < plain["static_s"]
    before, after = plain["competent_user_static"], matching["competent_user_static"]
    mega = [side["megatron-te"]["seconds_on_peer_runtime"] for side in (before, after)]
    assert mega[1] == pytest.approx(mega[0], rel=1e-12)
    assert not after["megatron-te"]["peer_compiled"] and after["torchtitan"]["peer_compiled"]
    assert after["torchtitan"]["seconds_on_peer_runtime"] < before["torchtitan"]["seconds_on_peer_runtime"]
    for kind in before:
        assert after[kind]["seconds_on_ours"] < before[kind]["seconds_on_ours"]
    cell = SMOKE_GRID["settings"][0] + (SMOKE_GRID["data"][0], SMOKE_GRID["hardware"][0])
    with pytest.raises(ValueError, match="'fa4'.*H100"):
        long_cell(*cell, batches=1, ours=OursOptions(attention="fa4"))
    with pytest.raises(ValueError, match="jobs must be >= 1, got 0"):
        side_by_side(SMOKE_GRID, jobs=0)
