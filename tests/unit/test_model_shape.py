"""The model description the planner reads (lightning_hotspa/model_shape.py): one shape from a preset, a
LlamaConfig or a Hugging Face config, the same prices from each, and errors that name the value."""

from __future__ import annotations

import pytest

from lightning_hotspa.layout import Layout
from lightning_hotspa.model_shape import PRESET_SHAPES, ModelShape, describe_model
from lightning_hotspa.models.config import PRESETS, LlamaConfig
from lightning_hotspa.models.hf_config import config_from_hf, config_to_hf
from lightning_hotspa.planner.cost.cost_model import AnalyticCostModel, CostModelError


def test_every_preset_config_describes_itself_as_its_preset_shape() -> None:
    assert set(PRESETS) == set(PRESET_SHAPES)
    for name, config in PRESETS.items():
        assert config.shape() == PRESET_SHAPES[name] == describe_model(name) == describe_model(config), name


def test_the_llama_module_has_the_parameters_the_shape_counts() -> None:
    from lightning_hotspa.models import Llama

    for name in ("tiny", "small"):
        module = Llama(LlamaConfig.preset(name))
        assert sum(p.numel() for p in module.parameters()) == PRESET_SHAPES[name].num_params(), name


def test_a_hugging_face_config_prices_like_the_llama_config_built_from_it() -> None:
    config = LlamaConfig.preset("llama3-8b", vocab_multiple=1)
    hf = config_to_hf(config)
    assert describe_model(hf) == config.shape() == config_from_hf(hf).shape()
    lay = Layout.parse("dp2xtp2xcp2")
    a, b = AnalyticCostModel(hf, "H100", 8), AnalyticCostModel(config, "H100", 8)
    assert a.capacity(lay, False) == b.capacity(lay, False)
    assert a.option(lay, False).stage_fixed == b.option(lay, False).stage_fixed


def test_a_stated_head_dim_is_priced_as_its_attention_width() -> None:
    """Qwen3-style: 32 heads of 128 over hidden 2560 (attention width 4096): the attention FLOPs follow
    the heads' width, not hidden; the same shape with head_dim derived (80) prices less attention."""
    qwen = ModelShape.from_hf_config({"hidden_size": 2560, "num_hidden_layers": 36, "num_attention_heads": 32,
                                      "num_key_value_heads": 8, "intermediate_size": 9728, "vocab_size": 151936,
                                      "head_dim": 128, "tie_word_embeddings": True})
    derived = qwen.replace(head_dim=None)
    assert (qwen.head_dim, derived.head_dim) == (128, 80)
    attention = [s.flops_per_token(65536) - s.flops_per_token(1) for s in (qwen, derived)]
    assert attention[0] / attention[1] == pytest.approx(128 / 80)
    assert qwen.num_params() > derived.num_params()  # wider q / k / v / o projections


@pytest.mark.parametrize(("value", "message"), [
    ("llama9000", r"unknown model preset 'llama9000'.*known presets"),
    (3.5, r"cannot describe float 3.5"),
    ({"hidden_size": 64}, r"needs \['num_hidden_layers', 'num_attention_heads', 'intermediate_size', 'vocab_size'\]"),
])
def test_what_is_not_a_model_is_named(value, message) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        describe_model(value)
    with pytest.raises(CostModelError, match=message):
        AnalyticCostModel(value, "H100", 8)


def test_a_bad_shape_field_is_named() -> None:
    with pytest.raises(ValueError, match="ModelShape.n_kv_heads=3 does not divide n_heads=8"):
        ModelShape(vocab_size=10, hidden=64, n_layers=1, n_heads=8, n_kv_heads=3, ffn_hidden=128)
    with pytest.raises(ValueError, match="hidden=66 is not divisible by n_heads=8; give head_dim"):
        ModelShape(vocab_size=10, hidden=66, n_layers=1, n_heads=8, n_kv_heads=8, ffn_hidden=128)
    with pytest.raises(ValueError, match="tie_embeddings must be a bool"):
        ModelShape(vocab_size=10, hidden=64, n_layers=1, n_heads=8, n_kv_heads=8, ffn_hidden=128,
                   tie_embeddings="yes")
