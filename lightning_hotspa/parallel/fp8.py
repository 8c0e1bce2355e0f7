"""FP8 linear layers through torchao's float8 recipes, with scales that do not depend on the layout.

``strategy.runtime.fp8`` (``tensorwise``, ``rowwise``, ``rowwise_with_gw_hp``: torchao's
``Float8LinearConfig.from_recipe_name``; dynamic scaling, torchao has no delayed scaling) turns the
projections of every transformer block (each ``nn.Linear`` inside a child of an ``nn.ModuleList``)
into FP8 GEMMs (``torch._scaled_mm``, which also runs on CPU). Embeddings and the LM head (outside
the blocks) stay in the working precision; a layer whose dims are not divisible by 16 x the largest
tp degree stays there too, with a log line.

Why not torchao's ``Float8Linear``: its scales come from the tensor it is handed (``tensor_to_amax``
reduces over a DeviceMesh only, never over our tp / cp groups, which may span several mesh dims), so
on a tp shard it would scale by the SHARD's amax and the FP8 math would depend on the layout. Here
:class:`_Fp8Matmul` is torchao's ``matmul_with_hp_or_float8_args`` with one change: every cast takes
its amax from torchao's ``tensor_to_amax``, reduces it (MAX) over the groups that split the axes it
spans, then uses torchao's ``amax_to_scale`` and ``hp_tensor_and_scale_to_float8`` (the precomputed
GLOBAL scale); the GEMMs are torchao's ``Float8TrainingTensor`` matmuls. For ``x [T, K] @ W.T``
(``W [N, K]``) the axes are split so:

- ``T`` (tokens) over cp (a micro-batch's tokens; under tp the GEMMs see the gathered tokens);
- ``K`` over tp for a ``rowwise`` layer (``wo``, ``w2``), ``N`` over tp for a ``colwise`` one;
- an ``:fsdp`` copy is gathered before its unit computes, so its weight amax is already global.

A tensorwise cast reduces over the groups of both its axes; an axiswise (rowwise) cast over the group
of the axis it reduces along. Then every layout casts each element with the scale the single process
uses for the same micro-batch; only the GEMMs' summation order differs (tests/distributed/test_fp8_ranks.py).
Micro-batches packed differently scale differently (dynamic scaling is per GEMM call), an FP8
rounding difference the tests bound separately. Not built: an FP8 all-gather of ``:fsdp`` shards
(same numbers, half the bytes); FP8 under tp overlap (an FP8 layer uses the plain collectives).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..mesh import RankGroup
from .state import ParallelState

__all__ = ["FP8_RECIPES", "Fp8Axes", "Fp8Forward", "Fp8Spec", "check_fp8", "fp8_linear", "install_fp8"]

log = logging.getLogger(__name__)

FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
_ALIGN = 16  # torch._scaled_mm needs both GEMM dims divisible by 16


def check_fp8(value: Any) -> str | None:
    """``strategy.runtime.fp8`` validated: None (off) or one of :data:`FP8_RECIPES`; torchao must import.

    Args:
        value: what the user wrote (None, ``"none"`` / ``"null"`` / ``""`` / False mean off).
    """
    if value is None or value is False or (isinstance(value, str) and value.lower() in ("", "none", "null")):
        return None
    if not isinstance(value, str) or value not in FP8_RECIPES:
        raise ValueError(f"strategy.runtime.fp8={value!r} is not an FP8 recipe; use null (off) or one of "
                         f"{list(FP8_RECIPES)} (torchao.float8's recipe names)")
    try:
        import torchao.float8  # noqa: F401
    except ImportError as err:
        raise ImportError(f"strategy.runtime.fp8={value!r} needs torchao (pip install torchao); it is not importable "
                          f"here: {err}") from err
    return value


class Fp8Spec:
    """One torchao recipe: its ``Float8LinearConfig`` and the GEMM configs ``Float8Linear`` builds.

    Args:
        recipe: one of :data:`FP8_RECIPES`.
    """

    def __init__(self, recipe: str) -> None:
        from torchao.float8 import Float8LinearConfig
        from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

        self.recipe = check_fp8(recipe)
        c = self.config = Float8LinearConfig.from_recipe_name(recipe)
        self.mm = LinearMMConfig(*(ScaledMMConfig(c.emulate, g.use_fast_accum, False, c.pad_inner_dim)
                                   for g in (c.gemm_config_output, c.gemm_config_grad_input,
                                             c.gemm_config_grad_weight)))

    def __repr__(self) -> str:
        return f"Fp8Spec({self.recipe!r})"


@dataclass(frozen=True)
class Fp8Axes:
    """The groups splitting a GEMM's axes on this rank (None: whole here): ``t`` tokens, ``k`` the
    contraction dim, ``n`` the output features."""

    t: RankGroup | None = None
    k: RankGroup | None = None
    n: RankGroup | None = None

    def groups(self, labels: str) -> list[RankGroup]:
        """The groups over ``labels`` (a string of axis names), each once, of more than one member."""
        out: list[RankGroup] = []
        for a in labels:
            g = getattr(self, a)
            if g is not None and g.size > 1 and all(g is not h for h in out):
                out.append(g)
        return out


def _cast(t: Tensor, cast: Any, spec: Fp8Spec, role: Any, labels: str, dim: int, axes: Fp8Axes) -> Tensor:
    """``t`` (axes ``labels``) cast to FP8 as ``cast`` says, its amax reduced over the groups it spans
    (axiswise: only the axis ``dim`` it reduces along); ``t`` itself where the cast is disabled."""
    from torchao.float8.config import ScalingGranularity, ScalingType
    from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim
    from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8
    from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax

    if cast.scaling_type is ScalingType.DISABLED:
        return t
    axiswise = get_maybe_axiswise_dim(dim, cast.scaling_granularity)
    amax = tensor_to_amax(t, scaling_granularity=cast.scaling_granularity, axiswise_dim=axiswise)
    spans = labels if cast.scaling_granularity is ScalingGranularity.TENSORWISE else labels[dim]
    for group in axes.groups(spans):
        amax = group.comm.all_reduce_max(amax)
    scale = amax_to_scale(amax, cast.target_dtype, round_scales_to_power_of_2=spec.config.round_scales_to_power_of_2)
    return hp_tensor_and_scale_to_float8(t, scale, cast.target_dtype, spec.mm, role, axiswise)


class _Fp8Matmul(torch.autograd.Function):
    """``x @ w.T`` with its three GEMMs in FP8 (torchao's ``matmul_with_hp_or_float8_args``, with
    global scales); saves ``x`` and ``w`` in high precision (an ``:fsdp`` unit re-gathers ``w``)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, spec: Fp8Spec, axes: Fp8Axes) -> Tensor:
        from torchao.float8.float8_training_tensor import GemmInputRole

        ctx.save_for_backward(x, w)
        ctx.spec, ctx.axes = spec, axes
        c = spec.config
        rows = x.reshape(-1, x.shape[-1])
        a = _cast(rows, c.cast_config_input, spec, GemmInputRole.INPUT, "tk", -1, axes)
        b = _cast(w.t(), c.cast_config_weight, spec, GemmInputRole.WEIGHT, "kn", 0, axes)
        return torch.mm(a, b).reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        from torchao.float8.float8_training_tensor import GemmInputRole

        x, w = ctx.saved_tensors
        spec, axes, c = ctx.spec, ctx.axes, ctx.spec.config
        go = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            g = _cast(go, c.cast_config_grad_output, spec, GemmInputRole.GRAD_OUTPUT, "tn", -1, axes)
            wt = _cast(w.t(), c.cast_config_weight_for_grad_input, spec, GemmInputRole.WEIGHT, "kn", -1, axes)
            grad_x = torch.mm(g, wt.t()).reshape(*grad.shape[:-1], w.shape[1])
        if ctx.needs_input_grad[1]:
            rows = x.reshape(-1, x.shape[-1])
            g = _cast(go, c.cast_config_grad_output_for_grad_weight, spec, GemmInputRole.GRAD_OUTPUT, "tn", 0, axes)
            a = _cast(rows, c.cast_config_input_for_grad_weight, spec, GemmInputRole.INPUT, "tk", 0, axes)
            grad_w = torch.mm(g.t(), a).to(w.dtype)
        return grad_x, grad_w, None, None


def fp8_linear(x: Tensor, weight: Tensor, bias: Tensor | None, spec: Fp8Spec, axes: Fp8Axes = Fp8Axes()) -> Tensor:
    """``F.linear(x, weight, bias)`` with FP8 GEMMs; the bias is added in ``x``'s precision.

    Args:
        x: ``[..., K]``; weight: ``[N, K]`` (this rank's shard); bias: ``[N]`` or None.
        spec: the recipe.
        axes: the groups splitting the tokens, K and N on this rank (:class:`Fp8Axes`).
    """
    out = _Fp8Matmul.apply(x, weight, spec, axes)
    return out if bias is None else out + bias


def tokens_group(state: ParallelState | None) -> RankGroup | None:
    """The group splitting a micro-batch's tokens at the GEMMs: cp (None outside a layout)."""
    groups = state.groups if state is not None else None
    return groups.cp if groups is not None and groups.cp.size > 1 else None


def left_operand(module: nn.Module, x: Tensor, rest: Sequence[Tensor]) -> Tensor:
    """The GEMM's left operand: ``x``, or a ``tp_linear_forward`` module's ``tp_row_input(x, *rest)``
    (SwiGLUDown: ``silu(a) * b``)."""
    row_input = getattr(type(module), "tp_row_input", None)
    return row_input(x, *rest) if callable(row_input) else x


class Fp8Forward:
    """An FP8 layer's forward where no tensor-parallel forward runs it (no tp layout in the world):
    installed as ``module.forward``; the tokens' amax is reduced over cp.

    Args:
        module: the ``nn.Linear``.
        state: the shared :class:`ParallelState` (None: a single process).
    """

    def __init__(self, module: nn.Module, state: ParallelState | None) -> None:
        self.module = module
        self.state = state

    def __call__(self, x: Tensor, *rest: Tensor) -> Tensor:
        m = self.module
        return fp8_linear(left_operand(m, x, rest), m.weight, m.bias, m._hotspa_fp8,
                          Fp8Axes(t=tokens_group(self.state)))


def _eligible(name: str, module: nn.Module, blocks: Sequence[str], max_tp: int) -> str | None:
    """Why ``module`` stays in the working precision, or None when it runs in FP8."""
    if not any(name.startswith(b + ".") for b in blocks):
        return "outside the transformer blocks"
    if type(module).forward is not nn.Linear.forward and not callable(getattr(type(module), "tp_row_input", None)):
        return f"{type(module).__name__} overrides nn.Linear.forward"
    align = _ALIGN * max_tp
    if module.in_features % align or module.out_features % align:
        return (f"[{module.out_features}, {module.in_features}] is not divisible by {align} (16 x the largest tp "
                f"degree {max_tp}; torch._scaled_mm needs 16 on every shard)")
    return None


def install_fp8(module: nn.Module, recipe: str, state: ParallelState | None = None, max_tp: int = 1) -> list[str]:
    """Marks the FP8 layers (``module._hotspa_fp8``, read by the tensor-parallel forwards) and installs
    :class:`Fp8Forward` on them; returns their names. Install BEFORE tensor parallelism (its forwards
    replace these and read the mark). Logs every block Linear left in the working precision.

    Args:
        module: the root module.
        recipe: one of :data:`FP8_RECIPES`.
        state: the shared :class:`ParallelState` (None: a single process).
        max_tp: the largest tp degree of the world (every shard must stay 16-aligned).
    """
    spec = Fp8Spec(recipe)
    blocks = [f"{path}.{child}" if path else child for path, sub in module.named_modules()
              if isinstance(sub, nn.ModuleList) for child, _ in sub.named_children()]
    names = []
    for name, sub in module.named_modules():
        if not isinstance(sub, nn.Linear):
            continue
        why = _eligible(name, sub, blocks, max_tp)
        if why is not None:
            if blocks and any(name.startswith(b + ".") for b in blocks):
                log.info("fp8: %s stays in %s: %s", name, sub.weight.dtype, why)
            continue
        sub._hotspa_fp8 = spec
        sub.forward = Fp8Forward(sub, state)
        names.append(name)
    if not names:
        log.info("fp8 %s: no transformer-block nn.Linear of %s qualifies", recipe, type(module).__name__)
    return names


def uninstall_fp8(module: nn.Module) -> int:
    """Removes what :func:`install_fp8` installed; returns how many layers."""
    removed = 0
    for sub in module.modules():
        if "_hotspa_fp8" in sub.__dict__:
            del sub._hotspa_fp8
            if isinstance(sub.__dict__.get("forward"), Fp8Forward):
                del sub.forward
            removed += 1
    return removed
