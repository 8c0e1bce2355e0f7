"""Pipeline parallelism inside a layout: ``torch.distributed.pipelining`` stages and schedules.

A ``pp > 1`` layout splits the decoder over the ranks of its pp group (the outermost mesh dims,
:meth:`~lightning_hotspa.layout.MeshShape.pp_dims`): the embedding on the first stage, the blocked
loss head (:mod:`..models.loss_head`) on the last, the layers split as the planner prices them
(:mod:`..pipeline_split`: the slowest stage's work, the loss head's counted, as small as it can be; an
uneven remainder on the middle stages, which hold neither end).
Inside a stage the layout's tp / cp hooks run as in any layout. A stage's index is its rank's SLOT in
the pp process group (its rank order), so torch's default stage -> rank mapping holds.

The schedules are torch's (:data:`SCHEDULES`): GPipe, 1F1B, interleaved 1F1B and the interleaved
zero-bubble one with ``virtual`` stages per rank (round-robin: rank ``g`` holds stages ``g, g+P, ...``).
One :class:`PipelineStage` set and schedule per (layout, schedule, micro-batch count, padded token
count, dtype), built lazily and cached. Every micro-batch of a stage is padded to the longest one's
token count (:func:`pad_micro_batch`: a padding document without targets), so the P2P buffers have
one shape. The first stage's root input is the micro-batch index; each stage reads its micro-batch's
rows from the plan (:class:`_Stage` sets ``ParallelState.micro_batch`` around every forward and
backward). Token-mean loss exact: the schedule's ``scale_grads`` is off and the loss function weighs
micro-batch ``i``'s token-mean loss by its target tokens over the step's (the ``target`` tensor).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..host import host_reads
from ..layout import Layout, LayoutError
from ..micro_batch import MicroBatch
from ..model_shape import describe_model
from ..pipeline_split import head_layers, stage_layer_counts
from ..plan import IGNORE_INDEX

__all__ = ["SCHEDULES", "PipelineRunner", "find_decoder", "layer_split", "pad_micro_batch"]

#: schedule name -> (torch class name, stages per rank it needs: 1, or >= 2 virtual ones)
SCHEDULES: dict[str, tuple[str, bool]] = {
    "gpipe": ("ScheduleGPipe", False),
    "1f1b": ("Schedule1F1B", False),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", True),
    "zero_bubble": ("ScheduleInterleavedZeroBubble", True),
}


def layer_split(n_layers: int, stages: int, layout: Layout | str = "", head: float = 0.0) -> list[range]:
    """The layers of each of ``stages`` pipeline stages (:func:`~lightning_hotspa.pipeline_split.stage_layer_counts`:
    the split the planner prices).

    Args:
        n_layers: the decoder's layers.
        stages: pipeline stages (``pp * virtual``).
        layout: named in the error.
        head: the loss head's work in layers (0 with virtual stages: the planner prices those even).
    """
    if stages > n_layers:
        raise LayoutError(f"layout {layout}: {stages} pipeline stages (pp x virtual stages) but the model has "
                          f"only {n_layers} layers; every stage needs at least one")
    out, start = [], 0
    for c in stage_layer_counts(n_layers, stages, head):
        out.append(range(start, start + c))
        start += c
    return out


def find_decoder(module: nn.Module) -> tuple[str, nn.Module]:
    """``(name prefix, Llama)``: the decoder a pp layout splits (the module itself or a submodule)."""
    from ..models.llama import Llama

    for name, sub in module.named_modules():
        if isinstance(sub, Llama):
            if sub.config.tie_embeddings:
                raise LayoutError(f"pipeline parallelism needs untied embeddings: {name or 'the model'} ties its "
                                  f"LM head to the embedding (one weight on the first and the last stage)")
            return (name + "." if name else ""), sub
    raise LayoutError(f"pipeline parallelism splits a Llama decoder (embedding, layers, loss head); "
                      f"{type(module).__name__} holds none")


def pad_micro_batch(mb: MicroBatch, tokens: int) -> MicroBatch:
    """``mb`` with a padding document (token 0, no targets) appended up to ``tokens`` local tokens.

    Args:
        mb: a packed micro-batch (cp-sliced when ``cp_size > 1``).
        tokens: the local token count wanted (>= ``mb``'s; the difference a multiple of the tp and
            even under cp, as two packed micro-batches' counts are).
    """
    pad = tokens - mb.num_tokens
    if pad == 0:
        return mb
    if pad < 0 or (mb.cp_size > 1 and pad % 2):
        raise LayoutError(f"cannot pad a micro-batch of {mb.num_tokens} tokens to {tokens}")
    ids = mb.input_ids
    if mb.cp_size > 1:
        c = pad // 2
        head, tail = mb.cp_rank * c, (2 * mb.cp_size - 1 - mb.cp_rank) * c
        pos = torch.cat([torch.arange(head, head + c), torch.arange(tail, tail + c)]).to(ids.device)
        cp_cu = torch.cat([mb.cp_cu_seqlens, mb.cp_cu_seqlens[-1:] + pad * mb.cp_size])
    else:
        pos, cp_cu = torch.arange(pad, device=ids.device), None
    return MicroBatch(torch.cat([ids, ids.new_zeros(pad)]), torch.cat([mb.labels, mb.labels.new_full((pad,),
                      IGNORE_INDEX)]), torch.cat([mb.position_ids, pos]),
                      torch.cat([mb.cu_seqlens, mb.cu_seqlens[-1:] + pad]), max(mb.max_seqlen, pad),
                      mb.num_target_tokens, mb.cp_size, mb.cp_rank, cp_cu, mb.doc_ids)


def _stage_module_names(layers: range, first: bool, last: bool) -> list[str]:
    """The decoder submodules one pipeline stage holds: the embedding on the first, its layers, the
    final norm and the loss head on the last: what :class:`_Part` holds (tests/unit/test_pipeline_owned.py)."""
    ends = (["tok_embeddings"] if first else []), (["norm", "output"] if last else [])
    return ends[0] + [f"layers.{i}" for i in layers] + ends[1]


class _Part(nn.Module):
    """One pipeline stage of the decoder: its layers, the embedding on the first, norm + loss head on
    the last. Holds the decoder's own submodules (the switch engine swaps their parameters)."""

    def __init__(self, decoder: nn.Module, layers: range, first: bool, last: bool, state: Any) -> None:
        super().__init__()
        self.first, self.last, self._state = first, last, state
        self._decoder = [decoder]  # not a submodule: its other stages' parameters are not this stage's
        self.embed = decoder.tok_embeddings if first else None
        self.layers = nn.ModuleList(decoder.layers[i] for i in layers)
        self.norm = decoder.norm if last else None
        self.head = decoder.output if last else None

    def forward(self, x: Tensor) -> Tensor:
        from torch.utils.checkpoint import checkpoint

        from ..activation_checkpointing import Checkpointing
        from ..models.rope import rotary_cos_sin

        decoder, mb = self._decoder[0], self._state.micro_batch
        if self.first:
            x = self.embed(mb.input_ids)
        config = decoder.config
        cos, sin = rotary_cos_sin(mb.position_ids, config.head_dim, config.rope_theta, x.dtype, config.rope_scaling)
        mode = decoder.activation_checkpointing if torch.is_grad_enabled() else Checkpointing.NONE
        for layer in self.layers:
            if mode is Checkpointing.FULL:
                x = checkpoint(layer, x, cos, sin, mb.cu_seqlens, mb.max_seqlen, use_reentrant=False)
            else:
                x = layer(x, cos, sin, mb.cu_seqlens, mb.max_seqlen, mode is Checkpointing.SELECTIVE)
        if self.last:
            return self.head(self.norm(x), mb.labels).reshape(1)  # [1]: the schedule concatenates outputs
        return x


def _release_buffers(infos: Any) -> list[Tensor]:
    """Drop the receive buffers of ``infos`` (torch ``_RecvInfo`` tuples): an empty tensor in their place.
    Returns the dropped buffers (for :func:`_free`)."""
    dropped = []
    for info in infos:
        buffer = getattr(info, "buffer", None)
        if buffer is not None and not getattr(info, "is_root_arg", False) and buffer.numel():
            info.buffer = buffer.new_empty(0)
            dropped.append(buffer)
    return dropped


def _free(buffers: list[Tensor]) -> None:
    """Free the storage of received buffers whose micro-batch's backward is over: a received activation
    is an autograd leaf, and the loss the schedule keeps until the step's end reaches it through the
    graph (its gradient-accumulation node holds the tensor), so dropping the reference frees nothing."""
    for buffer in buffers:
        buffer.grad = None
        buffer.data = buffer.new_empty(0)


def _fresh_buffers(infos: Any, device: torch.device) -> None:
    """Allocate the receive buffers of ``infos`` dropped by :func:`_release_buffers` (shape from their meta)."""
    for info in infos:
        meta, buffer = getattr(info, "tensor_meta", None), getattr(info, "buffer", None)
        if buffer is not None and meta is not None and buffer.numel() == 0 and math.prod(meta.shape):
            info.buffer = torch.empty(meta.shape, dtype=meta.dtype, device=device)


def _stage_class() -> type:
    """A :class:`PipelineStage` that sets the micro-batch of each chunk around its forward and backward,
    and holds a receive buffer only from its chunk's receive to the end of its backward.

    torch allocates every micro-batch's activation and gradient receive buffers when a schedule first
    runs and keeps them for the schedule's life (``2 m`` boundary tensors per stage for the whole step
    and, one cached schedule per bucket shape, after it), and a last stage's kept losses reach every
    received activation through the graph until the step ends. Here the buffers are dropped once
    built, allocated at each chunk's receive (``get_fwd_recv_ops`` / ``get_bwd_recv_ops``) and freed
    when the chunk's backward is over (its weight backward too, in the zero-bubble schedules). A torch
    version without these hooks keeps its own buffers: same results, more memory.
    """
    from torch.distributed.pipelining import PipelineStage

    class _Stage(PipelineStage):
        def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
            out = super()._prepare_forward_infra(*args, **kwargs)
            for infos in self.args_recv_info.values():
                _release_buffers(infos)
            return out

        def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> Any:
            out = super()._prepare_backward_infra(*args, **kwargs)
            for infos in self.grad_recv_info.values():
                _release_buffers(infos)
            return out

        def get_fwd_recv_ops(self, fwd_chunk_id: int) -> Any:
            _fresh_buffers(self.args_recv_info.get(fwd_chunk_id, ()), self.device)
            return super().get_fwd_recv_ops(fwd_chunk_id)

        def get_bwd_recv_ops(self, bwd_chunk_id: int) -> Any:
            _fresh_buffers(self.grad_recv_info.get(bwd_chunk_id, ()), self.device)
            return super().get_bwd_recv_ops(bwd_chunk_id)

        def _with(self, chunk: int, fn: Callable, *args: Any, **kwargs: Any) -> Any:
            state = self.hotspa_state
            saved, state.micro_batch = state.micro_batch, self.hotspa_micro_batches[chunk]
            try:
                return fn(chunk, *args, **kwargs)
            finally:
                state.micro_batch = saved

        def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            return self._with(fwd_chunk_id, super().forward_one_chunk, *args, **kwargs)

        def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            out = self._with(bwd_chunk_id, super().backward_one_chunk, *args, **kwargs)
            full = inspect.signature(super().backward_one_chunk).bind(bwd_chunk_id, *args, **kwargs)
            done = _release_buffers(self.args_recv_info.get(bwd_chunk_id, ())) + \
                _release_buffers(self.grad_recv_info.get(bwd_chunk_id, ()))
            if full.arguments.get("full_backward", True):
                _free(done)
            else:  # the weight backward still reads the received activation
                self.__dict__.setdefault("hotspa_pending", {})[bwd_chunk_id] = done
            return out

        def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            out = self._with(bwd_chunk_id, super().backward_weight_one_chunk, *args, **kwargs)
            _free(self.__dict__.get("hotspa_pending", {}).pop(bwd_chunk_id, []))
            return out

    return _Stage


class PipelineRunner:
    """Runs a pp layout's micro-batches of one rank through torch's pipeline schedules.

    Args:
        parallel: the :class:`~lightning_hotspa.parallel.model.ParallelModel` (its module holds a Llama).
        schedule: a key of :data:`SCHEDULES`.
        virtual: stages per rank for the interleaved schedules (>= 2 there, 1 for the others).
        device: where the root inputs live.
    """

    def __init__(self, parallel: Any, schedule: str = "1f1b", virtual: int | None = None,
                 device: torch.device | str = "cpu") -> None:
        if schedule not in SCHEDULES:
            raise LayoutError(f"pipeline schedule {schedule!r} is not one of {sorted(SCHEDULES)}")
        multi = SCHEDULES[schedule][1]
        virtual = (2 if multi else 1) if virtual is None else virtual
        if multi and virtual < 2 or not multi and virtual != 1:
            raise LayoutError(f"pipeline schedule {schedule!r} takes {'>= 2' if multi else '1'} stages per rank, "
                              f"got virtual={virtual}")
        self.parallel, self.schedule, self.virtual = parallel, schedule, virtual
        self.device = torch.device(device)
        self.prefix, self.decoder = find_decoder(parallel.module)
        #: the loss head's work in layers, as the planner counts it (0 with virtual stages: priced even there)
        self.head_layers = head_layers(describe_model(self.decoder.config)) if virtual == 1 else 0.0
        self._cache: dict[tuple, Any] = {}
        self._owned: dict[tuple[Layout, int], frozenset[str]] = {}
        #: schedules built (one per key): the cache's size
        self.built = 0

    def stage_ids(self, layout: Layout, slot: int) -> list[int]:
        """The pipeline stages a rank with pp-group slot ``slot`` holds (round-robin over virtual stages)."""
        return [slot + k * layout.pp for k in range(self.virtual)]

    def owned(self, layout: Layout, slot: int) -> frozenset[str]:
        """The parameter names the rank with pp-group ``slot`` computes with in ``layout``.

        Named from the decoder's structure (which submodules each stage holds), never from the
        parameters' identity: the switch engine installs new parameter objects at every switch, and
        a name looked up by ``id()`` could belong to a dead parameter whose id a new one reuses (it
        did: a rank freed one of its own stage's norm weights and died of SIGSEGV reading it).
        """
        key = (layout, slot)
        if key not in self._owned:  # structure only: the same answer every switch and reduction asks
            n = self.virtual * layout.pp
            split = layer_split(len(self.decoder.layers), n, layout, self.head_layers)
            names = set()
            for s in self.stage_ids(layout, slot):
                for module_name in _stage_module_names(split[s], s == 0, s == n - 1):
                    module = self.decoder.get_submodule(module_name)
                    names.update(f"{self.prefix}{module_name}.{p}" for p, _ in module.named_parameters())
            self._owned[key] = frozenset(names)
        return self._owned[key]

    def _build(self, layout: Layout, n_mb: int, tokens: int, dtype: torch.dtype) -> Any:
        import torch.distributed.pipelining as pipelining

        groups = self.parallel.state.groups
        pp = groups.pp
        slot = pp.slot_of_shard[pp.index]
        n = self.virtual * layout.pp
        split = layer_split(len(self.decoder.layers), n, layout, self.head_layers)
        hidden = self.decoder.config.hidden
        local = tokens // layout.tp  # sequence parallel: a stage's activations are its tp share of tokens
        stage_cls = _stage_class()
        stages = []
        for s in self.stage_ids(layout, slot):
            part = _Part(self.decoder, split[s], s == 0, s == n - 1, self.parallel.state)
            # static shapes (one bucket shape per schedule); received activations require grad, or
            # torch's static metadata gives the next stage a buffer that sends no gradient back
            inputs = torch.empty(1, dtype=torch.long, device="meta") if s == 0 else \
                torch.empty(local, hidden, dtype=dtype, device="meta", requires_grad=True)
            outputs = torch.empty(1, dtype=dtype, device="meta", requires_grad=True) if s == n - 1 else \
                torch.empty(local, hidden, dtype=dtype, device="meta", requires_grad=True)
            stage = stage_cls(part, s, n, self.device, input_args=inputs, output_args=outputs, group=pp.group)
            stage.hotspa_state = self.parallel.state
            stages.append(stage)
        cls = getattr(pipelining, SCHEDULES[self.schedule][0])
        loss = _weighted_loss
        if SCHEDULES[self.schedule][1]:
            return cls(stages, n_mb, loss_fn=loss, scale_grads=False)
        return cls(stages[0], n_mb, loss_fn=loss, scale_grads=False)

    def run(self, layout: Layout, micro_batches: Sequence[MicroBatch], weights: Sequence[float],
            record: Callable[[Tensor, MicroBatch], None] | None = None) -> Tensor:
        """Forward and backward of ``micro_batches`` (this rank's dp group's, in ``layout``, already
        active) through the schedule; gradients accumulate in the working parameters' ``.grad``.
        Returns the sum of the weighted losses this rank computed (its last stage's; 0 elsewhere).

        Args:
            layout: the stage's compute layout (``pp > 1``).
            micro_batches: the dp group's micro-batches (the same on every rank of the pp group).
            weights: each micro-batch's loss weight (its share of the step's token-mean loss).
            record: called with each micro-batch's unweighted loss on the last stage.
        """
        n_mb = len(micro_batches)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        if n_mb == 0:
            return total
        if self.schedule != "gpipe" and n_mb < layout.pp:
            raise LayoutError(f"layout {layout}: schedule {self.schedule!r} needs at least pp={layout.pp} "
                              f"micro-batches per dp group, got {n_mb}; use 'gpipe' or more micro-batches")
        tokens = max(mb.num_tokens for mb in micro_batches)
        dtype = next(p for p in self.decoder.layers[0].parameters()).dtype
        key = (layout, self.schedule, n_mb, tokens, dtype)
        if key not in self._cache:
            self._cache[key] = self._build(layout, n_mb, tokens, dtype)
            self.built += 1
        schedule = self._cache[key]
        with host_reads():  # plan metadata (real tensors under the fake-world estimator's mode)
            padded = [pad_micro_batch(mb, tokens) for mb in micro_batches]
        for stage in schedule._stages if hasattr(schedule, "_stages") else [schedule._stage]:
            stage.hotspa_micro_batches = padded
        losses: list[Tensor] = []
        idx = torch.arange(n_mb, device=self.device)
        target = torch.tensor(list(weights), dtype=dtype, device=self.device)
        schedule.step(idx, target=target, losses=losses)
        for i, loss in enumerate(losses):
            total += loss.detach().double()
            if record is not None and weights[i]:
                record(loss.detach() / weights[i], micro_batches[i])
        return total


def _weighted_loss(output: Tensor, weight: Tensor) -> Tensor:
    """A micro-batch's token-mean loss times its share of the step's target tokens."""
    return (output * weight).sum()
