"""The logged history of an offline W&B run, read from its ``run-*.wandb`` file.

wandb >= 0.31 writes the file from its Go core and ships no Python reader (``wandb sync --view`` and
``wandb.sdk.internal.datastore`` are gone). The file is LevelDB's log format
(github.com/google/leveldb doc/log_format.md: 32 KiB blocks of records, each a 7-byte header --
checksum, little-endian uint16 length, type FULL/FIRST/MIDDLE/LAST -- then its bytes) behind a
7-byte file header (``:W&B``, a magic uint16, a version byte); each assembled record is one
``wandb_internal_pb2.Record`` protobuf, the schema wandb ships. History rows are its ``history``
records: one per ``wandb.log`` call that Lightning's WandbLogger makes.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

__all__ = ["history_rows"]

_FILE_HEADER = 7
_BLOCK = 32768
_RECORD_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _payloads(data: bytes) -> list[bytes]:
    """The assembled records of a LevelDB-log byte string (after the file header)."""
    if data[:4] != b":W&B":
        raise ValueError(f"not a .wandb file (starts with {data[:4]!r})")
    out: list[bytes] = []
    pending = b""
    pos = _FILE_HEADER
    while pos + _RECORD_HEADER <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _RECORD_HEADER:  # a block's trailer: zero padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + _RECORD_HEADER])
        body = data[pos + _RECORD_HEADER:pos + _RECORD_HEADER + length]
        pos += _RECORD_HEADER + length
        if kind == 0 and length == 0:  # zero fill at the end of a block
            pos += _BLOCK - pos % _BLOCK if pos % _BLOCK else 0
            continue
        if kind == _FULL:
            out.append(body)
        elif kind == _FIRST:
            pending = body
        elif kind == _MIDDLE:
            pending += body
        elif kind == _LAST:
            out.append(pending + body)
            pending = b""
        else:
            raise ValueError(f"record of unknown type {kind} at byte {pos}")
    return out


def history_rows(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every history row of the offline run in ``run_dir`` (a folder holding one ``run-*.wandb``),
    in logging order, as ``{key: value}`` with values decoded from their JSON."""
    from wandb.proto import wandb_internal_pb2 as pb

    files = sorted(Path(run_dir).glob("run-*.wandb"))
    if len(files) != 1:
        raise ValueError(f"expected one run-*.wandb in {run_dir}, found {[f.name for f in files]}")
    rows = []
    for payload in _payloads(files[0].read_bytes()):
        record = pb.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") != "history":
            continue
        row = {}
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            row[key] = json.loads(item.value_json) if item.value_json else None
        rows.append(row)
    return rows
