"""The switching engine on real gloo ranks, checked against DTensor and a byte counter."""

import itertools
import zlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_hotspa.engine.switch import SwitchEngine, build_home_parameters
from lightning_hotspa.layout import Layout, LayoutError
from lightning_hotspa.mesh import WorldMesh
from lightning_hotspa.placements import build_shardings
from lightning_hotspa.testing.comm_bytes import count_collective_bytes

FOUNDATION = ["dp4", "dp2xtp2", "tp4", "dp2xcp2", "tp2xcp2"]
SHAPES = {"wq": (8, 12), "wo": (12, 8), "emb": (16, 4), "norm": (12,), "wk": (4, 12), "bias": (6,)}
ROLES = {"wq": "colwise", "wo": "rowwise", "emb": "vocab", "norm": "replicated",
         "wk": "replicated_partial", "bias": "replicated"}


def full_init(name, shape):
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=g)


def _engine(layouts, dtype=None, **kwargs):
    world = WorldMesh(layouts)
    shardings = build_shardings(SHAPES, ROLES, world.shape)
    home = build_home_parameters(world, shardings, full_init)
    return world, shardings, home, SwitchEngine(world, shardings, home, working_dtype=dtype, **kwargs)


def _expected(world, sharding, layout, dtype=None):
    t = full_init(sharding.name, sharding.shape)
    t = t.to(dtype) if dtype else t
    return distribute_tensor(t, world.device_mesh, sharding.layout_placements(Layout.parse(layout))).to_local()


def _geometry_bounds(world, shardings, layouts, itemsize):
    """(source, destination) -> bytes of this rank's destination shards its source shards lack, from
    DTensor's own placement of an index tensor (independent of the engine's accounting)."""
    held = {}
    for src in [None, *layouts]:
        for name, sh in shardings.items():
            index = torch.arange(torch.Size(sh.shape).numel(), dtype=torch.float64).reshape(sh.shape)
            placements = sh.home_placements() if src is None else sh.layout_placements(Layout.parse(src))
            held[src, name] = distribute_tensor(index, world.device_mesh, placements).to_local().flatten()
    return {(src, dst): itemsize * sum(int((~torch.isin(held[dst, n], held[src, n])).sum()) for n in shardings)
            for src in [None, *layouts] for dst in layouts}


def switch_every_pair(layouts, dtype=None, **engine_kwargs):
    """Home -> each layout and every ordered pair: exact shards, and bytes == counted == the bound
    DTensor's shard geometry gives."""
    world, shardings, home, engine = _engine(layouts, dtype, **engine_kwargs)
    geometry = _geometry_bounds(world, shardings, layouts, (dtype or torch.float32).itemsize)
    rows = []
    for name, p in home.items():  # the home state equals the single-process init, as DTensor sees it
        assert torch.equal(p.full_tensor(), full_init(name, shardings[name].shape)), name
    for src in [None, *layouts]:
        for dst in layouts:
            if src is not None:
                engine.materialize(Layout.parse(src))
            with count_collective_bytes() as log:
                target = Layout.parse(dst)
                report = engine.materialize(target) if src is None else engine.switch(target)
            for name, sh in shardings.items():
                got = engine.working[name]
                assert got.requires_grad and got.is_leaf
                assert torch.equal(got.detach(), _expected(world, sh, dst, dtype)), (src, dst, name)
                # DTensor's own redistribute from home agrees too
                ref = home[name].redistribute(placements=sh.layout_placements(Layout.parse(dst))).to_local()
                assert torch.equal(got.detach(), ref.to(got.dtype)), (src, dst, name)
            rows.append((src or "home", dst, report.bytes_received, geometry[src, dst],
                         log.bytes_received, report.collectives, log.count, report.lower_bound_bytes))
    return rows


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_switch_every_pair_exact_and_minimal(ranks, dtype):
    results = ranks(4).run(switch_every_pair, FOUNDATION, dtype)
    for rank_rows in results:
        assert len(rank_rows) == 5 + 25
        for src, dst, ours, bound, counted, collectives, calls, reported_bound in rank_rows:
            assert ours == counted == bound == reported_bound, (src, dst, ours, counted, bound, reported_bound)
            assert collectives == calls
            if bound == 0:
                assert calls == 0, (src, dst)
    # a spot check of absolute volume: tp4 -> dp4 gathers 3/4 of every tensor (fp32: 4 bytes)
    row = next(r for r in results[0] if r[:2] == ("tp4", "dp4"))
    total = sum(torch.Size(s).numel() for s in SHAPES.values() if s)
    sharded = sum(torch.Size(SHAPES[n]).numel() for n in ("wq", "wo", "emb"))
    itemsize = 2 if dtype == torch.bfloat16 else 4
    assert row[2] == sharded * 3 // 4 * itemsize
    home_row = next(r for r in results[0] if r[:2] == ("home", "dp4"))
    # every tensor splits over 4 at home except 'bias' (6 elements: over 2), so dp4 misses 3/4 resp. 1/2
    assert home_row[2] == ((total - 6) * 3 // 4 + 6 // 2) * itemsize
    assert row[2] < home_row[2]


def test_switch_with_several_buckets_in_flight_is_exact_and_minimal(ranks):
    """64-byte buckets, 3 gathers in flight (the NCCL way): the same shards and bytes as one at a time."""
    results = ranks(4).run(switch_every_pair, FOUNDATION, None, bucket_bytes=64, switch_buckets_in_flight=3)
    for rank_rows in results:
        for src, dst, ours, bound, counted, collectives, calls, reported_bound in rank_rows:
            assert ours == counted == bound == reported_bound, (src, dst, ours, counted, bound)
            assert collectives == calls
    assert max(r[5] for r in results[0]) > 3  # several buckets per switch: the window really slides


def test_bucket_defaults_by_backend_and_overrides():
    from lightning_hotspa.engine.buckets import bucket_defaults

    nccl, gloo = bucket_defaults("nccl"), bucket_defaults("gloo")
    assert nccl.engine_kwargs()["bucket_bytes"] >= 25 * 2**20 > gloo.engine_kwargs()["bucket_bytes"]
    assert nccl.switch_in_flight > 1 and gloo.switch_in_flight == 1
    assert bucket_defaults("nccl", bucket_mb=8).engine_kwargs()["bucket_bytes"] == 8 * 2**20
    with pytest.raises(ValueError, match="bucket_mb must be a positive number of MiB, got -1"):
        bucket_defaults("nccl", bucket_mb=-1)
    with pytest.raises(ValueError, match="switch_in_flight must be a positive int, got 0"):
        bucket_defaults("gloo", switch_in_flight=0)


def tp_up_is_free():
    world, shardings, home, engine = _engine(FOUNDATION)
    engine.materialize(Layout.parse("dp2xtp2"))
    with count_collective_bytes() as log:
        engine.switch(Layout.parse("tp4"))
    return log.count


def test_tp_up_is_a_local_slice(ranks):
    assert ranks(4).run(tp_up_is_free) == [0, 0, 0, 0]


def _rank_grad(name, shape, seed_key):
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{seed_key}".encode()))
    return torch.randn(shape, generator=g)


def reduce_grads_into_home(layouts, stage_layouts, via_backward=False, in_flight=2):
    """Each rank invents working grads with the right symmetry; the store must hold the exact sum.

    ``via_backward``: the grads come from two backward passes through the working params (the
    second with :meth:`overlap_next_backward`, one param per bucket, ``in_flight`` buckets pending),
    'wq' gets none; also returns how many buckets each stage launched before its end and the
    collectives it waited on in backward and at the end."""
    world, shardings, home, engine = _engine(layouts, **({"bucket_bytes": 1, "max_buckets_in_flight": in_flight}
                                                         if via_backward else {}))
    unused = "wq" if via_backward else None
    launched_early, waits = [], []
    rank = dist.get_rank()
    shape = world.shape
    expected = {n: torch.zeros(sh.shape) for n, sh in shardings.items()}
    reports = []
    for layout_name in stage_layouts:
        layout = Layout.parse(layout_name)
        engine.materialize(layout)
        grads = {}
        for name, sh in shardings.items():
            prefix = sh.layout_prefix(layout)
            for r in range(world.shape.world_size):
                coords = list(shape.coords(r))
                if sh.role.tp_grad == "replicate":  # identical across tp ranks: seed ignores tp coords
                    for d in shape.tp_dims(layout):
                        coords[d] = 0
                key = f"{layout_name}/{coords}"
                g = _rank_grad(name, sh.local_shape(prefix), key)
                if r == rank:
                    grads[name] = g
                if name == unused or (sh.role.tp_grad == "replicate" and tuple(coords) != shape.coords(r)):
                    continue  # no gradient, or a copy rather than a contribution
                lo, hi = sh.interval(r, prefix)
                if sh.dim is None or prefix == 0:
                    expected[name] += g
                else:
                    expected[name].narrow(sh.dim, lo, hi - lo).add_(g)
        with count_collective_bytes() as log:
            if via_backward:
                used = [n for n in grads if n != unused]
                sum((engine.working[n] * (0.25 * grads[n])).sum() for n in used).backward()
                engine.overlap_next_backward()
                sum((engine.working[n] * (0.75 * grads[n])).sum() for n in used).backward()
                launched_early.append(engine._overlap.launched)
                report = engine.reduce_gradients()
                waits.append((report.waits_in_backward, report.waits_at_end))
            else:
                report = engine.reduce_gradients(grads)
        reports.append((report.bytes_received, log.bytes_received))
    errors = {}
    for name, sh in shardings.items():
        lo, hi = sh.interval(rank, sh.home_prefix)
        exp = expected[name] if sh.dim is None or sh.home_prefix == 0 else expected[name].narrow(sh.dim, lo, hi - lo)
        got = engine.grad_store[name]
        errors[name] = float((got - exp).norm() / exp.norm().clamp_min(1e-30))
    engine.assign_home_grads()
    for name, p in home.items():
        assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements
        exp = expected[name]
        errors[name + ".full"] = float((p.grad.full_tensor() - exp).norm() / exp.norm().clamp_min(1e-30))
    return (errors, reports, launched_early, waits) if via_backward else (errors, reports)


def test_gradient_reduction_sums_across_stages(ranks):
    results = ranks(4).run(reduce_grads_into_home, FOUNDATION, ["dp2xtp2", "tp4", "dp4", "tp2xcp2", "dp2xcp2"])
    for errors, reports in results:
        assert max(errors.values()) < 1e-6, errors
        for ours, counted in reports:
            assert ours == counted


def test_gradient_reduction_overlapped_with_backward(ranks):
    """Buckets launched from gradient hooks during the last backward give the same store."""
    results = ranks(4).run(reduce_grads_into_home, FOUNDATION, ["dp4", "dp2xtp2", "tp2xcp2"], True)
    for errors, reports, launched_early, _ in results:
        assert max(errors.values()) < 1e-6, errors
        for ours, counted in reports:
            assert ours == counted
        # one param per bucket, launched in reverse parameter order: all but the unused 'wq' (the
        # last bucket) start during backward
        assert launched_early == [len(SHAPES) - 1] * 3, launched_early


def test_overlapped_reduction_waits_mid_backward_only_to_free_a_slot(ranks):
    """With one bucket in flight, the backward waits once per bucket it launches after the first (to
    free the slot) and never for a two-phase bucket's all-reduce ('bias' in dp4: home splits its 6
    rows over 2 of the 4 ranks, so reduce-scatter then all-reduce), which lands at the stage end."""
    results = ranks(4).run(reduce_grads_into_home, FOUNDATION, ["dp4", "dp2xtp2"], True, 1)
    for errors, _, launched_early, waits in results:
        assert max(errors.values()) < 1e-6, errors
        for launched, (in_backward, at_end) in zip(launched_early, waits):
            assert launched > 1 and in_backward == launched - 1, (launched, in_backward, at_end)


LAYOUTS_8 = ["dp8", "dp4xtp2", "dp2xtp4", "tp8", "dp2xtp2xcp2", "tp4xcp2"]


def test_switch_and_reduce_on_8_ranks(ranks):
    pool = ranks(8)
    for rank_rows in pool.run(switch_every_pair, LAYOUTS_8[:4]):
        for src, dst, ours, bound, counted, *_ in rank_rows:
            assert ours == counted == bound, (src, dst, ours, counted, bound)
    for errors, _ in pool.run(reduce_grads_into_home, LAYOUTS_8, ["tp4xcp2", "dp2xtp2xcp2", "dp8"]):
        assert max(errors.values()) < 1e-6, errors


def engine_misuse():
    world, shardings, home, engine = _engine(FOUNDATION)
    messages = []
    for call in (lambda: engine.switch(Layout.parse("dp4")), lambda: engine.reduce_gradients({}),
                 lambda: engine.materialize("dp2xtp2"), lambda: engine.materialize(Layout.parse("tp2xcp2xdp1")),
                 lambda: engine.materialize(Layout(dp=2, cp=2, cp_kv=2))):
        try:
            call()
            messages.append(None)
        except (RuntimeError, LayoutError) as e:
            messages.append(str(e))
    try:
        SwitchEngine(world, shardings, {k: v for k, v in home.items() if k != "wq"})
        messages.append(None)
    except LayoutError as e:
        messages.append(str(e))
    # gradients carried between layouts of one tp degree: kept as they are; across tp: refused
    shares = [engine.shares_gradients(Layout.parse(a), Layout.parse(b))
              for a, b in itertools.combinations(FOUNDATION, 2)]
    engine.materialize(Layout.parse("dp4"))
    for w in engine.working.values():
        w.grad = torch.ones_like(w)
    grads = {n: w.grad for n, w in engine.working.items()}
    engine.switch(Layout.parse("dp2xcp2"), keep_grads=True)
    kept = all(engine.working[n].grad is g for n, g in grads.items())
    try:
        engine.switch(Layout.parse("tp2xcp2"), keep_grads=True)
        messages.append(None)
    except LayoutError as e:
        messages.append(str(e))
    engine.switch(Layout.parse("dp4"))
    dropped = all(w.grad is None for w in engine.working.values())
    return messages, shares, kept, dropped


def test_engine_misuse_raises_clear_errors(ranks):
    messages, shares, kept, dropped = ranks(4).run(engine_misuse)[0]
    assert "materialize() first" in messages[0]
    assert "no active layout" in messages[1]
    assert "expected a Layout, got 'dp2xtp2' (str)" in messages[2]  # names are parsed at the edge only
    assert messages[3] is None  # tp2xcp2xdp1 is the same layout as tp2xcp2
    assert "layout dp2xcp2:kv is not among ['dp4', 'dp2xtp2', 'tp4', 'dp2xcp2', 'tp2xcp2']" in messages[4]
    assert "['wq']" in messages[5]
    assert "cannot keep the working gradients from dp2xcp2 to tp2xcp2" in messages[6]
    same_tp = [Layout.parse(a).tp == Layout.parse(b).tp for a, b in itertools.combinations(FOUNDATION, 2)]
    assert shares == same_tp and any(shares)
    assert kept and dropped

