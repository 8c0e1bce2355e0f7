"""The memory estimator (FakeTensorMode + fake process group + MemTracker) on tiny models, and the
engine's memory fixes it checks: buckets freed when their reduction lands, fp32 gradient accumulation,
shard-only initialization."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import SMALLISH

from lightning_hotspa.engine.home import build_home_parameters
from lightning_hotspa.engine.switch import SwitchEngine
from lightning_hotspa.layout import Layout
from lightning_hotspa.mesh import WorldMesh
from lightning_hotspa.models import Llama, LlamaConfig, init_parameter, llama_tp_plan, param_roles
from lightning_hotspa.placements import build_shardings
from lightning_hotspa.planner.cost.cost_model import AnalyticCostModel, CostModelError
from lightning_hotspa.planner.cost.hardware import get_profile
from lightning_hotspa.testing.fake_world import CATEGORIES, FakeWorld
from lightning_hotspa.tools.memory import CHUNK_KERNEL, estimate_layout

TINY = LlamaConfig.preset("tiny")
# wider than "tiny" so weights, not the fixed terms, dominate: 4 layers, MHA and GQA

_ESTIMATES: dict[tuple, dict] = {}


def estimate(layout: str, tokens: int, **kwargs) -> dict:
    """``estimate_layout(SMALLISH, 4, layout, tokens, **kwargs)``, each distinct call run once per module (several
    tests read the same step: a fake-world step of SMALLISH at 4096 tokens is seconds); the result is read-only."""
    key = (layout, tokens, tuple(sorted(kwargs.items())))
    if key not in _ESTIMATES:
        _ESTIMATES[key] = estimate_layout(SMALLISH, 4, layout, tokens, **kwargs)
    return _ESTIMATES[key]


@pytest.mark.parametrize("layout", ["dp4", "dp2xtp2", "tp2xcp2"])
def test_estimator_measures_every_category_and_agrees_with_the_cost_model(layout: str) -> None:
    # 1024, not 512: with sequence parallelism tp2xcp2 keeps so few activations at 512 tokens (128 per
    # rank) that its peak is the overlapped backward's gradient buckets in flight (2 x 4 MiB here, a
    # fixed cost the model does not price): 32.6 MB measured vs 29.4 MB predicted there, 1 % at 1024
    tokens = 1024
    got = estimate(layout, tokens)
    assert set(got["peak"]) == set(CATEGORIES)
    for category in ("params", "grads", "optimizer", "activations"):
        assert got["peak"][category] > 0, (category, got["peak"])
    predicted = AnalyticCostModel(SMALLISH, "H100", 4).peak_bytes(Layout.parse(layout), False, tokens)
    assert abs(got["peak_bytes"] / predicted - 1) < 0.10, (got["peak"], predicted)


@pytest.mark.parametrize("in_flight", [1, 2])
def test_gradient_buckets_do_not_outlive_their_reduction(in_flight: int) -> None:
    """Reducing after the backward (no overlap): the reduce phase may add at most the buckets in
    flight (fp32 input + output), never the whole layout's fp32 gradients."""
    bucket = 64 * 2**10
    got = estimate_layout(SMALLISH, 4, "dp4", 128, bucket_bytes=bucket, max_buckets_in_flight=in_flight,
                          overlap=False)
    added = sum(got["reduce_peak"].values()) - sum(got["reduce_start"].values())
    largest = SMALLISH.padded_vocab_size * SMALLISH.hidden * 4  # a tensor larger than a bucket goes alone
    fp32_grads = SMALLISH.num_params() * 4
    bound = (in_flight + 1) * max(bucket, largest) * 1.25
    assert bound < fp32_grads / 2  # the check can tell a bounded reduction from an unbounded one
    assert added <= bound, (added, bound, fp32_grads)


def _tiny_engine(world: WorldMesh, grad_accum_dtype):
    with torch.device("meta"):
        model = Llama(TINY)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    roles = {n: "replicated" for n in shapes}
    shardings = build_shardings(shapes, roles, world.shape)
    home = build_home_parameters(world, shardings, lambda n, s: init_parameter(n, s, 0, n_layers=2))
    return SwitchEngine(world, shardings, home, working_dtype=torch.bfloat16, grad_accum_dtype=grad_accum_dtype)


def test_bf16_working_gradients_accumulate_in_fp32_by_choice() -> None:
    """Small micro-batch gradients on top of a large one: lost in bf16 (1 + 1e-3 == 1), kept in fp32."""
    with FakeWorld(1):
        world = WorldMesh(["dp1"])
        sums = {}
        for accum in (torch.float32, None):
            engine = _tiny_engine(world, accum)
            engine.materialize(Layout.parse("dp1"))
            w = engine.working["norm.weight"]
            for scale in [1.0] + [1e-3] * 16:
                (w.float().sum() * scale).backward()
            got = engine.working_grad("norm.weight")
            sums[accum] = (got.dtype, float(got.float().mean()), w.grad is None)
            engine.release()
    assert sums[torch.float32][0] == torch.float32 and sums[torch.float32][2]  # main grad, no .grad kept
    assert abs(sums[torch.float32][1] - 1.016) < 1e-4
    assert sums[None][0] == torch.bfloat16 and sums[None][1] == 1.0  # the memory-tight option's loss


@pytest.mark.parametrize("rank", [0, 5])
def test_each_rank_initializes_only_its_shard_and_it_equals_the_full_model(rank: int) -> None:
    with FakeWorld(8, rank):
        world = WorldMesh(["dp2xtp4", "dp8"])
        with torch.device("meta"):
            model = Llama(TINY)
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        roles = param_roles(model, llama_tp_plan(TINY, 4))
        shardings = build_shardings(shapes, roles, world.shape)
        asked = []

        def shard(name, shape, dim, start, stop):
            asked.append((dim, start, stop))
            return init_parameter(name, shape, 3, n_layers=2, dim=dim, start=start, stop=stop)

        home = build_home_parameters(world, shardings, None, init_shard=shard)
        reference = build_home_parameters(world, shardings, lambda n, s: init_parameter(n, s, 3, n_layers=2))
    assert any(dim is not None and stop - start < shapes[n][dim] for (dim, start, stop), n in zip(asked, shapes))
    for name in shapes:
        assert torch.equal(home[name].to_local(), reference[name].to_local()), name


def test_a_switch_holds_both_copies_of_at_most_one_bucket() -> None:
    """dp2xtp2 -> dp4 all-gathers every tp-split weight: the old copies go bucket by bucket."""
    from lightning_hotspa.testing.fake_world import MemoryTracker, fake_mode

    bucket = 64 * 2**10
    with FakeWorld(4):
        world = WorldMesh(["dp4", "dp2xtp2"])
        with torch.device("meta"):
            model = Llama(SMALLISH)
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        shardings = build_shardings(shapes, param_roles(model, llama_tp_plan(SMALLISH, 2)), world.shape)
        with fake_mode():
            home = build_home_parameters(world, shardings, None, init_shard=lambda n, s, d, a, b: torch.empty(
                [b - a if i == d else x for i, x in enumerate(s)]))
            engine = SwitchEngine(world, shardings, home, working_dtype=torch.bfloat16, bucket_bytes=bucket)
            with MemoryTracker() as mem:
                engine.materialize(Layout.parse("dp2xtp2"))
                old = sum(w.numel() * 2 for w in engine.working.values())
                mem.reset_peak()
                start = sum(mem.current().values())
                engine.switch(Layout.parse("dp4"))
                new = sum(w.numel() * 2 for w in engine.working.values())
                peak = sum(mem.peak().values())
    largest = SMALLISH.padded_vocab_size * SMALLISH.hidden * 2
    assert old > 4 * largest  # holding both copies of everything would break the bound below
    assert peak - start <= new - old + 3 * max(bucket, largest), (peak - start, new, old)


def test_memory_model_has_an_activation_term_per_attention_backend() -> None:
    flash = AnalyticCostModel("llama7b", "H100", 8)
    math_ = AnalyticCostModel("llama7b", "H100", 8, attention_backend="sdpa-math")
    lay = Layout.parse("dp2xtp2xcp2")
    assert flash.attention_quadratic_bytes(lay) == 0
    assert math_.attention_quadratic_bytes(lay) == pytest.approx(32 / 4 * (32 * 2 + 8))
    gap = math_.peak_bytes(lay, False, 8192) - flash.peak_bytes(lay, False, 8192)
    assert gap == pytest.approx(math_.attention_quadratic_bytes(lay) * 8192**2 - 4 * 32 * 32 / 4 * 8192, rel=1e-6)
    assert 0 < math_.capacity(lay, False) < flash.capacity(lay, False)
    with pytest.raises(ValueError, match="attention_backend must be a registered attention kernel.*got 'xformers'"):
        AnalyticCostModel("llama7b", "H100", 8, attention_backend="xformers")
    with pytest.raises(ValueError, match="got 'math' \\('math' is now 'sdpa-math'\\)"):
        AnalyticCostModel("llama7b", "H100", 8, attention_backend="math")


def test_memory_cli_names_bad_rows(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_hotspa.tools.cli import main

    assert main(["memory", "--rows", "llama7b:x"]) == 2
    assert "'llama7b:x' must look like llama7b:8" in capsys.readouterr().err
    assert main(["memory", "--rows", "llama99b:8"]) == 2
    assert "llama99b" in capsys.readouterr().err


@pytest.mark.parametrize("activation_checkpointing", [False, True])
@pytest.mark.parametrize("layout, shard", [("dp4:fsdp", 4), ("dp4:fsdp2", 2)])
def test_fsdp_layout_holds_its_share_of_the_working_copy_plus_one_unit(layout: str, shard: int,
                                                                       activation_checkpointing: bool) -> None:
    """dp4:fsdp (and the HSDP dp4:fsdp2, split over 2 ranks, replicated over 2) through the
    estimator's real step (fake world, 4 ranks): the live working params (shards plus the gathered
    unit) peak at ~1/shard of dp4's replicated copy plus a block or two, since each unit's gathered
    tensors are freed after its forward and re-gathered in backward; the memory model says the same."""
    tokens = 128
    full = estimate("dp4", tokens, activation_checkpointing=activation_checkpointing)
    sharded = estimate(layout, tokens, activation_checkpointing=activation_checkpointing)
    replicated = full["working_params_peak"]
    assert replicated == SMALLISH.num_params() * 2  # bf16, every parameter once
    block = sum(p.numel() for p in Llama(SMALLISH).layers[0].parameters()) * 2
    head = SMALLISH.padded_vocab_size * SMALLISH.hidden * 2
    peak = sharded["working_params_peak"]
    assert replicated / shard < peak <= replicated / shard + 2 * max(block, head), (peak, replicated, block, head)
    # the check tells freed units from kept ones (4 blocks + 2 vocab units)
    assert peak < replicated / shard + replicated / 4
    assert sharded["peak"]["grads"] < full["peak"]["grads"]  # fp32 main grads at the sharded size
    cm = AnalyticCostModel(SMALLISH, "H100", 4)
    working = cm.memory(Layout.parse(layout), activation_checkpointing).working
    assert working == pytest.approx(cm.memory(Layout.parse("dp4:fsdp"), activation_checkpointing).working * 4 / shard)


def test_capacity_keeps_the_model_error_margin_so_a_capacity_micro_batch_fits() -> None:
    """Planned: predicted x (1 + margin) <= usable. A capacity micro-batch then fits even where the
    measured peak runs the largest measured model error (0.0081, BENCHMARKS.md) above the prediction
    (llama7b tp8 without the margin: 69.97 GiB measured vs 69.50 predicted, 69.60 usable)."""
    from lightning_hotspa.planner.cost.memory_model import MODEL_ERROR_MARGIN

    assert 0.0081 * 2 <= MODEL_ERROR_MARGIN <= 0.05  # headroom over the measured error, not a fudge
    cases = [("llama7b", 8, "tp8"), ("llama7b", 8, "dp4xtp2"), ("llama30b", 32, "tp8xcp4"),
             ("llama3-8b", 8, "tp2xcp4:kv")]
    for model, world, layout in cases:
        cm = AnalyticCostModel(model, "H100", world)
        lay = Layout.parse(layout)
        use = cm.memory(lay, False)
        cap = cm.capacity(lay, False)
        assert cap > 0, layout
        assert cm.peak_bytes(lay, False, cap) * (1 + 0.0081) <= use.usable, layout  # fits, worst error
        assert cm.peak_bytes(lay, False, cap + cm.capacity_multiple) > use.planning_budget, layout  # tight
        bare = AnalyticCostModel(model, "H100", world)
        bare.model_error_margin = 0.0
        assert bare.capacity(lay, False) > cap and bare.memory(lay, False).usable == use.usable, layout


def test_a_public_attribute_set_after_use_drops_the_memoized_capacities() -> None:
    """Capacities, options and reductions are memoized per layout (the candidate choice asks ~10^5 times);
    setting a margin afterwards prices with the new margin, not the remembered one."""
    cm, lay = AnalyticCostModel("llama7b", "H100", 8), Layout.parse("dp4xtp2")
    cap, option, reduce = cm.capacity(lay, False), cm.option(lay, False), cm.grad_reduce_seconds(lay)
    assert cm.option(lay, False) is option and option.capacity == cap  # the same object: memoized
    cm.model_error_margin = 0.0
    assert cm.capacity(lay, False) > cap and cm.option(lay, False).capacity == cm.capacity(lay, False)
    assert cm.grad_reduce_seconds(lay) <= reduce  # a larger capacity hides at least as much of it


@pytest.mark.parametrize("attention", ["cpu", "gpu"])
@pytest.mark.parametrize("layout", ["cp4:kv", "tp2xcp2:kv", "cp4:kv2", "dp2xcp2:kv"])
def test_memory_model_counts_what_the_kv_ring_saves_and_holds(layout: str, attention: str) -> None:
    """The KV ring saves q, the local k / v, the merged output and fp32 log-sum-exp per layer, and its
    backward holds an fp32 dq, a dK/dV partial and four local K/V slices in flight: the predicted peak is
    within 2 % of the estimator's (the real step in the fake world) at 4096 tokens, on the CPU block
    kernels and on the GPU path's (the all-gather it replaced held the whole micro-batch's K/V and an
    fp32 dK/dV sum, 1.8x-2.9x the prediction before the model counted them)."""
    tokens = 4096
    got = estimate(layout, tokens, attention=attention)
    cm = AnalyticCostModel(SMALLISH, "H100", 4, chunk_kernel=CHUNK_KERNEL[attention])
    lay = Layout.parse(layout)
    assert cm.kv_ring_extra_bytes(Layout.parse(layout.split(":")[0]), False, tokens) == 0  # Ulysses: none
    # for this model the ring's transients stay below what the layer's backward has freed by then
    assert cm.kv_ring_extra_bytes(lay, False, tokens) == 0
    predicted = cm.peak_bytes(lay, False, tokens)
    assert abs(got["peak_bytes"] / predicted - 1) < 0.02, (got["peak"], predicted)


# Each path is predicted with its own chunk_kernel: the CPU all-gather-KV chunks (cpu_flash_chunks,
# models/chunk_attention.py) keep their lse and, in the hybrid, their pre-exchange output for backward
# (cp4:kv2 measured 9,053.75 B/token on CPU against 8,492.5 when the model counted only what CUDA keeps:
# +6.6 %). Without the KV gather both paths keep the same tensors (dp4, dp2xtp2, tp2xcp2, cp4: equal
# measured peaks and predictions at 2048 and 4096 tokens, 2026-12-07): the GPU path runs there for
# dp2xtp2 only, the sentinel of that equality.
@pytest.mark.parametrize("layout, attention", [
    *((lay, "cpu") for lay in ("dp4", "dp2xtp2", "tp2xcp2", "cp4", "cp4:kv", "cp4:kv2")),
    *((lay, "gpu") for lay in ("dp2xtp2", "cp4:kv", "cp4:kv2"))])
def test_memory_model_counts_what_each_token_keeps_on_both_attention_paths(layout: str, attention: str) -> None:
    """The measured peak's growth per token between 2048 and 4096 tokens equals the model's, on the
    CPU kernels and on what flash-attn's varlen kernel keeps (docs/DESIGN.md §11): at the loss
    head's turn, or for the KV gather at its dK/dV reduce-scatter (whose bytes per gathered element
    and the hybrid's saved tensors were over-counted by 4-7 % here). Both points lie in one regime:
    at 1024 tokens a cp4 layout's peak is the head gradient's overlapped reduction instead (the
    estimator's 4 MiB buckets, a fixed term), which made the per-token growth look 8-12 % off."""
    small, large = (estimate(layout, t, attention=attention)["peak_bytes"] for t in (2048, 4096))
    cm = AnalyticCostModel(SMALLISH, "H100", 4, chunk_kernel=CHUNK_KERNEL[attention])
    lay = Layout.parse(layout)
    predicted = (cm.peak_bytes(lay, False, 4096) - cm.peak_bytes(lay, False, 2048)) / 2048
    assert abs((large - small) / 2048 / predicted - 1) < 0.02, ((large - small) / 2048, predicted)


@pytest.mark.parametrize("layout", ["dp4", "dp2xtp2", "cp4", "cp4:kv"])
def test_selective_checkpointing_memory_matches_the_estimator(layout: str) -> None:
    """Selective checkpointing keeps every layer's tensors but the attention core's (q / k / v and the
    kernel's; wo's input stays): the estimator's peak (the real step, the core recomputed) agrees with
    the memory model within 2 % at two sizes, and lies between full checkpointing's and none's."""
    cm, lay = AnalyticCostModel(SMALLISH, "H100", 4), Layout.parse(layout)
    for tokens in (2048, 4096):
        got = estimate(layout, tokens, activation_checkpointing="selective")["peak_bytes"]
        assert abs(got / cm.peak_bytes(lay, "selective", tokens) - 1) < 0.02, (tokens, got)
    modes = [cm.activation_bytes_per_token(m, lay.tp, lay.cp, lay.cp_kv) for m in ("full", "selective", "none")]
    assert modes == sorted(modes) and modes[0] < modes[1] < modes[2]


def test_memory_cli_names_a_bad_attention_path() -> None:
    with pytest.raises(ValueError, match="attention must be one of \\('cpu', 'gpu'\\), got 'tpu'"):
        estimate_layout(SMALLISH, 4, "dp4", 64, attention="tpu")


def test_a_bad_chunk_kernel_is_named() -> None:
    with pytest.raises(CostModelError, match="chunk_kernel must be a registered attention kernel, one of "
                                             "\\['cpu_flash_chunks', 'sdpa_chunk', 'fa3_chunks', 'fa4_chunks', "
                                             "'torch_flash_chunks'\\]; got 'sdpa'"):
        AnalyticCostModel(SMALLISH, "H100", 4, chunk_kernel="sdpa")
    with pytest.raises(ValueError, match="device_type must be one of \\('cuda', 'cpu'\\), got 'xpu'"):
        dataclasses.replace(get_profile("H100"), device_type="xpu")
    assert AnalyticCostModel(SMALLISH, "cpu-gloo", 4).chunk_kernel == "cpu_flash_chunks"
    assert AnalyticCostModel(SMALLISH, "H100", 4).chunk_kernel == "sdpa_chunk"


@pytest.mark.parametrize("layout", ["dp2xtp2", "tp4", "tp2xcp2"])
def test_keeping_the_gathered_region_inputs_is_priced_as_the_estimator_measures(layout: str) -> None:
    """Sequence parallelism without the backward re-gather (``tp_regather=False``, issue 52): each
    column region keeps its gathered input, 2 x hidden x (1 - 1/tp) working-dtype bytes per token and
    layer more than the shard it keeps by default. The memory model with a runtime that keeps them
    (``RuntimeProfile.tp_regather=False``) agrees with the estimator within 2 % per token and at the
    peak, and the extra bytes are what the estimator measures between the two runs."""
    from lightning_hotspa.planner.cost.runtime_profile import HOTSPA

    lay = Layout.parse(layout)
    cm = AnalyticCostModel(SMALLISH, "H100", 4, runtime=dataclasses.replace(HOTSPA, tp_regather=False))
    base = AnalyticCostModel(SMALLISH, "H100", 4)
    small, large = (estimate(layout, t, tp_regather=False)["peak_bytes"] for t in (2048, 4096))
    per_token = (cm.peak_bytes(lay, False, 4096) - cm.peak_bytes(lay, False, 2048)) / 2048
    assert abs((large - small) / 2048 / per_token - 1) < 0.02, ((large - small) / 2048, per_token)
    assert abs(large / cm.peak_bytes(lay, False, 4096) - 1) < 0.02, (large, cm.peak_bytes(lay, False, 4096))
    regathered = estimate(layout, 4096, attention="cpu")["peak_bytes"]
    extra = cm.peak_bytes(lay, False, 4096) - base.peak_bytes(lay, False, 4096)
    assert extra > 0 and abs((large - regathered) / extra - 1) < 0.05, (large - regathered, extra)
