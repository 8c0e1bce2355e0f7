"""Declarative tensor-parallel plan: glob pattern over module/parameter names -> role.

The model only *declares* how each weight is split (as torchtitan does); the parallel package
reads the roles and does the sharding and the collectives. Roles:

- ``colwise``: Linear weight [out, in] sharded on dim 0 (output features, i.e. heads).
- ``rowwise``: Linear weight sharded on dim 1; its outputs are partial sums over tp.
- ``vocab``: [vocab, hidden] sharded on dim 0: the Embedding (out-of-shard ids look up zeros)
  and the LM head Linear (colwise, but its consumer, the loss, needs every logit: the parallel
  forward gathers the vocab-sharded logits or hands them to a vocab-parallel loss).
- ``replicated``: the same on every tp rank, and so is its gradient (norms).
- ``replicated_partial``: the same weight on every tp rank, but each rank's gradient is a
  partial sum to be all-reduced over tp (KV projections when n_kv_heads < tp: every rank keeps
  all kv heads and uses the one its q heads need; q head i uses kv head i // (n_heads //
  n_kv_heads), so tp rank r needs kv head r // (tp // n_kv_heads)).
- ``sequence``: the same weight on every tp rank, applied to this rank's share of the tokens
  (sequence parallelism, Megatron-style: norms and the residual stream are split over tp along
  the sequence), so its gradient is a partial sum over tp. A plan that uses it turns sequence
  parallelism on for the whole model (docs/DESIGN.md §11, "Sequence parallelism"): ``llama_tp_plan``
  does unless ``sequence_parallel=False``.

Where the residual stream is gathered and where it is reduce-scattered follows from the roles and
the declared REGIONS (:data:`LLAMA_TP_REGIONS`, read from the model's ``tp_regions``): a region's
column-parallel readers share one gather of its input (Megatron's attention block: ``wq / wk / wv``;
the MLP: ``w1 / w3``), its ``rowwise`` layer (``wo``; ``w2``) reduce-scatters, the ``vocab``
embedding reduce-scatters and the ``vocab`` head gathers (parallel/regions.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatchcase

from torch import nn

from ..checks import check_int
from ..placements import ROLES, TPRole, role_of
from .config import LlamaConfig

__all__ = [
    "LLAMA_TP_REGIONS",
    "ROLES",
    "TPPlan",
    "TPRole",
    "check_tp_compatible",
    "llama_tp_plan",
    "param_roles",
    "shard_dim",
]

TPPlan = Mapping[str, TPRole]

#: Llama's column-parallel regions: ``{owner module pattern: the readers of its input}``, relative to
#: the ``Llama`` module (its ``tp_regions``); each region's rowwise layer closes it (``wo``, ``w2``)
LLAMA_TP_REGIONS: Mapping[str, tuple[str, ...]] = {
    "layers.*.attention": ("wq", "wk", "wv"),
    "layers.*.feed_forward": ("w1", "w3"),
}


def shard_dim(role: str) -> int | None:
    """The weight dim that ``role`` shards over tp, or None for the replicated roles (the roles
    themselves are defined once, in :mod:`lightning_hotspa.placements`)."""
    return role_of(role).shard_dim


def check_tp_compatible(config: LlamaConfig, tp: int) -> None:
    """Raise ValueError unless ``tp`` splits heads, FFN and padded vocab evenly."""
    check_int(tp, "tp")
    checks = {
        "n_heads": config.n_heads,
        "ffn_hidden": config.ffn_hidden,
        "padded_vocab_size": config.padded_vocab_size,
    }
    for field, value in checks.items():
        if value % tp:
            raise ValueError(f"tp={tp} does not divide {field}={value}")
    if config.tie_embeddings and tp > 1:
        raise ValueError(f"tp={tp}: tied embeddings (tie_embeddings=True) are not split by tensor parallel "
                         f"yet; use data / context parallel layouts, or untie (tie_embeddings=False: the "
                         f"head becomes its own parameter, trained apart from the embedding)")
    if config.n_kv_heads % tp and tp % config.n_kv_heads:
        # Otherwise a rank's contiguous q heads would straddle kv groups unevenly.
        raise ValueError(
            f"tp={tp} and n_kv_heads={config.n_kv_heads}: one must divide the other"
        )


def llama_tp_plan(config: LlamaConfig, tp: int, prefix: str = "", *,
                  sequence_parallel: bool = True) -> dict[str, TPRole]:
    """The plan for :class:`Llama` at one tp degree.

    Args:
        config: the model.
        tp: the largest tp degree the plan must split for.
        prefix: for a wrapped model ("model.").
        sequence_parallel: the norms and the residual stream split over tp along the tokens (the
            norms' role ``sequence``); False: replicated (plain Megatron tp, all-reduces).
    """
    check_tp_compatible(config, tp)
    kv: TPRole = "colwise" if config.n_kv_heads % tp == 0 else "replicated_partial"
    norm: TPRole = "sequence" if sequence_parallel else "replicated"
    plan: dict[str, TPRole] = {
        "tok_embeddings": "vocab",
        "layers.*.attention_norm": norm,  # sequence parallel: norms see this rank's tokens
        "layers.*.attention.wq": "colwise",
        "layers.*.attention.wk": kv,
        "layers.*.attention.wv": kv,
        "layers.*.attention.wo": "rowwise",
        "layers.*.ffn_norm": norm,
        "layers.*.feed_forward.w1": "colwise",
        "layers.*.feed_forward.w3": "colwise",
        "layers.*.feed_forward.w2": "rowwise",
        "norm": norm,
    }
    if not config.tie_embeddings:
        plan["output"] = "vocab"  # vocab-sharded logits
    return {prefix + pattern: role for pattern, role in plan.items()}


def param_roles(model: nn.Module, plan: TPPlan) -> dict[str, TPRole]:
    """Resolve every parameter of ``model`` to exactly one role of ``plan``.

    A pattern matches a parameter if it matches (fnmatch, case-sensitive) the parameter name or
    the name of the module owning it. Unmatched parameters, and parameters matched by patterns
    with different roles, raise ValueError.
    """
    for role in plan.values():
        shard_dim(role)  # validates the role
    roles: dict[str, TPRole] = {}
    unmatched: list[str] = []
    for name, _ in model.named_parameters():
        owner = name.rpartition(".")[0]
        hits = {p: r for p, r in plan.items() if fnmatchcase(name, p) or fnmatchcase(owner, p)}
        if not hits:
            unmatched.append(name)
            continue
        if len(set(hits.values())) > 1:
            raise ValueError(f"parameter {name!r} matches conflicting tp-plan patterns {hits}")
        roles[name] = next(iter(hits.values()))
    if unmatched:
        raise ValueError(f"no tp-plan pattern matches parameter(s) {unmatched}")
    return roles
