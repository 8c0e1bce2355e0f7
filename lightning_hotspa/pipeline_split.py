"""Which decoder layers each pipeline stage holds: one rule for the planner's stage prices
(``planner/cost/pp_schedule.py``) and the runtime's stages (``parallel/pipeline.py``), so the split
that is priced is the split that runs.

The rule: the slowest stage's work, ``max(layers on a stage, layers on the last + the loss head's
GEMM work in layers)``, as small as it can be; among equal splits the evenest, then the one whose
first stage holds the fewest layers (under 1F1B the first stage holds the most micro-batches'
activations). The layers the non-last stages share unevenly go to the middle stages first, then the
first.
"""

from __future__ import annotations

from typing import Any

__all__ = ["head_layers", "stage_layer_counts"]


def head_layers(shape: Any) -> float:
    """The loss head's GEMM work in transformer layers: ``padded vocab x hidden`` over one layer's parameters.

    Args:
        shape: a :class:`~lightning_hotspa.model_shape.ModelShape`.
    """
    head = shape.padded_vocab_size * shape.hidden
    layer = (shape.num_params(include_embedding=False) - head - shape.hidden) / shape.n_layers
    return head / layer


def stage_layer_counts(n_layers: int, stages: int, head: float = 0.0) -> tuple[int, ...]:
    """Layers per stage, first to last, by the module's rule.

    Args:
        n_layers: the decoder's layers.
        stages: pipeline stages (every one needs a layer).
        head: the loss head's work on the last stage, in layers (:func:`head_layers`; 0: none counted).
    """
    if not 1 <= stages <= n_layers:
        raise ValueError(f"{stages} pipeline stages for a model of {n_layers} layers: every stage needs a layer")
    if stages == 1:
        return (n_layers,)
    best: tuple[tuple[float, int, int], tuple[int, ...]] | None = None
    for last in range(1, n_layers - stages + 2):
        base, extra = divmod(n_layers - last, stages - 1)
        counts = [base] * (stages - 1)
        for s in [*range(1, stages - 1), 0][:extra]:
            counts[s] += 1
        layers = (*counts, last)
        key = (max(max(counts), last + head), max(layers) - min(layers), counts[0])
        if best is None or key < best[0]:
            best = (key, layers)
    assert best is not None
    return best[1]
