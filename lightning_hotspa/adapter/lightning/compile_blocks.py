"""Per-block ``torch.compile`` (``HotSPaStrategy(runtime={"compile_blocks": ...})``), as torchtitan applies it.

Lightning refuses ``torch.compile(model)`` for strategies other than single-device, DDP and FSDP
(the strategy must own the module's forward); compiling each transformer block (every child of an
``nn.ModuleList``) in place, AFTER the strategy has installed its tensor- and context-parallel
forwards, traces what the block really runs, the tp collectives included (dynamo maps our
``dist.*`` calls to its functional collectives). The switch engine runs between micro-batches,
outside every graph. Each block's ``forward`` is compiled, not its ``__call__``: the module's hooks, a
sharded (``:fsdp``) unit's gather, prefetch and release (``engine/fsdp.py``, asynchronous collectives), run
eagerly around the graph, as dynamo skips FSDP2's hooks (with ``block.compile()`` they were traced: graph breaks).

Graphs: the token dim is dynamic (``dynamic=True`` unless the caller says otherwise), and the CPU
attention is one opaque op (:mod:`lightning_hotspa.models.documents_op`), as is context parallelism's
(:mod:`lightning_hotspa.parallel.cp_attention_op`), so new document lengths never recompile. A layout switch
swaps the block's parameters (other shapes under tp) and the active groups, which dynamo guards on: one graph
per (layout, block). With ``dynamic`` on, ``compile_blocks`` also sets ``backed_size_oblivious`` (process-wide),
so a 1-token slice does not specialize a graph of its own, and turns duck shaping off (process-wide), so a token
count that equals the head dim on the first call is not specialized with it. It lets a selectively checkpointed
attention core mutate tp's column-region cache inside the checkpoint (dynamo's
``skip_fwd_side_effects_in_bwd_under_checkpoint``, process-wide where torch has it): the cache is empty again
after the forward, so nothing needs replaying in the recompute.
All blocks share one code object, and dynamo's recompile limit counts per code object (8 by
default): past it a block runs EAGER without an error, so :func:`compile_blocks` raises the limit
to what the run needs and :func:`compile_counts` reports any hit (docs/DESIGN.md §7, "torch.compile").
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["check_compile_spec", "compile_blocks", "compile_counts", "graphs_needed"]

log = logging.getLogger(__name__)

#: the graph-break reason dynamo records when a code object hits its recompile limit
_LIMIT_HIT = "Dynamo recompile limit exceeded"


def check_compile_spec(spec: Any) -> dict[str, Any] | None:
    """``compile_blocks`` as torch.compile's keyword arguments (None: off); ``dynamic`` defaults to True.

    Args:
        spec: False / None (off), True (torch.compile's defaults, the token dim dynamic) or a mapping
            of its keyword arguments.
    """
    if spec is None or spec is False:
        return None
    if spec is True:
        return {"dynamic": True}
    if isinstance(spec, Mapping) and all(isinstance(k, str) for k in spec):
        return {"dynamic": True, **spec}
    raise ValueError(f"compile_blocks must be True, False or a dict of torch.compile arguments, got {spec!r}")


def graphs_needed(blocks: int, layouts: int) -> int:
    """The recompile limit a run needs: one graph per (layout, block) and checkpointing variant (plain
    and selective recompute), and one more per block for warm-up.

    Args:
        blocks: compiled blocks.
        layouts: the run's layouts.
    """
    return blocks * (2 * layouts + 1)


def compile_blocks(module: nn.Module, options: Mapping[str, Any], layouts: int = 1) -> int:
    """Compiles every block of ``module`` in place; returns how many.

    Raises dynamo's recompile limit to :func:`graphs_needed` when it is lower (never lowers it).

    Args:
        module: the LightningModule, its parallel forwards already installed.
        options: torch.compile's keyword arguments (``backend``, ``mode``, ``dynamic``, ...).
        layouts: how many layouts the run switches between.
    """
    blocks = [block for child in module.modules() if isinstance(child, nn.ModuleList) for block in child]
    if not blocks:
        raise ValueError(f"compile_blocks needs the blocks in an nn.ModuleList; {type(module).__name__} has none")
    needed = graphs_needed(len(blocks), layouts)
    config = torch._dynamo.config
    if config.recompile_limit < needed:
        log.info("compile_blocks: dynamo's recompile_limit %d -> %d (%d blocks x %d layouts)",
                 config.recompile_limit, needed, len(blocks), layouts)
        config.recompile_limit = needed
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, needed)
    if hasattr(config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        # selective recompute checkpoints the attention core, where tp's column region caches its readers' outputs
        # (a Python-side effect, cleared again when the last reader takes its output): allowed, not replayed
        config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    if options.get("dynamic"):
        # a 1-token micro-batch slice would get its own graph (dynamo specializes sizes 0 and 1); a token count equal
        # to a fixed dim (the head dim) would share its symbol (duck shaping) and be specialized with it
        import torch.fx.experimental._config as fx_config

        fx_config.backed_size_oblivious = True
        fx_config.use_duck_shape = False
    for block in blocks:
        if getattr(block.__dict__.get("forward"), "hotspa_compiled_block", False):
            del block.forward  # compiled by an earlier run of this module: compile the class's own forward again
        compiled = torch.compile(block.forward, **options)  # the hooks stay eager (module docstring)
        compiled.hotspa_compiled_block = True
        block.forward = compiled
    return len(blocks)


def compile_counts() -> dict[str, int]:
    """This process' dynamo counters: ``compiled_graphs``, ``graph_breaks`` (a recompile-limit hit not
    included), ``cache_limit_hits`` (recompile-limit hits: those frames run eager), ``skipped_frames`` (frames dynamo
    could not trace at all: eager too) and ``recompile_limit``."""
    from torch._dynamo.utils import counters

    hits = sum(n for reason, n in counters["unimplemented"].items() if str(reason).startswith(_LIMIT_HIT))
    skipped = sum(counters["unimplemented"].values()) - hits
    breaks = sum(n for reason, n in counters["graph_break"].items() if not str(reason).startswith(_LIMIT_HIT))
    return {"compiled_graphs": int(counters["stats"]["unique_graphs"]), "graph_breaks": int(breaks),
            "cache_limit_hits": int(hits), "skipped_frames": int(skipped),
            "recompile_limit": int(torch._dynamo.config.recompile_limit)}
