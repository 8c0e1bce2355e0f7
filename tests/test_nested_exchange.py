"""The mixed-tp primitive (docs/DESIGN.md §4, "Mixed tp at once"): home shards -> each rank's
working copy in its own block's tp degree, and every rank's working gradients -> the home shards,
on 4 gloo ranks with a tp2 block {0, 1} beside two tp1 blocks {2}, {3}, against tensors built whole."""

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


def _full(name: str, salt: int, dtype=torch.float64) -> torch.Tensor:
    """A whole tensor of parameter ``name``, different per ``salt``."""
    g = torch.Generator().manual_seed(sorted(SHAPES).index(name) * 1000 + salt + 1)
    return torch.randn(SHAPES[name], generator=g, dtype=dtype)


def _cut(t, sharding, interval):
    return t if sharding.dim is None else t[(slice(None),) * sharding.dim + (slice(*interval),)]


def run_exchange(bucket_bytes, dtype=torch.float64):
    """Gathers working copies from home shards, then reduces fabricated working gradients; returns
    the largest error of each against the whole-tensor arithmetic, and the bytes received."""
    import torch.distributed as dist

    from lightning_hotspa.engine.nested_exchange import NestedExchange, working_interval

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = MeshShape.for_layouts(LAYOUTS, world)
    tp2, tp1 = Layout.parse("dp2xtp2"), Layout.parse("dp4")
    layouts = (tp2, tp2, tp1, tp1)
    block = (0, 0, 1, 2)  # ranks 0 and 1 are one tp2 block; 2 and 3 a tp1 block each
    shardings = build_shardings(SHAPES, ROLES, mesh)
    home = {n: _cut(_full(n, -1, dtype), s, s.interval(rank, s.home_prefix)).contiguous()
            for n, s in shardings.items()}
    exchange = NestedExchange(shardings, mesh, layouts, rank, bucket_bytes)
    working, gathered, gather_calls = exchange.gather(home)
    gather_err = max(float((working[n] - _cut(_full(n, -1, dtype), s, working_interval(s, layouts[rank], rank)))
                           .abs().max()) for n, s in shardings.items())

    def held(name, r):  # what rank r's working gradient is: a tp shard, a copy per block, a partial sum
        s = shardings[name]
        if s.role.tp_grad == "replicate":
            return _full(name, 100 + block[r], dtype)
        return _cut(_full(name, r, dtype), s, working_interval(s, layouts[r], r))

    grads = {n: held(n, rank) for n in shardings}
    shards, reduced, reduce_calls = exchange.reduce(grads, working)
    reduce_err = 0.0
    for name, s in shardings.items():
        expected = torch.zeros(SHAPES[name], dtype=dtype)
        if s.role.tp_grad == "replicate":
            for b in sorted(set(block)):
                expected += _full(name, 100 + b, dtype)
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


def test_nested_exchange_refuses_sharded_or_foreign_layouts():
    mesh = MeshShape.for_layouts(LAYOUTS + ["dp4:fsdp"], 4)
    from lightning_hotspa.engine.nested_exchange import NestedExchange

    shardings = build_shardings(SHAPES, ROLES, mesh)
    tp1 = Layout.parse("dp4")
    with pytest.raises(LayoutError, match=r"rank 2's working layout dp4:fsdp in a mixed-tp exchange must be a replicated"):
        NestedExchange(shardings, mesh, (tp1, tp1, Layout.parse("dp4:fsdp"), tp1), 0)
    with pytest.raises(LayoutError, match=r"rank 0's working layout tp4 .* must be a replicated layout among"):
        NestedExchange(shardings, mesh, (Layout.parse("tp4"),) * 4, 0)
    with pytest.raises(LayoutError, match=r"needs one layout per rank \(4\), got 3"):
        NestedExchange(shardings, mesh, (tp1,) * 3, 0)
