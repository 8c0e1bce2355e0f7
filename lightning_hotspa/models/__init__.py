"""Llama-style decoder written for one device, with its declarative tensor-parallel plan."""

from .attention import CoreAttention, repeat_kv, sdpa_attention
from .attention_kernels import (
    BACKENDS,
    KERNELS,
    AttentionKernel,
    auto_attention,
    auto_backend_name,
    select_attention_backend,
)
from .config import PRESETS, LlamaConfig
from .init import build_llama, init_parameter, init_weights, parameter_seed
from .llama import Attention, Block, FeedForward, Llama, RMSNorm
from .rope import apply_rotary, position_ids_from_cu_seqlens, rotary_cos_sin
from .tp_plan import (
    ROLES,
    TPPlan,
    TPRole,
    check_tp_compatible,
    llama_tp_plan,
    param_roles,
    shard_dim,
)

# The LightningModule pulls in Lightning (seconds to import); model-only users such as spawned
# tensor-parallel test workers should not pay for it, so it loads on first access.
_LAZY = {"IGNORE_INDEX", "LlamaLM", "PackedBatch", "token_mean_cross_entropy"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        from . import lightning_module

        return getattr(lightning_module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AttentionKernel",
    "BACKENDS",
    "KERNELS",
    "IGNORE_INDEX",
    "PRESETS",
    "ROLES",
    "Attention",
    "Block",
    "CoreAttention",
    "FeedForward",
    "Llama",
    "LlamaConfig",
    "LlamaLM",
    "PackedBatch",
    "RMSNorm",
    "TPPlan",
    "TPRole",
    "apply_rotary",
    "auto_attention",
    "auto_backend_name",
    "build_llama",
    "check_tp_compatible",
    "init_parameter",
    "init_weights",
    "llama_tp_plan",
    "param_roles",
    "parameter_seed",
    "position_ids_from_cu_seqlens",
    "repeat_kv",
    "rotary_cos_sin",
    "sdpa_attention",
    "select_attention_backend",
    "shard_dim",
    "token_mean_cross_entropy",
]
