"""``HotSPaStrategy``'s two option groups, :class:`RuntimeOptions` and :class:`ReliabilityOptions`
(frozen dataclasses; Hydra: the ``strategy.runtime`` / ``strategy.reliability`` nodes, passed as dicts),
and the error a keyword that moved into a group (or to the Trainer) gets.

    HotSPaStrategy(["dp4", "tp2xcp2"], runtime=RuntimeOptions(compile_blocks=True, fp8="rowwise"))
    HotSPaStrategy(["dp4", "tp2xcp2"], runtime={"compile_blocks": True})   # the same, as Hydra passes it

The strategy checks the values (each error names the field); these classes only hold them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["GROUPS", "MOVED", "ReliabilityOptions", "RuntimeOptions", "as_options", "moved_keywords",
           "moved_message"]


@dataclass(frozen=True)
class RuntimeOptions:
    """How a step runs on the devices; the math (the optimizer update) does not depend on any of them.

    Attributes:
        compile_blocks: ``torch.compile`` each block (child of an ``nn.ModuleList``) after the layouts are
            installed: True, or a dict of torch.compile arguments (e.g. ``{"backend": "aot_eager"}``);
            ``dynamic`` defaults to True (the token dim); dynamo's recompile limit is raised to the run's
            layouts x blocks (``adapter/lightning/compile_blocks.py``).
        fp8: None (default) or a torchao float8 recipe, ``"tensorwise"``, ``"rowwise"`` or
            ``"rowwise_with_gw_hp"``: the blocks' projections run their GEMMs in FP8 with dynamic scales
            reduced over the layout's groups; embeddings and the LM head stay in the working precision
            (``parallel/fp8.py``; needs torchao).
        tp_regather: under sequence parallelism each column region keeps only its input's token shard and
            gathers it again in backward (True, the default: less memory); False keeps the gathered input
            (more memory, one all-gather per region less); the cost planner prices the choice (issue 52).
        fsdp_reduce_dtype: ``"fp32"`` (default) or ``"bf16"``: the dtype ``:fsdp`` units reduce-scatter
            their gradients in (bf16: half the bytes, summed in bf16 as FSDP2's ``reduce_dtype``).
        bucket_mb: MiB per fused all-gather of a switch / per gradient-reduction bucket; None: the
            backend's default, 100 on NCCL, 4 on gloo (``engine/buckets.py``, docs/gpu-runtime.md).
        switch_buckets_in_flight: switch all-gather buckets in flight; None: 2 on NCCL, 1 on gloo.
        reduce_buckets_in_flight: gradient-reduction buckets in flight; None: 4 on NCCL, 2 on gloo.
        process_group_backend: ``"nccl"``, ``"gloo"``, ...; None: the device's default.
    """

    compile_blocks: bool | Mapping[str, Any] = False
    fp8: str | None = None
    tp_regather: bool = True
    fsdp_reduce_dtype: str = "fp32"
    bucket_mb: float | None = None
    switch_buckets_in_flight: int | None = None
    reduce_buckets_in_flight: int | None = None
    process_group_backend: str | None = None


@dataclass(frozen=True)
class ReliabilityOptions:
    """What a hang or a failed collective leaves behind (docs/debugging.md, ``adapter/lightning/reliability.py``).

    Attributes:
        subgroup_timeout: the timeout (a ``timedelta`` or seconds) of the mesh's tp / cp / dp / switch
            groups, where a step's collectives run; None: 10 minutes on NCCL (at most the strategy's
            ``timeout``), ``timeout`` elsewhere. A failure there raises ``CollectiveError`` naming the group.
        breadcrumb_dir: where each rank keeps its step / stage / layout / micro-batch / phase as
            ``rank<N>.txt`` (also ``$HOTSPA_BREADCRUMB_DIR``; a file there is refused at construction).
            None: off on gloo (a failed collective raises an error naming it),
            ``<default_root_dir>/hotspa_breadcrumbs`` on NCCL.
    """

    subgroup_timeout: Any = None
    breadcrumb_dir: Any = None


#: the strategy's keyword -> the options class it takes
GROUPS: dict[str, type] = {"runtime": RuntimeOptions, "reliability": ReliabilityOptions}

_TRAINER = {"accelerator": "Trainer(accelerator=...)", "parallel_devices": "Trainer(devices=...)",
            "cluster_environment": "Trainer(plugins=[...])", "checkpoint_io": "Trainer(plugins=[...])",
            "precision_plugin": "Trainer(precision=...) or Trainer(plugins=[...])"}
#: a keyword HotSPaStrategy took before issue 57 -> its group, or where the Trainer takes it
MOVED: dict[str, str] = {**{f.name: group for group, cls in GROUPS.items() for f in dataclasses.fields(cls)},
                         **_TRAINER}


def moved_message(name: str, owner: str = "HotSPaStrategy") -> str:
    """The one-line error for the old keyword ``name`` (also what the Hydra recipe prints for ``strategy.<name>``)."""
    where = MOVED[name]
    if where in GROUPS:
        return (f"{owner}({name}=...) moved: use {where}={GROUPS[where].__name__}({name}=...) "
                f"(Hydra: strategy.{where}.{name})")
    return f"{owner}({name}=...) moved: pass it to the Trainer as {where}, which hands it to the strategy"


def as_options(value: Any, group: str) -> Any:
    """``value`` for the group ``group`` as its options class: None -> the defaults, an instance as is, a
    mapping (Hydra's) -> the class built from it, an unknown key refused by name."""
    cls = GROUPS[group]
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        fields = [f.name for f in dataclasses.fields(cls)]
        unknown = [str(k) for k in value if k not in fields]
        if unknown:
            raise TypeError(f"{group}: unknown option(s) {unknown} for {cls.__name__}; valid: {fields}")
        return cls(**{str(k): v for k, v in value.items()})
    raise TypeError(f"{group} must be a {cls.__name__}, a dict of its fields or None, got {value!r}")


_F = TypeVar("_F", bound=Callable[..., Any])


def moved_keywords(init: _F) -> _F:
    """Wrap ``__init__`` so an old keyword raises :func:`moved_message` (``inspect.signature`` still shows
    ``init``'s own parameters)."""

    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        for name in kwargs:
            if name in MOVED:
                raise TypeError(moved_message(name, type(self).__name__))
        init(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]
