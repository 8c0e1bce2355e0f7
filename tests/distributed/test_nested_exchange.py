"""The mixed-tp primitive (docs/DESIGN.md §4, "Mixed tp at once"): home shards -> each rank's
working copy in its own block's tp degree, and every rank's working gradients -> the home shards,
on 4 gloo ranks with a tp2 block {0, 1} beside two tp1 blocks {2}, {3}, against tensors built whole."""

import functools

import pytest
import torch

from lightning_hotspa.layout import Layout, LayoutError, MeshShape
from lightning_hotspa.placements import build_shardings

LAYOUTS = ["dp4", "dp2xtp2"]
# every role, a parameter home cannot split over the world (6 rows: home prefix 1, tp2 inside it), one
# it cannot split at all (3 rows) and a scalar
SHAPES = {"col": (8, 3), "row": (3, 8), "vocab": (16, 4), "norm": (8,), "bias": (3,), "kv": (4, 6),
          "odd": (6, 2), "scale": ()}
ROLES = {"col": "colwise", "row": "rowwise", "vocab": "vocab", "norm": "replicated", "bias": "replicated",
         "kv": "replicated_partial", "odd": "colwise", "scale": "replicated"}


#: on 8 ranks "odd" has 12 rows (home prefix 2 of 3, tp4 inside it)
SHAPES8 = {**SHAPES, "odd": (12, 2)}


def _full(name: str, salt: int, dtype=torch.float64, shapes=SHAPES) -> torch.Tensor:
    """A whole tensor of parameter ``name`` (its shape from ``shapes``), different per ``salt``."""
    g = torch.Generator().manual_seed(sorted(shapes).index(name) * 1000 + salt + 1)
    return torch.randn(shapes[name], generator=g, dtype=dtype)


def _cut(t, sharding, interval):
    return t if sharding.dim is None else t[(slice(None),) * sharding.dim + (slice(*interval),)]


#: 8 ranks on a 2x2x2 mesh: a tp4 block {0..3}, a tp2 block {4, 5}, tp1 blocks {6}, {7}
LAYOUTS8 = ["dp8", "dp4xtp2", "dp2xtp4"]
PEERS8 = ("dp2xtp4",) * 4 + ("dp4xtp2",) * 2 + ("dp8",) * 2


def run_exchange(bucket_bytes, dtype=torch.float64, layout_names=None, peers=None, block=None):
    """Gathers working copies from home shards, then reduces fabricated working gradients; returns
    the largest error of each against the whole-tensor arithmetic, and the bytes received.

    Args:
        bucket_bytes: the exchange's bucket size.
        dtype: the tensors' dtype.
        layout_names: the mesh's layouts (default :data:`LAYOUTS`).
        peers: each rank's layout name (default: a tp2 block {0, 1}, tp1 on 2 and 3).
        block: each rank's block index (ranks of one block hold the same replicated gradients).
    """
    import torch.distributed as dist

    from lightning_hotspa.engine.nested_exchange import NestedExchange, working_interval

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = MeshShape.for_layouts(layout_names or LAYOUTS, world)
    layouts = tuple(Layout.parse(x) for x in (peers or ("dp2xtp2", "dp2xtp2", "dp4", "dp4")))
    block = block or (0, 0, 1, 2)  # ranks 0 and 1 are one tp2 block; 2 and 3 a tp1 block each
    shapes = SHAPES if world == 4 else SHAPES8
    full = functools.partial(_full, shapes=shapes)
    shardings = build_shardings(shapes, ROLES, mesh)
    home = {n: _cut(full(n, -1, dtype), s, s.interval(rank, s.home_prefix)).contiguous()
            for n, s in shardings.items()}
    exchange = NestedExchange(shardings, mesh, layouts, rank, bucket_bytes)
    working, gathered, gather_calls = exchange.gather(home)
    gather_err = max(float((working[n] - _cut(full(n, -1, dtype), s, working_interval(s, layouts[rank], rank)))
                           .abs().max()) for n, s in shardings.items())

    def held(name, r):  # what rank r's working gradient is: a tp shard, a copy per block, a partial sum
        s = shardings[name]
        if s.role.tp_grad == "replicate":
            return full(name, 100 + block[r], dtype)
        return _cut(full(name, r, dtype), s, working_interval(s, layouts[r], r))

    grads = {n: held(n, rank) for n in shardings}
    shards = {}
    reduced, reduce_calls = exchange.reduce(grads, working, lambda names, got: shards.update(zip(names, got)))
    assert set(shards) == set(shardings)
    reduce_err = 0.0
    for name, s in shardings.items():
        expected = torch.zeros(shapes[name], dtype=dtype)
        if s.role.tp_grad == "replicate":
            for b in sorted(set(block)):
                expected += full(name, 100 + b, dtype)
        else:
            for r in range(world):
                _cut(expected, s, working_interval(s, layouts[r], r)).add_(held(name, r))
        mine = _cut(expected, s, s.interval(rank, s.home_prefix))
        reduce_err = max(reduce_err, float((shards[name] - mine).abs().max()))
        assert shards[name].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    return gather_err, reduce_err, gathered, reduced, gather_calls, reduce_calls


@pytest.mark.parametrize("bucket_bytes", [4 * 2**20, 64], ids=["one_bucket", "many_buckets"])
def test_nested_exchange_moves_shards_and_sums_gradients_exactly(ranks, bucket_bytes):
    """Each rank's working chunk equals the whole tensor's slice; each home shard of the reduction
    equals the sum over blocks (a replicated role counted once per block, tp shards and partial
    sums from every rank); a tp1 rank receives the whole copy but its home chunk, a tp2 rank less."""
    out = ranks(4).run(run_exchange, bucket_bytes)
    for gather_err, reduce_err, *_ in out:
        assert gather_err == 0.0 and reduce_err <= 1e-12, (gather_err, reduce_err)
    received = [o[2] for o in out]
    assert received[0] == received[1] < received[2] == received[3], received
    calls = {o[4] for o in out}
    assert calls == ({1} if bucket_bytes > 2**10 else {len(SHAPES)}), calls


@pytest.mark.slow
def test_nested_exchange_on_a_three_dim_mesh(ranks):
    """8 ranks (2x2x2): a tp4, a tp2 and two tp1 blocks; the same exactness, and the wider the
    block's tp, the fewer bytes its ranks receive."""
    out = ranks(8).run(run_exchange, 64, torch.float64, LAYOUTS8, PEERS8, (0,) * 4 + (1,) * 2 + (2, 3))
    for gather_err, reduce_err, *_ in out:
        assert gather_err == 0.0 and reduce_err <= 1e-12, (gather_err, reduce_err)
    received = [o[2] for o in out]
    assert max(received[:4]) < min(received[4:6]) and max(received[4:6]) < min(received[6:]), received


def test_nested_exchange_refuses_sharded_or_foreign_layouts():
    mesh = MeshShape.for_layouts(LAYOUTS + ["dp4:fsdp"], 4)
    from lightning_hotspa.engine.nested_exchange import NestedExchange

    shardings = build_shardings(SHAPES, ROLES, mesh)
    tp1 = Layout.parse("dp4")
    with pytest.raises(
        LayoutError, match=r"rank 2's working layout dp4:fsdp in a block stage's exchange must be a replicated"
    ):  # without the engine's prefix (where a sharded block's copy lies) only replicated copies are routed
        NestedExchange(shardings, mesh, (tp1, tp1, Layout.parse("dp4:fsdp"), tp1), 0)
    with pytest.raises(LayoutError, match=r"rank 0's working layout tp4 .* must be a replicated layout among"):
        NestedExchange(shardings, mesh, (Layout.parse("tp4"),) * 4, 0)
    with pytest.raises(LayoutError, match=r"needs one layout per rank \(4\), got 3"):
        NestedExchange(shardings, mesh, (tp1,) * 3, 0)


@pytest.mark.parametrize("world, layout_names, peers, block", [
    (4, LAYOUTS, ("dp2xtp2", "dp2xtp2", "dp4", "dp4"), (0, 0, 1, 2)),
    (8, LAYOUTS8, PEERS8, (0,) * 4 + (1,) * 2 + (2, 3)),
], ids=["4ranks", "8ranks"])
def test_routes_agree_between_ranks_and_cover_each_copy_and_each_block_once(world, layout_names, peers, block):
    """Pure arithmetic, every rank's routes built in one process: what h sends r is what r expects
    from h; each working copy is tiled exactly once by what its rank receives; each home element
    receives one piece per block (a tp shard or a replicated role: the block's ranks split it) or
    one per rank (``replicated_partial``: every tp rank's partial sum)."""
    from lightning_hotspa.engine.nested_exchange import NestedExchange, working_interval

    mesh = MeshShape.for_layouts(layout_names, world)
    shapes = SHAPES if world == 4 else SHAPES8
    shardings = build_shardings(shapes, ROLES, mesh)
    layouts = tuple(Layout.parse(x) for x in peers)
    ex = [NestedExchange(shardings, mesh, layouts, r, bucket_bytes=64) for r in range(world)]
    for kind in ("gather_routes", "reduce_routes"):
        for h in range(world):
            for r in range(world):
                assert getattr(ex[h], kind).send[r] == getattr(ex[r], kind).recv[h], (kind, h, r)
    for r in range(world):
        for name, s in shardings.items():
            lo, hi = working_interval(s, layouts[r], r)
            pieces = sorted((a, b) for got in ex[r].gather_routes.recv for n, a, b in got if n == name)
            assert pieces[0][0] == lo and pieces[-1][1] == hi, (r, name, pieces)
            assert all(p[1] == q[0] for p, q in zip(pieces, pieces[1:])), (r, name, pieces)
            lo, hi = s.interval(r, s.home_prefix)
            count = [0] * (hi - lo)
            for got in ex[r].reduce_routes.recv:
                for n, a, b in got:
                    if n == name:
                        for i in range(a, b):
                            count[i - lo] += 1
            want = world if s.role.tp_grad == "partial" else len(set(block))
            assert count == [want] * (hi - lo), (r, name, count)
