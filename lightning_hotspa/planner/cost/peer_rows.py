"""Ours against a peer's published run, same configuration (issues 51 and 52): the rows ``recipes/benchmark_peers.py``
prices, every one by ONE function (:func:`price_ours`).

A :class:`PeerRow` names published runs (:mod:`.published_runs`) and the options OUR users would turn on
for them (:class:`OursOptions`). Ours is priced on ITS runtime description (:data:`.runtime_profile.HOTSPA`)
in the run's own layout, model, GPU count, sequence, batch and precision, on the run's hardware profile;
the ratio is ours' predicted tokens/s/GPU over the peer's PUBLISHED figure. Checkpointing only as ours' memory
model needs it (none, then the attention core, then full); ours' own optimizer step (the home shard over the
whole world). The options (:func:`option_space`; a row takes the fastest):

- ``attention``: the priced kernel family of ours' attention backend (``fa3`` where ``fa3_varlen`` runs:
  sm90; else ``fa2``, flash_varlen);
- ``compiled``: ``strategy.runtime.compile_blocks`` (inductor per block) at the runtime's ``compile_speedup``,
  offered where the peer's run was compiled or fused its elementwise work (Transformer Engine); the strategy
  then builds tp's plain collectives (no tp overlap), so eager with tp overlap is priced beside it;
- ``tp_regather``: False (the gathered inputs kept for backward) where the micro-batch still fits;
- ``fp8``: a torchao recipe (``tensorwise``, the fastest) where the peer's run was FP8 (``strategy.runtime.fp8``,
  parallel/fp8.py): ours is then priced on ``hotspa_runtime(fp8=recipe)``, torchao's published rates.

:data:`BEFORE` prices ours as main described it before issues 51 and 52: FlashAttention-2, eager, bf16, tp
collectives and the dp reduction exposed. Row providers (:data:`ROW_PROVIDERS`) are functions returning rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ...activation_checkpointing import Checkpointing
from .cost_model import AnalyticCostModel
from .hardware import FA3_OVER_FA2, HardwareProfile, get_profile
from .published_pricing import (
    PricedRun,
    at_precision,
    compiled,
    optimizer_seconds,
    parallelism_of,
    price_run,
    source_model,
)
from .published_runs import PUBLISHED_RUNS, TORCHTITAN_ASYNC_TP, PublishedRun
from .runtime_profile import HOTSPA, RuntimeProfile, hotspa_runtime
from .terms import ModelShape, resolve_model

__all__ = ["BEFORE", "OursOptions", "PeerRow", "ROW_PROVIDERS", "TITAN_70B_ASYNC_TP", "checkpointing_needed",
           "communication_rows", "compute_peer_rows", "matching_options", "option_space", "ours_cost_model",
           "ours_runtime", "peer_model_ratio", "price_ours", "price_row", "resolve_runs", "rows"]

#: GPUs (hardware profiles) where ours' FlashAttention-3 kernel runs (sm90)
_HOPPER = ("H100", "H100-GT500W", "H200")


@dataclass(frozen=True)
class OursOptions:
    """What ours runs for a row. Args: ``attention`` (a priced kernel family); ``compiled``
    (``strategy.runtime.compile_blocks``: the strategy then builds tp's plain collectives, ``tp_overlap=False``, so a
    compiled run is priced without tp overlap); ``fp8`` (a torchao recipe, or "" for bf16); ``conservative``
    (FA3 priced at the fitted FA2 value x ``FA3_OVER_FA2``, the kernels' own ratio, instead of the hardware
    profile's entry anchored on the fitted cuDNN value); ``tp_regather`` (False: ``HotSPaStrategy(
    runtime={"tp_regather": False})``, the gathered region inputs kept for backward); ``exposed_comm`` (tp collectives
    and the dp reduction priced fully exposed: the model before issue 52)."""

    attention: str = "fa2"
    compiled: bool = False
    fp8: str = ""
    conservative: bool = False
    tp_regather: bool = True
    exposed_comm: bool = False

    @property
    def tp_overlap(self) -> bool:
        """tp collectives overlapped with their GEMMs: the runtime's default, off under compile (the strategy's
        rule) and in the model before issue 52."""
        return not (self.compiled or self.exposed_comm)

    def flags(self) -> dict:
        """The user-facing switches these options are (the JSON's ``ours_options``)."""
        backend = {"fa2": "flash_varlen", "fa3": "fa3_varlen", "fa4": "fa4_varlen", "cudnn": "cudnn_varlen"}
        return {"attention_backend": backend.get(self.attention, self.attention), "compile_blocks": self.compiled,
                "fp8": self.fp8 or None, "tp_overlap": self.tp_overlap, "tp_regather": self.tp_regather}


#: ours as main described it before issues 51 and 52: FlashAttention-2, eager, bf16, tp collectives and the dp
#: reduction fully exposed
BEFORE = OursOptions(exposed_comm=True)


@dataclass(frozen=True)
class PeerRow:
    """One comparison. Args: ``name``; ``run_ids`` (published runs, by id or the run itself for a column the
    published-runs table does not hold, e.g. torchtitan's async TP; several: the row is their ``reduce``);
    ``reduce`` ("one" or "min": the lowest ratio); ``options`` (``run -> OursOptions``; None: the best of what a
    user of ours turns on, :func:`best_options`); ``target`` (the ratio the issue asks for, or None)."""

    name: str
    run_ids: tuple[str | PublishedRun, ...]
    reduce: str = "one"
    options: Callable[[PublishedRun], OursOptions] | None = None
    target: float | None = None


#: runtimes whose published runs fuse the elementwise work around the GEMMs without torch.compile (Transformer
#: Engine's fused kernels): ours compiles there (the same work fused)
_FUSED_RUNTIMES = ("nemo-te", "megatron-core")


def matching_options(run: PublishedRun) -> OursOptions:
    """The options a user of ours turns on for the peer's configuration: the fastest attention kernel ours runs
    on that GPU, compile where the peer compiled or fused (Transformer Engine), FP8 (torchao tensorwise) where
    the peer ran FP8 (ours' ``strategy.runtime.fp8``)."""
    return OursOptions(attention="fa3" if run.gpu in _HOPPER else "fa2",
                       compiled=run.compiled or run.system in _FUSED_RUNTIMES,
                       fp8="tensorwise" if run.precision == "fp8" else "")


def option_space(run: PublishedRun) -> list[OursOptions]:
    """What a user of ours may run for ``run``: :func:`matching_options`, and where that compiles, the same in
    eager (compile turns tp overlap off: which is faster depends on the row); each with the re-gather and,
    with tp, with the gathered inputs kept (priced only where they still fit)."""
    base = matching_options(run)
    compiles = [base] + ([dataclasses.replace(base, compiled=False)] if base.compiled else [])
    regather = (True, False) if run.tp > 1 else (True,)
    return [dataclasses.replace(o, tp_regather=r) for o in compiles for r in regather]


def ours_runtime(options: OursOptions) -> RuntimeProfile:
    """Our runtime description with ``options``: its attention kernel, its FP8 recipe (:func:`.hotspa_runtime`),
    tp overlap as the strategy builds it, the kept gathered inputs; its selective mode recomputes the attention
    core."""
    return dataclasses.replace(hotspa_runtime(options.fp8 or None), attention_kernel=options.attention,
                               selective_recompute="core-attention",
                               tp_comm_overlap=options.tp_overlap, tp_regather=options.tp_regather,
                               dp_reduce_overlap=HOTSPA.dp_reduce_overlap and not options.exposed_comm)


def ours_cost_model(model: str | ModelShape, gpu: str | HardwareProfile, world: int,
                    options: OursOptions) -> AnalyticCostModel:
    """The cost model of OUR runtime run with ``options`` (:func:`ours_runtime`), the one every comparison of ours
    with a peer prices on (peer rows, the long grid's ``--ours-options``): the hardware profile's GEMM side at the
    FP8 recipe's and compile's rates where turned on, FA3 at the fitted FA2 value x ``FA3_OVER_FA2`` where
    ``conservative``.

    Args:
        model: a model name or shape; gpu: a hardware profile (or its name); world: GPUs; options: what ours runs.
    """
    rt = ours_runtime(options)
    prof = get_profile(gpu)
    if options.conservative and options.attention == "fa3":
        hd = resolve_model(model).head_dim
        fa3 = min(1.0, prof.attention_efficiency_for("fa2", hd) * FA3_OVER_FA2)
        table = tuple(e for e in prof.attention_kernels if e[0] != "fa3") + (("fa3", hd, fa3),)
        prof = dataclasses.replace(prof, attention_kernels=table)
    if options.fp8:
        prof = at_precision(prof, rt, "fp8", recipe=options.fp8)
    if options.compiled:
        prof = compiled(prof, rt)
    return AnalyticCostModel(model, prof, world, runtime=rt)


def checkpointing_needed(cm: AnalyticCostModel, run: PublishedRun) -> str:
    """The lightest activation checkpointing under which ``run``'s micro-batch fits ours' memory model: "none",
    "selective" (the attention core; not built for sharded copies) or "full" (also when nothing fits)."""
    par, tokens = parallelism_of(run), run.micro_batch * run.seq_len
    modes = ("none", "full") if par.fsdp else ("none", "selective", "full")
    return next((m for m in modes[:-1] if cm.capacity(par, Checkpointing.parse(m)) >= tokens), "full")


def price_ours(run: PublishedRun, options: OursOptions) -> PricedRun:
    """Ours on ``run``'s configuration with ``options``: THE pricing of a peer row (every row of
    ``recipes/benchmark_peers.py``). The planner's path (:func:`.price_run`), with ours' checkpointing only as
    needed (:func:`checkpointing_needed`) and ours' optimizer step (torch Adam on the fp32 home shard, split
    over the whole world whatever the layout: docs/DESIGN.md's home state) instead of the peer's."""
    cm = ours_cost_model(run.model, run.gpu, run.world, options)
    rt = cm.runtime
    ours = dataclasses.replace(run, system=rt.name, precision="bf16", compiled=False,
                               checkpointing=checkpointing_needed(cm, run))
    p = price_run(ours, lambda _: cm)
    own_optimizer = cm.params / run.world * rt.optimizer_bytes_per_param / cm.hardware.hbm_bandwidth
    step = p.step_s - optimizer_seconds(ours, cm) + own_optimizer
    predicted = run.dp * run.grad_accum * run.micro_batch * run.seq_len / (step * run.world)
    return dataclasses.replace(p, run=ours, predicted=predicted, step_s=step,
                               other_s=step - p.dense_s - p.attention_s)


def resolve_runs(row: PeerRow) -> list[PublishedRun]:
    """``row``'s published runs (ids looked up in :data:`.PUBLISHED_RUNS`); a clear error for an unknown one."""
    known = {r.id: r for r in PUBLISHED_RUNS}
    missing = [i for i in row.run_ids if isinstance(i, str) and i not in known]
    if missing or not row.run_ids:
        raise ValueError(f"peer row {row.name!r}: unknown published runs {missing or list(row.run_ids)}")
    if row.reduce not in ("one", "min") or (row.reduce == "one" and len(row.run_ids) != 1):
        raise ValueError(f"peer row {row.name!r}: reduce must be 'one' (one run) or 'min', got {row.reduce!r} over "
                         f"{len(row.run_ids)} runs")
    return [known[i] if isinstance(i, str) else i for i in row.run_ids]


def price_row(row: PeerRow, options: OursOptions | None = None, conservative: bool = False,
              fp8: bool = True) -> dict:
    """``{"ratio", "options", "runs": [{id, ours, published, ratio, fits_ours, checkpointing, options}]}`` of one
    row (``options``: instead of the row's own, e.g. :data:`BEFORE`; ``conservative``: FA3 priced from the
    fitted FA2 value; ``fp8``: False prices the row's options in bf16, ``strategy.runtime.fp8`` off). Without
    ``options`` every run takes the fastest of :func:`option_space` (options whose micro-batch does not fit ours
    without full checkpointing are skipped when another fits)."""
    out = []
    for run in resolve_runs(row):
        if options is not None:
            space = [options]
        elif row.options is not None:
            space = [row.options(run)]
        else:
            space = option_space(run)
        if conservative:
            space = [dataclasses.replace(o, conservative=True) for o in space]
        if not fp8:
            space = [dataclasses.replace(o, fp8="") for o in space]
        priced = [(price_ours(run, o), o) for o in space]
        kept = [(p, o) for p, o in priced if o.tp_regather or p.fits_ours]  # kept inputs: only where they fit
        p, opts = max(kept or priced, key=lambda x: x[0].predicted)
        out.append({"id": run.id, "ours": round(p.predicted, 1), "published": run.tokens_per_s_per_gpu,
                    "ratio": p.predicted / run.tokens_per_s_per_gpu, "fits_ours": p.fits_ours,
                    "checkpointing": p.run.checkpointing, "options": opts.flags()})
    worst = min(out, key=lambda r: r["ratio"])
    return {"ratio": worst["ratio"], "options": worst["options"], "runs": out}


def peer_model_ratio(run: PublishedRun) -> float | None:
    """The PEER's own run priced on its runtime description over its published figure (the published-runs
    benchmark's number for that row, ``recipes/benchmark_published.py``: :func:`.source_model`); None for a run
    that table does not hold or excludes."""
    if run.excluded or run not in PUBLISHED_RUNS:
        return None
    return price_run(run, source_model).ratio


def _ids(prefix: str, min_seq: int = 0) -> tuple[str, ...]:
    return tuple(r.id for r in PUBLISHED_RUNS if r.id.startswith(prefix) and not r.excluded and r.seq_len >= min_seq)


def compute_peer_rows() -> list[PeerRow]:
    """The compute issue's rows (issue 51): torchtitan's 8B (eager, compile, compile + Float8), 70B 2D (its vanilla
    TP column; the async TP column is ``tools/peers_communication.py``'s ``torchtitan-70b-fsdp32-tp8``) and
    its context-parallel rows, Megatron-LM's tp8 row, NeMo's FP8 Llama 2 7B long-sequence rows."""
    out = [PeerRow("torchtitan-8b-fsdp-eager", ("titan-8b-fsdp8",)),
           PeerRow("torchtitan-8b-fsdp-compile", ("titan-8b-fsdp8-compile",)),
           PeerRow("torchtitan-8b-fsdp-compile-float8", ("titan-8b-fsdp8-compile-fp8",), target=1.0),
           PeerRow("torchtitan-70b-fsdp32-tp8-vanilla", ("titan-70b-fsdp32-tp8",)),
           PeerRow("megatron-22b-tp8", ("megatron-22b-tp8",))]
    out += [PeerRow(f"torchtitan-8b-{rid.split('-', 3)[3]}", (rid,)) for rid in _ids("titan-8b-fsdp", 32768)]
    out += [PeerRow(f"nemo-7b-fp8-{rid.split('-')[3]}", (rid,)) for rid in _ids("nemo-llama2-7b-")]
    out.append(PeerRow("nemo-7b-fp8-long-min", _ids("nemo-llama2-7b-", 16384), reduce="min", target=0.9))
    return out


_RUNS = {r.id: r for r in PUBLISHED_RUNS}
#: torchtitan's 2D row with async TP on (the same table's 'Async TP tokens/sec' column; not a published-runs row:
#: the torchtitan runtime description prices its vanilla TP column)
TITAN_70B_ASYNC_TP = dataclasses.replace(
    _RUNS["titan-70b-fsdp32-tp8"], id="titan-70b-fsdp32-tp8-async-tp", tokens_per_s_per_gpu=652.4,
    source=TORCHTITAN_ASYNC_TP.replace("Vanilla TP", "Async TP").format(
        table="Llama3 70b on 256 H100s table", size="70b") + " ('Async TP tokens/sec' 652.4)")


def communication_rows() -> list[PeerRow]:
    """The communication issue's rows (issue 52): Megatron-LM's README H100 rows without pp (>= 0.9) and
    torchtitan's 70B FSDP 32 x TP 8 with async TP (>= 1.0)."""
    return [*(PeerRow(f"megatron-h100-tp{tp}", (f"megatron-h100-tp{tp}",), target=0.9) for tp in (1, 2, 4, 8)),
            PeerRow("torchtitan-70b-fsdp32-tp8", (TITAN_70B_ASYNC_TP,), target=1.0)]


#: functions returning :class:`PeerRow` lists, priced alike by :func:`price_row`
ROW_PROVIDERS: list[Callable[[], Sequence[PeerRow]]] = [compute_peer_rows, communication_rows]


def rows() -> list[PeerRow]:
    """Every provider's rows (names must be unique)."""
    out = [row for provider in ROW_PROVIDERS for row in provider()]
    names = [r.name for r in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"peer rows repeat names {dup}")
    return out
