"""Memory per pipeline stage: what one rank of stage ``s`` of a pp layout holds, and the binding stage.

A rank of stage ``s`` holds (the pp-1 terms of :meth:`MemoryModel.memory`, restricted to its stage):

* home: the fp32 home state over the whole world (16 B per parameter / world), as without pp;
* working: its stage's layers (the tp-split part / tp, norms and replicated kv in full), the
  embedding on the first stage and the loss head + final norm on the last (``/ fsdp_shard`` for a
  sharded copy), each in the working dtype plus its gradient accumulator, and its largest
  parameter's gradient in the working dtype (the LM head / embedding on the first and last stages, a
  layer's MLP matrix between);
* activations: the per-layer part of :meth:`MemoryModel.activation_parts` for each of its layers
  and each micro-batch in flight (:func:`.pipeline.in_flight`: 1F1B's first stage holds ``p``,
  GPipe's every stage ``m``, the interleaved one's first ``p + (p - 1) / v``), the once-per-rank
  part (one layer recomputed, the rotary tables), and the loss head's on the last stage only;
  every stage but the last also holds each in-flight micro-batch's output (torch's schedule keeps it
  for that micro-batch's backward), one received output gradient (the runtime allocates a receive
  buffer at its receive: parallel/pipeline.py), and a layer's backward transients
  (:meth:`MemoryModel.layer_backward_bytes_per_token`: on the last stage the loss head's come first
  and are larger). These boundary tensors are ``hidden / (tp cp)`` wide (sequence parallel).

The stage whose capacity (tokens per micro-batch) is the smallest binds the layout's capacity.
"""

from __future__ import annotations

from typing import Any

from ...activation_checkpointing import Checkpointing
from ...layout import Layout
from .memory_use import MemoryUse, most_tokens
from .pp_schedule import in_flight

__all__ = ["binding_stage", "stage_memories"]


def stage_memories(mm: Any, par: Layout, activation_checkpointing: Checkpointing | bool) -> list[MemoryUse]:
    """One :class:`MemoryUse` per stage of ``par`` (first to last).

    Args:
        mm: the cost model (a :class:`~.memory_model.MemoryModel` with ``pipeline`` and ``stage_layers``).
        par: a layout with ``pp > 1``.
        activation_checkpointing: the mode.
    """
    m, hw, sched = mm.model, mm.hardware, mm.pipeline
    layers = mm.stage_layers(par)
    pp, tp = par.pp, par.tp
    kv = 2 * m.hidden * mm.kv_width if m.n_kv_heads % tp else 0.0  # replicated_partial kv: every tp rank
    layer_full = 2.0 * m.hidden + kv
    layer_split = mm.layer_params - layer_full
    vocab = m.padded_vocab_size * m.hidden / tp
    per_layer, once, head = mm.activation_parts(activation_checkpointing, tp, par.cp, par.cp_kv)
    # GPipe holds every micro-batch (priced at the schedule's m, default p); the others are capped by p, not m
    micro = sched.micro_batches or (pp if sched.name == "gpipe" else 1 << 30)
    usable = hw.memory_bytes * hw.memory_usable_fraction - hw.memory_reserved_bytes
    home = mm.params * 16.0 / mm.world_size
    out = []
    for s, n in enumerate(layers):
        first, last = s == 0, s == pp - 1
        params = n * (layer_split / tp + layer_full) + (vocab if first else 0.0) + (vocab + m.hidden if last else 0.0)
        largest = vocab if first or last else m.hidden * m.ffn_hidden / tp
        held = in_flight(sched, pp, s, micro)
        act = held * n * per_layer + once + (head if last else 0.0)
        if not last:
            boundary = mm.param_bytes * m.hidden / (tp * par.cp)
            act += (held * sched.virtual_stages + 1) * boundary + mm.layer_backward_bytes_per_token(tp, par.cp)
        head_per_token = mm.logits_bytes_per_token(tp, par.cp) if last else 0.0
        if par.fsdp:
            working = params / par.fsdp_shard * (mm.param_bytes + mm.grad_accum_bytes)
            unit = max(mm.largest_gathered_unit(tp) if n else 0.0, largest + m.hidden if first or last else 0.0)
            transient = unit * (3 * mm.param_bytes + mm.grad_bytes)
        else:
            in_working = largest * mm.param_bytes if mm.grad_accum_bytes != mm.param_bytes else 0.0
            working = params * (mm.param_bytes + mm.grad_accum_bytes) + in_working
            transient = max(0.0, largest * 4.0 * (1.0 + tp * pp / mm.world_size) - in_working)
        out.append(MemoryUse(home, working, act, usable, margin=mm.model_error_margin, transient=transient,
                             head_per_token=head_per_token))
    return out


def binding_stage(mm: Any, par: Layout, activation_checkpointing: Checkpointing | bool) -> MemoryUse:
    """The stage of ``par`` that holds the fewest tokens per micro-batch (its :class:`MemoryUse`).

    Args:
        mm: the cost model.
        par: a layout with ``pp > 1``.
        activation_checkpointing: the mode.
    """
    def tokens(mem: MemoryUse) -> int:
        free = mem.free_for_activations
        return min(most_tokens(free, mem.activation_per_token, 0.0),
                   most_tokens(free - mem.transient, mem.activation_per_token - mem.head_per_token, 0.0))

    stages = stage_memories(mm, par, activation_checkpointing)
    best = min(range(len(stages)), key=lambda s: (tokens(stages[s]), s))
    return stages[best]
