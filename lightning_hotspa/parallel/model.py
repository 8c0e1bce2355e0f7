"""Runs one module in any layout of a :class:`WorldMesh`.

``ParallelModel`` installs the tensor- and context-parallel hooks ONCE (they read the shared
:class:`ParallelState`), and per stage only swaps parameters and updates the state. Outside a stage
the module holds its home parameters, so ``module.parameters()`` is what the optimizer steps.

The LM head's loss: a module that opts in with ``vocab_parallel_loss = True`` (the
:class:`~lightning_hotspa.models.LlamaLM` contract: its logits are consumed ONLY through ``loss_fn``)
and has one ``vocab`` Linear gets its ``loss_fn`` wrapped by a vocab-parallel cross entropy on
sharded logits; any other module, ``loss_fn`` or not, sees gathered logits (its ``loss_fn`` is
never replaced behind its back: other users of the logits would see shards).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

from torch import nn

from ..activation_checkpointing import Checkpointing
from ..layout import Layout, LayoutError
from ..mesh import WorldMesh
from ..plan import MicroBatch
from .params import set_parameters
from .row_scatter import file_group
from .state import ParallelState

__all__ = ["ParallelModel"]


class ParallelModel:
    """``loss_parallel``: None reads the module's ``vocab_parallel_loss`` opt-in; True / False force it
    (True needs ``loss_fn``). ``self.loss_parallel`` says what was installed. ``tp_overlap``: tp
    communication with its GEMMs under sequence parallelism (``install_tensor_parallel``'s ``overlap``);
    ``tp_regather``: False keeps a region's gathered input for backward instead of gathering it again.
    ``fp8``: a torchao float8 recipe name for the transformer blocks' projections (:mod:`.fp8`), None off;
    ``self.fp8_linears`` names the layers that run in FP8."""

    def __init__(self, module: nn.Module, roles: Mapping[str, str], world: WorldMesh,
                 *, loss_parallel: bool | None = None, tp_overlap: bool = True, tp_regather: bool = True,
                 fp8: str | None = None) -> None:
        self.module = module
        self.world = world
        self.state = ParallelState()
        self.hooks = 0
        self.loss_parallel = False
        self.fp8_linears: list[str] = []
        if fp8 is not None:  # before tensor parallelism: its forwards read the FP8 mark
            from .fp8 import install_fp8

            self.fp8_linears = install_fp8(module, fp8, self.state, max(layout.tp for layout in world.layouts))
        if any(layout.tp > 1 for layout in world.layouts):
            from .tensor_parallel import install_tensor_parallel

            if loss_parallel is None:
                loss_parallel = getattr(module, "vocab_parallel_loss", False) is True
            self.loss_parallel = bool(loss_parallel)
            self.hooks += install_tensor_parallel(module, roles, self.state, loss_parallel=loss_parallel,
                                                  overlap=tp_overlap, regather=tp_regather)
        if any(layout.cp > 1 for layout in world.layouts):
            from .context_parallel import install_context_parallel

            self.hooks += install_context_parallel(module, self.state)
        self._checkpointers = [m for m in module.modules() if hasattr(m, "set_activation_checkpointing")]

    def activate(self, layout: Layout, params: Mapping[str, nn.Parameter],
                 activation_checkpointing: Checkpointing | bool | str = False) -> None:
        """Computes in ``layout`` with ``params`` (the switch engine's working parameters) from now on,
        recomputing what ``activation_checkpointing`` (a :class:`Checkpointing` mode, a bool or its
        name) says. A module's ``set_activation_checkpointing`` gets a bool (full / none) unless it
        declares ``selective_checkpointing = True`` (it then gets the mode, as :class:`Llama` does)."""
        mode = Checkpointing.parse(activation_checkpointing)
        if mode and not self._checkpointers:
            raise LayoutError(f"activation checkpointing ({mode}) was asked for layout {layout}, but "
                              f"{type(self.module).__name__} has no module with set_activation_checkpointing()")
        if mode is Checkpointing.SELECTIVE:
            plain = [type(m).__name__ for m in self._checkpointers if not getattr(m, "selective_checkpointing", False)]
            if plain:
                raise LayoutError(f"selective checkpointing was asked for layout {layout}, but {plain[0]} "
                                  f"does not declare selective_checkpointing = True; use 'full' or 'none'")
            if layout.fsdp:  # the recomputed core would read the unit's released (meta) weights
                raise LayoutError(f"selective checkpointing is not built for the sharded layout {layout} "
                                  f"(docs/DESIGN.md §11); use 'full' or 'none' there")
        groups = self.world.layout_groups(layout)
        if self.hooks:
            from .core_attention import check_attention

            check_attention(self.module, groups)  # re-attach swapped backends; heads vs layout
        self.state.groups = groups
        file_group(groups.tp)  # for the compiled row layer (.row_scatter)
        set_parameters(self.module, params)
        for m in self._checkpointers:
            m.set_activation_checkpointing(mode if getattr(m, "selective_checkpointing", False) else bool(mode))

    def restore(self, params: Mapping[str, nn.Parameter]) -> None:
        """Puts the home parameters back and leaves no layout active."""
        set_parameters(self.module, params)
        self.state.groups = None
        for m in self._checkpointers:
            m.set_activation_checkpointing(False)

    @contextlib.contextmanager
    def full_logits(self) -> Iterator[None]:
        """Inside: a vocab-parallel head returns whole logits (gathered over tp), as prediction needs;
        outside its logits stay sharded for the vocab-parallel loss."""
        from .tensor_parallel import TPForward

        heads = [f for m in self.module.modules() if isinstance(f := m.__dict__.get("forward"), TPForward)
                 and f.local_output]
        for f in heads:
            f.local_output = False
        try:
            yield
        finally:
            for f in heads:
                f.local_output = True

    @contextlib.contextmanager
    def micro_batch(self, mb: MicroBatch | None) -> Iterator[None]:
        self.state.micro_batch = mb
        try:
            yield
        finally:
            self.state.micro_batch = None


def uninstall_parallel(module: nn.Module) -> int:
    """Removes what an earlier :class:`ParallelModel` installed on ``module`` (its tensor-parallel
    forwards, attention wrappers and vocab-parallel loss), so a new one can install its own: a module
    fitted by one Trainer, used by another. Returns how many were removed.

    Args:
        module: the root module a ParallelModel was built on.
    """
    from .core_attention import ParallelCoreAttention
    from .fp8 import uninstall_fp8
    from .loss import VocabParallelLoss
    from .tensor_parallel import TPForward

    removed = 0
    for sub in module.modules():
        if isinstance(sub.__dict__.get("forward"), TPForward):
            del sub.forward
            removed += 1
        wrapper = sub.__dict__.get("_hotspa_attention")
        if isinstance(wrapper, ParallelCoreAttention):
            sub.core_attention = wrapper.inner if sub.core_attention is wrapper else sub.core_attention
            del sub._hotspa_attention
            removed += 1
    removed += uninstall_fp8(module)
    loss = module.__dict__.get("loss_fn")
    if isinstance(loss, VocabParallelLoss):
        original = loss.original
        if getattr(original, "__self__", None) is module and getattr(type(module), "loss_fn", None) is not None:
            del module.loss_fn  # the class's own method again
        else:
            module.loss_fn = original
        removed += 1
    return removed
