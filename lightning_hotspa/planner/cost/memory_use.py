"""What one option holds per rank (:class:`MemoryUse`) and the largest micro-batch that fits a budget.

Shared by the memory model (memory_model.py) and the per-stage pipeline memory (pp_memory.py).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MemoryUse", "most_tokens"]


@dataclass(frozen=True)
class MemoryUse:
    """Bytes per rank of one option."""

    home: float
    working: float
    activation_per_token: float  # per token of the micro-batch (already divided by tp*cp)
    usable: float  # the hardware's usable bytes (after its reserve): what "fits" compares with
    margin: float = 0.0  # the model's own error margin (:data:`MODEL_ERROR_MARGIN`)
    # Bytes live when the loss head's transients (``head_per_token``, part of the activations) are
    # not: an fsdp unit's gathered weights and gradient while it runs backward, or (replicated
    # copies) the overlapped reduction of the head's gradient; the peak holds the larger of the two.
    transient: float = 0.0
    head_per_token: float = 0.0

    @property
    def planning_budget(self) -> float:
        """Bytes a predicted peak may reach: ``usable / (1 + margin)``."""
        return self.usable / (1.0 + self.margin)

    @property
    def free_for_activations(self) -> float:
        return self.planning_budget - self.home - self.working

    def peak(self, tokens: float, quadratic: float = 0.0) -> float:
        """Bytes with a micro-batch of ``tokens`` (``quadratic``: the attention's s^2 bytes)."""
        extra = max(0.0, self.transient - self.head_per_token * tokens)
        return self.home + self.working + self.activation_per_token * tokens + quadratic + extra


def most_tokens(free: float, per_token: float, quadratic: float) -> int:
    """Largest ``T`` with ``per_token * T + quadratic * T^2 <= free`` (0 when ``free <= 0``)."""
    if free <= 0:
        return 0
    if quadratic == 0:
        return int(free // per_token)
    return int((-per_token + (per_token * per_token + 4 * quadratic * free) ** 0.5) / (2 * quadratic))
