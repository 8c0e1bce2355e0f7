"""Hot-path benchmark: the counts and ratios of issue 29, measured on the real code path, one JSON line last.

Keys (docs/gpu-runtime.md explains each):

* ``host_syncs_per_micro_batch``: per layout kind (dp, tp, ulysses, kv, hybrid, fsdp), the would-be
  host syncs (:mod:`lightning_hotspa.testing.host_syncs`) counted from each micro-batch's forward to
  the end of its backward, in the SECOND step (steady state), on 4 gloo ranks, a tiny GQA Llama;
  the max over ranks, divided by the micro-batches.
* ``reduce_waits``: per layout kind (dp, tp, fsdp), the gradient collectives a rank waits on inside
  the step's backward passes and after them (4 gloo ranks, tiny Llama, 64 KiB buckets, second step).
* ``kv_attention_calls_per_layer``: attention-kernel calls one layer's forward makes for ONE document
  on the busiest cp rank of ``:kv`` (llama3-8b heads, tp=1): the ring blocks the forward iterates
  (``parallel/kv_ring.py``), and per local query chunk (2 per document per rank).
* ``cp_exchange_bytes_per_layer``: per layout (llama3-8b heads, tp8, fake worlds of 64 and 1024 ranks,
  one document of ``--cp-tokens``), the bytes rank 0 receives in one attention layer's forward +
  backward cp exchange: the KV ring's, split into ``ring_overlapped`` (received while a block kernel
  ran between the shift's post and its wait) and ``ring_exposed``, the Ulysses all-to-alls
  (``ulysses_bytes``, never overlapped), ``exposed_bytes`` (the two exposed parts) and the cost
  model's bytes for the same exchanges (``cost_model_bytes``).
* ``kv_work_vs_single``: CPU seconds of forward+backward of one document at cp4 ``:kv`` summed over
  4 gloo ranks, over the same document in one process (4-D SDPA), same run.
* ``collectives_per_step``: llama7b on 8 fake ranks (``FakeTensorMode``), NCCL default bucket sizes:
  a switch from home plus one reducing stage (``:fsdp``: one forward+backward with its per-unit
  gathers and reduce-scatters); count and mean payload (MB per call, input size).
* ``process_groups_per_rank``: at 8, 64 and 1024 fake ranks, ``WorldMesh`` of the ``auto`` candidate
  set of llama3-8b on H100 plus what a ``SwitchEngine`` of its shardings adds at setup: process
  groups rank 0 belongs to, the mesh-dim ranges created, group creations every rank calls (one
  ``new_group`` per block on the fake backend; on NCCL one ``split_group`` per range) and the
  ``DeviceMesh``'s own. ``process_groups_wide_set``: the same for a wider set (``WIDE``).
* ``reduce_exposure``: per replicated layout (llama7b widths, 3 layers, 8 fake ranks, NCCL buckets) the
  share of one stage's gradient-reduction bytes launched with no backward GEMM left, and the exposed
  share when the last backward takes as long as the reduction, measured next to the cost model's
  (``planner/cost/grad_exposure.py``).
* ``tp_cp_bytes_per_layer``: per layout (llama7b widths, 8 fake ranks, 1024 tokens per dp group) the tp / cp
  collective MB rank 0 receives per layer in forward + backward, in flight while a GEMM runs (tp overlap's
  all-gather + matmul and matmul + reduce-scatter) and exposed (the backward re-gathers, cp exchanges). A count
  of what the code issues; on CPU / gloo nothing overlaps in time.
* ``switch_bytes_over_lower_bound``: ``benchmark_switch.py --world 4`` and ``--world 8`` (small model).

    python recipes/benchmark_hot_path.py [--kv-tokens 32768] [--skip-switch]
    python recipes/benchmark_hot_path.py --skip-switch --kv-tokens 256 --collectives-preset tiny \
        --group-worlds 8,64 --cp-tokens 2048 --cp-worlds 64 --fake-layouts dp8,dp4xtp2               # smoke
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_hotspa.layout import Layout  # noqa: E402
from lightning_hotspa.testing.spawn import run_on_ranks  # noqa: E402

KINDS = {"dp": "dp4", "tp": "dp2xtp2", "ulysses": "cp4", "kv": "cp4:kv", "hybrid": "cp4:kv2", "fsdp": "dp4:fsdp"}
MB = 1e6
#: a wider candidate set than ``auto`` picks today (tp, Ulysses, all-gather-KV, hybrid and HSDP layouts
#: on one mesh): where "only the groups a run uses" shows
WIDE = {64: ["dp8xtp8", "dp4xtp8xcp2", "dp2xtp8xcp4:kv", "tp8xcp8:kv2", "dp32xtp2:fsdp8"],
        1024: ["dp128xtp8", "dp64xtp8xcp2", "dp32xtp8xcp4:kv", "dp16xtp8xcp8:kv2", "dp512xtp2:fsdp8"]}


# -- host syncs ---------------------------------------------------------------------------------------

def _plan(world, layout: Layout, step: int):
    from lightning_hotspa.plan import Stage, StepPlan, slice_plan

    lengths = [40, 24, 56, 32] * layout.dp  # two micro-batches of two documents per dp group
    groups = tuple(((4 * g, 4 * g + 1), (4 * g + 2, 4 * g + 3)) for g in range(layout.dp))
    gen = torch.Generator().manual_seed(step)
    docs = [torch.randint(0, 256, (n,), generator=gen) for n in lengths]
    return slice_plan(StepPlan(step, tuple(lengths), (Stage(layout, groups, label=layout.name),)), docs,
                      world.shape, world.rank)


def host_syncs_rank() -> dict[str, dict]:
    """On one gloo rank: per layout kind, syncs per micro-batch in the second step, and their ops."""
    from lightning_hotspa.engine.step_runner import StepHooks, StepRunner
    from lightning_hotspa.engine.switch import SwitchEngine, build_home_parameters
    from lightning_hotspa.mesh import WorldMesh
    from lightning_hotspa.models import LlamaConfig, llama_tp_plan, param_roles
    from lightning_hotspa.parallel.model import ParallelModel
    from lightning_hotspa.placements import build_shardings
    from lightning_hotspa.testing.host_syncs import count_host_syncs
    from lightning_hotspa.tools.memory import _Wrapped

    torch.manual_seed(0)
    module = _Wrapped(LlamaConfig.preset("tiny"))
    layouts = [Layout.parse(x) for x in KINDS.values()]
    world = WorldMesh(layouts)
    init = {n: p.detach().clone() for n, p in module.named_parameters()}
    roles = param_roles(module, llama_tp_plan(module.model.config, 2, prefix="model."))
    shardings = build_shardings({n: tuple(p.shape) for n, p in init.items()}, roles, world.shape)
    home = build_home_parameters(world, shardings, lambda name, shape: init[name])
    parallel = ParallelModel(module, roles, world)
    parallel.restore(home)
    engine = SwitchEngine(world, shardings, home)
    runner = StepRunner(engine, parallel)

    class Window(StepHooks):
        def __init__(self, log):
            self.log, self.micro_batches = log, 0

        def enter_micro_batch(self, micro_batch):
            self.micro_batches += 1
            self.log.enabled = True

        def backward(self, scaled_loss):
            scaled_loss.backward()
            self.log.enabled = False

    out = {}
    for kind, name in KINDS.items():
        layout = Layout.parse(name)
        runner.run(_plan(world, layout, 0), module)  # warm-up step: caches fill
        engine.clear_grad_store()
        plan = _plan(world, layout, 1)
        with count_host_syncs() as log:
            log.enabled = False
            window = Window(log)
            runner.run(plan, module, window)
        engine.clear_grad_store()
        out[kind] = {"per_micro_batch": log.count / window.micro_batches, "ops": dict(log.ops)}
    return out


def host_syncs() -> dict:
    per_rank = run_on_ranks(host_syncs_rank, 4, timeout_s=1800)
    result, ops = {}, {}
    for kind in KINDS:
        worst = max(per_rank, key=lambda r: r[kind]["per_micro_batch"])[kind]
        result[kind], ops[kind] = worst["per_micro_batch"], worst["ops"]
    return {"host_syncs_per_micro_batch": result, "host_sync_ops_busiest_rank": ops}


# -- gradient-reduction waits ------------------------------------------------------------------------

def reduce_waits_rank() -> dict[str, dict]:
    """On one gloo rank: per layout kind, the gradient collectives waited on (``_Pending.result``
    with work) inside the step's backward passes and after them, in the second step; 64 KiB buckets
    (several per stage), the engine's default 2 in flight."""
    from lightning_hotspa.engine import gradients
    from lightning_hotspa.engine.step_runner import StepHooks, StepRunner
    from lightning_hotspa.engine.switch import SwitchEngine, build_home_parameters
    from lightning_hotspa.mesh import WorldMesh
    from lightning_hotspa.models import LlamaConfig, llama_tp_plan, param_roles
    from lightning_hotspa.parallel.model import ParallelModel
    from lightning_hotspa.placements import build_shardings
    from lightning_hotspa.tools.memory import _Wrapped

    torch.manual_seed(0)
    module = _Wrapped(LlamaConfig.preset("tiny"))
    kinds = {k: KINDS[k] for k in ("dp", "tp", "fsdp")}
    world = WorldMesh([Layout.parse(x) for x in kinds.values()])
    init = {n: p.detach().clone() for n, p in module.named_parameters()}
    roles = param_roles(module, llama_tp_plan(module.model.config, 2, prefix="model."))
    shardings = build_shardings({n: tuple(p.shape) for n, p in init.items()}, roles, world.shape)
    home = build_home_parameters(world, shardings, lambda name, shape: init[name])
    parallel = ParallelModel(module, roles, world)
    parallel.restore(home)
    runner = StepRunner(SwitchEngine(world, shardings, home, bucket_bytes=64 * 1024), parallel)
    state = {"inside": False, "backward": 0, "end": 0}
    original = gradients._Pending.result

    def result(self):
        if self.work is not None:
            state["backward" if state["inside"] else "end"] += 1
        return original(self)

    class Hooks(StepHooks):
        def backward(self, scaled_loss):
            state["inside"] = True
            try:
                scaled_loss.backward()
            finally:
                state["inside"] = False

    out = {}
    gradients._Pending.result = result
    try:
        for kind, name in kinds.items():
            layout = Layout.parse(name)
            runner.run(_plan(world, layout, 0), module, Hooks())  # warm-up step
            runner.engine.clear_grad_store()
            state.update(backward=0, end=0)
            runner.run(_plan(world, layout, 1), module, Hooks())
            runner.engine.clear_grad_store()
            out[kind] = {"in_backward": state["backward"], "at_end": state["end"]}
    finally:
        gradients._Pending.result = original
    return out


def reduce_waits() -> dict:
    per_rank = run_on_ranks(reduce_waits_rank, 4, timeout_s=1800)
    return {"reduce_waits": {kind: {"in_backward": max(r[kind]["in_backward"] for r in per_rank),
                                    "at_end": max(r[kind]["at_end"] for r in per_rank)} for kind in per_rank[0]}}


# -- the KV ring --------------------------------------------------------------------------------------

def kv_calls() -> dict:
    """Kernel calls per layer forward for one document, busiest cp rank (the geometry does not depend
    on the heads): one per ring block (``parallel/kv_ring.py``), the same on CPU and CUDA."""
    from lightning_hotspa.parallel.kv_ring import ring_geometry

    out = {}
    for tokens, cp in ((32768, 4), (131072, 8)):
        local = tokens // cp
        cu = torch.tensor([0, local], dtype=torch.int32)
        calls = max(sum(len(step) for step in ring_geometry(cu, cp, 1, cp, r).steps) for r in range(cp))
        out[f"{tokens // 1024}K cp{cp}"] = {"calls": calls, "per_local_chunk": calls / 2}
    return out


#: (fake world, layout) of ``cp_exchange_bytes_per_layer``: llama3-8b heads (Ulysses: its part must divide them)
CP_EXCHANGE = ((64, "tp8xcp8:kv"), (64, "tp8xcp8:kv2"), (64, "dp2xtp2xcp16"), (1024, "tp8xcp128:kv"),
               (1024, "tp8xcp128:kv32"))


def cp_exchange(world: int, layout: str, tokens: int, model: str = "llama3-8b") -> dict:
    """One attention layer's cp exchange, forward + backward, on rank 0 of a fake world (bf16, one
    document of ``tokens``): bytes received per layer, split into what a ring step receives while a
    block kernel runs between its post and its wait (``overlapped``: hidden where the backend
    overlaps) and what it receives with no kernel in between (``exposed``), plus the Ulysses
    all-to-alls (always exposed); beside the cost model's bytes for the same layer."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lightning_hotspa import group_collectives
    from lightning_hotspa.cp_kinds import CP_KINDS
    from lightning_hotspa.mesh import WorldMesh
    from lightning_hotspa.model_shape import describe_model
    from lightning_hotspa.parallel.core_attention import CP_ATTENTION, ParallelCoreAttention
    from lightning_hotspa.parallel.state import ParallelState
    from lightning_hotspa.plan import pack_micro_batch
    from lightning_hotspa.planner.cost.cost_model import AnalyticCostModel
    from lightning_hotspa.testing.comm_bytes import count_collective_bytes
    from lightning_hotspa.testing.fake_world import FakeWorld, fake_mode
    from lightning_hotspa.testing.gpu_attention import flash_varlen_standin

    shape, lay = describe_model(model), Layout.parse(layout)
    kernels = [0]

    class Kernels(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kernels[0] += func._overloadpacket.__name__.startswith("_scaled_dot_product")
            return func(*args, **(kwargs or {}))

    split = {"overlapped": 0, "exposed": 0}
    post, wait = group_collectives.GroupCollectives.ring_shift, group_collectives.RingShift.wait

    def posted(self, send):
        shift = post(self, send)
        shift.kernels_at_post = kernels[0]
        return shift

    def waited(self):
        key = "overlapped" if kernels[0] > self.kernels_at_post else "exposed"
        split[key] += self._recv.numel() * self._recv.element_size()
        return wait(self)

    with FakeWorld(world):
        mesh = WorldMesh([lay])
        groups = mesh.layout_groups(lay)
        mb = pack_micro_batch([torch.zeros(tokens, dtype=torch.int64)], lay.cp, groups.cp.index)
        rows, heads, kv_heads = int(mb.cu_seqlens[-1]), shape.n_heads // lay.tp, max(1, shape.n_kv_heads // lay.tp)
        wrapper = ParallelCoreAttention(flash_varlen_standin, ParallelState(groups, mb), "layer")
        group_collectives.GroupCollectives.ring_shift, group_collectives.RingShift.wait = posted, waited
        try:
            with fake_mode(), Kernels(), count_collective_bytes() as log:
                q, k, v = (torch.empty(rows, h, shape.head_dim, dtype=torch.bfloat16, requires_grad=True)
                           for h in (heads, kv_heads, kv_heads))
                out = CP_ATTENTION[lay.cp_kind](wrapper, q, k, v, mb.cu_seqlens, rows, groups)
                out.backward(torch.empty_like(out))
        finally:
            group_collectives.GroupCollectives.ring_shift, group_collectives.RingShift.wait = post, wait
    ring = sum(b for name, b in log.calls if name == "batch_isend_irecv")
    ulysses = log.bytes_received - ring
    cm = AnalyticCostModel(model, "H100", world)
    priced = {ex.what: (ex.rounds * ex.steps / ex.per + ex.tail) * ex.width / lay.tp * cm.param_bytes * tokens / lay.cp
              for ex in CP_KINDS[lay.cp_kind].exchanges(shape, lay.tp, lay.cp, lay.cp_kv)}
    return {"ring_bytes": ring, "ring_overlapped": split["overlapped"], "ring_exposed": split["exposed"],
            "ulysses_bytes": ulysses, "exposed_bytes": split["exposed"] + ulysses, "cost_model_bytes": priced}


def cp_exchanges(tokens: int, worlds: tuple[int, ...] = (64, 1024)) -> dict:
    """:func:`cp_exchange` of every :data:`CP_EXCHANGE` case on one of ``worlds``."""
    return {f"{layout} on {world}": cp_exchange(world, layout, tokens) for world, layout in CP_EXCHANGE
            if world in worlds}


def _qkv(tokens: int, heads: int, kv_heads: int, dim: int):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(tokens, h, dim, generator=gen) for h in (heads, kv_heads, kv_heads)]


def kv_work_rank(tokens: int, heads: int, kv_heads: int, dim: int) -> float:
    """This rank's CPU seconds of forward+backward of its share of one document at cp4 ``:kv``."""
    from lightning_hotspa.mesh import WorldMesh
    from lightning_hotspa.parallel.kv_ring import kv_ring_attention
    from lightning_hotspa.plan import pack_micro_batch

    world = WorldMesh(["cp4:kv"])
    groups = world.layout_groups(Layout.parse("cp4:kv"))  # a Layout: layout_groups takes no names
    cp_rank = groups.cp.index
    mb = pack_micro_batch([torch.zeros(tokens, dtype=torch.int64)], 4, cp_rank)
    q, k, v = _qkv(tokens, heads, kv_heads, dim)
    rows = torch.cat([torch.arange(tokens).chunk(8)[i] for i in (cp_rank, 7 - cp_rank)])
    q, k, v = (t[rows].clone().requires_grad_() for t in (q, k, v))
    dist.barrier()
    start = time.thread_time()
    out = kv_ring_attention(q, k, v, mb.cu_seqlens, groups, mb)
    out.sum().backward()
    return time.thread_time() - start


def kv_work(tokens: int, heads: int, kv_heads: int, dim: int) -> dict:
    from lightning_hotspa.models.attention import sdpa_attention

    torch.set_num_threads(1)
    q, k, v = (t.requires_grad_() for t in _qkv(tokens, heads, kv_heads, dim))
    start = time.thread_time()
    out = sdpa_attention(q, k, v, torch.tensor([0, tokens], dtype=torch.int32), tokens)
    out.sum().backward()
    single = time.thread_time() - start
    ranks = run_on_ranks(kv_work_rank, 4, tokens, heads, kv_heads, dim, timeout_s=3600)
    return {"kv_work_vs_single": sum(ranks) / single,
            "kv_work_detail": {"tokens": tokens, "heads": heads, "kv_heads": kv_heads, "head_dim": dim,
                               "single_cpu_s": single, "ranks_cpu_s": ranks}}


# -- collectives at llama7b scale, fake ranks ----------------------------------------------------------

def _nccl_bucket_kwargs() -> dict:
    """The strategy's NCCL bucket defaults (none before issue 29: the engine's own, 4 MiB)."""
    try:
        from lightning_hotspa.engine.buckets import bucket_defaults
    except ImportError:
        return {}
    return bucket_defaults("nccl").engine_kwargs()


def collectives_for(layout_name: str, preset: str = "llama7b") -> dict:
    """Count and mean payload of the collectives of a switch from home + one reducing stage of ``preset``."""
    from lightning_hotspa.engine.fsdp import ShardedUnits
    from lightning_hotspa.models import LlamaConfig
    from lightning_hotspa.testing.comm_bytes import count_collective_bytes
    from lightning_hotspa.tools.fake_llama import fake_llama
    from lightning_hotspa.tools.memory import _as_if_mid_step

    layout = Layout.parse(layout_name)
    sizes: list[int] = []
    with fake_llama(LlamaConfig.preset(preset), layout, 8, 64, **_nccl_bucket_kwargs()) as step:
        engine, parallel = step.engine, step.parallel
        units = ShardedUnits(engine, step.module) if layout.fsdp else None
        with _payloads(sizes), count_collective_bytes() as log:
            engine.materialize(layout)
            if units is None:
                _as_if_mid_step(engine, step.home)
            else:
                parallel.activate(layout, engine.working, False)
                with parallel.micro_batch(step.micro_batch), units.forward_prefetch():
                    loss = step.module(step.micro_batch)
                loss.backward()
                units.end_backward()
            engine.reduce_gradients()
    return {"count": log.count, "mean_payload_MB": (sum(sizes) / len(sizes) / MB) if sizes else 0.0}


@contextlib.contextmanager
def _payloads(sizes: list[int]):
    """Records the input bytes of every tensor collective (``dist`` functions) into ``sizes``."""
    names = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single", "broadcast")
    originals = {n: getattr(dist, n) for n in names}

    def wrap(fn, pick):
        def inner(*args, **kwargs):
            t = args[pick] if len(args) > pick else None
            if isinstance(t, torch.Tensor):
                sizes.append(t.numel() * t.element_size())
            return fn(*args, **kwargs)
        return inner

    for n, fn in originals.items():
        setattr(dist, n, wrap(fn, 1 if n in ("all_gather_into_tensor", "reduce_scatter_tensor",
                                             "all_to_all_single") else 0))
    try:
        yield
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)


# -- gradient reduction exposure -------------------------------------------------------------------------

EXPOSURE_LAYOUTS = ("dp8", "dp4xtp2", "dp2xtp4")
BESIDE_LAYOUTS = ("dp8", "dp4xtp2", "dp2xtp4", "tp8", "dp4xcp2", "dp2xtp2xcp2")


def reduce_exposure(world: int = 8, layers: int = 3, preset: str = "llama7b",
                    layouts: tuple[str, ...] = EXPOSURE_LAYOUTS) -> dict:
    """Per replicated layout (llama7b widths, ``layers`` layers, ``world`` fake ranks, NCCL's buckets): the
    share of the stage's reduction bytes launched with no backward GEMM left (exposed however fast the
    network), and the exposed share when the last backward takes 1 x the reduction's time, measured
    on the real code path against the cost model's (planner/cost/grad_exposure.py)."""
    import dataclasses

    from lightning_hotspa.model_shape import describe_model
    from lightning_hotspa.models import LlamaConfig
    from lightning_hotspa.planner.cost.grad_exposure import REDUCE_BUCKET_BYTES, exposed_share, reduce_buckets
    from lightning_hotspa.tools.reduce_exposure import measure_reduce_buckets

    config = dataclasses.replace(LlamaConfig.preset(preset), n_layers=layers)
    out = {}
    for name in layouts:
        par = Layout.parse(name)
        measured = measure_reduce_buckets(config, par, world)["buckets"]
        model = reduce_buckets(describe_model(config), par.tp, REDUCE_BUCKET_BYTES["cuda"])
        total = sum(b for b, _ in measured)
        out[name] = {"bytes_MB": total / MB, "no_gemm_left_share": sum(b for b, r in measured if r == 0) / total,
                     "exposed_share_at_1x": exposed_share(measured, 1.0),
                     "model_no_gemm_left_share": exposed_share(model, 1e9), "model_exposed_share_at_1x":
                     exposed_share(model, 1.0)}
    return {"reduce_exposure": out}


# -- tp / cp communication beside the GEMMs --------------------------------------------------------------

def _layer_bytes(layout_name: str, layers: int, world: int, tokens: int, preset: str) -> tuple[float, float]:
    """(bytes received beside a GEMM, bytes received exposed) by rank 0 in one micro-batch's forward +
    backward of llama7b's widths with ``layers`` layers on ``world`` fake ranks: a call made inside a tp
    overlap operation (``all_gather_matmul`` / ``matmul_reduce_scatter`` of the group's collectives
    object) moves its bytes while a GEMM runs on the backends that fuse them (NCCL: symmetric memory;
    gloo: its ring); every other call's are exposed."""
    import dataclasses

    from lightning_hotspa import group_collectives
    from lightning_hotspa.models import LlamaConfig
    from lightning_hotspa.testing.comm_bytes import count_collective_bytes
    from lightning_hotspa.tools.fake_llama import fake_llama

    config = dataclasses.replace(LlamaConfig.preset(preset), n_layers=layers)
    layout = Layout.parse(layout_name)
    beside: list[tuple[int, int]] = []  # [start, stop) of the log's calls made inside an overlap operation
    originals = {n: getattr(group_collectives.GroupCollectives, n) for n in ("all_gather_matmul",
                                                                            "matmul_reduce_scatter")}

    def wrap(fn):
        def inner(self, *args, **kwargs):
            start = log.count
            try:
                return fn(self, *args, **kwargs)
            finally:
                beside.append((start, log.count))
        return inner

    with count_collective_bytes() as log:
        for n, fn in originals.items():
            setattr(group_collectives.GroupCollectives, n, wrap(fn))
        try:
            with fake_llama(config, layout, world, tokens) as step:
                step.engine.materialize(layout)
                step.parallel.activate(layout, step.engine.working, False)
                first = log.count
                with step.parallel.micro_batch(step.micro_batch):
                    loss = step.module(step.micro_batch)
                loss.backward()
                last = log.count
        finally:
            for n, fn in originals.items():
                setattr(group_collectives.GroupCollectives, n, fn)
    inside = {i for a, b in beside for i in range(a, b)}
    calls = log.calls[first:last]
    hidden = sum(b for i, (_, b) in enumerate(calls, start=first) if i in inside)
    return float(hidden), float(sum(b for _, b in calls) - hidden)


def comm_beside_gemms(world: int = 8, tokens: int = 1024, preset: str = "llama7b",
                      layouts: tuple[str, ...] = BESIDE_LAYOUTS) -> dict:
    """Per layout (llama7b widths, ``world`` fake ranks, one micro-batch of ``tokens`` per dp group): the
    tp / cp collective bytes rank 0 receives per layer in forward + backward, split into those in flight
    while a GEMM runs (tp overlap) and those exposed (the re-gathers, cp exchanges), MB; the layer's
    share is the difference between a 2-layer and a 1-layer model (the embedding and head cancel)."""
    from lightning_hotspa.models import LlamaConfig

    heads, out = LlamaConfig.preset(preset).n_heads, {}
    for name in layouts:
        if heads % (Layout.parse(name).tp * Layout.parse(name).cp):
            continue  # (the smoke run's tiny model: 4 heads)
        one, two = _layer_bytes(name, 1, world, tokens, preset), _layer_bytes(name, 2, world, tokens, preset)
        out[name] = {"in_flight_beside_gemm_MB": (two[0] - one[0]) / MB, "exposed_MB": (two[1] - one[1]) / MB}
    return {"tp_cp_bytes_per_layer": out}


# -- process groups ------------------------------------------------------------------------------------

def process_groups(world_size: int, layouts=None) -> dict:
    """Groups rank 0 joins and group creations every rank calls (ours and the ``DeviceMesh``'s), for
    the ``auto`` set of llama3-8b (or ``layouts``): the ``WorldMesh`` plus what a ``SwitchEngine`` of
    llama3-8b's shardings asks for at setup (its home tensors are meta: only the names count)."""
    import torch.distributed.device_mesh as device_mesh
    import torch.distributed.distributed_c10d as c10d

    from lightning_hotspa.engine.switch import SwitchEngine
    from lightning_hotspa.mesh import WorldMesh
    from lightning_hotspa.models import LlamaConfig
    from lightning_hotspa.planner.candidates import auto_layouts
    from lightning_hotspa.testing.fake_world import FakeWorld
    from lightning_hotspa.tools.memory import _Wrapped, llama_roles_and_shardings

    layouts = layouts or auto_layouts(world_size, "llama3-8b", "H100", 131072)
    layouts = [Layout.parse(x) for x in layouts]
    created = {"ours": 0, "device_mesh": 0}
    modules = [(c10d, "ours"), (dist, "ours"), (device_mesh, "device_mesh")]
    originals = [(m, n, getattr(m, n)) for m, _ in modules for n in ("new_group", "split_group") if hasattr(m, n)]

    def wrap(fn, who):
        def inner(*args, **kwargs):
            created[who] += 1
            return fn(*args, **kwargs)
        return inner

    config = LlamaConfig.preset("llama3-8b")
    with torch.device("meta"):
        module = _Wrapped(config)
    widest = max(layouts, key=lambda x: x.tp)
    with FakeWorld(world_size):
        for (m, n, fn), who in zip(originals, [w for m, w in modules for n in ("new_group", "split_group")
                                                if hasattr(m, n)]):
            setattr(m, n, wrap(fn, who))
        try:
            start = time.perf_counter()
            world = WorldMesh(layouts)
            _, shardings = llama_roles_and_shardings(module, config, widest, world)
            SwitchEngine(world, shardings, {n: torch.empty(0, device="meta") for n in shardings})
            seconds = time.perf_counter() - start
        finally:
            for m, n, fn in originals:
                setattr(m, n, fn)
        # (the code before issue 29's group work had neither: every contiguous range, in ``_groups``)
        member = getattr(world, "process_group_count", None)
        if member is None:
            member = len({id(g.group) for g in world._groups.values() if g.group is not None})
        ranges = getattr(world, "group_ranges", None) or sorted((d[0], d[-1] + 1) for d in world._groups)
    every = world.shape.ndim * (world.shape.ndim + 1) // 2
    return {"layouts": [str(x) for x in layouts], "mesh": list(world.shape.sizes), "groups_of_rank_0": member,
            "ranges": [list(r) for r in ranges], "ranges_of_every_contiguous": every,
            "world_wide_creations": created["ours"], "device_mesh_creations": created["device_mesh"],
            "seconds": seconds}


# -- switch bytes --------------------------------------------------------------------------------------

def switch_bytes(world: int) -> float:
    cmd = [sys.executable, str(ROOT / "recipes" / "benchmark_switch.py"), "--world", str(world), "--hidden", "64",
           "--ffn", "128", "--layers", "2", "--repeats", "1"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=3600).stdout
    return json.loads(out.strip().splitlines()[-1])["max_bytes_over_lower_bound"]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-tokens", type=int, default=32768, help="document length of kv_work_vs_single")
    parser.add_argument("--kv-heads", type=int, nargs=2, default=(4, 2), metavar=("Q", "KV"))
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--cp-tokens", type=int, default=131072, help="document length of cp_exchange_bytes")
    parser.add_argument("--cp-worlds", default="64,1024", help="fake world sizes of cp_exchange_bytes_per_layer")
    parser.add_argument("--skip-switch", action="store_true", help="leave out the benchmark_switch runs")
    parser.add_argument("--only", nargs="*", default=None, help="compute only these keys' parts")
    parser.add_argument("--collectives-preset", default="llama7b", help="the model of collectives_per_step, "
                        "reduce_exposure and tp_cp_bytes_per_layer (the smoke run: tiny)")
    parser.add_argument("--group-worlds", default="8,64,1024", help="fake world sizes of process_groups_per_rank")
    parser.add_argument("--fake-layouts", default=None, help="comma-separated layouts of 8 fake ranks for "
                        "reduce_exposure and tp_cp_bytes_per_layer (default: each part's own; the smoke: 2)")
    args = parser.parse_args(argv)
    try:
        worlds = [int(x) for x in args.group_worlds.split(",")]
    except ValueError:
        raise SystemExit(f"--group-worlds takes comma-separated world sizes, got {args.group_worlds!r}") from None
    try:
        cp_worlds = tuple(int(x) for x in args.cp_worlds.split(","))
    except ValueError:
        raise SystemExit(f"--cp-worlds takes comma-separated world sizes, got {args.cp_worlds!r}") from None
    fake = tuple(args.fake_layouts.split(",")) if args.fake_layouts else None
    for name in fake or ():
        try:
            ranks = Layout.parse(name).world_size
        except ValueError as err:
            raise SystemExit(f"--fake-layouts: {err}") from None
        if ranks != 8:
            raise SystemExit(f"--fake-layouts: {name} covers {ranks} ranks, not the 8 fake ranks")
    parts = {"syncs": host_syncs, "waits": reduce_waits,
             "exposure": lambda: reduce_exposure(preset=args.collectives_preset,
                                                 layouts=fake or EXPOSURE_LAYOUTS),
             "beside": lambda: comm_beside_gemms(preset=args.collectives_preset, layouts=fake or BESIDE_LAYOUTS),
             "kv_calls": lambda: {"kv_attention_calls_per_layer": kv_calls()},
             "kv_work": lambda: kv_work(args.kv_tokens, *args.kv_heads, args.head_dim),
             "cp_exchange": lambda: {"cp_exchange_bytes_per_layer": cp_exchanges(args.cp_tokens, cp_worlds)},
             "collectives": lambda: {"collectives_per_step": {x: collectives_for(x, args.collectives_preset)
                                                              for x in ("dp8", "dp4xtp2", "dp8:fsdp")}},
             "groups": lambda: {"process_groups_per_rank": {str(n): process_groups(n) for n in worlds},
                                "process_groups_wide_set": {str(n): process_groups(n, WIDE[n]) for n in WIDE
                                                            if n in worlds}},
             "switch": lambda: {"switch_bytes_over_lower_bound": {f"world {w}": switch_bytes(w) for w in (4, 8)}}}
    if args.skip_switch:
        parts.pop("switch")
    result: dict = {"torch": torch.__version__}
    for name, fn in parts.items():
        if args.only and name not in args.only:
            continue
        start = time.perf_counter()
        result.update(fn())
        result.setdefault("seconds", {})[name] = round(time.perf_counter() - start, 1)
        print(f"{name}: done in {result['seconds'][name]} s", file=sys.stderr, flush=True)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
