"""The degrees the cost model prices: :class:`Parallelism` (a runtime :class:`Layout`, or a pipeline-
parallel layout the simulator prices for the artifact's baselines) and the errors naming what a model
cannot run."""

from __future__ import annotations

from dataclasses import dataclass

from ..checks import check_int
from ..layout import Layout, fsdp_replicas, layout_name, runs_in_lockstep
from ..models.config import LlamaConfig

__all__ = ["CostModelError", "Parallelism", "gradient_kind", "resolve_model", "shares_gradients"]


class CostModelError(ValueError):
    """A model / world / layout combination the cost model cannot price; the message names it."""


def resolve_model(model: LlamaConfig | str) -> LlamaConfig:
    """A :class:`LlamaConfig` or a preset name (``llama7b``, ``llama13b``, ``llama30b``, ...)."""
    if isinstance(model, LlamaConfig):
        return model
    try:
        return LlamaConfig.preset(str(model))
    except ValueError as err:
        raise CostModelError(str(err)) from None


@dataclass(frozen=True)
class Parallelism:
    """Degrees of one parallel strategy; ``pp`` > 1 only for simulating pipeline-parallel baselines."""

    dp: int = 1
    tp: int = 1
    cp: int = 1
    pp: int = 1
    cp_kv: int = 1  # the all-gather-KV part of cp (Layout.cp_kv); 1: Ulysses
    fsdp: bool = False  # working copy sharded over dp and cp, gathered per layer (Layout.fsdp)
    fsdp_shard: int = 0  # over how many dp x cp ranks (Layout.fsdp_shard; 0: all of them)

    def __post_init__(self) -> None:
        for f in ("dp", "tp", "cp", "pp", "cp_kv"):
            check_int(getattr(self, f), f"Parallelism.{f}", error=CostModelError)
        if not isinstance(self.fsdp, bool):
            raise CostModelError(f"Parallelism.fsdp must be True or False, got {self.fsdp!r}")
        if self.cp % self.cp_kv:
            raise CostModelError(f"Parallelism.cp_kv={self.cp_kv} must divide cp={self.cp}")
        group = self.dp * self.cp
        if self.fsdp and self.fsdp_shard == 0:
            object.__setattr__(self, "fsdp_shard", group)  # frozen: normalized as Layout does
        elif self.fsdp_shard and (not self.fsdp or self.fsdp_shard < 2 or group % self.fsdp_shard):
            raise CostModelError(f"Parallelism.fsdp_shard={self.fsdp_shard!r} must be > 1 and divide dp*cp = "
                                 f"{group}, with fsdp=True")

    @classmethod
    def of(cls, layout: Layout | Parallelism) -> Parallelism:
        if isinstance(layout, Parallelism):
            return layout
        return cls(layout.dp, layout.tp, layout.cp, 1, layout.cp_kv, layout.fsdp, layout.fsdp_shard)

    @property
    def fsdp_replicas(self) -> int:
        return fsdp_replicas(self.dp, self.cp, self.fsdp, self.fsdp_shard)

    @property
    def lockstep(self) -> bool:
        return runs_in_lockstep(self.cp, self.fsdp, self.fsdp_shard)

    @property
    def cp_ulysses(self) -> int:
        return self.cp // self.cp_kv

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.cp * self.pp

    @property
    def shards(self) -> int:
        """How many ways the working weights are split (a rank holds 1/shards of them)."""
        return self.tp * self.pp

    @property
    def name(self) -> str:
        return layout_name(self.dp, self.tp, self.cp, self.cp_kv, self.pp, self.fsdp, self.fsdp_shard)

    def __str__(self) -> str:
        return self.name

    def layout(self) -> Layout:
        if self.pp != 1:
            raise CostModelError(f"{self} has pipeline parallelism, which the runtime does not run (simulation only)")
        return Layout(self.dp, self.tp, self.cp, self.cp_kv, self.fsdp, self.fsdp_shard)


def _shards(par: Parallelism | Layout) -> int:
    """``Parallelism.of(par).shards`` without building one (switch pricing runs in tight loops)."""
    return par.tp * getattr(par, "pp", 1)


def shares_gradients(a: Parallelism | Layout, b: Parallelism | Layout) -> bool:
    """Stages in ``a`` then ``b`` share working shards and gradient states (same tp, and pp), so the
    runtime reduces once after both (``SwitchEngine.shares_gradients``); their ``stage_fixed`` agree.
    A sharded working copy (``fsdp``) keeps its gradients at its own shard (reduce-scattered every
    micro-batch), a replicated one at the tp shard: they share only with their own kind, as in the
    runtime (a plain fsdp stage's ``stage_fixed`` is 0; an HSDP one, ``:fsdp8``, sums its replicas)."""
    return gradient_kind(a) == gradient_kind(b)


def gradient_kind(par: Parallelism | Layout) -> tuple[int, int, int]:
    """(tp, pp, fsdp shard: 0 when replicated): stages of one kind share gradients
    (:func:`shares_gradients`)."""
    return (par.tp, getattr(par, "pp", 1), par.fsdp_shard if par.fsdp else 0)
