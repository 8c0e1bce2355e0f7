"""Peak memory per rank when 4 CPU ranks load a 1B-sized Hugging Face checkpoint into the home state.

Writes a Llama checkpoint of the ``1b`` preset's shape (TinyLlama: 22 layers, hidden 2048, GQA 32/4,
vocab 32000; random bf16 weights, 2 safetensors shards, made here tensor by tensor: nothing is
downloaded), then on each rank: ``LlamaLM.from_pretrained`` on the meta device and the home state
built as the strategy builds it, each rank reading only its own slices. Prints, per rank, the peak
resident memory while loading (``VmHWM`` after a reset; it includes checkpoint file pages mapped while
reading) and the anonymous memory before and after, next to the full model's size; the last line is one JSON object.

    python recipes/benchmark_hf_load.py [--dir /tmp/hf-1b] [--ranks 4] [--layouts dp4,dp2xtp2] [--preset 1b]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def write_checkpoint(path: Path, preset: str = "1b") -> int:
    """A random bf16 checkpoint of ``preset``'s shape; returns its parameter count."""
    from lightning_hotspa.models import Llama, LlamaConfig
    from lightning_hotspa.models.hf_config import config_to_hf
    from lightning_hotspa.models.hf_weights import hf_name, save_hf_folder

    config = LlamaConfig.preset(preset, vocab_multiple=1)
    with torch.device("meta"):
        model = Llama(config)
    shapes = [(n, p.shape) for n, p in model.named_parameters()]
    hf_config = config_to_hf(config, "bfloat16")
    if (path / "config.json").is_file():  # written by an earlier run: reused if it has this shape
        found = json.loads((path / "config.json").read_text())
        differ = sorted(k for k in ("hidden_size", "num_hidden_layers", "vocab_size") if found.get(k) != hf_config[k])
        if differ:
            raise SystemExit(f"--dir {path} holds a checkpoint of another shape ({differ} differ from the "
                             f"{preset} preset's); give another --dir")
        return sum(s.numel() for _, s in shapes)
    g = torch.Generator().manual_seed(0)

    def tensors():
        for name, shape in shapes:
            yield hf_name(name), (0.02 * torch.randn(shape, generator=g)).to(torch.bfloat16)

    save_hf_folder(path, hf_config, tensors(), max_shard_bytes=1 << 30)
    return sum(s.numel() for _, s in shapes)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return -1


def load_on_rank(path: str, layouts: list[str]) -> dict:
    from lightning_hotspa.engine.home import build_home_parameters, region_initializer
    from lightning_hotspa.mesh import WorldMesh
    from lightning_hotspa.models import LlamaLM, param_roles
    from lightning_hotspa.placements import build_shardings

    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM): spawning copied the parent's
    before = {"rss": _status_kib("VmRSS") / 1024, "anon": _status_kib("RssAnon") / 1024}
    world = WorldMesh(layouts)
    with torch.device("meta"):
        module = LlamaLM.from_pretrained(path)
    max_tp = max(x.tp for x in world.layouts)
    roles = param_roles(module, module.tp_plan(max_tp))
    shardings = build_shardings({n: tuple(p.shape) for n, p in module.named_parameters()}, roles, world.shape)
    home = build_home_parameters(world, shardings, None, init_shard=region_initializer(module.init_parameter))
    local_bytes = sum(p.to_local().numel() * p.to_local().element_size() for p in home.values())
    return {"rank": world.rank, "peak_rss_mib": _status_kib("VmHWM") / 1024, "rss_before_mib": before["rss"],
            "anon_before_mib": before["anon"], "anon_after_mib": _status_kib("RssAnon") / 1024,
            "home_shard_mib": local_bytes / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default="/tmp/hotspa-hf-1b")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--layouts", default="dp4,dp2xtp2")
    parser.add_argument("--preset", default="1b", help="the checkpoint's shape (the smoke run: tiny)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from lightning_hotspa.testing.spawn import run_on_ranks

    path = Path(args.dir)
    params = write_checkpoint(path, args.preset)
    out = run_on_ranks(load_on_rank, args.ranks, str(path), args.layouts.split(","), timeout_s=1800)
    full_fp32_mib, full_file_mib = params * 4 / 2**20, params * 2 / 2**20
    for r in sorted(out, key=lambda r: r["rank"]):
        print(f"rank {r['rank']}: peak RSS {r['peak_rss_mib']:.0f} MiB while loading (RSS before "
              f"{r['rss_before_mib']:.0f}); anonymous {r['anon_before_mib']:.0f} -> {r['anon_after_mib']:.0f} MiB; "
              f"home shard {r['home_shard_mib']:.0f} MiB")
    print(f"full model: {params / 1e9:.2f}B parameters = {full_fp32_mib:.0f} MiB fp32 ({full_file_mib:.0f} MiB bf16 "
          f"on disk)")
    print(json.dumps({"preset": args.preset, "params": params, "full_fp32_mib": full_fp32_mib,
                      "checkpoint_mib": full_file_mib, "layouts": args.layouts,
                      "per_rank": sorted(out, key=lambda r: r["rank"]),
                      "max_peak_rss_mib": max(r["peak_rss_mib"] for r in out)}))


if __name__ == "__main__":
    main()
