"""A Hugging Face checkpoint loaded slice by slice into the home state (each rank reads only its own
rows / columns) trains in dp, tp and cp layouts exactly as ``transformers`` computes it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from helpers import HF_DOC_LENGTHS, hf_docs, hf_model, hf_reference, home_grad_errors  # noqa: E402

LAYOUTS = ["dp4", "dp2xtp2", "tp4", "dp2xcp2", "tp2xcp2"]


def run_layouts(cases: dict) -> dict:
    """Every (checkpoint, HF reference) of ``cases`` in every layout (one pool call)."""
    return {arch: _run_one(path, ref_loss, ref_grads) for arch, (path, ref_loss, ref_grads) in cases.items()}


def _run_one(path: str, ref_loss: float, ref_grads: dict) -> dict:

    from lightning_hotspa.engine.switch import SwitchEngine, build_home_parameters
    from lightning_hotspa.layout import Layout
    from lightning_hotspa.mesh import WorldMesh
    from lightning_hotspa.models import LlamaLM, param_roles
    from lightning_hotspa.models.hf_weights import hf_name
    from lightning_hotspa.parallel.model import ParallelModel
    from lightning_hotspa.placements import build_shardings
    from lightning_hotspa.plan import Stage, StepPlan, slice_plan

    documents = hf_docs()
    world = WorldMesh(LAYOUTS)
    with torch.device("meta"):  # as under trainer.init_module(empty_init=True)
        module = LlamaLM.from_pretrained(path)
    roles = param_roles(module, module.tp_plan(4))
    shardings = build_shardings({n: tuple(p.shape) for n, p in module.named_parameters()}, roles, world.shape)
    reads = []

    def init_shard(name, shape, dim, start, stop):
        reads.append((name, dim, start, stop))
        return module.init_parameter(name, dim=dim, start=start, stop=stop)

    home = build_home_parameters(world, shardings, None, init_shard=init_shard)
    parallel = ParallelModel(module, roles, world)
    parallel.restore(home)
    engine = SwitchEngine(world, shardings, home)
    results = {}
    for name in LAYOUTS:
        lay = Layout.parse(name)
        ids = list(range(len(HF_DOC_LENGTHS)))
        groups = tuple(tuple((d,) for d in ids[i::lay.dp]) for i in range(lay.dp))  # one doc per micro-batch
        plan = StepPlan(0, tuple(HF_DOC_LENGTHS), (Stage(lay, groups),))
        mine = slice_plan(plan, documents, world.shape, world.rank)
        loss_sum = torch.zeros((), dtype=torch.float64)
        for stage in mine.stages:
            engine.materialize(stage.layout)
            parallel.activate(stage.layout, engine.working)
            for mb in stage.micro_batches:
                with parallel.micro_batch(mb):
                    loss = module.training_step(mb)
                scaled = loss * (mb.num_target_tokens / plan.global_target_tokens)
                scaled.backward()
                if parallel.state.groups.tp.index == 0:
                    loss_sum += float(scaled.detach())
            engine.reduce_gradients()
        errors = home_grad_errors(parallel, engine, home, loss_sum, ref_grads,
                                  lambda pname: hf_name(pname.removeprefix("model.")))
        worst = max(errors, key=errors.get)
        results[name] = {"loss_err": abs(float(loss_sum) - ref_loss) / ref_loss, "grad_err": errors[worst],
                         "worst": worst}
    sliced = sum(1 for _, dim, _, _ in reads if dim is not None)
    return {"results": results, "sliced_reads": sliced, "reads": len(reads)}


@pytest.mark.slow
def test_hf_checkpoints_train_in_dp_tp_cp_like_transformers(ranks, tmp_path):
    """Qwen2 (untied: q/k/v biases under tp, replicated_partial kv in tp4) and Mistral (a sliding
    window shorter than two documents, applied after the Ulysses exchange in cp layouts). The
    references are computed here, so the ranks never import transformers."""
    cases = {}
    for arch, extra in (("qwen2", {"tie_word_embeddings": False}), ("mistral", {})):
        model = hf_model(arch, **extra)
        model.save_pretrained(tmp_path / arch)
        _, ref_loss, ref_grads = hf_reference(model, hf_docs())
        cases[arch] = (str(tmp_path / arch), ref_loss, ref_grads)
    out = ranks(4).run(run_layouts, cases)
    for rank_out in out:
        for arch, res in rank_out.items():
            assert res["sliced_reads"] > 0  # embeddings / projections came as slices
            for layout, r in res["results"].items():
                assert r["loss_err"] <= 1e-5 and r["grad_err"] <= 1e-5, (arch, layout, r)
    print({arch: {k: (f"{v['loss_err']:.1e}", f"{v['grad_err']:.1e}") for k, v in res["results"].items()}
           for arch, res in out[0].items()})
