"""Hugging Face ``config.json`` <-> :class:`LlamaConfig` for the Llama, Mistral and Qwen2 families.

Why strict: a field we do not model (an unknown RoPE type, biases on the output projection, a head
dim that is not hidden / heads) would load without complaint and compute something else, so every
field that changes the math is either mapped or refused by name. Both shapes of RoPE settings are
read: transformers 4.x writes ``rope_theta`` + ``rope_scaling``, transformers 5 ``rope_parameters``
(with ``rope_theta`` inside).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..checks import read_json_object
from .config import Llama3RopeScaling, LlamaConfig

__all__ = ["ARCHITECTURES", "HFConfigError", "config_from_hf", "config_to_hf", "read_hf_config"]

#: architecture -> model_type; all three share Llama's tensor layout (Qwen2 adds q/k/v biases)
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}


class HFConfigError(ValueError):
    """A Hugging Face config this project cannot load faithfully; the message names the field."""


def read_hf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``config.json`` of a local Hugging Face model folder."""
    from .hf_weights import in_model_folder

    file = Path(path).expanduser() / "config.json"
    if not file.is_file():
        raise HFConfigError(f"{str(Path(path))!r} is not a Hugging Face model folder: it has no config.json")
    in_model_folder(file, file.parent, HFConfigError)
    return read_json_object(file, error=HFConfigError, hint="; cut off or not a config.json?",
                            what="config object")


def _architecture(hf: Mapping[str, Any]) -> str:
    names = hf.get("architectures") or []
    if not names:
        by_type = {v: k for k, v in ARCHITECTURES.items()}
        if hf.get("model_type") in by_type:
            return by_type[hf["model_type"]]
    if len(names) != 1 or names[0] not in ARCHITECTURES:
        raise HFConfigError(f"unsupported architecture {names or hf.get('model_type')!r}; "
                            f"supported: {sorted(ARCHITECTURES)}")
    return names[0]


def _rope(hf: Mapping[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    params = dict(hf.get("rope_parameters") or {})  # transformers 5
    scaling = dict(hf.get("rope_scaling") or {})  # transformers 4.x
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    source = params if params.get("rope_type", "default") != "default" else scaling
    kind = source.get("rope_type", source.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise HFConfigError(f"unsupported RoPE scaling rope_type={kind!r}; supported: 'default', 'llama3'")
    fields = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [f for f in fields if f not in source]
    if missing:
        raise HFConfigError(f"llama3 RoPE scaling misses {missing}")
    return float(theta), Llama3RopeScaling(**{f: source[f] for f in fields})


def _refuse(hf: Mapping[str, Any], arch: str) -> None:
    checks = {
        "hidden_act": (hf.get("hidden_act", "silu") != "silu", "only 'silu' (SwiGLU) is implemented"),
        "attention_bias": (bool(hf.get("attention_bias")), "biases on q/k/v/o projections (Llama) are not implemented"),
        "mlp_bias": (bool(hf.get("mlp_bias")), "biases on the MLP projections are not implemented"),
        "attention_dropout": (float(hf.get("attention_dropout") or 0.0) != 0.0, "dropout is not implemented"),
        "pretraining_tp": (int(hf.get("pretraining_tp") or 1) != 1, "only pretraining_tp=1 is implemented"),
        "use_sliding_window": (arch == "Qwen2ForCausalLM" and bool(hf.get("use_sliding_window")),
                               "Qwen2's per-layer sliding window (max_window_layers) is not implemented"),
    }
    head_dim, hidden, heads = hf.get("head_dim"), hf["hidden_size"], hf["num_attention_heads"]
    checks["head_dim"] = (head_dim is not None and head_dim != hidden // heads,
                          f"head_dim={head_dim} differs from hidden_size / num_attention_heads = {hidden // heads}")
    for field, (bad, why) in checks.items():
        if bad:
            raise HFConfigError(f"{arch} config field {field}={hf.get(field)!r}: {why}")


_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


def config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> LlamaConfig:
    """A :class:`LlamaConfig` equal in math to the Hugging Face config ``hf`` (a parsed config.json).

    ``vocab_multiple`` defaults to 1: the checkpoint's vocabulary is kept exactly (padded rows would
    add logits the released model does not have). ``overrides`` replace any field.
    """
    missing = [k for k in _REQUIRED if hf.get(k) is None]
    if missing:
        raise HFConfigError(f"the Hugging Face config has no {', '.join(repr(k) for k in missing)} "
                            f"(a {hf.get('model_type', 'model')!r} config.json needs {list(_REQUIRED)})")
    for key in _REQUIRED:
        if isinstance(hf[key], bool) or not isinstance(hf[key], int) or hf[key] <= 0:
            raise HFConfigError(f"the Hugging Face config's {key!r} must be a positive integer, got {hf[key]!r}")
    arch = _architecture(hf)
    _refuse(hf, arch)
    theta, scaling = _rope(hf)
    window = hf.get("sliding_window") if arch == "MistralForCausalLM" else None
    fields: dict[str, Any] = dict(
        vocab_size=int(hf["vocab_size"]), hidden=int(hf["hidden_size"]), n_layers=int(hf["num_hidden_layers"]),
        n_heads=int(hf["num_attention_heads"]),
        n_kv_heads=int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
        ffn_hidden=int(hf["intermediate_size"]), rope_theta=theta, rope_scaling=scaling,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), max_seq_len=int(hf.get("max_position_embeddings", 4096)),
        vocab_multiple=1, qkv_bias=arch == "Qwen2ForCausalLM",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        sliding_window=None if window is None else int(window),
    )
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise HFConfigError(f"unknown LlamaConfig override(s) {unknown}; fields: {sorted(fields)}")
    fields.update(overrides)
    return LlamaConfig(**fields)


def config_to_hf(config: LlamaConfig, torch_dtype: str = "float32") -> dict[str, Any]:
    """A config.json that ``transformers`` loads into the matching ``*ForCausalLM`` (4.x and 5 keys).

    A padded vocabulary is written as what the model has: ``vocab_size`` = the padded row count, so
    the Hugging Face model computes the same logits (and softmax) over the same rows; ids at or past
    the original ``vocab_size`` are padding no data ever holds.

    Args:
        config: the model's config.
        torch_dtype: the stored dtype's name.
    """
    if config.qkv_bias and config.sliding_window is not None:
        raise HFConfigError(f"q/k/v biases (Qwen2) with sliding_window={config.sliding_window}: no supported "
                            f"Hugging Face architecture has both")
    arch = "Qwen2ForCausalLM" if config.qkv_bias else (
        "MistralForCausalLM" if config.sliding_window is not None else "LlamaForCausalLM")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        s = config.rope_scaling
        rope = {"rope_type": "llama3", "rope_theta": config.rope_theta, "factor": s.factor,
                "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings}
    out: dict[str, Any] = {
        "architectures": [arch], "model_type": ARCHITECTURES[arch], "vocab_size": config.padded_vocab_size,
        "hidden_size": config.hidden, "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads, "num_key_value_heads": config.n_kv_heads,
        "intermediate_size": config.ffn_hidden, "hidden_act": "silu", "rms_norm_eps": config.norm_eps,
        "max_position_embeddings": config.max_seq_len, "tie_word_embeddings": config.tie_embeddings,
        "head_dim": config.head_dim, "attention_dropout": 0.0, "torch_dtype": torch_dtype, "dtype": torch_dtype,
        "rope_theta": config.rope_theta, "rope_parameters": rope,
        "rope_scaling": None if config.rope_scaling is None else {k: v for k, v in rope.items() if k != "rope_theta"},
    }
    if arch == "LlamaForCausalLM":
        out.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    if arch == "MistralForCausalLM":
        out["sliding_window"] = config.sliding_window
    if arch == "Qwen2ForCausalLM":
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=config.n_layers)
    return out
