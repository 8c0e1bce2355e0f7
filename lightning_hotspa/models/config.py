"""Shape of a Llama-style decoder, with the presets and counts the planner needs.

The config is frozen and validated up front so that a bad value fails at construction with
its name, not later as a shape error deep inside a sharded forward pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..checks import check_int, check_number
from ..model_shape import PRESET_SHAPES, ModelShape

__all__ = ["ARTIFACT_VOCAB", "Llama3RopeScaling", "LLAMA2_VOCAB", "LLAMA3_VOCAB", "LlamaConfig", "PRESETS"]


@dataclass(frozen=True, kw_only=True)
class Llama3RopeScaling:
    """Llama-3.1-style RoPE frequency scaling (Hugging Face ``rope_type: "llama3"``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if not (self.factor > 0 and 0 < self.low_freq_factor < self.high_freq_factor
                and self.original_max_position_embeddings > 0):
            raise ValueError(f"Llama3RopeScaling needs factor > 0, 0 < low_freq_factor < high_freq_factor "
                             f"and original_max_position_embeddings > 0, got {self}")


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Hyper-parameters of the decoder; ``head_dim = hidden // n_heads``."""

    vocab_size: int
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 4096
    # The embedding and LM head get ``padded_vocab_size`` rows so that every tensor-parallel
    # degree we use divides them evenly (uneven DTensor shards misalign: docs/DESIGN.md §7, trap "uneven shards").
    vocab_multiple: int = 128
    # Architecture variants found in released checkpoints (Hugging Face Llama / Mistral / Qwen2):
    qkv_bias: bool = False  # biases on the q / k / v projections (Qwen2)
    tie_embeddings: bool = False  # the LM head reuses the embedding matrix (no ``output`` module)
    rope_scaling: Llama3RopeScaling | None = None  # Llama-3.1 long-context frequency scaling
    sliding_window: int | None = None  # a query sees at most this many keys, itself included (Mistral)

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, Mapping):  # Hydra / JSON hand a mapping
            object.__setattr__(self, "rope_scaling", Llama3RopeScaling(**self.rope_scaling))
        for name in ("qkv_bias", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"LlamaConfig.{name} must be a bool, got {getattr(self, name)!r}")
        window = self.sliding_window
        if window is not None:
            check_int(window, "LlamaConfig.sliding_window", hint=" or None")
        for name in ("vocab_size", "hidden", "n_layers", "n_heads", "n_kv_heads",
                     "ffn_hidden", "max_seq_len", "vocab_multiple"):
            check_int(getattr(self, name), f"LlamaConfig.{name}")
        for name in ("rope_theta", "norm_eps"):
            check_number(getattr(self, name), f"LlamaConfig.{name}")
        if self.hidden % self.n_heads:
            raise ValueError(
                f"LlamaConfig.hidden={self.hidden} is not divisible by n_heads={self.n_heads}"
            )
        if (self.hidden // self.n_heads) % 2:
            raise ValueError(
                f"LlamaConfig head_dim={self.hidden // self.n_heads} (hidden={self.hidden} / "
                f"n_heads={self.n_heads}) must be even for rotary embeddings"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"LlamaConfig.n_kv_heads={self.n_kv_heads} does not divide "
                f"n_heads={self.n_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    @property
    def padded_vocab_size(self) -> int:
        """``vocab_size`` rounded up to a multiple of ``vocab_multiple``."""
        m = self.vocab_multiple
        return (self.vocab_size + m - 1) // m * m

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> LlamaConfig:
        """A named preset, optionally with some fields replaced."""
        if name not in PRESETS:
            raise ValueError(
                f"unknown LlamaConfig preset {name!r}; known presets: {sorted(PRESETS)}"
            )
        return dataclasses.replace(PRESETS[name], **overrides)

    def shape(self) -> ModelShape:
        """What the planner and the cost model read of this config (:mod:`..model_shape`)."""
        return ModelShape(vocab_size=self.vocab_size, hidden=self.hidden, n_layers=self.n_layers,
                          n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, ffn_hidden=self.ffn_hidden,
                          head_dim=self.head_dim, tie_embeddings=self.tie_embeddings, qkv_bias=self.qkv_bias,
                          vocab_multiple=self.vocab_multiple)

    def num_params(self, *, include_embedding: bool = True) -> int:
        """Exact parameter count of :class:`Llama` built from this config (padded vocab;
        :meth:`ModelShape.num_params`)."""
        return self.shape().num_params(include_embedding=include_embedding)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token of a document of ``seq_len`` tokens
        (:meth:`ModelShape.flops_per_token`)."""
        return self.shape().flops_per_token(seq_len)


LLAMA2_VOCAB = 32000  # the LLaMA / LLaMA-2 SentencePiece tokenizer (Hugging Face "meta-llama/Llama-2-*")
LLAMA3_VOCAB = 128256  # the Llama-3 tiktoken-based tokenizer (128000 + 256 reserved specials)
ARTIFACT_VOCAB = 30592  # the HotSPa artifact's Megatron-padded vocabulary: planning comparisons only

#: Each preset's Llama settings beside its shape (:data:`..model_shape.PRESET_SHAPES`): context and
#: RoPE (Llama 3 / 3.1: theta 500000, 128K context; the long-context simulator prices them to 512K).
_LLAMA_SETTINGS: dict[str, dict[str, Any]] = {
    "tiny": {"max_seq_len": 2048}, "small": {"max_seq_len": 4096},
    "llama3-8b": {"rope_theta": 500000.0, "max_seq_len": 131072},
    "llama3-70b": {"rope_theta": 500000.0, "max_seq_len": 131072},
}


def _from_shape(name: str, shape: ModelShape) -> LlamaConfig:
    return LlamaConfig(vocab_size=shape.vocab_size, hidden=shape.hidden, n_layers=shape.n_layers,
                       n_heads=shape.n_heads, n_kv_heads=shape.n_kv_heads, ffn_hidden=shape.ffn_hidden,
                       vocab_multiple=shape.vocab_multiple, tie_embeddings=shape.tie_embeddings,
                       qkv_bias=shape.qkv_bias, **({"max_seq_len": 32768} | _LLAMA_SETTINGS.get(name, {})))


PRESETS: dict[str, LlamaConfig] = {name: _from_shape(name, shape) for name, shape in PRESET_SHAPES.items()}
