"""Tensor parallelism for any model from its per-parameter roles, installed once.

Why explicit collectives on local tensors (docs/DESIGN.md §4): a tp group may span several
world-mesh dims, which ``parallelize_module`` (1-D tp mesh) cannot express without a flattened mesh
that DTensor cannot redistribute back from. So each role becomes a Megatron-style forward on the
module's CURRENT parameters (the switch engine's local shards) and the ACTIVE layout's tp group,
both read at call time; with tp = 1 (or no layout active) every forward is the module's own.

What each role means for the module that owns it (``nn.Linear`` / ``nn.Embedding``; any other
module may only hold ``replicated`` parameters):

============================  ================================================================
``colwise`` Linear            input through ``f`` (identity fwd, all-reduce bwd); output stays
                              sharded on its last dim (it feeds a ``rowwise`` layer or heads)
``rowwise`` Linear            output through ``g`` (all-reduce fwd, identity bwd); a bias must be
                              ``replicated`` and is added once, after the reduction
``vocab`` Linear              colwise, but the output is GATHERED along its last dim in shard
                              order (backward keeps the own slice): the plan's way to mark a
                              colwise layer whose consumer needs the full width (the LM head)
``vocab`` Embedding           vocab-parallel lookup: ids outside this rank's rows read zeros,
                              then ``g``
``replicated_partial`` Linear every rank holds the full weight but uses only the part its shard
                              needs (kv heads, see :mod:`.attention`); input through ``f``, and
                              the engine sums the weight's partial gradients over tp
``replicated``                untouched
``sequence``                  untouched (a replicated weight applied to this rank's tokens)
============================  ================================================================

Column-parallel layers reading the same tensor (q, k, v; w1, w3) share ONE ``f``, so their input
gradient is all-reduced once, as with Megatron's fused QKV: the plan DECLARES these regions
(``tp_regions``, :func:`declared_regions`; :mod:`.regions`); any other plain column-parallel Linear
is a region of its own.

Sequence parallelism (:mod:`.sequence_parallel`): a plan with any ``sequence`` role keeps the
tokens between the tp regions split over tp. Then ``f`` becomes an all-gather of the tokens (one
per region; the region keeps only this rank's shard for backward and gathers it again there, with
its input gradient's reduce-scatter), ``g`` of a row-parallel output and of the vocab-parallel
embedding a reduce-scatter along the tokens, and a ``vocab`` head gathers its input tokens. Every
other parameter such a model has must then be ``sequence`` (not ``replicated``: its gradient is a
partial sum over tp), and it needs a ``vocab`` nn.Embedding (where the tokens get split).

FP8 (:mod:`.fp8`, ``strategy.runtime.fp8``): a layer :func:`~.fp8.install_fp8` marked runs its GEMM in FP8
with its amax reduced over the tp group that splits it (and cp for the tokens), so the scales do not
depend on the layout; such a layer uses the plain collectives (no tp overlap), and a region of FP8
readers gathers its input once through autograd and runs each reader's FP8 GEMM on it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fnmatch import fnmatchcase

import torch.nn.functional as F
from torch import Tensor, nn

from ..layout import LayoutError
from ..mesh import RankGroup
from ..models.vocab import check_token_ids
from .collectives import copy_to_group, gather_last_dim, reduce_from_group
from .core_attention import attention_modules, ensure_parallel_attention
from .fp8 import Fp8Axes, fp8_linear, left_operand, tokens_group
from .loss import VocabParallelLoss
from .regions import ColumnRegion
from .row_scatter import row_scatter
from .sequence_parallel import gather_tokens, scatter_tokens
from .state import ParallelState

__all__ = ["declared_regions", "install_tensor_parallel", "module_kinds", "TPForward"]

_DIM0 = ("colwise", "vocab")  # roles that shard dim 0 (a Linear's output features)
_UNTOUCHED = ("replicated", "sequence")  # roles whose module keeps its own forward
_READERS = ("colwise", "partial_input")  # kinds that read a column-parallel region's input


def _fail(name: str, message: str) -> LayoutError:
    return LayoutError(f"tensor-parallel plan, {name}: {message}")


def _linear_kind(name: str, roles: Mapping[str, str]) -> str | None:
    weight, bias = roles[f"{name}.weight"], roles.get(f"{name}.bias")
    allowed_bias = {
        "colwise": _DIM0, "vocab": _DIM0, "rowwise": ("replicated", "sequence"),
        "replicated_partial": ("replicated_partial",), "replicated": ("replicated",),
        "sequence": ("sequence",),
    }
    if weight not in allowed_bias:
        raise _fail(name, f"unknown role {weight!r} for the weight")
    if bias is not None and bias not in allowed_bias[weight]:
        raise _fail(name, f"a {weight!r} weight needs its bias to be one of {allowed_bias[weight]}, got {bias!r}"
                    + (" (the bias is added once, after the all-reduce)" if weight == "rowwise" else ""))
    return {"colwise": "colwise", "vocab": "gather", "rowwise": "rowwise",
            "replicated_partial": "partial_input", "replicated": None, "sequence": None}[weight]


def module_kinds(module: nn.Module, roles: Mapping[str, str]) -> dict[str, str]:
    """Validates ``roles`` against ``module`` and says which forward each module needs.

    Returns ``{module name: kind}`` for the modules that need a parallel forward; raises a
    :class:`LayoutError` naming the parameter for any role the module type cannot honour.
    """
    params = dict(module.named_parameters())
    unknown = sorted(set(roles) - set(params))
    if unknown:
        raise LayoutError(f"tensor-parallel roles name parameters {unknown[:5]} that "
                          f"{type(module).__name__} does not have")
    missing = sorted(set(params) - set(roles))
    if missing:
        raise LayoutError(f"tensor-parallel roles miss parameters {missing[:5]} of {type(module).__name__}")
    kinds: dict[str, str] = {}
    for name, sub in module.named_modules():
        own = {leaf: roles[f"{name}.{leaf}" if name else leaf] for leaf, p in sub._parameters.items() if p is not None}
        if not own or all(r in _UNTOUCHED for r in own.values()):
            continue
        label = name or type(module).__name__
        for base in (nn.Linear, nn.Embedding):
            if isinstance(sub, base) and type(sub).forward is not base.forward and not _linear_like(sub):
                raise _fail(label, f"{type(sub).__name__} overrides {base.__name__}.forward; tensor parallel "
                            f"replaces that forward, so it splits only plain {base.__name__} modules")
        if isinstance(sub, nn.Linear):
            prefixed = {f"{name}.{leaf}": r for leaf, r in own.items()}
            kind = _linear_kind(name, prefixed)
        elif isinstance(sub, nn.Embedding):
            if own.get("weight") != "vocab":
                raise _fail(label, f"an nn.Embedding supports the roles 'vocab' and 'replicated', got {own}")
            if sub.max_norm is not None or sub.sparse or sub.scale_grad_by_freq:
                raise _fail(label, "a vocab-parallel nn.Embedding cannot use max_norm, sparse gradients "
                            "or scale_grad_by_freq (they see only this rank's rows)")
            kind = "vocab_embedding"
        else:
            raise _fail(label, f"{type(sub).__name__} holds parameters with roles {own}; tensor parallel can "
                        f"split only nn.Linear and nn.Embedding weights (other modules: 'replicated')")
        if kind is not None:
            kinds[name] = kind
    return kinds


def _linear_like(module: nn.Module) -> bool:
    """An ``nn.Linear`` subclass whose own forward is linear in its weight as ``F.linear`` is
    (``tp_linear_forward = True``: models.kernels.SwiGLUDown, models.loss_head.LMHead): run as is on
    the shard, with the role's collectives around it."""
    return isinstance(module, nn.Linear) and getattr(type(module), "tp_linear_forward", False) is True


def _sequence_parallel(roles: Mapping[str, str], kinds: Mapping[str, str], owner: str) -> bool:
    """True if the plan uses the ``sequence`` role; then checks what sequence parallelism needs."""
    if "sequence" not in roles.values():
        return False
    plain = sorted(n for n, r in roles.items() if r == "replicated")
    if plain:
        raise LayoutError(f"tensor-parallel plan of {owner}: its 'sequence' roles turn on sequence parallelism, "
                          f"where a replicated weight sees only this rank's tokens and its gradient is a partial "
                          f"sum over tp; give {plain[:5]} the role 'sequence' instead of 'replicated'")
    if "vocab_embedding" not in kinds.values():
        raise LayoutError(f"tensor-parallel plan of {owner}: sequence parallelism ('sequence' roles) splits the "
                          f"tokens at a 'vocab' nn.Embedding, and the plan has none")
    return True


class TPForward:
    """A module's forward under tensor parallelism; installed once as ``module.forward``.

    Args:
        module: the module.
        kind: what it does under tp (:func:`module_kinds`).
        state: the shared :class:`ParallelState` (the active groups).
        sequence_parallel: tokens between the tp regions are split over tp (:mod:`.sequence_parallel`).
        region: the column-parallel region this module reads in, with its name there (:mod:`.regions`).
        local_output: a vocab head whose loss is vocab-parallel (its logits stay sharded).
    """

    def __init__(self, module: nn.Module, kind: str, state: ParallelState, sequence_parallel: bool,
                 region: tuple[ColumnRegion, str] | None = None, local_output: bool = False,
                 overlap: bool = True) -> None:
        self.module = module
        self.kind = kind
        self.state = state
        self.sequence_parallel = sequence_parallel
        self.region = region
        self.local_output = local_output
        self.fp8 = getattr(module, "_hotspa_fp8", None)  # the FP8 recipe (.fp8) or None
        # a row-parallel output's reduce-scatter runs with its GEMM (.row_scatter) where the module allows it
        self.row_overlap = overlap and sequence_parallel and kind == "rowwise" and self.fp8 is None and \
            (not _linear_like(module) or callable(getattr(type(module), "tp_row_input", None)))

    def _reduce(self, out: Tensor, tp: RankGroup) -> Tensor:
        """``g`` (all-reduce), or the reduce-scatter along the tokens under sequence parallelism."""
        return scatter_tokens(out, tp) if self.sequence_parallel else reduce_from_group(out, tp)

    def _copy(self, x: Tensor, tp: RankGroup) -> Tensor:
        """``f`` of a layer outside any region (the vocab head): copy, or gather the tokens."""
        return gather_tokens(x, tp) if self.sequence_parallel else copy_to_group(x, tp)

    def __call__(self, x: Tensor, *rest: Tensor) -> Tensor:
        m, groups = self.module, self.state.groups
        tp = groups.tp if groups is not None and groups.tp.size > 1 else None
        if self.kind == "vocab_embedding":
            return self._embedding(x, tp)
        if self.fp8 is not None:
            return self._fp8(x, rest, tp)
        if _linear_like(m):
            return self._linear_like(x, rest, tp)
        if tp is None:
            return F.linear(x, m.weight, m.bias)
        if self.row_overlap:
            out = row_scatter(m.weight, tp, x)
            return out if m.bias is None else out + m.bias
        if self.kind == "rowwise":
            out = self._reduce(F.linear(x, m.weight), tp)
            return out if m.bias is None else out + m.bias
        if self.region is not None:  # colwise, partial_input
            region, name = self.region
            return region.output(name, x, tp)
        out = F.linear(self._copy(x, tp), m.weight, m.bias)  # gather: the vocab head
        return out if self.local_output else gather_last_dim(out, tp)

    def _fp8(self, x: Tensor, rest: tuple[Tensor, ...], tp: RankGroup | None) -> Tensor:
        """An FP8 layer: its GEMM in FP8 (:func:`~.fp8.fp8_linear`) with the role's collectives around
        it; the amax groups: tp on the dim the role splits, cp on the tokens."""
        m, tokens = self.module, tokens_group(self.state)
        if tp is None:
            return fp8_linear(left_operand(m, x, rest), m.weight, m.bias, self.fp8, Fp8Axes(t=tokens))
        if self.kind == "rowwise":
            out = self._reduce(fp8_linear(left_operand(m, x, rest), m.weight, None, self.fp8,
                                          Fp8Axes(t=tokens, k=tp)), tp)
            return out if m.bias is None else out + m.bias
        if self.region is not None:  # colwise, partial_input
            region, name = self.region
            return region.output(name, x, tp)
        raise LayoutError(f"{type(m).__name__}: an FP8 layer of kind {self.kind!r} is not built (only block "
                          f"projections run in FP8; parallel/fp8.py)")

    def _linear_like(self, x: Tensor, rest: tuple[Tensor, ...], tp: RankGroup | None) -> Tensor:
        """A ``tp_linear_forward`` module's own forward on its shard; a vocab head called with
        labels computes the vocab-parallel loss itself (``group=``)."""
        m, own = self.module, type(self.module).forward
        if tp is None:
            return own(m, x, *rest)
        if self.row_overlap:
            out = row_scatter(m.weight, tp, x, *rest, left=type(m).tp_row_input)
            return out if m.bias is None else out + m.bias
        if self.kind == "rowwise":
            out = self._reduce(own(m, x, *rest), tp)
            return out if m.bias is None else out + m.bias
        x = self._copy(x, tp)
        if self.kind == "gather" and rest:
            return own(m, x, *rest, group=tp)
        out = own(m, x, *rest)
        return gather_last_dim(out, tp) if self.kind == "gather" and not self.local_output else out

    def _embedding(self, ids: Tensor, tp: RankGroup | None) -> Tensor:
        m = self.module
        if tp is None:
            return F.embedding(ids, m.weight, m.padding_idx)
        rows = m.weight.shape[0]
        # an id outside every rank's rows would read zeros everywhere: refuse it, as tp=1 does
        check_token_ids(ids, rows * tp.size, f"input ids of the vocab-parallel {type(m).__name__}")
        start = tp.index * rows
        outside = (ids < start) | (ids >= start + rows)
        local = (ids - start).masked_fill(outside, 0)
        pad = m.padding_idx
        pad = pad - start if pad is not None and start <= pad < start + rows else None
        out = F.embedding(local, m.weight, pad)
        return self._reduce(out.masked_fill(outside.unsqueeze(-1), 0.0), tp)


def declared_regions(module: nn.Module) -> dict[str, tuple[str, ...]]:
    """The column-parallel regions ``module`` declares: every submodule's ``tp_regions`` (``{owner
    pattern: reader names}``, relative to that submodule, e.g. :data:`~lightning_hotspa.models.tp_plan.
    LLAMA_TP_REGIONS` on ``Llama``), with the submodule's name prefixed.

    Args:
        module: the root module.
    """
    out: dict[str, tuple[str, ...]] = {}
    for name, sub in module.named_modules():
        for pattern, readers in (getattr(sub, "tp_regions", None) or {}).items():
            out[f"{name}.{pattern}" if name and pattern else name or pattern] = tuple(readers)
    return out


def _build_regions(module: nn.Module, kinds: Mapping[str, str], declared: Mapping[str, Sequence[str]],
                   sequence_parallel: bool, overlap: bool = True, regather: bool = True,
                   state: ParallelState | None = None) -> dict[str, tuple[ColumnRegion, str]]:
    """``{reader module name: (its region, its name there)}``: the declared regions, and one region of
    its own for every other plain column-parallel Linear."""
    out: dict[str, tuple[ColumnRegion, str]] = {}
    modules = dict(module.named_modules())
    for pattern, readers in declared.items():
        owners = [n for n in modules if fnmatchcase(n, pattern)]
        if not owners:
            raise LayoutError(f"tensor-parallel region {pattern!r} (readers {list(readers)}) matches no module "
                              f"of {type(module).__name__}")
        for owner in owners:
            names = [f"{owner}.{r}" if owner else r for r in readers]
            bad = [n for n in names if kinds.get(n) not in _READERS or _linear_like(modules.get(n))]
            if bad:
                raise LayoutError(f"tensor-parallel region {owner or pattern!r}: {bad[0]} is not a plain column-"
                                  f"parallel nn.Linear (roles 'colwise' or 'replicated_partial'); kinds "
                                  f"{ {n: kinds.get(n) for n in names} }")
            region = ColumnRegion(owner, {r: modules[n] for r, n in zip(readers, names, strict=True)},
                                  sequence_parallel, overlap, regather,
                                  kinds={r: kinds[n] for r, n in zip(readers, names, strict=True)}, state=state)
            out.update({n: (region, r) for r, n in zip(readers, names, strict=True)})
    for name, kind in kinds.items():
        if kind in _READERS and name not in out and not _linear_like(modules[name]):
            out[name] = (ColumnRegion(name, {name: modules[name]}, sequence_parallel, overlap, regather,
                                      kinds={name: kind}, state=state), name)
    return out


def install_tensor_parallel(
    module: nn.Module, roles: Mapping[str, str], state: ParallelState, *, loss_parallel: bool = False,
    regions: Mapping[str, Sequence[str]] | None = None, overlap: bool = True, regather: bool = True,
) -> int:
    """Installs the parallel forwards (and kv-head selection) once; returns how many were installed.

    Args:
        module: the root module.
        roles: every parameter's tp role (:func:`~lightning_hotspa.models.tp_plan.param_roles`).
        state: the shared :class:`ParallelState`.
        loss_parallel: the ``vocab`` Linear keeps its logits sharded and ``module.loss_fn`` is
            replaced by a vocab-parallel cross entropy (the model must compute its loss through it).
        regions: ``{owner module pattern: reader names}``, the column-parallel layers sharing one
            input (:mod:`.regions`); None reads what the module declares (:func:`declared_regions`).
        overlap: under sequence parallelism, the tp communication runs with its GEMMs (tp overlap, on by
            default): a column region's token all-gather with its readers' GEMMs, a row-parallel
            layer's reduce-scatter with its GEMM (:mod:`.row_scatter`), through the group's collectives
            object (``group_collectives.py``: fused on NCCL, a ring on gloo); False: collective, then GEMM.
        regather: under sequence parallelism a region keeps only its input's token shard and gathers it
            again in backward (the default, less memory); False keeps the gathered input
            (``RuntimeProfile.tp_regather``).
    """
    kinds = module_kinds(module, roles)
    heads = [n for n, k in kinds.items() if k == "gather"]
    if loss_parallel:
        if len(heads) != 1 or not callable(getattr(module, "loss_fn", None)):
            raise LayoutError(f"loss_parallel needs exactly one 'vocab' nn.Linear (found {heads}) and a "
                              f"callable {type(module).__name__}.loss_fn(logits, labels) to replace")
    sequence_parallel = _sequence_parallel(roles, kinds, type(module).__name__)
    regions = _build_regions(module, kinds, declared_regions(module) if regions is None else regions,
                             sequence_parallel, overlap, regather, state)
    installed = 0
    for name, kind in kinds.items():
        sub = module.get_submodule(name)
        if isinstance(sub.__dict__.get("forward"), TPForward):
            raise LayoutError(f"{name} already has a tensor-parallel forward; install once per module")
        sub.forward = TPForward(sub, kind, state, sequence_parallel, regions.get(name),
                                local_output=loss_parallel and kind == "gather", overlap=overlap)
        installed += 1
    for name, owner in attention_modules(module):
        partial = [child for child, k in kinds.items() if k == "partial_input"
                   and child.rpartition(".")[0] == name]
        if partial:
            ensure_parallel_attention(owner, name or type(owner).__name__, state).select_kv = True
            installed += 1
    if loss_parallel:
        module.loss_fn = VocabParallelLoss(state, module.loss_fn, module.get_submodule(heads[0]))
        installed += 1
    return installed
