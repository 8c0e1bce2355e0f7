"""``hotspa consolidate CKPT_DIR OUT.ckpt``: one of our DCP checkpoint folders as a single-file
Lightning checkpoint that ``load_from_checkpoint`` reads (``adapter/checkpoints/single_file.py``)."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """The ``consolidate`` sub-command.

    Args:
        sub: the CLI's sub-parsers.
    """
    cmd = sub.add_parser("consolidate", help="a DCP checkpoint folder as one Lightning .ckpt file "
                                             "(load_from_checkpoint reads it; no optimizer state)")
    cmd.add_argument("checkpoint_dir", help="a checkpoint folder, or latest:<dir> (the newest committed one in <dir>)")
    cmd.add_argument("out_file", help="the .ckpt file to write")
    return cmd


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Writes the file; returns what it wrote.

    Args:
        args: the parsed ``checkpoint_dir`` and ``out_file``.
    """
    from ..adapter.checkpoints.single_file import consolidate_checkpoint
    from .progress import progress

    ckpt = consolidate_checkpoint(args.checkpoint_dir, args.out_file,
                                  progress=lambda files: progress(files, "hotspa consolidate: checksums", unit="file"))
    print(f"wrote {len(ckpt['state_dict'])} tensors (global step {ckpt.get('global_step')}) to {args.out_file}")
    return {"out_file": args.out_file, "tensors": len(ckpt["state_dict"]), "global_step": ckpt.get("global_step")}
