"""Running a real Lightning Trainer with HotSPaStrategy inside the test rank pool, and the
single-process reference it must match."""

from __future__ import annotations

import contextlib
import os
import zlib

import torch
import torch.distributed as dist

from lightning_hotspa.layout import Layout, MeshShape
from lightning_hotspa.plan import Block, Stage, StepPlan, pack_micro_batch, slice_plan


@contextlib.contextmanager
def lightning_rank_env():
    """Tells Lightning the ranks already exist (as torchrun would), then cleans up."""
    rank, world = dist.get_rank(), dist.get_world_size()
    env = {"LOCAL_RANK": str(rank), "NODE_RANK": "0", "WORLD_SIZE": str(world), "RANK": str(rank),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "WANDB_MODE": "offline"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def make_docs(step: int, lengths, vocab: int = 256) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(zlib.crc32(f"docs/{step}".encode()))
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def deal(layout: Layout, doc_ids: list[int], per_micro_batch: int = 2) -> Stage:
    """Documents dealt to dp groups unevenly (group 0 gets the most), a few per micro-batch."""
    groups: list[list[tuple[int, ...]]] = [[] for _ in range(layout.dp)]
    chunks = [tuple(doc_ids[i:i + per_micro_batch]) for i in range(0, len(doc_ids), per_micro_batch)]
    for i, chunk in enumerate(chunks):
        groups[(i * i) % layout.dp].append(chunk)
    return Stage(layout, tuple(tuple(g) for g in groups), label=layout.name)


def mixed_plan(step: int, lengths: list[int], layouts: list[Layout]) -> StepPlan:
    """Documents split over every layout as its own stage (a stage may get few documents)."""
    share = -(-len(lengths) // len(layouts))
    stages = [deal(layout, list(range(i * share, min(len(lengths), (i + 1) * share))))
              for i, layout in enumerate(layouts) if i * share < len(lengths)]
    return StepPlan(step, tuple(lengths), tuple(stages))


def rank_plans(plans: list[StepPlan], layouts: list[Layout], rank: int):
    mesh = MeshShape.for_layouts(layouts, len(layouts) and layouts[0].world_size)
    return [slice_plan(p, make_docs(p.step, p.doc_lengths), mesh, rank) for p in plans]


def reference_run(model_factory, plans: list[StepPlan], clip: float | None = None):
    """Single process: the same optimizer on the whole global mini-batch, token-mean loss."""
    model = model_factory()
    optimizer = model.configure_optimizers()
    optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
    losses, grads = [], []
    for plan in plans:
        mb = pack_micro_batch(make_docs(plan.step, plan.doc_lengths))
        optimizer.zero_grad()
        loss = model.training_step(mb, 0)
        loss.backward()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        losses.append(float(loss))
    return model, losses, grads


def rel_errors(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    return {n: float((ours[n].double() - ref[n].double()).norm() / ref[n].double().norm().clamp(min=1e-30))
            for n in ref}


def groups_of(layouts: list[str], layout: Layout, ranks) -> tuple[int, ...]:
    """The dp groups of ``layout`` that hold ``ranks`` on the 4-rank mesh of ``layouts`` (dp order
    is not rank order on a 2x2 mesh)."""
    mesh = MeshShape.for_layouts([Layout.parse(x) for x in layouts], 4)
    return tuple(sorted({mesh.rank_coords(layout, r)[0] for r in ranks}))


def block_of(layouts: list[str], name: str, ranks, counts, docs: list[int]) -> Block:
    """A block of layout ``name`` on ``ranks`` (the 4-rank mesh of ``layouts``); its k-th dp group
    runs ``counts[k]`` micro-batches of up to 2 documents taken from the front of ``docs``."""
    layout = Layout.parse(name)
    groups = []
    for count in counts:
        mbs = []
        for _ in range(count):
            mbs.append(tuple(docs[:2]))
            del docs[:2]
        groups.append(tuple(mbs))
    return Block(layout, groups_of(layouts, layout, ranks), tuple(groups))


def evaluate_plans(layouts: list[str], make_model, plans: list[StepPlan]) -> list[tuple[float, float, object]]:
    """Per plan, evaluated with ``StepRunner.run_forward`` on the mesh of ``layouts``: the token-weighted
    sum of the micro-batch losses over all ranks, the single process's loss on the same documents, and
    the engine's active layout afterwards. ``make_model()`` builds the model (the same weights each call)."""
    from test_step_runner import _setup

    from lightning_hotspa.engine.step_runner import StepRunner

    module, world, home, parallel, engine = _setup(layouts, make_model())
    runner = StepRunner(engine, parallel)
    out = []
    for plan in plans:
        docs = make_docs(plan.step, plan.doc_lengths, vocab=module.config.vocab_size)
        total = torch.zeros((), dtype=torch.float64)

        def weighted(mb, total=total):
            loss = module(mb)
            total.add_(loss.double() * mb.num_target_tokens / parallel.state.tp_size)  # tp ranks hold copies
            return loss

        with torch.no_grad():
            runner.run_forward(slice_plan(plan, docs, world.shape, world.rank), weighted)
        dist.all_reduce(total)
        with torch.no_grad():
            reference = float(make_model()(pack_micro_batch(docs)))
        out.append((float(total) / plan.global_target_tokens, reference, engine.active))
    return out
