"""Hugging Face checkpoints in and out, checked against ``transformers`` itself (tiny random models
built locally): logits, token-mean loss and gradients on packed documents equal Hugging Face's
per-document results; HF -> ours -> HF is bit-exact; configs of transformers 4.x and 5 both load."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from helpers import hf_docs, hf_model, hf_reference, rel_error  # noqa: E402

from lightning_hotspa.models import LlamaLM  # noqa: E402
from lightning_hotspa.models.hf_config import HFConfigError, config_from_hf  # noqa: E402
from lightning_hotspa.models.hf_weights import hf_name  # noqa: E402
from lightning_hotspa.plan import pack_micro_batch  # noqa: E402

TOL = 1e-5


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """llama (Llama-3 RoPE scaling), mistral (sliding window shorter than two documents), qwen2
    (q/k/v biases, tied embeddings, saved in 3 safetensors shards with an index)."""
    out = {}
    for arch in ("llama", "mistral", "qwen2"):
        path = tmp_path_factory.mktemp(arch)
        model = hf_model(arch)
        model.save_pretrained(path, max_shard_size="100KB" if arch == "qwen2" else "1GB")
        out[arch] = (path, model)
    return out


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_packed_logits_loss_and_grads_equal_transformers(folders, arch):
    path, hf = folders[arch]
    documents = hf_docs()
    ref_logits, ref_loss, ref_grads = hf_reference(hf, documents)
    ours = LlamaLM.from_pretrained(str(path))
    mb = pack_micro_batch(documents)
    logits = ours(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.max_seqlen)
    for i, piece in enumerate(logits.split([len(d) for d in documents])):
        assert rel_error(piece, ref_logits[i]) <= TOL, (arch, i, rel_error(piece, ref_logits[i]))
    loss = ours.training_step(mb)
    assert abs(float(loss.detach()) - ref_loss) / ref_loss <= TOL
    loss.backward()
    grads = {hf_name(n): p.grad for n, p in ours.model.named_parameters()}
    assert set(grads) == set(ref_grads) - ({"lm_head.weight"} if ours.config.tie_embeddings else set())
    errors = {n: rel_error(g, ref_grads[n]) for n, g in grads.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOL, (arch, worst, errors[worst])


def test_the_features_are_really_exercised(folders):
    """Each architecture's special feature changes the result: without it the match breaks."""
    documents = hf_docs()
    mb = pack_micro_batch(documents)
    for arch, override in (("llama", {"rope_scaling": None}), ("mistral", {"sliding_window": None})):
        path, hf = folders[arch]
        ref_logits, _, _ = hf_reference(hf, documents)
        plain = LlamaLM.from_pretrained(str(path), **override)
        logits = plain(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.max_seqlen).detach()
        assert rel_error(logits, torch.cat(ref_logits)) > 1e-3, arch
    qwen = LlamaLM.from_pretrained(str(folders["qwen2"][0]))
    assert qwen.config.qkv_bias and qwen.config.tie_embeddings and not hasattr(qwen.model, "output")
    from lightning_hotspa.adapter.lightning.module_layouts import supported_layouts

    layouts, why = supported_layouts(qwen, 4)  # tied: no tp plan yet, cp through its attention core
    assert [str(x) for x in layouts] == ["dp4", "dp2xcp2", "cp4"] and "tied embeddings" in why
    assert float(qwen.model.layers[0].attention.wk.bias.detach().abs().sum()) > 0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_round_trip_hf_ours_hf_is_bit_exact(folders, tmp_path, arch):
    import transformers

    path, hf = folders[arch]
    LlamaLM.from_pretrained(str(path)).save_pretrained(str(tmp_path))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert type(back) is type(hf)
    mine, theirs = back.state_dict(), hf.state_dict()
    assert set(mine) == set(theirs)
    assert all(torch.equal(mine[n], theirs[n]) for n in theirs)
    for key in ("rope_theta", "sliding_window", "tie_word_embeddings", "num_key_value_heads", "rms_norm_eps"):
        assert getattr(back.config, key, None) == getattr(hf.config, key, None), key


LLAMA3_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}
BASE_JSON = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 2048,
             "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
             "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
             "tie_word_embeddings": True}


def test_both_rope_config_shapes_read_the_same():
    v4 = {**BASE_JSON, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **LLAMA3_SCALING}}
    v4_old_key = {**BASE_JSON, "rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **LLAMA3_SCALING}}
    v5 = {**BASE_JSON, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3_SCALING}}
    configs = [config_from_hf(c) for c in (v4, v4_old_key, v5)]
    assert configs[0] == configs[1] == configs[2]
    assert configs[0].rope_theta == 500000.0 and configs[0].rope_scaling.factor == 8.0
    plain = config_from_hf({**BASE_JSON, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert plain.rope_theta == 1e6 and plain.rope_scaling is None


@pytest.mark.parametrize("change, match", [
    ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture.*GPT2LMHeadModel"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_type='yarn'"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"head_dim": 128}, "head_dim=128 differs"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
])
def test_unsupported_configs_are_refused_by_name(change, match):
    with pytest.raises(HFConfigError, match=match):
        config_from_hf({**BASE_JSON, **change})


def test_mismatched_checkpoint_and_padding_are_refused(folders, tmp_path):
    path, _ = folders["llama"]
    with pytest.raises(HFConfigError, match="vocab_multiple=100 would pad"):
        LlamaLM.from_pretrained(str(path), vocab_multiple=100)
    cfg = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    shutil.copy(path / "model.safetensors", tmp_path / "model.safetensors")  # an outside symlink is refused
    with pytest.raises(HFConfigError, match=r"missing \['model.layers.2"):
        LlamaLM.from_pretrained(str(tmp_path))
