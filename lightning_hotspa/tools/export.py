"""``hotspa export CKPT_DIR OUT_DIR``: one of our DCP checkpoints as a Hugging Face folder
(``config.json`` + safetensors) that ``transformers`` loads, at any world size the checkpoint had."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_parser", "run", "run_upgrade"]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    exp = sub.add_parser("export",
                         help="one of our DCP checkpoints as a Hugging Face folder (config.json + safetensors)")
    exp.add_argument("checkpoint_dir", help="a checkpoint folder, or latest:<dir> (the newest committed one in <dir>)")
    exp.add_argument("out_dir", help="the Hugging Face folder to write (created; see --overwrite)")
    exp.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="default: as stored")
    exp.add_argument("--overwrite", action="store_true",
                     help="replace a non-empty OUT_DIR: only the exported files remain in it")
    up = sub.add_parser("upgrade-checkpoint", help="convert a checkpoint written before commit markers (its "
                        "meta.pt is read weights-only; --trust-pickle to unpickle it in full)")
    up.add_argument("folder", help="the checkpoint folder to convert in place")
    up.add_argument("--trust-pickle", action="store_true",
                    help="unpickle an old meta.pt in full when a weights-only load cannot read it (runs any code "
                    "it holds: only for folders you wrote)")
    return exp


#: torch.distributed.checkpoint's note when it loads without a process group, which export always does
#: on purpose (one process reads every rank's shards): nothing a user can act on
SINGLE_PROCESS_NOTE = ("torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to "
                       "load in a single process.")


def run(args: argparse.Namespace) -> dict[str, Any]:
    import re
    import warnings

    import torch

    from ..adapter.checkpoints.hf_export import export_hf
    from .progress import progress

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=re.escape(SINGLE_PROCESS_NOTE), category=UserWarning)
        names = export_hf(args.checkpoint_dir, args.out_dir, getattr(torch, args.dtype) if args.dtype else None,
                          overwrite=args.overwrite,
                          progress=lambda items, what, unit: progress(items, what, unit=unit))
    print(f"wrote {len(names)} tensors and config.json to {args.out_dir}")
    return {"out_dir": args.out_dir, "tensors": len(names)}


def run_upgrade(args: argparse.Namespace) -> dict[str, Any]:
    """Converts an old-format checkpoint folder in place (see :mod:`..adapter.checkpoints.upgrade`)."""
    from ..adapter.checkpoints.upgrade import upgrade_legacy_checkpoint

    path = upgrade_legacy_checkpoint(args.folder, trust_pickle=args.trust_pickle)
    print(f"converted {path}: weights-only metadata and a commit marker with checksums")
    return {"folder": str(path)}
