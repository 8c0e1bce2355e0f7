"""Analytic cost model: predicted seconds and memory of documents, micro-batches, stages and switches.

Everything the solver optimizes reduces to four numbers per *option* (a layout with activation
checkpointing on or off), collected in :class:`OptionCost`:

* ``quadratic`` and ``linear``: a document of cp-padded length ``s`` costs ``a*s^2 + b*s`` seconds on
  its tp x cp group (plus ``per_document``, zero analytically, fitted in profiled mode: the CPU
  attention backend runs one kernel per document). Why per document: with varlen attention (``cu_seqlens``) packed documents do not
  attend to each other, so a micro-batch's work is the sum over its documents. Why this form: dense
  FLOPs are linear in ``s`` and causal attention FLOPs are ``~s^2`` (Hydraulis' ``a s^2 + b s + c``).
* ``per_micro_batch``: fixed seconds per micro-batch (collective latencies, launches).
* ``stage_fixed``: seconds per stage: the dp gradient reduce-scatter into the world-sharded home state.
  Consecutive stages of one tp degree keep accumulating into the same working gradients and reduce
  once (:func:`shares_gradients`): a plan pays it once per such run (:mod:`.predict`).

How work divides over tp and cp. A tp x cp group owns one micro-batch. Tensor parallelism splits
every weight, so each tp rank does ``1/tp`` of every GEMM on its tokens; Ulysses context parallelism
gives each cp rank ``1/cp`` of the tokens for the GEMMs and, after its all-to-all, ``1/cp`` of the
heads over the whole sequence for attention. Both parts therefore divide by ``tp*cp`` (the 2*cp chunk
split of plan.py keeps causal work even, and is exact under Ulysses since attention runs on whole
rows); the cost is padding (``s`` rounded up to ``2*cp``) and communication:

* TP (Megatron with sequence parallel): 2 all-reduce-equivalents of the ``[s/cp, h]`` activations per
  layer forward, 2 backward, 2 more when checkpointing recomputes the forward; ring cost
  ``2(tp-1)/tp * bytes / busbw``. Not overlapped with compute (as in our runtime).
* CP (Ulysses): per layer one all-to-all of fused q/k/v and one of the output forward, the same
  backward (+ forward again with checkpointing); each moves ``(cp-1)/cp`` of its ``1/tp`` head slice.
* Local shapes are smaller than the unsharded ones, so a rank's kernels may run below the
  unsharded efficiency: compute divides by ``tp*cp * hardware.shard_efficiency(tp, cp)`` (a
  measured per-degree curve, recipes/gpu_check.py part (c); 1.0 when the profile has none).
* CP all-gather-KV (``cp_kv``, :mod:`~lightning_hotspa.parallel.kv_gather`; the hybrid runs Ulysses
  over ``u = cp / cp_kv`` ranks first, priced as above with ``u``): per layer an all-gather of K and V
  over the ``cp_kv`` group forward, a re-gather and a reduce-scatter of dK / dV backward (+ a gather
  with checkpointing); each moves ``(cp_kv-1)`` local K/V slices of ``s/cp`` tokens x ``2 kv_width/tp``.
  The gathered K/V are not saved, so backward recomputes the attention forward: attention FLOPs x 4/3.
* Activation checkpointing recomputes each layer's forward: +1/3 of the layers' training FLOPs.
* dp: one reduce-scatter of the stage's fp32 gradients per run of same-tp stages (docs/DESIGN.md §4, "Gradients live in the engine's store").
* Switches (switch.py): a move from tp ``s`` to tp ``t < s`` all-gathers ``1/t - 1/s`` of the bf16
  weights over a group spanning ``s`` consecutive ranks; ``t >= s`` is a local slice (free). Home is
  sharded over the whole world. Group spans decide intra- (NVLink) vs inter-node bandwidth, nodes of
  ``devices_per_node``; the mesh puts tp on the most local dims, then cp, then dp.
* pp (simulation of the artifact's (dp, tp, pp) layouts only): each rank runs ``L/pp`` layers, a dp
  group's ``m`` micro-batches take ``sum/pp * (m + pp - 1)/m`` (1F1B bubble).

Memory per rank (:meth:`AnalyticCostModel.memory`, checked against the real step by ``hotspa memory``):
home state over the world (fp32 weights, Adam m and v, fp32 gradient store: 16 B per parameter /
world), bf16 working weights and their fp32 main-grad accumulators (6 B / (tp*pp) for the tp-split
parameters, norms in full), and activations per token as the runtime saves them (norms and residual
stream full on every tp rank: no sequence parallelism; attention per ``attention_backend``; SwiGLU;
the loss head's fp32 logits) over cp: without checkpointing every layer's saved tensors, with it only
each layer's input plus one layer being recomputed. What is left decides the option's token capacity.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..checks import check_int
from ..layout import Layout
from ..models.config import LlamaConfig
from .hardware import HardwareProfile, get_profile
from .packing import cp_padded_lengths, max_doc_length

__all__ = [
    "AnalyticCostModel",
    "CostModelError",
    "MemoryUse",
    "OptionCost",
    "Parallelism",
    "resolve_model",
    "shares_gradients",
]


class CostModelError(ValueError):
    """A model / world / layout combination the cost model cannot price; the message names it."""


def resolve_model(model: LlamaConfig | str) -> LlamaConfig:
    """A :class:`LlamaConfig` or a preset name (``llama7b``, ``llama13b``, ``llama30b``, ...)."""
    if isinstance(model, LlamaConfig):
        return model
    try:
        return LlamaConfig.preset(str(model))
    except ValueError as err:
        raise CostModelError(str(err)) from None


@dataclass(frozen=True)
class Parallelism:
    """Degrees of one parallel strategy; ``pp`` > 1 only for simulating pipeline-parallel baselines."""

    dp: int = 1
    tp: int = 1
    cp: int = 1
    pp: int = 1
    cp_kv: int = 1  # the all-gather-KV part of cp (Layout.cp_kv); 1: Ulysses

    def __post_init__(self) -> None:
        for f in ("dp", "tp", "cp", "pp", "cp_kv"):
            check_int(getattr(self, f), f"Parallelism.{f}", error=CostModelError)
        if self.cp % self.cp_kv:
            raise CostModelError(f"Parallelism.cp_kv={self.cp_kv} must divide cp={self.cp}")

    @classmethod
    def of(cls, layout: Layout | Parallelism) -> Parallelism:
        if isinstance(layout, Parallelism):
            return layout
        return cls(layout.dp, layout.tp, layout.cp, 1, layout.cp_kv)

    @property
    def cp_ulysses(self) -> int:
        return self.cp // self.cp_kv

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.cp * self.pp

    @property
    def shards(self) -> int:
        """How many ways the working weights are split (a rank holds 1/shards of them)."""
        return self.tp * self.pp

    @property
    def name(self) -> str:
        parts = [f"{k}{v}" for k, v in (("dp", self.dp), ("tp", self.tp), ("cp", self.cp), ("pp", self.pp))
                 if v > 1]
        base = "x".join(parts) or "dp1"
        if self.cp_kv == 1:
            return base
        return base + (":kv" if self.cp_kv == self.cp else f":kv{self.cp_kv}")

    def __str__(self) -> str:
        return self.name

    def layout(self) -> Layout:
        if self.pp != 1:
            raise CostModelError(f"{self} has pipeline parallelism, which the runtime does not run (simulation only)")
        return Layout(self.dp, self.tp, self.cp, self.cp_kv)


def _shards(par: Parallelism | Layout) -> int:
    """``Parallelism.of(par).shards`` without building one (switch pricing runs in tight loops)."""
    return par.tp * getattr(par, "pp", 1)


def shares_gradients(a: Parallelism | Layout, b: Parallelism | Layout) -> bool:
    """Stages in ``a`` then ``b`` share working shards and gradient states (same tp, and pp), so the
    runtime reduces once after both (``SwitchEngine.shares_gradients``); their ``stage_fixed`` agree."""
    a, b = Parallelism.of(a), Parallelism.of(b)
    return (a.tp, a.pp) == (b.tp, b.pp)


@dataclass(frozen=True)
class OptionCost:
    """Predicted seconds of one option; see the module docstring for the meaning of each term."""

    parallelism: Parallelism
    activation_checkpointing: bool
    capacity: int  # tokens per micro-batch, cp padding included
    quadratic: float  # a: seconds per (padded length)^2 of a document
    linear: float  # b: seconds per padded token
    per_micro_batch: float  # d
    stage_fixed: float  # F
    per_document: float = 0.0  # e: fixed seconds per document (0 analytically; e.g. per-document kernels on CPU)

    @property
    def key(self) -> tuple[str, bool]:
        return (self.parallelism.name, self.activation_checkpointing)

    @property
    def label(self) -> str:
        return self.parallelism.name + ("+ac" if self.activation_checkpointing else "")

    @property
    def max_doc_length(self) -> int:
        return max_doc_length(self.capacity, self.parallelism.cp) if self.capacity > 0 else 0

    def padded(self, lengths: Sequence[int] | np.ndarray) -> np.ndarray:
        return cp_padded_lengths(lengths, self.parallelism.cp)

    def doc_seconds(self, padded: np.ndarray) -> np.ndarray:
        """``a s^2 + b s (+ e)`` of each (already padded) document."""
        s = np.asarray(padded, dtype=np.float64)
        return (self.quadratic * s + self.linear) * s + self.per_document

    def balance_cost(self, padded: np.ndarray) -> np.ndarray:
        """Per-document cost for dp balancing: its seconds plus its share of a micro-batch's
        fixed cost (a :data:`~.packing.DocCost`)."""
        s = np.asarray(padded, dtype=np.float64)
        return self.doc_seconds(s) + self.per_micro_batch * s / max(self.capacity, 1)

    def pipeline_factor(self, micro_batches: int) -> float:
        pp = self.parallelism.pp
        return 1.0 if pp == 1 or micro_batches == 0 else (micro_batches + pp - 1) / micro_batches

    def group_seconds(self, doc_seconds_sum: float, micro_batches: int) -> float:
        """One dp group's time for its micro-batches (documents' seconds summed beforehand)."""
        if micro_batches == 0:
            return 0.0
        return (doc_seconds_sum + self.per_micro_batch * micro_batches) * self.pipeline_factor(micro_batches)

    def with_coefficients(self, quadratic: float, linear: float, per_micro_batch: float,
                          per_document: float | None = None) -> OptionCost:
        return dataclasses.replace(self, quadratic=float(quadratic), linear=float(linear),
                                   per_micro_batch=float(per_micro_batch),
                                   per_document=self.per_document if per_document is None else float(per_document))


@dataclass(frozen=True)
class MemoryUse:
    """Bytes per rank of one option."""

    home: float
    working: float
    activation_per_token: float  # per token of the micro-batch (already divided by tp*cp)
    usable: float

    @property
    def free_for_activations(self) -> float:
        return self.usable - self.home - self.working


class AnalyticCostModel:
    """Prices options, stages and switches of ``model`` on ``world_size`` devices of ``hardware``.

    ``grad_bytes``: bytes per gradient element in the stage reduction (fp32: our runtime sums in
    fp32). ``param_bytes``: working weights (bf16). ``capacity_multiple``: capacities are rounded
    down to it, so tables read cleanly. ``grad_accum_bytes``: working gradient accumulators (4: fp32
    main grads, the bf16-mixed default; 2: ``grad_accumulation="bf16"``). ``attention_backend``:
    ``"flash"`` (linear memory) or ``"math"`` (SDPA's fallback, quadratic in the document length).
    """

    def __init__(self, model: LlamaConfig | str, hardware: HardwareProfile | str, world_size: int, *,
                 grad_bytes: int = 4, param_bytes: int = 2, capacity_multiple: int = 128,
                 grad_accum_bytes: int = 4, attention_backend: str = "flash") -> None:
        check_int(world_size, "world size", error=CostModelError)
        self.model = resolve_model(model)
        self.hardware = get_profile(hardware)
        self.world_size = world_size
        self.grad_bytes = grad_bytes
        self.param_bytes = param_bytes
        self.capacity_multiple = capacity_multiple
        self.grad_accum_bytes = grad_accum_bytes  # working gradient accumulators (fp32 main grads: 4)
        if attention_backend not in ("flash", "math"):
            raise CostModelError(f"attention_backend must be 'flash' (flash_varlen, torch_varlen, sdpa) or "
                                 f"'math' (SDPA's quadratic fallback), got {attention_backend!r}")
        self.attention_backend = attention_backend
        m = self.model
        self.params = float(m.num_params())
        self.dense_params = float(m.num_params(include_embedding=False))
        self.layer_params = (self.dense_params - m.padded_vocab_size * m.hidden - m.hidden) / m.n_layers
        self.attn_width = m.n_heads * m.head_dim
        self.kv_width = m.n_kv_heads * m.head_dim

    # ------------------------------------------------------------------ validity
    def check(self, par: Parallelism | Layout) -> Parallelism:
        """The parallelism, or a :class:`CostModelError` saying why this model cannot run it."""
        par = Parallelism.of(par)
        m = self.model
        if par.world_size != self.world_size:
            raise CostModelError(f"{par} covers {par.world_size} devices, the world has {self.world_size}")
        if m.n_heads % (par.tp * par.cp_ulysses):
            raise CostModelError(f"{par}: tp*cp={par.tp * par.cp_ulysses} (the Ulysses part of cp) does not divide "
                                 f"the model's {m.n_heads} attention heads (tp splits heads, Ulysses cp scatters "
                                 f"them; all-gather-KV cp, ':kv', does not)")
        if m.n_kv_heads % par.tp and par.tp % m.n_kv_heads:
            raise CostModelError(f"{par}: tp={par.tp} and the model's {m.n_kv_heads} kv heads do not nest")
        if m.n_layers % par.pp:
            raise CostModelError(f"{par}: pp={par.pp} does not divide the model's {m.n_layers} layers")
        if (m.ffn_hidden % par.tp) or (m.padded_vocab_size % par.tp):
            raise CostModelError(f"{par}: tp={par.tp} does not divide ffn {m.ffn_hidden} / vocab "
                                 f"{m.padded_vocab_size}")
        return par

    # ------------------------------------------------------------------ memory (issue 19)
    # What our runtime holds per rank, term by term; checked against the real code path under
    # FakeTensorMode + MemTracker by ``hotspa memory`` (tools/memory.py). TP here has no sequence
    # parallelism: norms and the residual stream are full on every tp rank (divided by cp only).
    def _param_split(self, tp: int) -> tuple[float, float]:
        """(parameters split by tp, parameters every tp rank holds in full) of the model."""
        m = self.model
        norms = (2 * m.n_layers + 1) * m.hidden
        kv = 2 * m.n_layers * m.hidden * self.kv_width
        full = norms + (kv if m.n_kv_heads % tp else 0)  # kv heads fewer than tp: replicated_partial
        return self.params - full, full

    def activation_bytes_per_token(self, activation_checkpointing: bool, tp: int = 1, cp: int = 1) -> float:
        """Bytes one token of a micro-batch adds to the peak of one rank in a tp x cp group: the
        tensors autograd saves (module docstring of models/llama.py; attention per
        ``attention_backend``) plus the loss head's transients at the forward/backward turn."""
        m = self.model
        h, f, hd, wb = m.hidden, m.ffn_hidden, m.head_dim, self.param_bytes
        a = self.attn_width
        kv = a if m.n_heads != m.n_kv_heads else self.kv_width  # GQA: SDPA saves the repeated k, v
        norm = 4.0 * h + 2.0 * wb * h  # fp32 input copy, normed, weighted output (saved by the linears)
        replicated = 2 * norm
        attention = wb * (3 * a + 2 * kv) + self._attention_state_bytes()  # q, k, v, out, wo input
        sharded = attention + 4.0 * wb * f  # SwiGLU: w1 out, silu, w3 out, product
        layer = replicated / cp + sharded / (tp * cp)
        rope = 2.0 * wb * hd / cp  # cos, sin tables shared by the layers
        v = m.padded_vocab_size / tp
        # loss head: final norm; logits (working dtype), fp32 logits/softmax and their gradients
        head = norm / cp + (12.0 if tp == 1 else 10.0) * v / cp
        if activation_checkpointing:  # each layer's input, plus one layer recomputed
            return m.n_layers * wb * h / cp + layer + rope + head
        return m.n_layers * layer + rope + head

    def _attention_state_bytes(self) -> float:
        """Per token per layer beyond q, k, v and out: flash kernels keep an fp32 log-sum-exp per
        head; the quadratic math fallback is :meth:`attention_quadratic_bytes`."""
        return 4.0 * self.model.n_heads if self.attention_backend == "flash" else 0.0

    def attention_quadratic_bytes(self, par: Parallelism | Layout) -> float:
        """Bytes per rank per (document length)^2: zero for flash kernels (flash_varlen, torch_varlen,
        CPU SDPA with 4-D inputs); the math kernel saves each layer's softmax [h/tp, s, s] in the
        working dtype (split by cp under Ulysses) and holds fp32 scores and their gradient in the
        layer being differentiated."""
        if self.attention_backend == "flash":
            return 0.0
        par = Parallelism.of(par)
        heads = self.model.n_heads / (par.tp * par.cp)
        return heads * (self.model.n_layers * self.param_bytes + 2 * 4.0)

    def memory(self, par: Parallelism | Layout, activation_checkpointing: bool) -> MemoryUse:
        """Home: fp32 weights, AdamW m and v, fp32 gradient store (16 B / parameter / world).
        Working: weights in the working dtype plus their gradient accumulators (``grad_accum_bytes``:
        fp32 main grads by default, +4 B per working parameter) over the layout's tp (and pp), and
        the largest gradient in the working dtype before its accumulation hook folds it in."""
        par = Parallelism.of(par)
        hw = self.hardware
        home = self.params * 16.0 / self.world_size
        split, full = self._param_split(par.tp)
        per_rank = split / par.shards + full / par.pp
        largest = self.model.padded_vocab_size * self.model.hidden / par.tp  # the LM head
        working = per_rank * (self.param_bytes + self.grad_accum_bytes) + \
            (largest * self.param_bytes if self.grad_accum_bytes != self.param_bytes else 0.0)
        act = self.activation_bytes_per_token(activation_checkpointing, par.tp, par.cp)
        usable = hw.memory_bytes * hw.memory_usable_fraction - hw.memory_reserved_bytes
        return MemoryUse(home, working, act, usable)

    def peak_bytes(self, par: Parallelism | Layout, activation_checkpointing: bool, tokens: int) -> float:
        """Predicted peak bytes per rank with a micro-batch of ``tokens`` (no reserve: compare with
        the memory estimator, ``hotspa memory``)."""
        mem = self.memory(par, activation_checkpointing)
        quadratic = self.attention_quadratic_bytes(par) * float(tokens) ** 2  # one document: the worst
        return mem.home + mem.working + mem.activation_per_token * tokens + quadratic

    def capacity(self, par: Parallelism | Layout, activation_checkpointing: bool) -> int:
        """Most tokens one micro-batch may hold (0: the weights alone do not fit)."""
        mem = self.memory(par, activation_checkpointing)
        free = mem.free_for_activations
        if free <= 0:
            return 0
        q, b = self.attention_quadratic_bytes(par), mem.activation_per_token
        tokens = int(free // b) if q == 0 else int((-b + (b * b + 4 * q * free) ** 0.5) / (2 * q))
        q = self.capacity_multiple
        return (tokens // q) * q if tokens >= q else tokens

    def activation_ratio(self) -> float:
        """Capacity gain of checkpointing: activations per token without / with it."""
        return self.activation_bytes_per_token(False) / self.activation_bytes_per_token(True)

    # ------------------------------------------------------------------ time
    def _coefficients(self, par: Parallelism, ac: bool) -> tuple[float, float, float]:
        m, hw = self.model, self.hardware
        # tp*cp*pp ways, each at the measured efficiency of its smaller local shapes (1.0 by default)
        div = par.tp * par.cp * par.pp * hw.shard_efficiency(par.tp, par.cp)
        layers = m.n_layers / par.pp
        recompute = 1.0 + (1.0 / 3.0 if ac else 0.0)
        # compute: attention 6*L*H*hd*s*(s+1) (models/config.py), dense 6*P*s (+2*P_layers*s recompute)
        attn = 6.0 * m.n_layers * self.attn_width * recompute / (div * hw.peak_flops * hw.attention_efficiency)
        dense_flops = 6.0 * self.dense_params + (2.0 * self.layer_params * m.n_layers if ac else 0.0)
        dense = dense_flops / (div * hw.peak_flops * hw.dense_efficiency)
        a, b = attn, attn + dense
        d = layers * hw.layer_overhead_s * recompute
        if par.tp > 1:
            calls = (4 + (2 if ac else 0)) * layers + 1  # + the vocab-parallel embedding
            bw, lat = hw.bandwidth(par.tp), hw.latency(par.tp)
            b += calls * 2.0 * (par.tp - 1) / par.tp * m.hidden * self.param_bytes / par.cp / bw
            d += calls * lat
        # ---- context parallelism (w15: Ulysses part, then all-gather-KV part) ----
        u, g = par.cp_ulysses, par.cp_kv
        if u > 1:
            span = par.tp * u
            bw, lat = hw.bandwidth(span), hw.latency(span)
            per_token = (2 * self.attn_width + 2 * self.kv_width) / par.tp * self.param_bytes / par.cp
            rounds = 2 + (1 if ac else 0)  # forward, backward, recomputed forward
            b += rounds * layers * (u - 1) / u * per_token / bw
            d += rounds * 2 * layers * lat
        if g > 1:
            span = par.tp * par.cp
            bw, lat = hw.bandwidth(span), hw.latency(span)
            per_token = 2 * self.kv_width / par.tp * self.param_bytes / par.cp  # local K and V per token
            rounds = 3 + (1 if ac else 0)  # gather, re-gather + reduce-scatter backward, recompute
            b += rounds * layers * (g - 1) * per_token / bw
            d += rounds * layers * lat
            recompute_attn = 1.0 / 3.0  # backward recomputes the attention forward (K/V not saved)
            a += attn * recompute_attn / recompute
            b += attn * recompute_attn / recompute
        # ---- end context parallelism ----
        if par.pp > 1:  # activations across each stage boundary, forward and backward
            bw = hw.bandwidth(self.world_size)
            b += 2.0 * m.hidden * self.param_bytes / (par.tp * par.cp) / bw
            d += 2.0 * hw.latency(self.world_size)
        return a, b, d

    def grad_reduce_seconds(self, par: Parallelism | Layout) -> float:
        """The stage's reduce-scatter of fp32 gradients over the ranks sharing a weight shard."""
        par = Parallelism.of(par)
        g = par.dp * par.cp
        if g == 1:
            return 0.0
        nbytes = self.params / par.shards * self.grad_bytes
        hw = self.hardware
        return (g - 1) / g * nbytes / hw.bandwidth(self.world_size) + hw.latency(self.world_size)

    def option(self, par: Parallelism | Layout, activation_checkpointing: bool,
               capacity: int | None = None) -> OptionCost:
        par = self.check(par)
        a, b, d = self._coefficients(par, activation_checkpointing)
        cap = self.capacity(par, activation_checkpointing) if capacity is None else int(capacity)
        return OptionCost(par, bool(activation_checkpointing), cap, a, b, d, self.grad_reduce_seconds(par))

    # ------------------------------------------------------------------ switches
    def switch_bytes(self, source: Parallelism | Layout | None, target: Parallelism | Layout) -> float:
        """Bytes each rank receives to hold ``target``'s working weights (``source`` None: home)."""
        dst = _shards(target)
        src = self.world_size if source is None else _shards(source)
        return self.params * self.param_bytes * max(0.0, 1.0 / dst - 1.0 / src)

    def switch_seconds(self, source: Parallelism | Layout | None, target: Parallelism | Layout) -> float:
        nbytes = self.switch_bytes(source, target)
        if nbytes <= 0:
            return 0.0
        span = self.world_size if source is None else _shards(source)
        hw = self.hardware
        return nbytes / hw.bandwidth(span) + hw.latency(span)

    def switch_sequence_seconds(self, order: Sequence[Parallelism | Layout]) -> float:
        """Home to the first stage's layout, then each next one (the step's switches)."""
        total, prev = 0.0, None
        for par in order:
            total += self.switch_seconds(prev, par)
            prev = par
        return total

    def shared_reduction_seconds(self, order: Sequence[Parallelism | Layout]) -> float:
        """Gradient reductions a stage order saves against one per stage: a stage followed by one
        that :func:`shares_gradients` with it does not reduce (the run's last stage does)."""
        return sum(self.grad_reduce_seconds(a) for a, b in zip(order, order[1:]) if shares_gradients(a, b))

    def summary(self) -> dict[str, float]:
        return {"params": self.params, "world_size": self.world_size,
                "flops_per_token_4k": self.model.flops_per_token(4096)}

