"""Fake-world count of how much of a stage's gradient reduction its last backward can hide.

One stage's last micro-batch runs forward and backward on the real code path (``SwitchEngine``,
``ParallelModel``, ``overlap_next_backward``) in a fake world of ``world`` ranks under
``FakeTensorMode`` (shapes only). Every reduction bucket the engine launches is logged with its
input bytes and the GEMM FLOPs (``aten.mm`` / ``addmm`` / ``bmm``) the backward has run by then; the
backward's total GEMM FLOPs give each bucket's ``rest``: the share of the backward still to run once
it is on the wire. A bucket launched with no GEMM left (``rest`` 0, e.g. the embedding's, or one
launched by ``reduce_gradients`` after the backward) is exposed whatever the network's speed. The
cost model prices the same pairs from the model's shape (``planner/cost/grad_exposure.py``);
``tests/unit/test_grad_exposure.py`` compares the two and ``recipes/benchmark_hot_path.py`` reports them.
"""

from __future__ import annotations

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from ..layout import Layout

__all__ = ["measure_reduce_buckets"]

_GEMMS = {"mm", "addmm", "bmm"}


class _GemmFlops(TorchDispatchMode):
    """Counts the FLOPs of every GEMM dispatched (2 x m x n x k), while ``on``."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0.0
        self.on = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.on and func.overloadpacket.__name__ in _GEMMS:
            a, b = (args[1], args[2]) if func.overloadpacket.__name__ == "addmm" else (args[0], args[1])
            self.flops += 2.0 * a.numel() * b.shape[-1]
        return out


def measure_reduce_buckets(config: Any, layout: Layout | str, world_size: int, tokens: int = 256,
                           bucket_bytes: int = 100 * 2**20) -> dict[str, Any]:
    """The reduction buckets of one stage's last backward on rank 0 of a fake world.

    Args:
        config: a ``LlamaConfig``.
        layout: the stage's layout (a replicated working copy: the one whose reduction overlaps).
        world_size: fake ranks.
        tokens: tokens of the stage's micro-batch (one document per dp group).
        bucket_bytes: the engine's bucket size (the NCCL default).

    Returns ``{"buckets": [(bytes, rest), ...] in launch order, "in_backward": bytes launched from the
    backward's hooks, "at_end": bytes launched after it}``.
    """
    from .fake_llama import fake_llama

    layout = Layout.parse(layout) if isinstance(layout, str) else layout
    if layout.fsdp:
        raise ValueError(f"{layout}: a sharded copy reduce-scatters per unit; measure a replicated layout")
    launches: list[tuple[float, float, bool]] = []  # (bytes, GEMM FLOPs so far, inside the backward)
    counter, state = _GemmFlops(), {"inside": False}
    with fake_llama(config, layout, world_size, tokens, bucket_bytes=bucket_bytes) as step:
        engine, launch = step.engine, step.engine._launch

        def logged(plan, bucket, grads, into, where):
            nbytes = sum(engine.working[n].numel() for n in bucket.names) * 4.0
            launches.append((nbytes, counter.flops, state["inside"]))
            return launch(plan, bucket, grads, into, where)

        engine._launch = logged
        engine.materialize(layout)
        step.parallel.activate(layout, engine.working, False)
        with step.parallel.micro_batch(step.micro_batch):
            loss = step.module(step.micro_batch)
        engine.overlap_next_backward()
        with counter:
            counter.on, state["inside"] = True, True
            loss.backward()
            counter.on, state["inside"] = False, False
        engine.reduce_gradients()
    total = counter.flops or 1.0
    return {"buckets": [(b, max(0.0, 1.0 - f / total) if inside else 0.0) for b, f, inside in launches],
            "in_backward": sum(b for b, _, inside in launches if inside),
            "at_end": sum(b for b, _, inside in launches if not inside)}
