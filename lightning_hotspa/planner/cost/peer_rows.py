"""Ours against a peer's published run, same configuration (issue 51): the rows ``recipes/benchmark_peers.py`` prices.

A :class:`PeerRow` names published runs (:mod:`.published_runs`) and the options OUR users would turn on
for them (:class:`OursOptions`). Ours is priced on ITS runtime description (:data:`.runtime_profile.HOTSPA`)
in the run's own layout, model, GPU count, sequence, batch and precision, on the run's hardware profile;
the ratio is ours' predicted tokens/s/GPU over the peer's PUBLISHED figure. Where the peer ran selective
checkpointing ours is priced with its own selective mode (the attention core recomputed). The options:

- ``attention``: the priced kernel family of ours' attention backend (``fa3`` where ``fa3_varlen`` runs:
  sm90; else ``fa2``, flash_varlen);
- ``compiled``: ``strategy.compile_blocks`` (inductor per block) at the runtime's ``compile_speedup``,
  turned on where the peer's run was compiled or fused its elementwise work (Transformer Engine);
- ``fp8``: a torchao recipe (``tensorwise``, the fastest) where the peer's run was FP8 (``strategy.fp8``,
  parallel/fp8.py): ours is then priced on ``hotspa_runtime(fp8=recipe)``, torchao's published rates.

``before`` prices ours as the main branch described it before issue 51: FlashAttention-2, no compile, bf16.
Row providers (:data:`ROW_PROVIDERS`) are functions returning rows; the communication issue adds its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .cost_model import AnalyticCostModel
from .hardware import FA3_OVER_FA2, get_profile
from .published_pricing import PricedRun, at_precision, compiled, price_run
from .published_runs import PUBLISHED_RUNS, PublishedRun
from .runtime_profile import RuntimeProfile, hotspa_runtime
from .terms import resolve_model

__all__ = ["BEFORE", "OursOptions", "PeerRow", "ROW_PROVIDERS", "compute_peer_rows", "ours_runtime", "price_ours",
           "price_row", "rows"]

#: GPUs (hardware profiles) where ours' FlashAttention-3 kernel runs (sm90)
_HOPPER = ("H100", "H100-GT500W", "H200")


@dataclass(frozen=True)
class OursOptions:
    """What ours runs for a row. Args: ``attention`` (a priced kernel family); ``compiled``; ``fp8`` (a torchao
    recipe, or "" for bf16); ``conservative`` (FA3 priced at the fitted FA2 value x ``FA3_OVER_FA2``, the kernels'
    own ratio, instead of the hardware profile's entry anchored on the fitted cuDNN value)."""

    attention: str = "fa2"
    compiled: bool = False
    fp8: str = ""
    conservative: bool = False

    def flags(self) -> dict:
        """The user-facing switches these options are (the JSON's ``ours_options``)."""
        backend = {"fa2": "flash_varlen", "fa3": "fa3_varlen", "fa4": "fa4_varlen", "cudnn": "cudnn_varlen"}
        return {"attention_backend": backend.get(self.attention, self.attention), "compile_blocks": self.compiled,
                "fp8": self.fp8 or None}


#: ours as main described it before issue 51
BEFORE = OursOptions()


@dataclass(frozen=True)
class PeerRow:
    """One comparison. Args: ``name``; ``run_ids`` (published runs; several: the row is their ``reduce``);
    ``reduce`` ("one" or "min": the lowest ratio); ``options`` (``run -> OursOptions``; None: the peer's own
    features, :func:`matching_options`); ``target`` (the ratio the issue asks for, or None)."""

    name: str
    run_ids: tuple[str, ...]
    reduce: str = "one"
    options: Callable[[PublishedRun], OursOptions] | None = None
    target: float | None = None


#: runtimes whose published runs fuse the elementwise work around the GEMMs without torch.compile (Transformer
#: Engine's fused kernels): ours compiles there (the same work fused)
_FUSED_RUNTIMES = ("nemo-te",)


def matching_options(run: PublishedRun) -> OursOptions:
    """The options a user of ours turns on for the peer's configuration: the fastest attention kernel ours runs
    on that GPU, compile where the peer compiled or fused (Transformer Engine), FP8 (torchao tensorwise) where
    the peer ran FP8 (ours' ``strategy.fp8``)."""
    return OursOptions(attention="fa3" if run.gpu in _HOPPER else "fa2",
                       compiled=run.compiled or run.system in _FUSED_RUNTIMES,
                       fp8="tensorwise" if run.precision == "fp8" else "")


def ours_runtime(options: OursOptions) -> RuntimeProfile:
    """Our runtime description with ``options``' attention kernel and FP8 recipe (:func:`.hotspa_runtime`); its
    selective mode recomputes the attention core."""
    return dataclasses.replace(hotspa_runtime(options.fp8 or None), attention_kernel=options.attention,
                               selective_recompute="core-attention")


def price_ours(run: PublishedRun, options: OursOptions) -> PricedRun:
    """Ours on ``run``'s configuration with ``options`` (the planner's pricing path, :func:`.price_run`)."""
    rt = ours_runtime(options)

    def model_for(r: PublishedRun) -> AnalyticCostModel:
        prof = get_profile(r.gpu)
        if options.conservative and options.attention == "fa3":
            hd = resolve_model(r.model).head_dim
            fa3 = min(1.0, prof.attention_efficiency_for("fa2", hd) * FA3_OVER_FA2)
            table = tuple(e for e in prof.attention_kernels if e[0] != "fa3") + (("fa3", hd, fa3),)
            prof = dataclasses.replace(prof, attention_kernels=table)
        if options.fp8:
            prof = at_precision(prof, rt, "fp8", recipe=options.fp8)
        if options.compiled:
            prof = compiled(prof, rt)
        return AnalyticCostModel(r.model, prof, r.world, runtime=rt)

    return price_run(dataclasses.replace(run, system=rt.name, precision="bf16", compiled=False), model_for)


def price_row(row: PeerRow, options: OursOptions | None = None, conservative: bool = False,
              fp8: bool = True) -> dict:
    """``{"ratio", "options", "runs": [{id, ours, published, ratio, fits_ours}]}`` of one row (``options``:
    instead of the row's own, e.g. :data:`BEFORE`; ``conservative``: FA3 priced from the fitted FA2 value;
    ``fp8``: False prices the row's own options in bf16, ``strategy.fp8`` off)."""
    known = {r.id: r for r in PUBLISHED_RUNS}
    missing = [i for i in row.run_ids if i not in known]
    if missing or not row.run_ids:
        raise ValueError(f"peer row {row.name!r}: unknown published runs {missing or row.run_ids}")
    if row.reduce not in ("one", "min") or (row.reduce == "one" and len(row.run_ids) != 1):
        raise ValueError(f"peer row {row.name!r}: reduce must be 'one' (one run) or 'min', got {row.reduce!r} over "
                         f"{len(row.run_ids)} runs")
    out = []
    for rid in row.run_ids:
        run = known[rid]
        opts = (row.options or matching_options)(run) if options is None else options
        if conservative:
            opts = dataclasses.replace(opts, conservative=True)
        if not fp8:
            opts = dataclasses.replace(opts, fp8="")
        p = price_ours(run, opts)
        out.append({"id": rid, "ours": round(p.predicted, 1), "published": run.tokens_per_s_per_gpu,
                    "ratio": p.predicted / run.tokens_per_s_per_gpu, "fits_ours": p.fits_ours,
                    "options": opts.flags()})
    worst = min(out, key=lambda r: r["ratio"])
    return {"ratio": worst["ratio"], "options": worst["options"], "runs": out}


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


#: functions returning :class:`PeerRow` lists; the communication issue appends its ``communication_peer_rows``
ROW_PROVIDERS: list[Callable[[], Sequence[PeerRow]]] = [compute_peer_rows]


def rows() -> list[PeerRow]:
    """Every provider's rows (names must be unique)."""
    out = [row for provider in ROW_PROVIDERS for row in provider()]
    names = [r.name for r in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"peer rows repeat names {dup}")
    return out
