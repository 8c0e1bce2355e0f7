"""Hugging Face checkpoints out: a model loaded from HF under ``trainer.init_module(empty_init=True)``
(each rank reads its own slices at setup), trained with hot switching, then written back both live
(``save_pretrained`` on every rank) and from our DCP checkpoint (``hotspa export``, one process)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from helpers import hf_model  # noqa: E402


def train_and_save(hf_dir: str, out: str) -> dict:
    import lightning as L
    import torch.distributed as dist
    from helpers import lightning_rank_env, mixed_plan, rank_plans

    from lightning_hotspa import HotSPaStrategy
    from lightning_hotspa.layout import Layout
    from lightning_hotspa.models import LlamaLM

    layouts = ["dp4", "dp2xtp2"]
    plans = [mixed_plan(s, [30, 12, 5, 40, 9, 17, 25, 8], [Layout.parse(x) for x in layouts]) for s in range(2)]
    batches = rank_plans(plans, [Layout.parse(x) for x in layouts], dist.get_rank())
    with lightning_rank_env():
        trainer = L.Trainer(accelerator="cpu", devices=4, strategy=HotSPaStrategy(layouts), max_steps=2,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, use_distributed_sampler=False)
        with trainer.init_module(empty_init=True):
            model = LlamaLM.from_pretrained(hf_dir, lr=1e-2)
        slices = []
        original = model.init_parameter

        def recording_init(name, *, dim=None, start=0, stop=None):  # the region the strategy asks for
            slices.append(dim)
            return original(name, dim=dim, start=start, stop=stop)

        model.init_parameter = recording_init
        trainer.fit(model, torch.utils.data.DataLoader(batches, batch_size=None, collate_fn=lambda x: x))
        trainer.save_checkpoint(f"{out}/ckpt")
        model.save_pretrained(f"{out}/live")  # every rank: gathers, rank 0 writes
    dist.barrier()
    return {"sliced": sum(d is not None for d in slices), "reads": len(slices), "step": trainer.global_step}


@pytest.mark.slow
def test_export_from_live_module_and_from_dcp_checkpoint_load_in_transformers(ranks, tmp_path, capsys, monkeypatch):
    import transformers

    from lightning_hotspa.tools.cli import main

    hf = hf_model("qwen2", tie_word_embeddings=False)
    hf.save_pretrained(tmp_path / "hf")
    info = ranks(4).run(train_and_save, str(tmp_path / "hf"), str(tmp_path))
    assert all(r["step"] == 2 and r["sliced"] > 0 for r in info), info
    monkeypatch.setenv("HOTSPA_PROGRESS", "1")  # as a terminal would get it: bars on stderr only
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "exported")]) == 0
    out, err = capsys.readouterr()
    assert "config.json" in out and "hotspa export" not in out
    assert "hotspa export: checksums" in err and "hotspa export: tensors" in err
    load = transformers.AutoModelForCausalLM.from_pretrained
    live, exported = (load(str(tmp_path / k), dtype=torch.float32).state_dict() for k in ("live", "exported"))
    before = hf.state_dict()
    assert set(live) == set(exported) == set(before)
    assert all(torch.equal(live[n], exported[n]) for n in before)  # world 4 DCP == live gather, exactly
    assert all(not torch.equal(live[n], before[n]) for n in before if n.endswith("proj.weight"))  # trained
