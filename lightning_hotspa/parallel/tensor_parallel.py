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

Several column-parallel layers reading the same tensor (q, k, v; w1, w3) share ONE ``f``, so their
input gradient is all-reduced once, as with Megatron's fused QKV.

Sequence parallelism (:mod:`.sequence_parallel`): a plan with any ``sequence`` role keeps the
tokens between the tp regions split over tp. Then ``f`` becomes an all-gather of the tokens (one
per shared input; a plain colwise / kv Linear keeps only its shard for backward and gathers it
again there), ``g`` of a row-parallel output and of the vocab-parallel embedding a reduce-scatter
along the tokens, and a ``vocab`` head gathers its input tokens. Every other parameter such a model
has must then be ``sequence`` (not ``replicated``: its gradient is a partial sum over tp), and it
needs a ``vocab`` nn.Embedding (where the tokens get split).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping

import torch.nn.functional as F
from torch import Tensor, nn

from ..layout import LayoutError
from ..mesh import RankGroup
from ..models.vocab import check_token_ids
from .attention import attention_modules, ensure_parallel_attention
from .collectives import copy_to_group, gather_last_dim, reduce_from_group
from .loss import VocabParallelLoss
from .sequence_parallel import Regather, gather_tokens, scatter_tokens, sequence_parallel_linear
from .state import ParallelState

__all__ = ["install_tensor_parallel", "module_kinds", "TPForward"]

_DIM0 = ("colwise", "vocab")  # roles that shard dim 0 (a Linear's output features)
_UNTOUCHED = ("replicated", "sequence")  # roles whose module keeps its own forward


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


class _SharedInputCopy:
    """Shares one ``f(x)`` among the layers reading the same ``x`` (q, k, v; w1, w3): one backward
    all-reduce, or under sequence parallelism one all-gather forward, one reduce-scatter backward and
    one :class:`~.sequence_parallel.Regather`.

    The copy of the open region is held until its last reader has run (how many read it is learned
    when the region closes: its row-parallel output or a vocab head, :meth:`close_region`), the
    next input arrives, or a backward reaches the region: under sequence parallelism nothing else
    keeps the gathered rows alive between the region's layers, and a recomputation under activation
    checkpointing may stop before the closing layer.
    """

    def __init__(self, sequence_parallel: bool = False) -> None:
        self.sequence_parallel = sequence_parallel
        self._source: weakref.ref | None = None
        self._group: RankGroup | None = None
        self._copy: Tensor | None = None
        self._regather: Regather | None = None
        self._opener: object | None = None  # the layer that opened the region
        self._reads = 0
        self._readers: dict[int, int] = {}  # id(opener) -> how many layers read its region's copy

    def __call__(self, x: Tensor, group: RankGroup, reader: object) -> tuple[Tensor, Regather | None]:
        """``f(x)`` for the layer ``reader`` (the memoized one if the same ``x`` and group)."""
        if self._copy is not None and self._source is not None and self._source() is x and self._group is group:
            copied, regather = self._copy, self._regather
            self._reads += 1
        else:
            if self.sequence_parallel:
                copied, regather = gather_tokens(x, group), Regather(group, on_backward=self.release)
            else:
                copied, regather = copy_to_group(x, group), None
            self._source, self._group, self._copy, self._regather = weakref.ref(x), group, copied, regather
            self._opener, self._reads = reader, 1
        if self._readers.get(id(self._opener)) == self._reads:  # its last reader: let go of the copy
            self._source = self._copy = None
        return copied, regather

    def release(self) -> None:
        """Forgets the open region (its copy is no longer needed in forward)."""
        self._source = self._group = self._copy = self._regather = self._opener = None

    def close_region(self) -> Regather | None:
        """The open region's Regather (None without sequence parallelism); the region is released."""
        regather = self._regather
        if self._opener is not None:
            self._readers[id(self._opener)] = self._reads
        self.release()
        return regather


class TPForward:
    """A module's forward under tensor parallelism; installed once as ``module.forward``."""

    def __init__(self, module: nn.Module, kind: str, state: ParallelState, copies: _SharedInputCopy,
                 local_output: bool = False) -> None:
        self.module = module
        self.kind = kind
        self.state = state
        self.copies = copies
        self.local_output = local_output  # vocab head whose loss is vocab-parallel

    @property
    def sequence_parallel(self) -> bool:
        """Tokens between the tp regions are split over tp (:mod:`.sequence_parallel`)."""
        return self.copies.sequence_parallel

    def _reduce(self, out: Tensor, tp: RankGroup, closes_region: bool = True) -> Tensor:
        """``g`` (all-reduce), or the reduce-scatter along the tokens under sequence parallelism (a
        row-parallel output closes the region opened by the last shared input: its backward
        all-gather re-gathers that input too)."""
        regather = self.copies.close_region() if closes_region else None
        if not self.sequence_parallel:
            return reduce_from_group(out, tp)
        return scatter_tokens(out, tp, regather)

    def __call__(self, x: Tensor, *rest: Tensor) -> Tensor:
        m, groups = self.module, self.state.groups
        tp = groups.tp if groups is not None and groups.tp.size > 1 else None
        if self.kind == "vocab_embedding":
            return self._embedding(x, tp)
        if _linear_like(m):
            return self._linear_like(x, rest, tp)
        if tp is None:
            return F.linear(x, m.weight, m.bias)
        if self.kind == "rowwise":
            out = self._reduce(F.linear(x, m.weight), tp)
            return out if m.bias is None else out + m.bias
        full, regather = self.copies(x, tp, self)  # colwise, gather, partial_input
        if regather is not None and self.kind != "gather":  # keep the shard, not the gathered rows
            return sequence_parallel_linear(full, x, m.weight, m.bias, regather)
        out = F.linear(full, m.weight, m.bias)
        if self.kind == "gather":
            self.copies.close_region()
            if not self.local_output:
                out = gather_last_dim(out, tp)
        return out

    def _linear_like(self, x: Tensor, rest: tuple[Tensor, ...], tp: RankGroup | None) -> Tensor:
        """A ``tp_linear_forward`` module's own forward on its shard; a vocab head called with
        labels computes the vocab-parallel loss itself (``group=``)."""
        m, own = self.module, type(self.module).forward
        if tp is None:
            return own(m, x, *rest)
        if self.kind == "rowwise":
            out = self._reduce(own(m, x, *rest), tp)
            return out if m.bias is None else out + m.bias
        x, _ = self.copies(x, tp, self)
        if self.kind == "gather":
            self.copies.close_region()
            if rest:
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
        return self._reduce(out.masked_fill(outside.unsqueeze(-1), 0.0), tp, closes_region=False)


def install_tensor_parallel(
    module: nn.Module, roles: Mapping[str, str], state: ParallelState, *, loss_parallel: bool = False
) -> int:
    """Installs the parallel forwards (and kv-head selection) once; returns how many were installed.

    With ``loss_parallel`` the ``vocab`` Linear keeps its logits sharded and ``module.loss_fn`` is
    replaced by a vocab-parallel cross entropy (the model must compute its loss through it).
    """
    kinds = module_kinds(module, roles)
    heads = [n for n, k in kinds.items() if k == "gather"]
    if loss_parallel:
        if len(heads) != 1 or not callable(getattr(module, "loss_fn", None)):
            raise LayoutError(f"loss_parallel needs exactly one 'vocab' nn.Linear (found {heads}) and a "
                              f"callable {type(module).__name__}.loss_fn(logits, labels) to replace")
    copies = _SharedInputCopy(_sequence_parallel(roles, kinds, type(module).__name__))
    installed = 0
    for name, kind in kinds.items():
        sub = module.get_submodule(name)
        if isinstance(sub.__dict__.get("forward"), TPForward):
            raise LayoutError(f"{name} already has a tensor-parallel forward; install once per module")
        sub.forward = TPForward(sub, kind, state, copies, local_output=loss_parallel and kind == "gather")
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
