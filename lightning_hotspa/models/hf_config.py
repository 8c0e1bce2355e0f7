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


_ABSENT = object()


class _Fields:
    """The fields of one parsed config.json, each read with its JSON type checked; errors name the
    file and the key (a string where a number belongs is refused, never coerced: ``"false"`` is not
    false, ``"16"`` is not 16).

    Args:
        hf: the parsed config.json.
        where: the file (or "the Hugging Face config"), for messages.
    """

    def __init__(self, hf: Mapping[str, Any], where: str) -> None:
        self.hf, self.where = hf, where

    def _bad(self, key: str, what: str, value: Any) -> HFConfigError:
        return HFConfigError(f"{self.where}: {key!r} must be {what}, got {value!r} ({type(value).__name__})")

    def get(self, key: str, kind: str, default: Any = None, *, source: Mapping[str, Any] | None = None,
            prefix: str = "") -> Any:
        """``key`` of ``source`` (default: the config) as ``kind``: "int" (> 0), "int0" (>= 0), "number"
        (finite, > 0), "number0" (finite, >= 0), "bool", "str", "object" or "list"; absent or null:
        ``default``."""
        import math
        import numbers

        value = (self.hf if source is None else source).get(key, _ABSENT)
        if value is _ABSENT or value is None:
            return default
        name = prefix + key
        if kind in ("int", "int0"):
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if kind == "int" else 0):
                raise self._bad(name, "a positive integer" if kind == "int" else "an integer >= 0", value)
        elif kind in ("number", "number0"):
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or \
                    (value <= 0 if kind == "number" else value < 0):
                raise self._bad(name, "a finite number > 0" if kind == "number" else "a finite number >= 0", value)
            value = float(value)
        elif kind == "bool" and not isinstance(value, bool):
            raise self._bad(name, "a JSON boolean (true or false)", value)
        elif kind == "str" and not isinstance(value, str):
            raise self._bad(name, "a string", value)
        elif kind == "object" and not isinstance(value, Mapping):
            raise self._bad(name, "an object (or null)", value)
        elif kind == "list" and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise self._bad(name, "a list of strings", value)
        return value


def _architecture(f: _Fields) -> str:
    names = f.get("architectures", "list") or []
    model_type = f.get("model_type", "str")
    if not names:
        by_type = {v: k for k, v in ARCHITECTURES.items()}
        if model_type in by_type:
            return by_type[model_type]
    if len(names) != 1 or names[0] not in ARCHITECTURES:
        raise HFConfigError(f"{f.where}: unsupported architecture {names or model_type!r}; "
                            f"supported: {sorted(ARCHITECTURES)}")
    return names[0]


def _rope(f: _Fields) -> tuple[float, Llama3RopeScaling | None]:
    params = dict(f.get("rope_parameters", "object") or {})  # transformers 5
    scaling = dict(f.get("rope_scaling", "object") or {})  # transformers 4.x
    theta = f.get("rope_theta", "number", source=params, prefix="rope_parameters.") \
        or f.get("rope_theta", "number", 10000.0)
    p_kind = f.get("rope_type", "str", "default", source=params, prefix="rope_parameters.")
    key, source = ("rope_parameters", params) if p_kind != "default" else ("rope_scaling", scaling)
    kind = f.get("rope_type", "str", None, source=source, prefix=f"{key}.") or \
        f.get("type", "str", "default", source=source, prefix=f"{key}.")
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise HFConfigError(f"{f.where}: unsupported RoPE scaling rope_type={kind!r}; supported: 'default', 'llama3'")
    fields = {"factor": "number", "low_freq_factor": "number", "high_freq_factor": "number",
              "original_max_position_embeddings": "int"}
    missing = [k for k in fields if source.get(k) is None]
    if missing:
        raise HFConfigError(f"{f.where}: llama3 RoPE scaling ({key}) misses {missing}")
    return theta, Llama3RopeScaling(**{k: f.get(k, kind, source=source, prefix=f"{key}.")
                                       for k, kind in fields.items()})


def _refuse(f: _Fields, arch: str) -> None:
    head_dim, hidden, heads = f.get("head_dim", "int"), f.hf["hidden_size"], f.hf["num_attention_heads"]
    checks = {
        "hidden_act": (f.get("hidden_act", "str", "silu") != "silu", "only 'silu' (SwiGLU) is implemented"),
        "attention_bias": (f.get("attention_bias", "bool", False), "biases on q/k/v/o projections (Llama) are not "
                           "implemented"),
        "mlp_bias": (f.get("mlp_bias", "bool", False), "biases on the MLP projections are not implemented"),
        "attention_dropout": (f.get("attention_dropout", "number0", 0.0) != 0.0, "dropout is not implemented"),
        "pretraining_tp": (f.get("pretraining_tp", "int", 1) != 1, "only pretraining_tp=1 is implemented"),
        "use_sliding_window": (arch == "Qwen2ForCausalLM" and f.get("use_sliding_window", "bool", False),
                               "Qwen2's per-layer sliding window (max_window_layers) is not implemented"),
        "head_dim": (head_dim is not None and head_dim != hidden // heads,
                     f"head_dim={head_dim} differs from hidden_size / num_attention_heads = {hidden // heads}"),
    }
    for field, (bad, why) in checks.items():
        if bad:
            raise HFConfigError(f"{f.where}: {arch} config field {field}={f.hf.get(field)!r}: {why}")


_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


def config_from_hf(hf: Mapping[str, Any], *, where: str = "the Hugging Face config", **overrides: Any) -> LlamaConfig:
    """A :class:`LlamaConfig` equal in math to the Hugging Face config ``hf`` (a parsed config.json).

    ``vocab_multiple`` defaults to 1: the checkpoint's vocabulary is kept exactly (padded rows would
    add logits the released model does not have). ``overrides`` replace any field. Every field read
    is type-checked (:class:`_Fields`); errors name ``where`` and the key.

    Args:
        hf: the parsed config.json.
        where: its file, for messages.
        overrides: LlamaConfig fields.
    """
    f = _Fields(hf, where)
    missing = [k for k in _REQUIRED if hf.get(k) is None]
    if missing:
        raise HFConfigError(f"{where} has no {', '.join(repr(k) for k in missing)} "
                            f"(a {hf.get('model_type', 'model')!r} config.json needs {list(_REQUIRED)})")
    for key in _REQUIRED:
        f.get(key, "int")
    arch = _architecture(f)
    _refuse(f, arch)
    theta, scaling = _rope(f)
    heads = hf["num_attention_heads"]
    kv_heads = f.get("num_key_value_heads", "int", heads)
    if heads % kv_heads:
        raise HFConfigError(f"{where}: 'num_key_value_heads' {kv_heads} does not divide 'num_attention_heads' "
                            f"{heads}")
    window = f.get("sliding_window", "int") if arch == "MistralForCausalLM" else None
    fields: dict[str, Any] = dict(
        vocab_size=hf["vocab_size"], hidden=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=heads,
        n_kv_heads=kv_heads, ffn_hidden=hf["intermediate_size"], rope_theta=theta, rope_scaling=scaling,
        norm_eps=f.get("rms_norm_eps", "number", 1e-6), max_seq_len=f.get("max_position_embeddings", "int", 4096),
        vocab_multiple=1, qkv_bias=arch == "Qwen2ForCausalLM",
        tie_embeddings=f.get("tie_word_embeddings", "bool", False), sliding_window=window,
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
