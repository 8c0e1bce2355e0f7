"""Pipeline-parallel terms of the cost model: the bubble per schedule, micro-batches in flight per
stage, the layer split over stages, and the point-to-point activation traffic.

Notation: ``p`` stages, ``m`` micro-batches per dp group, ``v`` virtual stages (model chunks) per rank.
A micro-batch's time on one stage is ``t`` (forward ``T_F`` + input-gradient backward ``T_B`` + weight-
gradient backward ``T_W``); ``m`` of them take ``m t`` without a bubble. Per schedule:

* ``gpipe`` (Huang et al. 2019, arXiv 1811.06965): all forwards, then all backwards; bubble
  ``(p - 1) / m`` of ``m t``; stage ``s`` holds all ``m`` micro-batches' activations.
* ``1f1b`` (PipeDream-Flush, Narayanan et al. 2021, arXiv 2104.04473 §2.2.1): the same bubble
  ``(p - 1) / m``; stage ``s`` (0-based) holds at most ``min(p - s, m)`` micro-batches: the first
  stage holds the most.
* ``interleaved`` (the same paper, §2.2.2): each rank runs ``v`` chunks of ``L / (p v)`` layers;
  bubble ``(p - 1) / (v m)``; ``v`` times the point-to-point messages; stage ``s`` warms up
  ``min(2 (p - s - 1) + (v - 1) p, m v)`` chunk forwards before its first backward (Megatron-LM's
  ``get_forward_backward_func`` interleaved schedule), so it holds ``(warmup + 1) / v`` micro-batches'
  worth of its layers: stage 0 ``p + (p - 1) / v``, more than 1F1B's ``p``.
* ``zb-h1`` (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", ICLR 2024, arXiv 2401.10241, §3): the
  backward split into B and W, W deferred into the bubble; bubble ``(p - 1)(T_F + T_B - T_W)``
  against 1F1B's ``(p - 1)(T_F + T_B + T_W)``, the same peak memory as 1F1B. ASSUMED
  ``T_F = T_B = T_W`` (the paper's own setting), with full checkpointing's recomputed forward in
  ``T_B``: the bubble is 1/3 (1/2 with full checkpointing) of 1F1B's.

Point-to-point: per micro-batch each stage receives its input activation and sends its output (and
the gradients back): ``tokens x hidden`` in the working dtype per boundary and direction, each rank
of a tp x cp group sending its sequence-parallel share (``1 / (tp cp)``); ``v`` times as many with the
interleaved schedule. Exposed unless the runtime overlaps them (``p2p_overlap``, Megatron-LM's
README: "pipeline-parallel communication (enabled by default)" overlapped with computation), then
``1 - layer_comm_overlap`` of them. Pipeline stages take the OUTERMOST mesh dims, so a stage's rank
and its peer in the next stage lie ``world / p`` ranks apart.

Layer split (:func:`stage_layers`): ``even`` (``L / p`` each: Megatron-LM's default, the embedding on
the first stage and the loss head on the last beside their layers) or ``balanced`` (ours, and what
our runtime runs: ``lightning_hotspa/pipeline_split.py``, the slowest stage's work minimized, the loss
head counted as ``head_layers`` layers of GEMM work on the last stage; the embedding lookup has no GEMM).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...pipeline_split import stage_layer_counts

__all__ = ["SCHEDULES", "PipelineSchedule", "get_schedule", "in_flight", "stage_layers"]

#: the priced schedules (torch.distributed.pipelining: ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B; its
#: zero-bubble classes are the interleaved / V-shaped variants, priced here as ZB-H1 on one chunk per rank)
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


@dataclass(frozen=True)
class PipelineSchedule:
    """How a pp layout's micro-batches are scheduled and its layers split.

    Args:
        name: one of :data:`SCHEDULES`.
        virtual_stages: ``v``, chunks per rank (``interleaved`` only; 1 otherwise).
        split: ``"balanced"`` (ours) or ``"even"`` (``L / p`` layers per stage, Megatron-LM's default).
        p2p_overlap: the runtime overlaps the point-to-point transfers with computation.
        micro_batches: the ``m`` GPipe's memory is priced at (it holds every micro-batch; default ``p``).
    """

    name: str = "1f1b"
    virtual_stages: int = 1
    split: str = "balanced"
    p2p_overlap: bool = False
    micro_batches: int = 0

    def __post_init__(self) -> None:
        if self.name not in SCHEDULES:
            raise ValueError(f"pipeline schedule must be one of {sorted(SCHEDULES)}, got {self.name!r}")
        if not isinstance(self.virtual_stages, int) or self.virtual_stages < 1:
            raise ValueError(f"virtual_stages must be an int >= 1, got {self.virtual_stages!r}")
        if self.virtual_stages > 1 and self.name != "interleaved":
            raise ValueError(f"virtual_stages={self.virtual_stages}: only the 'interleaved' schedule has virtual "
                             f"stages (schedule {self.name!r})")
        if self.split not in ("balanced", "even"):
            raise ValueError(f"split must be 'balanced' or 'even', got {self.split!r}")
        if not isinstance(self.micro_batches, int) or self.micro_batches < 0:
            raise ValueError(f"micro_batches must be an int >= 0, got {self.micro_batches!r}")

    @property
    def label(self) -> str:
        return f"interleaved(v={self.virtual_stages})" if self.name == "interleaved" else self.name

    def bubble(self, pp: int, micro_batches: int, recompute: bool = False) -> float:
        """Idle time over busy time of a dp group's ``micro_batches`` on ``pp`` stages (0 without pp).

        Args:
            pp: stages.
            micro_batches: ``m``.
            recompute: full activation checkpointing (its recomputed forward is part of ``T_B``).
        """
        if pp == 1 or micro_batches <= 0:
            return 0.0
        base = (pp - 1) / micro_batches
        if self.name == "interleaved":
            return base / self.virtual_stages
        if self.name == "zb-h1":
            t_f, t_b, t_w = 1.0, 2.0 if recompute else 1.0, 1.0
            return base * (t_f + t_b - t_w) / (t_f + t_b + t_w)
        return base

    def messages(self) -> int:
        """Point-to-point messages per micro-batch, boundary and direction a rank sends (``v``)."""
        return self.virtual_stages


def get_schedule(spec: PipelineSchedule | str | None) -> PipelineSchedule:
    """A :class:`PipelineSchedule` from itself, a name (``"interleaved:2"``: ``v`` = 2) or None (1F1B)."""
    if spec is None:
        return PipelineSchedule()
    if isinstance(spec, PipelineSchedule):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"pipeline schedule must be a name or a PipelineSchedule, got {spec!r}")
    name, _, v = spec.partition(":")
    if v and not v.isdigit():
        raise ValueError(f"pipeline schedule {spec!r}: the part after ':' is the virtual stage count, an int")
    return PipelineSchedule(name, int(v) if v else (2 if name == "interleaved" else 1))


def in_flight(schedule: PipelineSchedule, pp: int, stage: int, micro_batches: int) -> float:
    """Micro-batches whose activations of its layers stage ``stage`` (0-based) holds at its peak.

    Args:
        schedule: the schedule.
        pp: stages.
        stage: the stage.
        micro_batches: ``m`` (GPipe holds them all).
    """
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} is not one of the {pp} stages")
    m = max(1, micro_batches)
    if schedule.name == "gpipe":
        return float(m)
    if schedule.name == "interleaved":
        v = schedule.virtual_stages
        warmup = min(2 * (pp - stage - 1) + (v - 1) * pp, m * v)
        return min(warmup + 1, m * v) / v
    return float(min(pp - stage, m))


def stage_layers(n_layers: int, pp: int, head_layers: float = 0.0, split: str = "balanced",
                 virtual_stages: int = 1) -> tuple[int, ...]:
    """Transformer layers per stage, first to last.

    Args:
        n_layers: the model's layers.
        pp: stages (each gets at least one layer).
        head_layers: the loss head's GEMM work on the last stage, in layers.
        split: ``"even"`` (``n_layers / pp``, must divide) or ``"balanced"``
            (:func:`~lightning_hotspa.pipeline_split.stage_layer_counts`: the runtime's own split).
        virtual_stages: ``v`` chunks per rank (interleaved): the split is even, ``pp * v`` must divide.
    """
    if pp < 1 or pp > n_layers:
        raise ValueError(f"pp={pp} must be between 1 and the model's {n_layers} layers (each stage needs a layer)")
    if virtual_stages > 1 or split == "even":
        if n_layers % (pp * virtual_stages):
            raise ValueError(f"pp={pp} x virtual stages {virtual_stages} does not divide the model's {n_layers} "
                             f"layers (an even split needs it)")
        return (n_layers // pp,) * pp
    return stage_layer_counts(n_layers, pp, head_layers)
