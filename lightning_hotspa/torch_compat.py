"""Differences between the torch versions the project supports (2.11-2.13), handled in one place.

torch 2.13 deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` in favour of
``all_gather_single`` / ``reduce_scatter_single``, which 2.11 lacks; the engine and the parallel
compute path keep the old names, so the FutureWarning they raise on 2.13 is silenced here, by
message, for those two calls only. Importing this module installs the filter.

:func:`outer_saved_tensor_hooks` peeks at torch's stack of saved-tensor hooks (a private binding,
kept here): the sharded working copy (``engine/fsdp.py``) installs its own hooks only where no one
else's (activation checkpointing's) own the saved tensors.

:func:`causal_lower_right` builds torch's bottom-right causal bias (a tensor subclass) outside any
active dispatch mode (creating it inside one raises; the memory estimator's ``FakeTensorMode`` and
the benchmark counters are such modes), through a private helper kept here.

:func:`cpu_flash_attention` / :func:`cpu_flash_attention_backward` call the CPU flash-attention
kernel SDPA dispatches to (private aten ops, same signature on 2.11-2.13) for its log-sum-exp, which
the public SDPA does not return (``models/chunk_attention.py``: the cp ring merges its blocks with it);
:func:`cuda_efficient_attention` / :func:`cuda_efficient_attention_backward` do the same with SDPA's
memory-efficient CUDA kernel (never run on a GPU yet).

:func:`process_groups` lists the process groups this process holds (torch keeps no public list):
the test pool restarts ranks that hold too many (each gloo group keeps threads that poll).
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["C10D_DEPRECATION_MESSAGE", "causal_lower_right", "cpu_flash_attention", "cpu_flash_attention_backward",
           "cuda_efficient_attention", "cuda_efficient_attention_backward",
           "cuda_events_time", "outer_saved_tensor_hooks", "process_groups"]

#: The warning-message pattern of the two deprecated collectives (regex, as ``warnings`` wants).
C10D_DEPRECATION_MESSAGE = ".*(all_gather_into_tensor|reduce_scatter_tensor).*deprecated"

warnings.filterwarnings("ignore", message=C10D_DEPRECATION_MESSAGE, category=FutureWarning)


def outer_saved_tensor_hooks() -> bool:
    """True if saved-tensor hooks are active (e.g. inside ``torch.utils.checkpoint``'s forward or
    its recomputation): hooks pushed now would shadow them."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:  # not in this torch: assume none (checked on 2.11-2.13, where it exists)
        return False
    return top(False) is not None


_BIASES: dict[tuple[int, int], object] = {}


def causal_lower_right(seq_len_q: int, seq_len_kv: int) -> object:
    """torch's ``causal_lower_right(seq_len_q, seq_len_kv)`` bias for SDPA (query i sees keys
    ``<= i + seq_len_kv - seq_len_q``), one object per shape, created outside dispatch modes.

    Args:
        seq_len_q: query rows.
        seq_len_kv: key rows (>= ``seq_len_q``).
    """
    key = (seq_len_q, seq_len_kv)
    if key not in _BIASES:
        from torch.nn.attention.bias import causal_lower_right as build
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            _BIASES[key] = build(seq_len_q, seq_len_kv)
        if len(_BIASES) > 256:  # one entry per (chunk, prefix) shape seen: drop the oldest
            del _BIASES[next(iter(_BIASES))]
    return _BIASES[key]


def cpu_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                        mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU flash kernel's ``(out, logsumexp)`` of 4-D ``[1, h, L, d]`` inputs (GQA native).

    Args:
        q, k, v: query, key and value, ``[1, heads, rows, head_dim]`` (k, v may have fewer heads).
        is_causal: top-left causal (square blocks: also bottom-right).
        mask: an additive ``[L, S]`` mask in q's dtype (0 or -inf), or None.
    """
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, attn_mask=mask)
    return out, lse


def cpu_flash_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 out: torch.Tensor, lse: torch.Tensor,
                                 is_causal: bool, mask: torch.Tensor | None = None
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The CPU flash kernel's gradients of q, k, v, given the (merged) output and log-sum-exp.

    Args:
        grad: the output's gradient, ``[1, h, L, d]``.
        q, k, v: as given to :func:`cpu_flash_attention`.
        out, lse: the attention output and log-sum-exp of every key the rows see (not only ``k``'s).
        is_causal, mask: as given to the forward.
    """
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, is_causal, attn_mask=mask)


def cuda_efficient_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                             mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA's memory-efficient CUDA kernel's ``(out, logsumexp [1, h, L])`` (never run on a GPU yet:
    recipes/gpu_check_cp.py part (r) checks it). k / v must have q's head count (no GQA in this kernel).

    Args:
        q, k, v, is_causal, mask: as :func:`cpu_flash_attention`'s.
    """
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, mask, True, 0.0, is_causal)
    return out, lse[..., :q.shape[2]]


def cuda_efficient_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                      out: torch.Tensor, lse: torch.Tensor, is_causal: bool,
                                      mask: torch.Tensor | None = None
                                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`cuda_efficient_attention` from the (merged) output and log-sum-exp (the kernel
    wants its log-sum-exp padded to a multiple of 32 rows; no dropout, so its random state is unused).

    Args:
        grad, q, k, v, out, lse, is_causal, mask: as :func:`cpu_flash_attention_backward`'s.
    """
    rows = lse.shape[-1]
    padded = torch.nn.functional.pad(lse, (0, -rows % 32))
    none = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad, q, k, v, mask, out, padded, none, none, 0.0, [True, True, True, False], is_causal)
    return dq, dk, dv


def cuda_events_time(device: torch.device) -> bool:
    """Whether torch's CUDA events time work on ``device`` (a CUDA device of a CUDA build): the stage
    clock's one device question (``engine/timing.py`` asks it here; the runtime asks none itself).

    Args:
        device: the device the stage runs on.
    """
    return device.type == "cuda" and torch.cuda.is_available()


def process_groups() -> list[object]:
    """Every process group this process holds, the default one included (a private map, kept here)."""
    from torch.distributed import distributed_c10d

    return list(distributed_c10d._world.pg_map)
