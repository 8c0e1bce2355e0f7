"""FP8 across layouts: one step of a tiny Llama in several layouts against the single process in FP8.

Every layout runs the SAME micro-batches (whole micro-batches are dealt to dp groups; every document
length is a multiple of 4, so neither tp2 nor cp2 pads one), so the single process on those
micro-batches casts every element with the same scale when the amax reductions of
``parallel/fp8.py`` are right: the layouts then differ from it by the GEMMs' summation order only.
``tp2-no-reduce`` runs tp2 with the reductions switched off (each shard scaled by its own amax), the
control that shows what the comparison catches. Used by tests/distributed/test_fp8_ranks.py and
recipes/benchmark_fp8.py (each rank runs :func:`run_fp8_layouts`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ..layout import Layout
from ..plan import Stage, StepPlan, pack_micro_batch, slice_plan

__all__ = ["CASES", "DOC_LENGTHS", "run_fp8_layouts", "scaled_mm_counter"]

DOC_LENGTHS = (44, 8, 132, 20, 64, 4, 88, 32)  # multiples of 4: no tp2 / cp2 padding
MICRO_BATCHES = ((0, 1), (2, 3), (4, 5), (6, 7))  # the same in every layout
SP_LAYOUTS = ("dp2", "tp2", "dp2:fsdp", "cp2")
#: case -> its stages ((layout, micro-batch indices), ...); "tp2-nosp" runs on a plan without sequence parallel
CASES: dict[str, tuple[tuple[str, tuple[int, ...]], ...]] = {
    "dp2": (("dp2", (0, 1, 2, 3)),), "tp2-sp": (("tp2", (0, 1, 2, 3)),), "dp2:fsdp": (("dp2:fsdp", (0, 1, 2, 3)),),
    "cp2": (("cp2", (0, 1, 2, 3)),), "switching": (("dp2", (0, 1)), ("tp2", (2,)), ("dp2:fsdp", (3,))),
    "tp2-nosp": (("tp2", (0, 1, 2, 3)),), "tp2-no-reduce": (("tp2", (0, 1, 2, 3)),),
}


class _Model(nn.Module):
    """The tiny Llama (ffn 128, so every tp2 shard stays 16-aligned) with its token-mean loss."""

    def __init__(self, dtype: torch.dtype) -> None:
        from ..models import Llama, LlamaConfig

        super().__init__()
        torch.manual_seed(0)
        self.config = LlamaConfig.preset("tiny", ffn_hidden=128)
        self.model = Llama(self.config).to(dtype)

    def forward(self, mb) -> torch.Tensor:
        from ..models import token_mean_cross_entropy

        return token_mean_cross_entropy(self.model(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.max_seqlen),
                                        mb.labels)


def _docs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 256, (n,), generator=g) for n in DOC_LENGTHS]


def _stage(layout: str, mbs: tuple[int, ...]) -> Stage:
    dp = Layout.parse(layout).dp
    groups = tuple(tuple(MICRO_BATCHES[m] for m in mbs[g::dp]) for g in range(dp))
    return Stage(Layout.parse(layout), groups)


@contextlib.contextmanager
def scaled_mm_counter() -> Iterator[dict[str, int]]:
    """Counts ``aten._scaled_mm`` calls inside (a TorchDispatchMode); yields ``{"calls": n}``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts = {"calls": 0}

    class _Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._scaled_mm.default:
                counts["calls"] += 1
            sub = [t for t in types if t is not torch.Tensor and issubclass(t, torch.Tensor)]
            if sub:  # a float8 subclass's own dispatch calls _scaled_mm on plain tensors: run it under the mode
                with self:
                    return sub[0].__torch_dispatch__(func, types, args, kwargs or {})
            return func(*args, **(kwargs or {}))

    with _Count():
        yield counts


@contextlib.contextmanager
def _no_reduction() -> Iterator[None]:
    from ..parallel import fp8

    original = fp8.Fp8Axes.groups
    fp8.Fp8Axes.groups = lambda self, labels: []
    try:
        yield
    finally:
        fp8.Fp8Axes.groups = original


def _reference(recipe: str | None, dtype: torch.dtype, docs: list[torch.Tensor], total: int) -> tuple[float, dict]:
    """The single process on the same micro-batches (FP8 where ``recipe``): loss and gradients."""
    from ..parallel.fp8 import install_fp8

    model = _Model(dtype)
    if recipe is not None:
        install_fp8(model, recipe)
    loss = 0.0
    for ids in MICRO_BATCHES:
        mb = pack_micro_batch([docs[i] for i in ids])
        part = model(mb) * (mb.num_target_tokens / total)
        part.backward()
        loss += float(part.detach())
    return loss, {n: p.grad.float().clone() for n, p in model.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def run_fp8_layouts(recipe: str, dtype: torch.dtype = torch.float32, cases: tuple[str, ...] = tuple(CASES)) -> dict:
    """On every rank of a 2-rank world: each case's loss and gradients vs the single process in FP8.

    Returns ``{"cases": {case: {"loss", "loss_err", "max_grad_err", "worst"}}, "between": the largest relative
    difference of any gradient between two layouts (the control excluded), "fp8_linears", "scaled_mm_calls",
    "bf16_loss_rel": the FP8 reference loss against the same run without FP8}``.

    Args:
        recipe: one of ``parallel.fp8.FP8_RECIPES``.
        dtype: the model's precision.
        cases: which of :data:`CASES` to run.
    """
    from ..engine.step_runner import StepRunner
    from ..engine.switch import SwitchEngine, build_home_parameters
    from ..group_collectives import world_collectives
    from ..mesh import WorldMesh
    from ..models import llama_tp_plan, param_roles
    from ..parallel.model import ParallelModel
    from ..placements import build_shardings

    docs = _docs()
    total = sum(n - 1 for n in DOC_LENGTHS)
    ref_loss, ref_grads = _reference(recipe, dtype, docs, total)
    bf_loss, _ = _reference(None, dtype, docs, total)
    setups: dict[bool, tuple] = {}
    out: dict = {"cases": {}, "scaled_mm_calls": 0}
    grads_of: dict[str, dict[str, torch.Tensor]] = {}
    for case in cases:
        sp = case != "tp2-nosp"
        if sp not in setups:
            layouts = list(SP_LAYOUTS) if sp else ["tp2"]
            module = _Model(dtype)
            world = WorldMesh(layouts)
            init = {n: p.detach().clone() for n, p in module.named_parameters()}
            roles = param_roles(module, llama_tp_plan(module.config, 2, prefix="model.", sequence_parallel=sp))
            shardings = build_shardings({n: tuple(p.shape) for n, p in init.items()}, roles, world.shape)
            home = build_home_parameters(world, shardings, lambda name, shape, init=init: init[name])
            parallel = ParallelModel(module, roles, world, fp8=recipe)
            parallel.restore(home)
            engine = SwitchEngine(world, shardings, home)
            setups[sp] = (module, world, home, parallel, engine, StepRunner(engine, parallel))
            out["fp8_linears"] = len(parallel.fp8_linears)
        module, world, home, parallel, engine, runner = setups[sp]
        plan = StepPlan(0, DOC_LENGTHS, tuple(_stage(lay, mbs) for lay, mbs in CASES[case]))
        with _no_reduction() if case == "tp2-no-reduce" else contextlib.nullcontext(), scaled_mm_counter() as n:
            result = runner.run(slice_plan(plan, docs, world.shape, world.rank), module)
        out["scaled_mm_calls"] += n["calls"]
        engine.assign_home_grads()
        grads = {name: p.grad.full_tensor().float() for name, p in home.items()}
        for p in home.values():
            p.grad = None
        engine.clear_grad_store()
        errors = {name: _rel(g, ref_grads[name]) for name, g in grads.items()}
        worst = max(errors, key=errors.get)
        loss = float(result.loss)
        out["cases"][case] = {"loss": loss, "loss_err": abs(loss - ref_loss) / abs(ref_loss),
                              "max_grad_err": errors[worst], "worst": worst,
                              "errors": {k: v for k, v in errors.items() if v > 1e-4}}
        if case != "tp2-no-reduce":
            grads_of[case] = grads
    names = list(grads_of)
    out["between"] = max((_rel(grads_of[a][p], grads_of[b][p]) for i, a in enumerate(names) for b in names[i + 1:]
                          for p in grads_of[a]), default=0.0)
    out["layouts_run"] = len({lay for c in grads_of for lay, _ in CASES[c]} | ({"tp2-nosp"} & set(names)))
    out["bf16_loss_rel"] = abs(ref_loss - bf_loss) / abs(bf_loss)
    world_collectives().barrier()
    return out


class _Pair(nn.Module):
    """One block of a column-parallel ``up`` then a row-parallel ``down`` Linear (no bias)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.blocks = nn.ModuleList([nn.ModuleDict({"up": nn.Linear(64, 128, bias=False),
                                                    "down": nn.Linear(128, 64, bias=False)})])
        with torch.no_grad():  # the tp shards' amaxes differ (by 8x, a different power of two)
            self.blocks[0]["up"].weight[:64] *= 8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        block = self.blocks[0]
        return block["down"](block["up"](x))


def run_gemm_check(recipe: str) -> dict[str, float]:
    """On each rank of a 2-rank world: a column- then row-parallel FP8 pair under tp2 against the single
    process, ``{"reduced": the largest relative error of the output and every gradient, "unreduced": the
    same with the amax reductions off}``: one GEMM pair, so only summation order separates a right scale."""
    from ..layout import Layout
    from ..mesh import WorldMesh
    from ..parallel.fp8 import install_fp8
    from ..parallel.model import ParallelModel

    g = torch.Generator().manual_seed(5)
    x = torch.randn(48, 64, generator=g)
    r = torch.randn(48, 64, generator=g)
    ref = _Pair()
    install_fp8(ref, recipe)
    xr = x.clone().requires_grad_()
    out_ref = ref(xr)
    (out_ref * r).sum().backward()
    roles = {"blocks.0.up.weight": "colwise", "blocks.0.down.weight": "rowwise"}
    world = WorldMesh(["tp2"])
    module = _Pair()
    parallel = ParallelModel(module, roles, world, fp8=recipe)
    rank = world.layout_groups(Layout.parse("tp2")).tp.index
    up, down = ref.blocks[0]["up"].weight, ref.blocks[0]["down"].weight
    shards = {"blocks.0.up.weight": up.detach()[rank * 64:(rank + 1) * 64],
              "blocks.0.down.weight": down.detach()[:, rank * 64:(rank + 1) * 64]}
    ref_grads = {"blocks.0.up.weight": up.grad[rank * 64:(rank + 1) * 64],
                 "blocks.0.down.weight": down.grad[:, rank * 64:(rank + 1) * 64]}
    out: dict[str, float] = {}
    for label, ctx in (("reduced", contextlib.nullcontext()), ("unreduced", _no_reduction())):
        params = {n: nn.Parameter(t.clone()) for n, t in shards.items()}
        parallel.activate(Layout.parse("tp2"), params)
        xi = x.clone().requires_grad_()
        with ctx:
            y = module(xi)
            (y * r).sum().backward()
        errs = [_rel(y.detach(), out_ref.detach()), _rel(xi.grad, xr.grad)]
        errs += [_rel(params[n].grad, ref_grads[n]) for n in params]
        out[label] = max(errs)
    return out
