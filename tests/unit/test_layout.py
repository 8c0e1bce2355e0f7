"""Layouts and the world-mesh factorization: pure arithmetic, no process groups."""

import itertools

import pytest
import torch

from lightning_hotspa.layout import Layout, LayoutError, MeshShape, parse_layouts
from lightning_hotspa.placements import build_shardings

FOUNDATION = ["dp4", "dp2xtp2", "tp4", "dp2xcp2", "tp2xcp2"]


def test_layout_parse_and_name():
    assert Layout.parse("dp2xtp2") == Layout(dp=2, tp=2)
    assert Layout.parse("tp2 x cp2") == Layout(tp=2, cp=2)
    assert Layout.parse({"dp": 4}) == Layout(dp=4)
    assert Layout(dp=2, tp=2).name == "dp2xtp2"
    assert Layout().name == "dp1"
    assert Layout(tp=2, cp=2).world_size == 4


def test_one_layout_type_prices_pp_and_is_keyword_only():
    """pp is a field of Layout (the simulator's baselines); names round-trip; construction is keyword-only."""
    piped = Layout(dp=2, tp=2, pp=2)
    assert (piped.name, piped.world_size, piped.shards) == ("dp2xtp2xpp2", 8, 4)
    assert Layout.parse(piped.name) == Layout.parse({"dp": 2, "tp": 2, "pp": 2}) == piped
    assert Layout(dp=2, pp=2, fsdp=True).name == "dp2xpp2:fsdp" and Layout(dp=8) == Layout.parse("dp8")
    with pytest.raises(TypeError):
        Layout(2, 2)  # type: ignore[misc]


def test_cp_kinds_parse_name_and_nest():
    """All-gather-KV (':kv') and the hybrid (':kvN': Ulysses over cp/N, KV gather over N)."""
    assert Layout.parse("tp2xcp4:kv") == Layout(tp=2, cp=4, cp_kv=4)
    assert Layout.parse({"cp": 8, "cp_kv": 2}) == Layout.parse("cp8:kv2") == Layout(cp=8, cp_kv=2)
    for name, kind, ulysses in (("cp4", "ulysses", 4), ("cp4:kv", "kv", 1), ("cp8:kv2", "hybrid", 4)):
        lay = Layout.parse(name)
        assert (lay.name, lay.cp_kind, lay.cp_ulysses) == (name, kind, ulysses)
    assert Layout(cp=4) != Layout(cp=4, cp_kv=4)  # two layouts; both may sit in one mesh
    mesh = MeshShape.for_layouts(["dp8", "cp8:kv2", "cp8:kv", "tp2xcp4"], 8)
    assert mesh.sizes == (2, 2, 2)  # cp8:kv2 needs a boundary at its Ulysses part (4)
    hybrid = Layout.parse("cp8:kv2")
    assert (list(mesh.cp_ulysses_dims(hybrid)), list(mesh.cp_kv_dims(hybrid))) == ([0, 1], [2])
    for rank in range(8):  # cp index = Ulysses index * cp_kv + KV index (nested shard order)
        u = mesh.shard_index(rank, mesh.cp_ulysses_dims(hybrid))
        assert mesh.rank_coords(hybrid, rank)[2] == u * 2 + mesh.shard_index(rank, mesh.cp_kv_dims(hybrid))


def test_fsdp_suffix_names_a_sharded_working_copy():
    """':fsdp' (after any ':kv'): the same degrees and mesh, another layout."""
    assert Layout.parse("dp2xtp2:fsdp") == Layout(dp=2, tp=2, fsdp=True)
    assert Layout.parse("dp2xcp2:kv:fsdp") == Layout(dp=2, cp=2, cp_kv=2, fsdp=True)
    assert Layout.parse({"dp": 4, "fsdp": True}).name == "dp4:fsdp"
    assert Layout(dp=2, cp=2, cp_kv=2, fsdp=True).name == "dp2xcp2:kv:fsdp"
    assert Layout.parse("dp4:fsdp") != Layout.parse("dp4") and Layout.parse("dp4:fsdp").degrees == Layout(dp=4)
    assert MeshShape.for_layouts(["dp4", "dp4:fsdp", "dp2xtp2:fsdp"], 4).sizes == (2, 2)


def test_fsdp_shard_suffix_names_an_hsdp_copy_and_becomes_a_mesh_boundary():
    """':fsdp<n>': sharded over the n most local dp x cp ranks; n = dp*cp is plain ':fsdp'."""
    hsdp = Layout.parse("dp8xcp2:kv:fsdp4")
    assert hsdp == Layout(dp=8, cp=2, cp_kv=2, fsdp=True, fsdp_shard=4) and hsdp.name == "dp8xcp2:kv:fsdp4"
    assert (hsdp.fsdp_replicas, Layout.parse("dp16:fsdp").fsdp_shard) == (4, 16)
    assert Layout.parse("dp16:fsdp16") == Layout.parse("dp16:fsdp") == Layout(dp=16, fsdp=True)
    assert Layout.parse({"dp": 16, "fsdp": True, "fsdp_shard": 8}).name == "dp16:fsdp8"
    mesh = MeshShape.for_layouts(["dp8xtp2", "dp4xtp2xcp2:fsdp2"], 16)
    assert mesh.sizes == (2, 2, 4)  # tp 2, then tp x shard = 4 (the cp dim), dp
    assert mesh.fsdp_dims(Layout.parse("dp4xtp2xcp2:fsdp2")) == range(1, 2)
    assert mesh.fsdp_dims(Layout.parse("dp8xtp2")) == range(0)
    # lockstep rounds only where a shard group spans dp groups
    assert [Layout.parse(x).lockstep for x in ("dp16:fsdp", "dp8:fsdp2", "dp4xcp4:fsdp4", "dp2xcp8:fsdp2",
                                               "cp16:fsdp", "dp16")] == [True, True, False, False, False, False]


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda: Layout(dp=0), "dp must be a positive int, got 0"),
        (lambda: Layout(tp=-2), "tp must be a positive int, got -2"),
        (lambda: Layout(cp=1.5), "cp must be a positive int, got 1.5"),
        (lambda: Layout(dp=True), "dp must be a positive int, got True"),
        (lambda: parse_layouts(["dp2xpp2:fsdp"], 4), "layout dp2xpp2:fsdp: pipeline parallelism \\(pp=2\\) with a "
                                                     "sharded working copy \\(:fsdp\\) is not built"),
        (lambda: parse_layouts(["dp2xpp2"], 8),
         "layout dp2xpp2 covers 4 ranks \\(dp\\*tp\\*cp\\*pp = 2\\*1\\*1\\*2\\)"),
        (lambda: Layout.parse("dp2xpp2xpp2"), "names pp twice"),
        (lambda: Layout.parse("dp2xdp2"), "names dp twice"),
        (lambda: Layout.parse({"dp": 2, "sp": 2}), "unknown keys \\['sp'\\]"),
        (lambda: parse_layouts([], 4), "layout list is empty"),
        (lambda: parse_layouts(["dp2xtp2", "dp2"], 4), "layout dp2 covers 2 ranks"),
        (lambda: parse_layouts(["dp4", "dp4"], 4), "dp4 is listed twice"),
        (lambda: parse_layouts("dp4", 4), "expected a list of layouts"),
        (lambda: MeshShape.for_layouts(["tp2xcp3", "tp3xcp2"], 6), "do not nest"),
        (lambda: MeshShape.for_layouts(["cp6:kv2", "tp2xcp3"], 6), "Ulysses part of cp"),
        (lambda: Layout.parse("tp4:kv"), "no cp > 1"),
        (lambda: Layout.parse("cp4:kv3"), "cp_kv=3 must divide cp=4"),
        (lambda: Layout.parse("cp4:ring"), "cannot parse layout 'cp4:ring'"),
        (lambda: Layout(cp=2, cp_kv=0), "cp_kv must be a positive int, got 0"),
        (lambda: Layout.parse({"cp": 2, "cp_kind": "kv"}), "unknown keys \\['cp_kind'\\]"),
        (lambda: Layout.parse("tp4:fsdp"), "tp4:fsdp: fsdp shards the working copy .* dp = cp = 1"),
        (lambda: Layout.parse("dp4:fsdp:kv"), "cannot parse layout 'dp4:fsdp:kv'"),
        (lambda: Layout(dp=4, fsdp=1), "fsdp must be True or False, got 1"),
        (lambda: Layout.parse("dp4:fsdp3"), "dp4:fsdp3: fsdp_shard=3 must be > 1 and divide dp\\*cp = 4"),
        (lambda: Layout.parse("dp4:fsdp1"), "':fsdp1' must shard over 2 ranks or more"),
        (lambda: Layout(dp=4, fsdp_shard=2), "fsdp_shard=2 shards a working copy, but fsdp is False"),
        (lambda: Layout(dp=4, fsdp=True, fsdp_shard=2.0), "fsdp_shard must be an int, got 2.0"),
        (lambda: MeshShape.for_layouts(["dp6:fsdp2", "dp2xcp3"], 6), "tp\\*fsdp shard"),
    ],
)
def test_bad_layouts_name_the_value(bad, match):
    with pytest.raises(LayoutError, match=match):
        bad()


def test_saved_layouts_are_records_of_fields_and_old_names_still_load():
    for layout in [Layout(dp=4), Layout(tp=2, cp=4, cp_kv=2), Layout(dp=8, tp=2, fsdp=True, fsdp_shard=4),
                   Layout(dp=2, tp=2, pp=2)]:
        record = layout.to_state()
        assert record == {"dp": layout.dp, "tp": layout.tp, "cp": layout.cp, "pp": layout.pp,
                          "cp_kv": layout.cp_kv, "fsdp": layout.fsdp, "fsdp_shard": layout.fsdp_shard}
        assert Layout.from_state(record) == layout and Layout.from_state(layout.name) == layout  # old states
    with pytest.raises(LayoutError, match=r"missing \['fsdp_shard'\], unknown \['cp_kind'\]"):
        Layout.from_state({**{k: v for k, v in Layout(dp=4).to_state().items() if k != "fsdp_shard"}, "cp_kind": 1})
    with pytest.raises(LayoutError, match=r"got 4 \(int\)"):
        Layout.from_state(4)
    with pytest.raises(LayoutError, match="cp_kv=3 must divide cp=4"):  # the record is validated like any layout
        Layout.from_state({**Layout(cp=4).to_state(), "cp_kv": 3})


def test_factorization_for_foundation_set():
    shape = MeshShape.for_layouts(FOUNDATION, 4)
    assert shape.sizes == (2, 2)
    assert list(shape.tp_dims(Layout(tp=4))) == [0, 1]
    assert list(shape.tp_dims(Layout(dp=2, tp=2))) == [0]
    assert list(shape.cp_dims(Layout(tp=2, cp=2))) == [1]
    assert list(shape.cp_dims(Layout(dp=2, cp=2))) == [0]
    assert list(shape.dp_dims(Layout(dp=2, cp=2))) == [1]
    # tp groups are the most local ranks
    assert shape.group_ranks(0, shape.tp_dims(Layout(dp=2, tp=2))) == (0, 1)
    assert shape.group_ranks(3, shape.tp_dims(Layout(dp=2, tp=2))) == (2, 3)
    assert MeshShape.for_layouts(["dp8", "dp4xtp2", "dp2xtp2xcp2", "tp4xcp2"], 8).sizes == (2, 2, 2)
    assert MeshShape.for_layouts(["dp4", "tp4"], 4).sizes == (4,)
    assert MeshShape.for_layouts(["dp1"], 1).sizes == (1,)


@pytest.mark.parametrize("world, layouts", [(4, FOUNDATION), (8, ["dp8", "dp4xtp2", "dp2xtp2xcp2", "tp4xcp2", "tp8"])])
def test_rank_coords_cover_every_role_once(world, layouts):
    shape = MeshShape.for_layouts(layouts, world)
    for layout in shape.layouts:
        coords = [shape.rank_coords(layout, r) for r in range(world)]
        assert sorted(coords) == sorted(itertools.product(range(layout.dp), range(layout.tp), range(layout.cp)))


def test_mesh_tensor_matches_coords():
    shape = MeshShape.for_layouts(["dp8", "dp4xtp2", "dp2xtp2xcp2"], 8)
    mesh = shape.mesh_tensor()
    for r in range(8):
        assert int(mesh[shape.coords(r)]) == r


def test_tp_degrees_nest_as_chunks():
    """A smaller tp's chunk always contains the chunks a larger tp gives the same rank."""
    shape = MeshShape.for_layouts(["dp8", "dp4xtp2", "dp2xtp4", "tp8"], 8)
    sh = build_shardings({"w": (16, 3)}, {"w": "colwise"}, shape)["w"]
    for r in range(8):
        for small, large in itertools.combinations(range(shape.ndim + 1), 2):
            a, b = sh.interval(r, small), sh.interval(r, large)
            assert a[0] <= b[0] and b[1] <= a[1]


def test_home_sharding_rules():
    shape = MeshShape.for_layouts(FOUNDATION, 4)
    sh = build_shardings(
        {"col": (8, 4), "row": (4, 8), "norm": (6,), "scalar": (), "odd": (2, 4)},
        {"col": "colwise", "row": "rowwise", "norm": "replicated", "scalar": "replicated", "odd": "replicated"},
        shape,
    )
    assert sh["col"].home_prefix == 2 and sh["col"].local_shape(2) == (2, 4)
    assert sh["row"].dim == 1 and sh["row"].local_shape(2) == (4, 2)
    assert sh["norm"].home_prefix == 1  # 6 splits over 2 but not 4: never an uneven split
    assert sh["scalar"].home_prefix == 0
    with pytest.raises(LayoutError, match="size 6 on dim 0, which tp=4 of layout tp4"):
        build_shardings({"w": (6, 4)}, {"w": "colwise"}, shape)
    with pytest.raises(LayoutError, match="unknown tensor-parallel role 'diagonal'"):
        build_shardings({"w": (8, 4)}, {"w": "diagonal"}, shape)
    with pytest.raises(LayoutError, match="no role given for parameters \\['w'\\]"):
        build_shardings({"w": (8, 4)}, {}, shape)
    assert torch.Size(sh["col"].shape) == torch.Size([8, 4])


def test_world_mesh_groups_carry_a_description_naming_them():
    """NCCL's watchdog and flight recorder name a timed-out group by its description."""
    from lightning_hotspa.mesh import WorldMesh
    from lightning_hotspa.testing.fake_world import FakeWorld

    with FakeWorld(8, rank=5):
        world = WorldMesh(["dp2xtp4", "dp4xtp2"])
        tp = world.layout_groups(Layout.parse("dp2xtp4")).tp
        assert tp.group.group_desc == f"hotspa mesh dims {list(tp.dims)} ranks 4..7 (4)"


def test_pipeline_dims_are_outermost() -> None:
    """pp takes the outermost mesh dims (after tp, cp and dp); the dp / pp groups of a rank."""
    mesh = MeshShape.for_layouts(["dp2xpp2", "dp4", "tp2xcp2", "tp2xpp2", "pp4"], 4)
    assert mesh.sizes == (2, 2)
    dp2pp2, tp2pp2, pp4 = (Layout.parse(x) for x in ("dp2xpp2", "tp2xpp2", "pp4"))
    assert (mesh.dp_dims(dp2pp2), mesh.pp_dims(dp2pp2)) == (range(0, 1), range(1, 2))
    assert (mesh.tp_dims(tp2pp2), mesh.dp_dims(tp2pp2), mesh.pp_dims(tp2pp2)) == (range(0, 1), range(1, 1), range(1, 2))
    assert mesh.pp_dims(pp4) == range(0, 2) and mesh.pp_dims(Layout.parse("dp4")) == range(2, 2)
    assert mesh.group_ranks(0, mesh.pp_dims(dp2pp2)) == (0, 2)  # a stage's dp ranks are consecutive
    assert [mesh.rank_coords(dp2pp2, r)[0] for r in range(4)] == [0, 1, 0, 1]  # both stages see one dp shard
