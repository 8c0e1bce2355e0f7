"""Apply measured rates (a profile-update JSON file) to a hardware profile.

``recipes/gpu_check.py`` measures, on a real device, what :mod:`.hardware` only assumes (dense and
attention efficiency, the per-degree shard efficiency curves) and writes them as a small JSON file::

    {"profile": "H200",
     "set": {"dense_efficiency": 0.61, "attention_efficiency": 0.43,
             "tp_efficiency": [[2, 0.97], [4, 0.93], [8, 0.85]],
             "cp_efficiency": [[2, 0.98], [4, 0.95], [8, 0.9]]},
     "measured": {"date": "...", "device": "NVIDIA H200", "command": "..."}}

Any tool that takes a profile name takes that file's path too (``get_profile`` applies it), e.g.
``hotspa simulate --hardware gpu_check_out/h200_profile_update.json``. To make the figures the
default, ``python -m lightning_hotspa.planner.cost.profile_update FILE`` prints the updated profile's
fields to paste into :data:`.hardware.PROFILES`.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from .hardware import (
    UPDATABLE_FIELDS,
    ProfileUpdateError,
    apply_profile_update,
    load_updated_profile,
)

# the functions live with the profiles (planner/cost/hardware.py); this module is their command line
__all__ = ["UPDATABLE_FIELDS", "ProfileUpdateError", "apply_profile_update", "load_updated_profile", "main"]

def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description="Print a hardware profile with a profile-update file applied.")
    parser.add_argument("file", help="a profile-update JSON file (recipes/gpu_check.py writes one)")
    args = parser.parse_args(argv)
    profile = load_updated_profile(args.file)
    out = profile.as_dict()
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
