"""``hotspa memory`` for pipelined layouts: peak memory of one rank of one pipeline stage, measured on
the real step's code path under ``FakeTensorMode``, next to the cost model's per-stage prediction.

The rank sits in the fake world as a rank of the chosen stage (its pp slot). One step of the layout:
the home state (fp32, AdamW state created), the switch from home into the layout (its own stages'
parameters only), ``2 pp`` micro-batches of one ``tokens``-long document per dp group through torch's
schedule (1F1B by default; ``2 pp`` reaches its steady state, where the first stage holds ``pp``
micro-batches' activations AND its filled gradient accumulators: with only ``pp`` micro-batches its
peak comes before any gradient exists), the gradient reduction and the optimizer step. The prediction is
:func:`~lightning_hotspa.planner.cost.pp_memory.stage_memories` for that stage at the same tokens.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..layout import Layout, LayoutError
from ..models.config import LlamaConfig

__all__ = ["estimate_pipeline_stage", "stage_prediction", "stage_rank"]


def stage_rank(layout: Layout, world_size: int, stage: int) -> int:
    """The lowest global rank whose pipeline slot in ``layout`` is ``stage``.

    Args:
        layout: a layout with ``pp > 1``.
        world_size: the world it runs on.
        stage: the stage's index (``0 <= stage < pp``).
    """
    from ..layout import MeshShape

    if not 0 <= stage < layout.pp:
        raise LayoutError(f"layout {layout}: stage {stage} is not one of its {layout.pp} pipeline stages")
    shape = MeshShape.for_layouts([layout], world_size)
    dims = tuple(shape.pp_dims(layout))
    for rank in range(world_size):
        if sorted(shape.group_ranks(rank, dims)).index(rank) == stage:
            return rank
    raise LayoutError(f"layout {layout}: no rank of {world_size} holds stage {stage}")  # not reached


def stage_prediction(cm: Any, layout: Layout, activation_checkpointing: Any, tokens: int, stage: int) -> float:
    """The cost model's peak bytes of a rank of ``stage`` with micro-batches of one ``tokens``-long document.

    Args:
        cm: the :class:`~lightning_hotspa.planner.cost.cost_model.AnalyticCostModel`.
        layout: a layout with ``pp > 1``.
        activation_checkpointing: the mode.
        tokens: the micro-batch's tokens.
        stage: the stage's index.
    """
    from ..planner.cost.pp_memory import stage_memories

    quadratic = cm.attention_quadratic_bytes(layout) * float(tokens) ** 2  # one document: the worst
    kv = cm.kv_ring_extra_bytes(layout, activation_checkpointing, tokens)
    return stage_memories(cm, layout, activation_checkpointing)[stage].peak(tokens, quadratic) + kv


def _plan(layout: Layout, tokens: int, micro_batches: int) -> Any:
    """``micro_batches`` micro-batches of one ``tokens``-long document per dp group."""
    from ..plan import Stage, StepPlan

    n = layout.dp * micro_batches
    groups = tuple(tuple((g * micro_batches + j,) for j in range(micro_batches)) for g in range(layout.dp))
    return StepPlan(0, tuple([tokens] * n), (Stage(layout, groups, label=str(layout)),))


def estimate_pipeline_stage(config: LlamaConfig, world_size: int, layout: Layout | str, tokens: int, *,
                            stage: int = 0, activation_checkpointing: Any = False,
                            working_dtype: torch.dtype = torch.bfloat16,
                            grad_accum_dtype: torch.dtype | None = torch.float32,
                            schedule: str = "1f1b", micro_batches: int | None = None) -> dict[str, Any]:
    """Peak bytes by category of a rank of ``stage`` in the pipelined ``layout`` for one step.

    Args:
        config: the model.
        world_size: the fake world's size.
        layout: a layout with ``pp > 1``.
        tokens: each micro-batch's one document (divisible by ``2 * cp`` and ``tp``).
        stage: the pipeline stage measured (0: the first, ``pp - 1``: the last).
        activation_checkpointing: a mode (``"none"``, ``"selective"``, ``"full"``) or a bool.
        working_dtype, grad_accum_dtype: as the strategy's bf16-mixed.
        schedule: a key of :data:`~lightning_hotspa.parallel.pipeline.SCHEDULES` without virtual stages.
        micro_batches: per dp group (default ``2 * pp``: the schedule's steady state, what the model prices).
    """
    from ..engine.step_runner import StepHooks, StepRunner
    from ..layout import MeshShape
    from ..plan import slice_plan
    from ..testing.fake_world import MemoryTracker
    from .fake_llama import fake_llama
    from .memory_parts import fill_grad_store, reduce_and_step, track_home_and_engine, warm_optimizer

    start = time.perf_counter()
    layout = Layout.parse(layout)
    if layout.pp == 1:
        raise LayoutError(f"layout {layout} is not pipelined: estimate it with estimate_layout")
    rank = stage_rank(layout, world_size, stage)
    micro_batches = 2 * layout.pp if micro_batches is None else micro_batches
    if micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches}: need at least one per dp group")
    plan = _plan(layout, tokens, micro_batches)
    docs = [torch.zeros(tokens, dtype=torch.int64) for _ in plan.doc_lengths]
    mine = slice_plan(plan, docs, MeshShape.for_layouts([layout], world_size), rank)  # real metadata
    with fake_llama(config, layout, world_size, tokens, rank=rank, working_dtype=working_dtype,
                    grad_accum_dtype=grad_accum_dtype) as fake:
        home, engine, parallel = fake.home, fake.engine, fake.parallel
        optimizer = warm_optimizer(home)
        runner = StepRunner(engine, parallel, pipeline_schedule=schedule)
        with MemoryTracker() as mem:
            working = track_home_and_engine(mem, home, optimizer, engine)
            step = mine.stages[0]
            runner.enter(step)
            fill_grad_store(engine, home)  # an earlier stage of the step filled it
            parallel.activate(layout, engine.working, activation_checkpointing)
            runner._run_pipeline(step, mine, 1.0, StepHooks())
            peak_before = mem.peak()
            reduce_peak, after = reduce_and_step(mem, engine, parallel, home, optimizer, engine.reduce_gradients)
            peak = max((peak_before, reduce_peak, after), key=lambda d: sum(d.values()))
    return {"rank": rank, "stage": stage, "micro_batches": len(mine.stages[0].micro_batches), "peak": peak,
            "peak_bytes": sum(peak.values()), "working_params_peak": working.peak,
            "seconds": time.perf_counter() - start}

