"""recipes/lightning_baselines.py: the ``ModelParallelStrategy`` baseline's tp plan computes our model.

torch's ``parallelize_module`` plan (Colwise / Rowwise, our two-input :class:`SwiGLUDownRowwise` on the
fused SwiGLU down projection) and FSDP2 on dp1 x tp2: the loss and every full gradient equal the plain
single-process model's on the same micro-batch, so the benchmarks compare against the same math.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-5
MODEL = {"preset": "tiny", "n_kv_heads": 4}  # benchmark_e2e.py's: torch's plan shards k/v like q


def _baselines():
    if "lightning_baselines" not in sys.modules:
        path = ROOT / "recipes" / "lightning_baselines.py"
        spec = importlib.util.spec_from_file_location("lightning_baselines", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["lightning_baselines"] = module
    return sys.modules["lightning_baselines"]


def _batch():
    from lightning_hotspa.plan import pack_micro_batch

    g = torch.Generator().manual_seed(3)
    return pack_micro_batch([torch.randint(0, 256, (n,), generator=g) for n in (37, 90, 5)])


def baseline_vs_plain() -> dict[str, float]:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_hotspa.models import LlamaLM

    batch = _batch()
    plain = LlamaLM(MODEL, seed=0)
    ref_loss = plain._loss(batch)  # training_step without its self.log (no Trainer here)
    ref_loss.backward()
    module = _baselines().model_parallel_llama(MODEL, seed=0)
    module._device_mesh = init_device_mesh("cpu", (1, dist.get_world_size()),
                                           mesh_dim_names=("data_parallel", "tensor_parallel"))
    module.configure_model()
    loss = module._loss(batch)
    loss.backward()
    ref = dict(plain.named_parameters())
    errors = {"loss": abs(float(loss) - float(ref_loss)) / abs(float(ref_loss))}
    for name, p in module.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        want = ref[name].grad
        errors[name] = float((grad - want).norm() / want.norm())
    return errors


def test_model_parallel_baseline_equals_the_plain_model(ranks) -> None:
    errors = ranks(2).run(baseline_vs_plain)[0]
    assert len(errors) > 10  # the loss and every parameter
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOLERANCE, (worst, errors[worst])
