"""Memory at real scale without GPUs: measured peak per rank (the real step under FakeTensorMode and a
fake process group, torch's MemTracker) next to the cost model's predicted peak, for llama7b on 8/16
ranks, llama13b on 8/16, llama30b on 32, Llama-3 8B on 8 and Llama-3 70B on 64, every candidate layout.
The last line printed is one JSON object (rows, max_rel_error, reserve, model_error_margin, feasible_rows,
feasible_rows_that_fit: planner-feasible rows whose measured peak fits the usable memory).

    python recipes/benchmark_memory.py --quick        # one 7B and one 70B row (< 5 minutes)
    python recipes/benchmark_memory.py                # the full table
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_hotspa.tools import memory  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command")
    memory.add_parser(sub)
    args = parser.parse_args(["memory", *sys.argv[1:]])
    result = memory.run(args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
