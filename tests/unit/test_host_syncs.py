"""No host sync per micro-batch: what the batch knows travels with it (host_facts), and the NCCL
runtime helpers (docs/gpu-runtime.md). The per-layout counts on 4 ranks are
recipes/benchmark_hot_path.py's ``host_syncs_per_micro_batch``."""

import pickle

import pytest
import torch

from lightning_hotspa.adapter.lightning.nccl_runtime import (
    ALLOCATOR_SETTINGS,
    apply_allocator_settings,
    objects_to_cpu,
)
from lightning_hotspa.host_facts import recall
from lightning_hotspa.models import Llama, LlamaConfig, token_mean_cross_entropy
from lightning_hotspa.models.vocab import VocabularyError
from lightning_hotspa.plan import pack_micro_batch
from lightning_hotspa.testing.host_syncs import count_host_syncs


def _micro_batch(high: int = 200):
    g = torch.Generator().manual_seed(0)
    return pack_micro_batch([torch.randint(0, high, (n,), generator=g) for n in (37, 12, 64)])


def _step(model, mb):
    logits = model(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.max_seqlen)
    token_mean_cross_entropy(logits, mb.labels).backward()


@pytest.mark.parametrize("window", [None, 16])
def test_model_forward_backward_reads_no_device_value(window):
    torch.manual_seed(0)
    model = Llama(LlamaConfig.preset("tiny", sliding_window=window))
    mb = _micro_batch().to("cpu")
    _step(model, mb)  # the first micro-batch may fill caches
    mb = _micro_batch().to("cpu")
    with count_host_syncs() as log:
        _step(model, mb)
    assert log.count == 0, dict(log.ops)


def test_a_bad_token_id_fails_by_name_without_reading_the_device():
    model = Llama(LlamaConfig.preset("tiny"))
    mb = _micro_batch()
    ids = mb.input_ids.clone()
    ids[5] = 300  # outside the vocabulary of 260
    bad = pack_micro_batch([ids])
    with count_host_syncs() as log, pytest.raises(VocabularyError, match="token id 300"):
        model(bad.input_ids, bad.position_ids, bad.cu_seqlens, bad.max_seqlen)
    assert log.count == 0, dict(log.ops)


def test_moved_and_unpickled_micro_batches_keep_their_facts_without_revalidating():
    mb = pack_micro_batch([torch.arange(10), torch.arange(6)], cp_size=2, cp_rank=1)
    with count_host_syncs() as log:
        moved = mb.to("cpu", non_blocking=True)
    assert log.count == 0, dict(log.ops)  # .to() does not validate again (on a device: a sync per tensor)
    assert moved == mb and recall(moved.cu_seqlens, "bounds") == (0, 6, 10)
    loaded = pickle.loads(pickle.dumps(mb))  # a loader worker's batch
    assert recall(loaded.cp_cu_seqlens, "bounds") == (0, 12, 20)
    assert recall(loaded.labels, "id_range") == ((3, 9), -100)


def test_allocator_settings_respect_the_users_and_objects_go_to_cpu():
    env = {}
    assert apply_allocator_settings(env) == ALLOCATOR_SETTINGS and env["PYTORCH_CUDA_ALLOC_CONF"] == ALLOCATOR_SETTINGS
    mine = {"PYTORCH_ALLOC_CONF": "max_split_size_mb:128"}
    assert apply_allocator_settings(mine) is None and mine == {"PYTORCH_ALLOC_CONF": "max_split_size_mb:128"}
    t = torch.ones(2)
    payload = {"a": [t, (t, 3)], "b": "x"}
    assert objects_to_cpu(payload) == {"a": [t, (t, 3)], "b": "x"}  # CPU tensors stay (same objects)
