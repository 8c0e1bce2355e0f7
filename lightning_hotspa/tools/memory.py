"""``hotspa memory``: peak memory per rank of the REAL training step at any scale, without GPUs.

For each (model, world size, layout) one process joins a fake process group of that world size as
rank 0 (:mod:`lightning_hotspa.testing.fake_world`) and, under ``FakeTensorMode`` (no bytes behind the
tensors), runs the code path of a training step: home state (fp32, sharded over the world, AdamW
state already created), switch engine and model, a switch from home into the layout, one forward and
backward of a full-capacity micro-batch (the cost model's capacity, one document), the gradient
reduction, and the optimizer step. torch's ``MemTracker`` accounts every storage, and the engine files
its own buffers (working params, fp32 main grads, bucket buffers, the gradient store) under the right
category. The measured peak stands next to the cost model's predicted peak (:meth:`peak_bytes`).

What the tracker cannot see (allocator fragmentation, the CUDA context, NCCL buffers) is the
hardware profile's reserve (a fixed GiB plus a usable fraction); ``fits`` (measured peak <= usable)
uses it. The planner's capacity also keeps the memory model's own error margin
(:data:`~lightning_hotspa.planner.cost.memory_model.MODEL_ERROR_MARGIN`: predicted x (1 + margin) <= usable),
so a capacity micro-batch fits even where the model under-predicts a little.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from ..layout import Layout
from ..models.attention_kernels import default_chunk_kernel, kernel
from ..models.config import LlamaConfig
from ..planner.cost.cost_model import AnalyticCostModel, CostModelError
from ..planner.cost.memory_model import MODEL_ERROR_MARGIN
from .memory_parts import Wrapped as _Wrapped
from .memory_parts import empty_shard as _empty_shard
from .memory_parts import (
    fill_grad_store,
    llama_roles_and_shardings,
    reduce_and_step,
    track_home_and_engine,
    warm_optimizer,
)
from .memory_parts import one_document_micro_batch as _micro_batch
from .progress import progress

__all__ = ["ATTENTION_PATHS", "CHUNK_KERNEL", "ROWS", "QUICK_ROWS", "add_parser", "candidate_layouts",
           "estimate_layout", "estimate_rows", "run"]

GiB = 2**30

#: (model, world size) of the full table; the Llama-3 shapes are presets ``llama3-8b`` / ``llama3-70b``
ROWS = (("llama7b", 8), ("llama7b", 16), ("llama13b", 8), ("llama13b", 16), ("llama30b", 32),
        ("llama3-8b", 8), ("llama3-70b", 64))
#: what ``--attention`` may name: the CPU kernels, or the tensors the GPU's flash-attn varlen kernel keeps
ATTENTION_PATHS = ("cpu", "gpu")
#: the cost model's ``chunk_kernel`` that predicts each path (the registry's chunk kernel beside it)
CHUNK_KERNEL = {"cpu": default_chunk_kernel("cpu"), "gpu": kernel("flash_varlen").chunk_kernel}
#: ``--quick``: one 7B and one 70B row, a few layouts each (under 5 minutes on the 2-core box)
QUICK_ROWS = (("llama7b", 8, ("dp8", "dp4xtp2", "dp2xtp2xcp2")), ("llama3-70b", 64, ("dp8xtp8", "dp4xtp8xcp2")))


def candidate_layouts(cm: AnalyticCostModel) -> list[Layout]:
    """Every layout the cost model can price (tp within a node), feasible or not."""
    world = cm.world_size
    out = []
    for tp in (d for d in range(1, world + 1) if world % d == 0 and d <= cm.hardware.devices_per_node):
        for cp in (d for d in range(1, world // tp + 1) if (world // tp) % d == 0):
            lay = Layout(dp=world // (tp * cp), tp=tp, cp=cp)
            try:
                cm.check(lay)
            except CostModelError:
                continue
            out.append(lay)
    return out


def estimate_layout(config: LlamaConfig, world_size: int, layout: Layout | str, tokens: int, *,
                    activation_checkpointing: Any = False, working_dtype: torch.dtype = torch.bfloat16,
                    grad_accum_dtype: torch.dtype | None = torch.float32,
                    bucket_bytes: int = 4 * 2**20, max_buckets_in_flight: int = 2,
                    overlap: bool = True, attention: str = "cpu",
                    peers: Sequence[Layout | str] | None = None, tp_regather: bool = True) -> dict[str, Any]:
    """Peak bytes of rank 0 by category for one training step in ``layout``; also the peak of the
    gradient-reduction phase alone (``reduce_peak``, ``reduce_start``: bytes when it began).
    ``activation_checkpointing``: a mode (``"none"``, ``"selective"``, ``"full"``) or a bool.
    ``overlap``: reduce buckets during the backward (the strategy's way) or all after it.
    ``attention``: "cpu" runs the model's CPU kernel (SDPA's flash kernel per document); "gpu" keeps
    what flash-attn's varlen kernel keeps (:mod:`lightning_hotspa.testing.gpu_attention`).
    ``peers``: every rank's working layout of a block stage (``peers[0]`` is ``layout``; a sharded
    block's is its ``:fsdp<n>`` layout, gathered per unit inside the block): rank 0 runs as
    a block of it, its copy from and its gradients into home through the joint exchange, not overlapped
    (``engine/nested_exchange.py``). ``tp_regather``: False keeps each column region's gathered input
    for backward (``ParallelModel(tp_regather=)``)."""
    if attention not in ATTENTION_PATHS:
        raise ValueError(f"attention must be one of {ATTENTION_PATHS}, got {attention!r}")
    mixed = tuple(Layout.parse(x) for x in peers) if peers is not None else None
    if mixed is not None and (len(mixed) != world_size or mixed[0] != Layout.parse(layout)):
        raise ValueError(f"peers must name {world_size} layouts, the first the estimated layout "
                         f"{Layout.parse(layout)}; got {[str(x) for x in mixed]}")
    from ..engine.fsdp import ShardedUnits
    from ..engine.home import build_home_parameters
    from ..engine.switch import SwitchEngine
    from ..host import set_host_reads
    from ..mesh import WorldMesh
    from ..parallel.model import ParallelModel
    from ..testing.fake_world import FakeWorld, MemoryTracker, fake_mode, host_reads_real

    layout = Layout.parse(layout)
    start = time.perf_counter()
    with FakeWorld(world_size):
        # outside the fake mode: it reads real tensors
        world = WorldMesh(sorted(set(mixed), key=str) if mixed else [layout])
        mb = _micro_batch(layout, world, tokens)
        with torch.device("meta"):
            module = _Wrapped(config)
        if attention == "gpu":
            from ..testing.gpu_attention import flash_varlen_standin

            module.model.set_attention_backend(flash_varlen_standin)
        widest = max(mixed, key=lambda x: x.tp) if mixed else layout  # one tp plan for every block
        roles, shardings = llama_roles_and_shardings(module, config, widest, world)
        previous = set_host_reads(host_reads_real)
        try:
            with fake_mode():
                module.to_empty(device="cpu")
                home = build_home_parameters(world, shardings, None, init_shard=_empty_shard)
                parallel = ParallelModel(module, roles, world, tp_regather=tp_regather)
                parallel.restore(home)
                optimizer = warm_optimizer(home)
                engine = SwitchEngine(world, shardings, home, working_dtype=working_dtype,
                                      bucket_bytes=bucket_bytes, grad_accum_dtype=grad_accum_dtype,
                                      max_buckets_in_flight=max_buckets_in_flight)
                units = ShardedUnits(engine, module) if layout.fsdp else None  # per-unit gathers (engine/fsdp.py)
                with MemoryTracker() as mem:
                    working = track_home_and_engine(mem, home, optimizer, engine)
                    engine.materialize_blocks(mixed) if mixed else engine.materialize(layout)
                    _as_if_mid_step(engine, home)
                    parallel.activate(layout, engine.working, activation_checkpointing)
                    with parallel.micro_batch(mb), units.forward_prefetch() if units else contextlib.nullcontext():
                        loss = module(mb)
                    if overlap and not mixed:  # as the strategy does before a stage's last backward
                        engine.overlap_next_backward()
                    loss.backward()
                    if units is not None:  # the last unit's reduce-scatter lands, as the runner does
                        units.end_backward()
                    del loss
                    reduce_start = mem.current()
                    peak_before = mem.peak()
                    reduce_peak, after = reduce_and_step(mem, engine, parallel, home, optimizer,
                                                         engine.reduce_blocks if mixed else engine.reduce_gradients)
                    peak = max((peak_before, reduce_peak, after), key=lambda d: sum(d.values()))
        finally:
            set_host_reads(previous)
    return {"peak": peak, "peak_bytes": sum(peak.values()), "reduce_peak": reduce_peak,
            "reduce_start": reduce_start, "working_params_peak": working.peak,
            "seconds": time.perf_counter() - start}


def _as_if_mid_step(engine: Any, home: dict[str, torch.Tensor]) -> None:
    """The steady state of a stage's last micro-batch in a multi-stage step: an earlier stage filled
    the gradient store, an earlier micro-batch the working gradients (fp32 main grads, or ``.grad``
    when accumulating in the working dtype)."""
    fill_grad_store(engine, home)
    for name, w in engine.working.items():
        if engine._accumulates(w):
            engine.main_grads[name] = torch.zeros_like(w, dtype=engine.grad_accum_dtype)
            engine._label("grads", engine.main_grads[name])
        else:
            w.grad = torch.zeros_like(w)
            engine._label("grads", w.grad)


def estimate_rows(rows: Sequence[tuple], hardware: str = "H100", *, log: Any = print,
                  attention: str = "cpu") -> dict[str, Any]:
    """The table: each (model, world[, layouts]) row's layouts, measured vs predicted peak.

    A layout's micro-batch is its capacity with the cheaper checkpointing option that holds any tokens
    (no checkpointing first); a layout with no capacity at all runs ``2*cp*64`` tokens with
    checkpointing, to show how far its weights alone are from fitting.
    """
    out, worst = [], 0.0
    for number, row in enumerate(progress(rows, "hotspa memory", unit="row"), 1):
        model, world = row[0], row[1]
        config = model if isinstance(model, LlamaConfig) else LlamaConfig.preset(model)  # the real step's model
        cm = AnalyticCostModel(config, hardware, world, chunk_kernel=CHUNK_KERNEL[attention])
        layouts = [Layout.parse(x) for x in row[2]] if len(row) > 2 else candidate_layouts(cm)
        for lay in layouts:
            ac = cm.capacity(lay, False) < 2 * lay.cp
            cap = cm.capacity(lay, ac)
            feasible = cap >= 2 * lay.cp
            tokens = cap - cap % (2 * lay.cp) if feasible else 2 * lay.cp * 64
            stages = {}
            if lay.pp > 1:  # the first stage (most micro-batches in flight) and the last (the loss head)
                from .memory_pipeline import estimate_pipeline_stage, stage_prediction

                for s in sorted({0, lay.pp - 1}):
                    got = estimate_pipeline_stage(config, world, lay, tokens, stage=s, activation_checkpointing=ac)
                    stages[s] = (got, stage_prediction(cm, lay, ac, tokens, s))
                measured = max((got for got, _ in stages.values()), key=lambda g: g["peak_bytes"])
            else:
                measured = estimate_layout(config, world, lay, tokens, activation_checkpointing=ac, attention=attention)
            predicted = cm.peak_bytes(lay, ac, tokens)
            use = cm.memory(lay, ac)
            limit = use.usable  # "fits": the measured peak within the hardware's usable bytes
            entry = {"model": model, "world": world, "layout": lay.name, "activation_checkpointing": ac,
                     "tokens": tokens, "planner_feasible": feasible,
                     "measured_peak_gib": round(measured["peak_bytes"] / GiB, 3),
                     "predicted_peak_gib": round(predicted / GiB, 3),
                     "usable_gib": round(limit / GiB, 3),
                     "planning_budget_gib": round(use.planning_budget / GiB, 3),
                     "fits": bool(measured["peak_bytes"] <= limit),
                     "measured_gib": {k: round(v / GiB, 3) for k, v in measured["peak"].items()},
                     "seconds": round(measured["seconds"], 1)}
            if stages:  # each stage against its own prediction
                entry["stages"] = {s: {"measured_peak_gib": round(got["peak_bytes"] / GiB, 3),
                                       "predicted_peak_gib": round(pred / GiB, 3)} for s, (got, pred) in stages.items()}
                worst = max([worst] + [abs(got["peak_bytes"] / pred - 1) for got, pred in stages.values()])
            worst = max(worst, abs(measured["peak_bytes"] / predicted - 1))
            out.append(entry)
            log(f"[row {number}/{len(rows)}] {model:>11} w{world:<3} {lay.name:<14} ac={int(ac)} tokens={tokens:>6} "
                f"measured {entry['measured_peak_gib']:8.2f} GiB predicted {entry['predicted_peak_gib']:8.2f} "
                f"usable {entry['usable_gib']:6.1f} fits={entry['fits']!s:<5} planner={feasible!s:<5} "
                f"{entry['measured_gib']} ({entry['seconds']} s)")
    fit = sum(1 for e in out if e["planner_feasible"] and e["fits"])
    feasible = sum(1 for e in out if e["planner_feasible"])
    return {"hardware": hardware, "attention": attention, "rows": out, "max_rel_error": round(worst, 4),
            "reserve": _reserve(hardware), "model_error_margin": MODEL_ERROR_MARGIN, "feasible_rows": feasible,
            "feasible_rows_that_fit": fit}


def _reserve(hardware: str) -> dict[str, float]:
    from ..planner.cost.hardware import get_profile

    hw = get_profile(hardware)
    return {"memory_gib": hw.memory_bytes / GiB, "usable_fraction": hw.memory_usable_fraction,
            "reserved_gib": hw.memory_reserved_bytes / GiB}


#: torch's MemTracker, handed a None where it looks for tensors (it skips it; nothing is mis-counted
#: and nothing a user can act on)
MEM_TRACKER_NOTE = "Expected a tensor or a traceable wrapper-subclass of tensor, but got <class 'NoneType'>"


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """The ``hotspa memory`` subcommand (``sub``: the CLI's subparsers)."""
    mem = sub.add_parser("memory", help="peak memory per rank of the real step under FakeTensorMode, "
                         "measured next to the cost model's prediction")
    mem.add_argument("--quick", action="store_true", help="one 7B and one 70B row, a few layouts each")
    mem.add_argument("--hardware", default="H100", help="hardware profile (its memory, reserve and capacity)")
    mem.add_argument("--rows", default=None, help="e.g. llama7b:8,llama3-70b:64 (default: the full table)")
    mem.add_argument("--layouts", default=None, help="comma list applied to every row (default: all)")
    mem.add_argument("--attention", default="cpu", choices=ATTENTION_PATHS,
                     help="measure the CPU attention kernel, or what the GPU's flash-attn varlen kernel keeps")
    mem.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    return mem


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows: list[tuple] = list(QUICK_ROWS if args.quick else ROWS)
    if args.rows:
        rows = []
        for item in args.rows.split(","):
            model, _, world = item.partition(":")
            if not world.isdigit() or int(world) < 1:
                raise ValueError(f"--rows entry {item!r} must look like llama7b:8")
            rows.append((model, int(world)))
    if args.layouts:
        rows = [(r[0], r[1], tuple(args.layouts.split(","))) for r in rows]
    start = time.perf_counter()
    print(f"hotspa memory: {len(rows)} row(s) (model x world size) on {args.hardware}, each layout's real step "
          f"traced under FakeTensorMode: measured vs predicted peak per rank", flush=True)
    with warnings.catch_warnings():  # torch's mem_tracker says it skips a None it is handed
        warnings.filterwarnings("ignore", message=re.escape(MEM_TRACKER_NOTE), category=UserWarning)
        result = estimate_rows(rows, args.hardware, attention=args.attention)
    result["seconds"] = round(time.perf_counter() - start, 1)
    print(f"hotspa memory: {len(result['rows'])} layouts in {result['seconds']} s; worst |measured / predicted - 1| "
          f"{result['max_rel_error']:.2%}; {result['feasible_rows_that_fit']} of {result['feasible_rows']} "
          f"planner-feasible layouts fit the usable memory", flush=True)
    return result
