"""The attention-kernel registry: ONE record per kernel, read by every part that names a kernel.

A record (:class:`AttentionKernel`) says what the kernel is for (``role``), whether it can run here
(``unavailable``), how it is called (``call``, and ``backward`` for a chunk kernel), what it keeps for
backward (the memory model's terms) and how the cost model prices it (``priced_as``). Readers:

- the model (``Llama.set_attention_backend``, :func:`select_attention_backend`, "auto"): the
  ``documents`` kernels, causal attention over packed documents ``(q, k, v, cu_seqlens, max_seqlen)``;
- the KV ring (``parallel/kv_ring.py``, :func:`chunk_kernel_for`): the ``chunks`` kernels, one query
  chunk over one key chunk that travelled to it, with its log-sum-exp (:mod:`.chunk_attention`);
- the memory model (``planner/cost/memory_model.py``): ``saves_lse``, ``saves_output``, ``quadratic``;
- the cost model's efficiency tables and runtime profiles (``planner/cost``): the ``priced`` records,
  kernel families published systems run (:data:`PRICED_KERNELS`), which ours are priced as.

This module is the one place (with ``group_collectives``) that asks a device type: which kernel runs
on which device is a kernel's own fact. To add a kernel, add its record to :data:`KERNELS`
(docs/extending.md).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from . import chunk_attention as chunks
from . import varlen_kernels as varlen
from .attention import (
    CoreAttention,
    flash_varlen_attention,
    sdpa_attention,
    torch_varlen_attention,
)

__all__ = ["AttentionKernel", "BACKENDS", "KERNELS", "PRICED_KERNELS", "ROLES", "auto_attention",
           "auto_backend_name", "auto_order", "chunk_kernel_for", "default_chunk_kernel", "kernel", "kernel_of",
           "select_attention_backend"]

#: what a record is for: attention over packed documents (the model's core attention), the KV ring's
#: block kernel, or a kernel family the cost model prices (published systems run them; this runtime does not)
ROLES = ("documents", "chunks", "priced")

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_CPU_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16)

Reason = Callable[[torch.device | None, torch.dtype | None, int | None], str | None]


def _runs_anywhere(device: torch.device | None, dtype: torch.dtype | None, window: int | None) -> str | None:
    return None


def _priced_only(device: torch.device | None, dtype: torch.dtype | None, window: int | None) -> str | None:
    return "it is a kernel family the cost model prices; this runtime does not run it"


@dataclass(frozen=True, kw_only=True)
class AttentionKernel:
    """One attention kernel.

    Args:
        name: its name (``attention_backend=``, a hardware profile's efficiency entry, a runtime profile).
        role: one of :data:`ROLES`.
        summary: one line: what it is.
        call: ``documents``: the core attention (``window=`` keyword if it runs a sliding window);
            ``chunks``: the forward over a rank's chunks (:mod:`.chunk_attention`); ``priced``: None.
        backward: ``chunks``: one chunk's backward (``packed``: every chunk's at once); else None.
        unavailable: ``(device, dtype, window) -> reason or None`` (any of them None: not known yet).
        saves_lse: it keeps an fp32 log-sum-exp per head and token for backward (memory model).
        saves_output: ``chunks``: it keeps its own output for backward (the Ulysses hybrid's extra copy).
        quadratic: it keeps each layer's softmax, s x s per head (SDPA's math fallback).
        priced_as: the ``priced`` record whose efficiency entries price it (``priced``: itself).
        priced_by_flops: ``priced``: no efficiency entry; priced by its FLOPs and score bytes.
        chunk_kernel: ``documents``: the chunk kernel the KV ring (a packed one: the KV gather) runs beside it
            (None: by device).
        repeats_kv: it takes no GQA: K / V are repeated to the query heads and kept so (memory model).
        packed: ``chunks``: every chunk in ONE varlen call, K / V ranges packed (``models/varlen_kernels.py``);
            its backward takes all blocks and returns full-size gradients (memory model: the packed copies).
    """

    name: str
    role: str
    summary: str
    call: Callable[..., Any] | None = None
    backward: Callable[..., Any] | None = None
    unavailable: Reason = _runs_anywhere
    saves_lse: bool = True
    saves_output: bool = False
    quadratic: bool = False
    priced_as: str | None = None
    priced_by_flops: bool = False
    chunk_kernel: str | None = None
    repeats_kv: bool = False
    packed: bool = False

    def reason(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
               window: int | None = None) -> str | None:
        """Why it cannot run on ``device`` with ``dtype`` and ``window`` (None: it can).

        Args:
            device: the inputs' device (None: not checked).
            dtype: the inputs' dtype (None: not checked).
            window: the sliding window (None: full causal).
        """
        return self.unavailable(None if device is None else torch.device(device), dtype, window)


@functools.cache
def _flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


@functools.cache
def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a stand-in without a spec
        return False


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _hopper_reason(device: torch.device | None, dtype: torch.dtype | None, majors: tuple[int, ...], module: str,
                   package: str) -> str | None:
    if (reason := _cuda_low_precision(device, dtype)) is not None:
        return reason
    if device is not None and torch.cuda.is_available() and _capability(device)[0] not in majors:
        major, minor = _capability(device)
        return f"it runs on compute capability {[f'sm{m}x' for m in majors]}, not sm{major}{minor}"
    return None if _installed(module) else f"{package} is not installed ({module} not found)"


def _fa3_reason(device: torch.device | None, dtype: torch.dtype | None, window: int | None) -> str | None:
    return _hopper_reason(device, dtype, (9,), "flash_attn_interface", "FlashAttention-3 (flash-attn's hopper/)")


def _fa4_reason(device: torch.device | None, dtype: torch.dtype | None, window: int | None) -> str | None:
    return _hopper_reason(device, dtype, (9, 10, 11), "flash_attn.cute", "flash-attn-4")


#: torch's packed cuDNN attention: its varlen backward sized the dQ accumulator from the head dim before
#: pytorch/pytorch#186142 (2026-06); 2.13 is the first release taken as having the fix
_CUDNN_VARLEN_TORCH = (2, 13)


def _cudnn_varlen_reason(device: torch.device | None, dtype: torch.dtype | None, window: int | None) -> str | None:
    if window is not None:
        return f"cuDNN's packed attention runs no sliding window (got {window})"
    if (reason := _cuda_low_precision(device, dtype)) is not None:
        return reason
    if tuple(int(x) for x in torch.__version__.split(".")[:2]) < _CUDNN_VARLEN_TORCH:
        return f"torch {torch.__version__}: packed cuDNN attention needs torch >= 2.13 (pytorch#186142)"
    if device is not None and torch.cuda.is_available() and _capability(device)[0] < 8:
        return "cuDNN fused attention needs compute capability sm80 or newer"
    return None


def _torch_flash_chunks_reason(device: torch.device | None, dtype: torch.dtype | None,
                               window: int | None) -> str | None:
    if (reason := _torch_varlen_reason(device, dtype, window)) is not None:
        return reason
    from torch.nn.attention.varlen import varlen_attn  # lazy: absent from older torch

    if "window_size" not in inspect.signature(varlen_attn).parameters:
        return f"torch {torch.__version__}'s varlen_attn has no window_size (its causal mask is not bottom-right)"
    return None


@functools.cache
def _torch_varlen_available() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _cuda_low_precision(device: torch.device | None, dtype: torch.dtype | None) -> str | None:
    if device is not None and device.type != "cuda":
        return f"it runs only on CUDA, not on {device.type!r}"
    if dtype is not None and dtype not in _LOW_PRECISION:
        return f"it runs fp16 / bf16 only, not {dtype}"
    return None


def _flash_varlen_reason(device: torch.device | None, dtype: torch.dtype | None, window: int | None) -> str | None:
    if (reason := _cuda_low_precision(device, dtype)) is not None:
        return reason
    return None if _flash_attn_installed() else "flash-attn is not installed (pip install 'lightning-hotspa[gpu]')"


def _torch_varlen_reason(device: torch.device | None, dtype: torch.dtype | None, window: int | None) -> str | None:
    if (reason := _cuda_low_precision(device, dtype)) is not None:
        return reason
    return None if _torch_varlen_available() else f"torch {torch.__version__} has no torch.nn.attention.varlen"


def _cuda_reason(device: torch.device | None, dtype: torch.dtype | None, window: int | None) -> str | None:
    return None if device is None or device.type == "cuda" else f"it runs only on CUDA, not on {device.type!r}"


def _cpu_flash_chunks_reason(device: torch.device | None, dtype: torch.dtype | None,
                             window: int | None) -> str | None:
    if device is not None and device.type != "cpu":
        return f"it calls the CPU flash kernel, not one on {device.type!r}"
    if dtype is not None and dtype not in _CPU_FLASH_DTYPES:
        return f"the CPU flash kernel runs {[str(d) for d in _CPU_FLASH_DTYPES]}, not {dtype}"
    return None


_RECORDS = (
    AttentionKernel(name="flash_varlen", role="documents", call=flash_varlen_attention,
                    unavailable=_flash_varlen_reason, priced_as="fa2", chunk_kernel="sdpa_chunk",
                    summary="flash-attn 2's varlen kernel (CUDA, fp16 / bf16; GQA native)"),
    AttentionKernel(name="torch_varlen", role="documents", call=torch_varlen_attention,
                    unavailable=_torch_varlen_reason, priced_as="fa2", chunk_kernel="sdpa_chunk",
                    summary="torch.nn.attention.varlen.varlen_attn (the flash kernel shipped with torch; CUDA)"),
    AttentionKernel(name="fa4_varlen", role="documents", call=varlen.fa4_varlen_attention,
                    unavailable=_fa4_reason, priced_as="fa4", chunk_kernel="fa4_chunks",
                    summary="FlashAttention-4's varlen kernel (flash-attn-4, CUTE; sm90 / sm100, fp16 / bf16; GQA)"),
    AttentionKernel(name="fa3_varlen", role="documents", call=varlen.fa3_varlen_attention,
                    unavailable=_fa3_reason, priced_as="fa3", chunk_kernel="fa3_chunks",
                    summary="FlashAttention-3's varlen kernel (flash_attn_interface; sm90, fp16 / bf16; GQA)"),
    AttentionKernel(name="cudnn_varlen", role="documents", call=varlen.cudnn_varlen_attention,
                    unavailable=_cudnn_varlen_reason, priced_as="cudnn", chunk_kernel="torch_flash_chunks",
                    repeats_kv=True,
                    summary="cuDNN fused attention, packed (aten._cudnn_attention_forward with cu_seqlens; "
                            "K / V repeated for GQA; no window)"),
    AttentionKernel(name="sdpa", role="documents", call=sdpa_attention, priced_as="fa2",
                    summary="torch SDPA, one causal 4-D call per document (CPU flash kernel; any device)"),
    AttentionKernel(name="cpu_flash_chunks", role="chunks", call=chunks.cpu_block_forward,
                    backward=chunks.cpu_block_backward, unavailable=_cpu_flash_chunks_reason,
                    saves_output=True, priced_as="cpu",
                    summary="the CPU flash kernel per ring block (its log-sum-exp kept); backward from the "
                            "merged output and log-sum-exp"),
    AttentionKernel(name="sdpa_chunk", role="chunks", call=chunks.cuda_block_forward,
                    backward=chunks.cuda_block_backward, unavailable=_cuda_reason, saves_output=True,
                    priced_as="fa2",
                    summary="SDPA's memory-efficient CUDA kernel per ring block (its log-sum-exp kept; k / v "
                            "repeated per block); backward from the merged output and log-sum-exp"),
    AttentionKernel(name="fa3_chunks", role="chunks", call=functools.partial(varlen.packed_chunks_forward, "fa3"),
                    backward=functools.partial(varlen.packed_chunks_backward, "fa3"), unavailable=_fa3_reason,
                    saves_lse=False, packed=True, priced_as="fa3",
                    summary="every chunk in ONE FlashAttention-3 varlen call (keys packed); backward re-runs it"),
    AttentionKernel(name="fa4_chunks", role="chunks", call=functools.partial(varlen.packed_chunks_forward, "fa4"),
                    backward=functools.partial(varlen.packed_chunks_backward, "fa4"), unavailable=_fa4_reason,
                    saves_lse=False, packed=True, priced_as="fa4",
                    summary="every chunk in ONE FlashAttention-4 varlen call (keys packed); backward re-runs it"),
    AttentionKernel(name="torch_flash_chunks", role="chunks",
                    call=functools.partial(varlen.packed_chunks_forward, "torch_flash"),
                    backward=functools.partial(varlen.packed_chunks_backward, "torch_flash"),
                    unavailable=_torch_flash_chunks_reason, saves_lse=False, packed=True, priced_as="fa2",
                    summary="every chunk in ONE torch varlen_attn call (torch's flash kernel; keys packed)"),
    AttentionKernel(name="fa2", role="priced", unavailable=_priced_only, summary="FlashAttention-2"),
    AttentionKernel(name="fa3", role="priced", unavailable=_priced_only, summary="FlashAttention-3 (Hopper)"),
    AttentionKernel(name="fa4", role="priced", unavailable=_priced_only,
                    summary="FlashAttention-4 (CUTE DSL; Hopper / Blackwell)"),
    AttentionKernel(name="cudnn", role="priced", unavailable=_priced_only, summary="cuDNN's fused attention"),
    AttentionKernel(name="flex", role="priced", unavailable=_priced_only, summary="torch FlexAttention"),
    AttentionKernel(name="sdpa-math", role="priced", unavailable=_priced_only, saves_lse=False, quadratic=True,
                    summary="SDPA's math fallback (the s x s scores materialized)"),
    AttentionKernel(name="cpu", role="priced", unavailable=_priced_only, summary="the CPU flash kernel"),
    AttentionKernel(name="unfused", role="priced", unavailable=_priced_only, saves_lse=False, quadratic=True,
                    priced_by_flops=True, summary="plain matmul-softmax-matmul attention"),
)

#: every registered kernel by name
KERNELS: dict[str, AttentionKernel] = {k.name: k for k in _RECORDS}

#: the kernel families a hardware profile may rate and a runtime profile may run (cost model)
PRICED_KERNELS: tuple[str, ...] = tuple(k.name for k in _RECORDS if k.role == "priced")

#: the model's core attentions by name (``attention_backend=``)
BACKENDS: dict[str, CoreAttention] = {k.name: k.call for k in _RECORDS if k.role == "documents"}

#: what "auto" tries, in order (the first that can run the inputs), by CUDA compute capability major: the
#: Hopper-class FlashAttention kernels first where installed (priced above FA2, planner/cost/hardware.py).
#: cuDNN's packed path is opt-in (``attention_backend="cudnn_varlen"``): torch 2.13's own varlen_attn keeps
#: it off (``_should_use_cudnn`` returns False) and no GPU has run it here.
_AUTO_ORDER = ("flash_varlen", "torch_varlen", "sdpa")
_AUTO_BY_MAJOR = {9: ("fa3_varlen", "fa4_varlen", *_AUTO_ORDER), 10: ("fa4_varlen", *_AUTO_ORDER),
                  11: ("fa4_varlen", *_AUTO_ORDER)}
#: the chunk kernels a documents kernel without its own ``chunk_kernel`` tries, in order
_CHUNK_ORDER = ("cpu_flash_chunks", "sdpa_chunk")


def _check_records() -> None:
    for k in _RECORDS:
        if k.role not in ROLES:
            raise ValueError(f"attention kernel {k.name!r}: role must be one of {ROLES}, got {k.role!r}")
        priced = k.name if k.role == "priced" else k.priced_as
        if priced not in KERNELS or KERNELS[priced].role != "priced":
            raise ValueError(f"attention kernel {k.name!r}: priced_as must name a priced kernel, got {priced!r}")
        if k.chunk_kernel is not None and KERNELS.get(k.chunk_kernel, k).role != "chunks":
            raise ValueError(f"attention kernel {k.name!r}: chunk_kernel {k.chunk_kernel!r} is no chunk kernel")
        if k.packed and k.role != "chunks":
            raise ValueError(f"attention kernel {k.name!r}: only a chunk kernel is packed")
        if (k.call is None) != (k.role == "priced") or (k.backward is None) != (k.role != "chunks"):
            raise ValueError(f"attention kernel {k.name!r}: a {k.role} kernel has the wrong calls")


_check_records()


def kernel(name: str, role: str | None = None) -> AttentionKernel:
    """The record named ``name``; a clear error naming the registered ones otherwise.

    Args:
        name: a kernel name.
        role: if given, the record must have this role.
    """
    record = KERNELS.get(name) if isinstance(name, str) else None
    if record is None or (role is not None and record.role != role):
        known = [k for k, r in KERNELS.items() if role is None or r.role == role]
        what = "attention kernel" if role is None else f"{role} attention kernel"
        raise ValueError(f"unknown {what} {name!r}; registered: {known}")
    return record


def auto_order(device: torch.device | str) -> tuple[str, ...]:
    """The ``documents`` kernels "auto" tries on ``device``, in order (by its compute capability).

    Args:
        device: the inputs' device.
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return _AUTO_ORDER
    return _AUTO_BY_MAJOR.get(_capability(device)[0], _AUTO_ORDER)


def auto_backend_name(device: torch.device | str, dtype: torch.dtype, window: int | None = None) -> str:
    """The backend "auto" uses for inputs on ``device`` with ``dtype`` (and a sliding ``window``).

    Args:
        device: the inputs' device.
        dtype: the inputs' dtype.
        window: the model's sliding window (None: full causal).
    """
    return next(n for n in auto_order(device) if KERNELS[n].reason(device, dtype, window) is None)


def auto_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                   window: int | None = None) -> Tensor:
    """Pick the backend per call from the inputs' device and dtype (the model's default)."""
    fn = BACKENDS[auto_backend_name(q.device, q.dtype, window)]
    return fn(q, k, v, cu_seqlens, max_seqlen) if window is None else fn(q, k, v, cu_seqlens, max_seqlen,
                                                                         window=window)


def select_attention_backend(name: str = "auto", device: torch.device | str | None = None) -> CoreAttention:
    """The core-attention callable for ``name``.

    "auto" returns :func:`auto_attention`, which decides per call (so it stays right when the
    model moves between devices or precisions). A named backend is checked against ``device``
    when one is given, and against what is installed.

    Args:
        name: "auto" or a ``documents`` kernel of :data:`KERNELS`.
        device: the device it will run on (None: not checked).
    """
    if name == "auto":
        return auto_attention
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {['auto', *BACKENDS]}")
    reason = KERNELS[name].reason(device)
    if reason is not None:
        raise ValueError(f"attention backend {name!r} is unavailable: {reason}")
    return BACKENDS[name]


def kernel_of(core: object) -> AttentionKernel | None:
    """The ``documents`` record of a core attention (a window bound with ``functools.partial`` unwrapped;
    a stand-in names the kernel it stands in for in its ``attention_kernel`` attribute); None for
    "auto" and for callables the registry does not know.

    Args:
        core: a core-attention callable.
    """
    while isinstance(core, functools.partial):
        core = core.func
    named = getattr(core, "attention_kernel", None)
    if isinstance(named, str):
        return kernel(named, "documents")
    return next((k for k in _RECORDS if k.role == "documents" and k.call is core), None)


def default_chunk_kernel(device: torch.device | str, dtype: torch.dtype | None = None,
                         window: int | None = None) -> str:
    """The chunk kernel that runs on ``device`` when the documents kernel names none.

    Args:
        device: the inputs' device (or a device type, as a hardware profile names it).
        dtype: the inputs' dtype (None: not checked).
        window: the sliding window (None: full causal).
    """
    for name in _CHUNK_ORDER:
        if KERNELS[name].reason(device, dtype, window) is None:
            return name
    reasons = {n: KERNELS[n].reason(device, dtype, window) for n in _CHUNK_ORDER}
    raise ValueError(f"no chunk kernel runs on {device!r} with {dtype}: {reasons}")


def chunk_kernel_for(core: object, q: Tensor, window: int | None) -> AttentionKernel:
    """The chunk kernel the KV ring runs for the model's core attention ``core`` on ``q``'s inputs.

    Args:
        core: the model's core attention (a registered one, "auto", or a stand-in).
        q: the query rows (their device and dtype).
        window: the model's sliding window (None: full causal).
    """
    record = kernel_of(core)
    if record is None:  # "auto" or an unknown callable: what auto runs on these inputs
        record = KERNELS[auto_backend_name(q.device, q.dtype, window)]
    name = record.chunk_kernel or default_chunk_kernel(q.device, q.dtype, window)
    return KERNELS[name]
