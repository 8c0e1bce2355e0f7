"""The memory half of the analytic cost model: bytes per rank of an option, and its token capacity.

What our runtime holds per rank, term by term (the cost model's module docstring lists them); checked
against the real code path under FakeTensorMode + the fake process group by ``hotspa memory``
(tools/memory.py). A mixin of :class:`~.cost_model.AnalyticCostModel`, which sets ``model``,
``hardware``, ``world_size``, ``params``, ``layer_params``, ``param_bytes``, ``grad_bytes``,
``grad_accum_bytes``, ``attention`` and ``chunks`` (the attention-kernel registry's records of the core
attention and the all-gather-KV chunk kernel: their memory terms), ``attn_width``, ``kv_width`` and
``capacity_multiple``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ...activation_checkpointing import Checkpointing
from ...layout import Layout
from .cp_memory import MEMORY_TERMS
from .memory_use import MemoryUse, most_tokens

__all__ = ["HEAD_STATE_BYTES", "HEAD_VOCAB_BLOCK", "MODEL_ERROR_MARGIN", "MemoryModel", "MemoryUse"]

#: models.loss_head.DEFAULT_VOCAB_BLOCK (the planner does not import the model's modules; a test checks
#: they agree): vocabulary rows the blocked loss head computes at once
HEAD_VOCAB_BLOCK = 8192
#: per token, what the blocked loss head keeps until its backward: the label index (int64), two masks,
#: the fp32 log-sum-exp
HEAD_STATE_BYTES = 8.0 + 1.0 + 1.0 + 4.0

#: The planner plans against ``predicted peak x (1 + margin) <= usable``: a margin for the memory model's
#: OWN error (not for what the tracker cannot see: that is the hardware profile's reserve). Derived from
#: the measured error, not tuned per row: the full ``hotspa memory`` table is within 0.0002 on both
#: attention paths (2026-12-02, 94 rows each); the largest under-prediction measured is 0.0176, an
#: all-gather-KV hybrid row (llama7b tp2xcp4:kv2 on 8, GPU path; BENCHMARKS.md "Memory at scale"), which
#: 0.02 still covers. With it every layout the planner calls feasible fits with its capacity
#: micro-batch.
MODEL_ERROR_MARGIN = 0.02


class MemoryModel:
    """Memory per rank of ``self.model`` on ``self.world_size`` devices of ``self.hardware``."""

    model: Any
    hardware: Any
    #: planned peak x (1 + this) <= usable; set 0 to plan against the bare prediction
    model_error_margin: float = MODEL_ERROR_MARGIN
    #: the registry records whose memory terms price the core attention and the all-gather-KV chunks
    #: (``models.attention_kernels``; the cost model sets them)
    attention: Any
    chunks: Any
    #: the loss head's per-token state (:data:`HEAD_STATE_BYTES`; read by :mod:`.kv_ring_memory`)
    head_state_bytes: float = HEAD_STATE_BYTES

    def __setattr__(self, name: str, value: Any) -> None:
        """Sets ``name``; a public attribute (a margin, a profile, a schedule) also drops every memoized result."""
        object.__setattr__(self, name, value)
        if not name.startswith("_"):
            self.__dict__.pop("_memo_table", None)

    def _memoized(self, key: tuple, compute: Callable[[], Any]) -> Any:
        """``compute()`` once per ``key`` on this model: for the pure functions of a layout and the public
        attributes (capacity, options, reductions) the planner asks thousands of times per layout set."""
        table = self.__dict__.setdefault("_memo_table", {})
        if key not in table:
            table[key] = compute()
        return table[key]

    # What our runtime holds per rank, term by term; checked against the real code path under
    # FakeTensorMode + MemTracker by ``hotspa memory`` (tools/memory.py). TP is sequence parallel: norms
    # and the residual stream hold this rank's share of the tokens (divided by tp x cp).
    def _param_split(self, tp: int) -> tuple[float, float]:
        """(parameters split by tp, parameters every tp rank holds in full) of the model."""
        m = self.model
        norms = (2 * m.n_layers + 1) * m.hidden
        kv = 2 * m.n_layers * m.hidden * self.kv_width
        full = norms + (kv if m.n_kv_heads % tp else 0)  # kv heads fewer than tp: replicated_partial
        return self.params - full, full

    def norm_bytes_per_token(self) -> float:
        """One RMSNorm per token: its input in the working dtype and an fp32 inverse rms (what
        models.kernels.rms_norm saves), and its output (saved by the linears it feeds)."""
        return 2.0 * self.param_bytes * self.model.hidden + 4.0

    def attention_saved_bytes(self, tp: int = 1, cp: int = 1, cp_kv: int = 1) -> float:
        """Per token per layer, what one rank's attention saves: q, k and v as the kernel sees them
        (GQA K/V unrepeated: SDPA ``enable_gqa`` / flash), the output once (a view of it feeds wo),
        the kernel's fp32 log-sum-exp per head (flash kernels); under cp what its kind saves
        (:data:`~.cp_memory.MEMORY_TERMS`: Ulysses adds the output after its all-to-all back and the
        kv heads it repeated for the exchange; the KV gather saves q, its LOCAL k / v and wo's input,
        and the log-sum-exp and output only with a chunk kernel that keeps them; measured,
        tests/unit/test_memory.py). Under tp with kv heads fewer than tp (replicated_partial) each
        rank's k / v are views of the whole kv projection, which is what stays alive."""
        m, wb, a = self.model, self.param_bytes, self.attn_width
        par = Layout(dp=1, tp=tp, cp=cp, cp_kv=cp_kv)
        if cp > 1:
            return MEMORY_TERMS[par.cp_kind].saved(self, par)
        state = self.attention_state_bytes() / (tp * cp)
        kv = self.kv_width if m.n_kv_heads % tp else self.kv_width / tp
        if self.attention.repeats_kv:  # a kernel without GQA (cuDNN packed) keeps K / V repeated to the q heads
            kv = max(kv, a / tp)
        return wb * (2 * a / tp + 2 * kv) + state

    def activation_bytes_per_token(self, activation_checkpointing: Checkpointing | bool, tp: int = 1, cp: int = 1,
                                   cp_kv: int = 1) -> float:
        """Bytes one token of a micro-batch adds to the peak of one rank in a tp x cp group: the
        tensors autograd saves (models/llama.py and models/kernels.py; attention per
        ``attention`` kernel and cp kind) plus the loss head's transients at the forward/backward turn.
        Full checkpointing keeps each layer's input and one layer recomputed; selective keeps every
        layer's tensors but its attention core's (q / k / v, the kernel's; wo's input stays), and a
        layer's recomputed core counts where it exceeds the loss head's transients, freed by then
        (measured: the head's turn is the peak; docs/DESIGN.md §11)."""
        per_layer, once, head = self.activation_parts(activation_checkpointing, tp, cp, cp_kv)
        return self.model.n_layers * per_layer + once + head

    def activation_parts(self, activation_checkpointing: Checkpointing | bool, tp: int = 1, cp: int = 1,
                         cp_kv: int = 1) -> tuple[float, float, float]:
        """(per layer, once, loss head) bytes per token of :meth:`activation_bytes_per_token` (= ``n_layers x
        per layer + once + head``): a pipeline stage holds its layers' per-layer part for each micro-batch in
        flight (:mod:`.pp_memory`)."""
        mode = Checkpointing.parse(activation_checkpointing)
        m = self.model
        f, hd, wb = m.ffn_hidden, m.head_dim, self.param_bytes
        replicated = 2 * self.norm_bytes_per_token()  # sequence parallel: this rank's tokens only (/ tp)
        ffn = 2.0 * wb * f / (tp * cp)  # SwiGLU: the w1 and w3 outputs (models.kernels.SwiGLUDown)
        attention = self.attention_saved_bytes(tp, cp, cp_kv)
        layer = replicated / (tp * cp) + ffn + attention
        runtime = getattr(self, "runtime", None)
        if tp > 1 and runtime is not None and runtime.name == "hotspa" and not runtime.tp_regather:
            # the two column regions keep their gathered input for backward, not this rank's shard of it
            # (OUR runtime's option; another runtime's description prices time only: this model's memory
            # is ours, e.g. ``fits_ours`` of a published row)
            layer += 2.0 * wb * m.hidden * (1.0 - 1.0 / tp) / cp
        rope = 2.0 * wb * hd / cp  # cos, sin tables shared by the layers
        # loss head: final norm (on this rank's tokens; the head keeps its input gathered over tp), the
        # blocked head's per-token state and its transients
        head = (self.norm_bytes_per_token() / tp + wb * m.hidden * (1 - 1 / tp) + HEAD_STATE_BYTES) / cp \
            + self.logits_bytes_per_token(tp, cp)
        if mode is Checkpointing.FULL:  # each layer's input (this rank's tokens), plus one layer recomputed
            return wb * m.hidden / (tp * cp), layer + rope, head
        if mode is Checkpointing.SELECTIVE:  # the core's output (wo's input) kept, the rest recomputed
            kept = wb * self.attn_width / (tp * cp)
            recomputed = max(0.0, attention - kept - self.logits_bytes_per_token(tp, cp))
            return layer - attention + kept, recomputed + rope, head
        return layer, rope, head

    def layer_backward_bytes_per_token(self, tp: int = 1, cp: int = 1) -> float:
        """A transformer layer's backward transients per token at their largest, SwiGLU's (models.kernels):
        the incoming gradient gathered over tp and five ``ffn / tp`` wide tensors (four the backward
        computes, one the fake-world measurement of a 7B-70B pp stage shows beside them: 5.2 of them
        and 0.9 of the hidden gradient fit its four rows). Live at a pipeline stage's peak where no loss
        head's larger transient precedes it (every stage but the last, :mod:`.pp_memory`)."""
        m, wb = self.model, self.param_bytes
        return wb * (5.0 * m.ffn_hidden / tp + m.hidden) / cp

    def logits_bytes_per_token(self, tp: int = 1, cp: int = 1) -> float:
        """The blocked loss head's transients per token (models/loss_head.py) at its backward, the
        larger end: one block's recomputed logits in fp32 next to their working-dtype copy (the
        forward holds the same and its log-sum-exp works in place), plus the fp32 hidden-gradient
        sum; a block is ``HEAD_VOCAB_BLOCK`` of this rank's vocabulary rows."""
        m, wb = self.model, self.param_bytes
        block = min(float(HEAD_VOCAB_BLOCK), m.padded_vocab_size / tp)
        low = wb if wb < 4 else 0.0  # a working-dtype copy next to the fp32 one (none in fp32)
        return ((4.0 + low) * block + 4.0 * m.hidden) / cp

    def attention_state_bytes(self) -> float:
        """Per token per layer beyond q, k, v and out: flash kernels keep an fp32 log-sum-exp per
        head (``attention.saves_lse``); the quadratic math fallback is :meth:`attention_quadratic_bytes`."""
        return 4.0 * self.model.n_heads if self.attention.saves_lse else 0.0

    def attention_quadratic_bytes(self, par: Layout) -> float:
        """Bytes per rank per (document length)^2: zero for flash kernels (flash_varlen, torch_varlen,
        CPU SDPA with 4-D inputs); the math kernel saves each layer's softmax [h/tp, s, s] in the
        working dtype (split by cp under Ulysses) and holds fp32 scores and their gradient in the
        layer being differentiated."""
        if not self.attention.quadratic:
            return 0.0
        heads = self.model.n_heads / (par.tp * par.cp)
        return heads * (self.model.n_layers * self.param_bytes + 2 * 4.0)

    def largest_gathered_unit(self, tp: int) -> float:
        """Parameters per tp rank of the largest unit a sharded working copy gathers at once: one
        transformer block, the embedding or the LM head (+ final norm)."""
        m = self.model
        kv = 2 * m.hidden * self.kv_width
        block = self.layer_params - 2 * m.hidden - (kv if m.n_kv_heads % tp else 0)  # tp-split part
        block = block / tp + 2 * m.hidden + (kv if m.n_kv_heads % tp else 0)
        return max(block, m.padded_vocab_size * m.hidden / tp + m.hidden)

    def memory(self, par: Layout, activation_checkpointing: Checkpointing | bool,
               mixed_tp: bool = False) -> MemoryUse:
        """Home: fp32 weights, AdamW m and v, fp32 gradient store (16 B / parameter / world).
        Working: weights in the working dtype plus their gradient accumulators (``grad_accum_bytes``:
        fp32 main grads by default, +4 B per working parameter) over the layout's tp (and pp), and
        the largest gradient in the working dtype before its accumulation hook folds it in.

        A sharded working copy (``fsdp``): weights and main grads over tp x fsdp_shard (tp x dp x cp
        for plain ``:fsdp``: the home shard in the working dtype; main grads at the sharded size); its
        ``transient``: two gathered units (the current and the prefetched one,
        :meth:`largest_gathered_unit`) and the current unit's gradient in the working dtype and in fp32
        for its reduce-scatter (``grad_bytes``).
        Measured (``hotspa memory``, BENCHMARKS.md): the peak holds the larger of that and the loss
        head's logits transients, not both.

        ``mixed_tp``: ``par`` is one block of a mixed-tp stage (docs/DESIGN.md §4, "Mixed tp at
        once"): the same working copy, per block (a tp1 block holds tp times a tp block's), but its
        gradients are reduced after the stage's last backward by the joint exchange
        (``engine/nested_exchange.py``), not overlapped: the transient is then the larger
        parameter's fp32 send buffer (this rank's 1/tp of the LM head) and receive buffer (at most
        the whole head: every rank's piece of this rank's home chunk); counted as if beside the
        activations (conservative: they are freed by then). A SHARDED block (``plan.Block.sharded``)
        is priced as its working layout ``:fsdp<n>``: parameters / block ranks; its joint exchange
        sends this rank's shard of the largest parameter and receives at most all of it, counted
        as a transient beside the per-unit gathers' (the larger of the two)."""
        if par.pp > 1:  # the stage that holds the fewest tokens (pp_memory.py)
            from .pp_memory import binding_stage

            return binding_stage(self, par, activation_checkpointing)
        hw = self.hardware
        home = self.params * 16.0 / self.world_size
        split, full = self._param_split(par.tp)
        per_rank = split / par.shards + full / par.pp
        act = self.activation_bytes_per_token(activation_checkpointing, par.tp, par.cp, par.cp_kv)
        usable = hw.memory_bytes * hw.memory_usable_fraction - hw.memory_reserved_bytes
        if par.fsdp:
            working = per_rank / par.fsdp_shard * (self.param_bytes + self.grad_accum_bytes)
            transient = self.largest_gathered_unit(par.tp) * (3 * self.param_bytes + self.grad_bytes)
            if mixed_tp:  # a sharded block's joint exchange (docs/DESIGN.md §4, "Blocks")
                largest = self.model.padded_vocab_size * self.model.hidden / par.tp
                transient = max(transient, largest * 4.0 * (1.0 / par.fsdp_shard + par.tp))
            return MemoryUse(home, working, act, usable, margin=self.model_error_margin, transient=transient,
                             head_per_token=self.logits_bytes_per_token(par.tp, par.cp))
        largest = self.model.padded_vocab_size * self.model.hidden / par.tp  # the LM head
        in_working = largest * self.param_bytes if self.grad_accum_bytes != self.param_bytes else 0.0
        working = per_rank * (self.param_bytes + self.grad_accum_bytes) + in_working
        # its overlapped reduction early in backward: an fp32 bucket of it and its reduce-scatter output
        # (1 / (dp*cp) of it), while nearly every activation but the head's transients is alive
        reduce = largest * 4.0 * (1.0 + par.tp / self.world_size)
        if mixed_tp:
            reduce = largest * 4.0 * (1.0 + par.tp)
        return MemoryUse(home, working, act, usable, margin=self.model_error_margin,
                         transient=max(0.0, reduce - in_working),
                         head_per_token=self.logits_bytes_per_token(par.tp, par.cp))

    def peak_bytes(self, par: Layout, activation_checkpointing: Checkpointing | bool, tokens: int,
                   mixed_tp: bool = False) -> float:
        """Predicted peak bytes per rank with a micro-batch of ``tokens`` (no reserve: compare with
        the memory estimator, ``hotspa memory``); ``mixed_tp``: as a block of a mixed-tp stage."""
        quadratic = self.attention_quadratic_bytes(par) * float(tokens) ** 2  # one document: the worst
        kv = self.kv_ring_extra_bytes(par, activation_checkpointing, tokens)
        if par.pp > 1:  # the fullest stage at this micro-batch
            from .pp_memory import stage_memories

            return max(mem.peak(tokens, quadratic) for mem in stage_memories(self, par, activation_checkpointing)) + kv
        mem = self.memory(par, activation_checkpointing, mixed_tp)
        return mem.peak(tokens, quadratic) + kv

    def kv_ring_extra_bytes(self, par: Layout, activation_checkpointing: Checkpointing | bool,
                              tokens: int) -> float:
        """The cp kind's per-layer transients beyond what is freed by then (``CpMemoryTerms.extra``:
        the KV ring / hybrid ones, :mod:`.kv_ring_memory`; 0 for Ulysses or no cp); under
        selective checkpointing the layer's recomputed q / k / v are alive again during its backward."""
        mode = Checkpointing.parse(activation_checkpointing)
        extra = MEMORY_TERMS[par.cp_kind].extra
        if extra is None:
            return 0.0
        again = 0.0
        if mode is Checkpointing.SELECTIVE:
            kept = self.param_bytes * self.attn_width / (par.tp * par.cp)  # wo's input
            again = self.attention_saved_bytes(par.tp, par.cp, par.cp_kv) - kept
        return extra(self, par, tokens, again)

    def capacity(self, par: Layout, activation_checkpointing: Checkpointing | bool, mixed_tp: bool = False) -> int:
        """Most tokens one micro-batch may hold (0: the weights alone do not fit): its predicted peak
        stays within the planning budget (usable / (1 + ``model_error_margin``)); ``mixed_tp``: as a
        block of a mixed-tp stage (:meth:`memory`). Rounded down to ``capacity_multiple`` and to the
        layout's :attr:`~lightning_hotspa.layout.Layout.token_granule` (below ``capacity_multiple``
        tokens, to the granule alone). Memoized per argument set."""
        return self._memoized(("capacity", par, activation_checkpointing, mixed_tp),
                              lambda: self._capacity(par, activation_checkpointing, mixed_tp))

    def _capacity(self, par: Layout, activation_checkpointing: Checkpointing | bool, mixed_tp: bool) -> int:
        mem = self.memory(par, activation_checkpointing, mixed_tp)
        q = self.attention_quadratic_bytes(par)
        free = mem.free_for_activations
        # the peak is the larger of (activations) and (activations without the logits + transient)
        tokens = min(most_tokens(free, mem.activation_per_token, q),
                     most_tokens(free - mem.transient, mem.activation_per_token - mem.head_per_token, q))
        if tokens <= 0:
            return 0
        if MEMORY_TERMS[par.cp_kind].extra is not None:  # its kind's transients are piecewise: bisect
            budget = mem.planning_budget
            lo, hi = 0, tokens
            while lo < hi:
                mid = (lo + hi + 1) // 2
                fits = self.peak_bytes(par, activation_checkpointing, mid, mixed_tp) <= budget
                lo, hi = (mid, hi) if fits else (lo, mid - 1)
            tokens = lo
        # a multiple of the layout's token granule, so sequence parallelism's padding stays within it
        granule = par.token_granule
        q = math.lcm(self.capacity_multiple, granule)
        q = q if tokens >= q else granule
        return tokens - tokens % q

    def activation_ratio(self) -> float:
        """Capacity gain of checkpointing: activations per token without / with it."""
        return self.activation_bytes_per_token(False) / self.activation_bytes_per_token(True)
