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
default, ``python -m lightning_hotspa.planner.profile_update FILE`` prints the updated profile's
fields to paste into :data:`.hardware.PROFILES`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .hardware import HardwareProfile, get_profile

__all__ = ["UPDATABLE_FIELDS", "ProfileUpdateError", "apply_profile_update", "load_updated_profile"]

#: the fields a measurement may set; the rest of a profile (links, memory) stays as written
UPDATABLE_FIELDS = ("peak_flops", "dense_efficiency", "attention_efficiency", "layer_overhead_s",
                    "tp_efficiency", "cp_efficiency")


class ProfileUpdateError(ValueError):
    """A profile-update file or mapping that cannot be applied; the message names the bad part."""


def apply_profile_update(profile: str | HardwareProfile, update: Mapping[str, Any]) -> HardwareProfile:
    """``profile`` with the ``update["set"]`` fields replaced (validated as any profile is), its
    ``source`` saying where the new figures came from."""
    base = get_profile(profile)
    if not isinstance(update, Mapping) or not isinstance(update.get("set"), Mapping):
        raise ProfileUpdateError(f"a profile update needs a 'set' mapping of fields, got {update!r}")
    fields = dict(update["set"])
    unknown = sorted(set(fields) - set(UPDATABLE_FIELDS))
    if unknown:
        raise ProfileUpdateError(f"profile update sets unknown or fixed fields {unknown}; "
                                 f"updatable: {list(UPDATABLE_FIELDS)}")
    for key in ("tp_efficiency", "cp_efficiency"):
        if key in fields:
            try:
                fields[key] = tuple((int(d), float(e)) for d, e in fields[key])
            except (TypeError, ValueError):
                raise ProfileUpdateError(f"{key} must be [[degree, efficiency], ...], got {fields[key]!r}") from None
    measured = update.get("measured") or {}
    note = " MEASURED " + ", ".join(f"{k}={v}" for k, v in sorted(measured.items())) if measured else ""
    try:
        return dataclasses.replace(base, **fields, source=base.source + f" UPDATED: {sorted(fields)}" + note)
    except ValueError as err:
        raise ProfileUpdateError(f"profile update for {base.name}: {err}") from None


def load_updated_profile(path: str | Path) -> HardwareProfile:
    """The profile a profile-update JSON file names, with the file's fields applied."""
    path = Path(path)
    try:
        update = json.loads(path.read_text())
    except OSError as err:
        raise ProfileUpdateError(f"cannot read profile update {str(path)!r}: {err}") from None
    except json.JSONDecodeError as err:
        raise ProfileUpdateError(f"profile update {str(path)!r} is not JSON: {err}") from None
    if not isinstance(update, Mapping) or not isinstance(update.get("profile"), str):
        raise ProfileUpdateError(f"profile update {str(path)!r} must name its base 'profile' (e.g. \"H200\")")
    return apply_profile_update(update["profile"], update)


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
