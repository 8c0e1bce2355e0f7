"""``hotspa export CKPT_DIR OUT_DIR``: one of our DCP checkpoints as a Hugging Face folder
(``config.json`` + safetensors) that ``transformers`` loads, at any world size the checkpoint had."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    exp = sub.add_parser("export", help="one of our DCP checkpoints as a Hugging Face folder (config.json + safetensors)")
    exp.add_argument("checkpoint_dir")
    exp.add_argument("out_dir")
    exp.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="default: as stored")
    return exp


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from ..adapter.hf_export import export_hf

    names = export_hf(args.checkpoint_dir, args.out_dir, getattr(torch, args.dtype) if args.dtype else None)
    print(f"wrote {len(names)} tensors and config.json to {args.out_dir}")
    return {"out_dir": args.out_dir, "tensors": len(names)}
