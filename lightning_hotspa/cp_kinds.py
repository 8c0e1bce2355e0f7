"""The context-parallel kinds: ONE record per kind, read by every part that names, offers or prices one.

A layout's ``cp`` ranks split in two (``Layout.cp_kv``): a Ulysses part, the ``cp // cp_kv`` most local
ranks, which scatters heads by all-to-all (``parallel/ulysses.py``), and a gather part, ``cp_kv`` groups
of them, which passes K and V around a ring (``parallel/kv_ring.py``). A kind (:class:`CpKind`) is one way of
choosing that split: Ulysses (``cp_kv == 1``), the KV ring (``cp_kv == cp``), the hybrid (in between).
Readers:

- ``layout.py``: the name suffix (``Layout.parse`` / ``Layout.name``: ``pattern``, ``cp_kv_of``,
  ``suffix_of``) and ``Layout.cp_kind`` (``holds``);
- ``planner/candidates.py``: which kinds ``layouts="auto"`` offers (``offer``);
- ``planner/cost/cost_model.py``: the collectives a kind issues per layer (``exchanges``, data);
- ``planner/cost/cp_memory.py`` (what it saves, its transients) and ``parallel/core_attention.py``
  (its attention call): bound per kind name there, on their own floors, and checked against
  :data:`CP_KINDS` at import (:func:`check_bound`).

Pure arithmetic on ints and a :class:`~lightning_hotspa.model_shape.ModelShape`: no torch, no process
groups. To add a kind, add its record to ``_RECORDS`` (docs/extending.md).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

__all__ = ["CP_KINDS", "CP_SUFFIX", "CpKind", "Exchange", "check_bound", "kind_of", "parse_suffix"]


@dataclass(frozen=True, kw_only=True)
class Exchange:
    """One collective a cp kind issues in every layer, as the cost model prices it.

    Args:
        what: what it moves (for docs and messages).
        ranks: the group's size (the Ulysses part or the gather part of cp).
        span: consecutive devices the group lies within (tp x its part and the parts inside it).
        stride: the group holds every ``stride``-th of them (the ranks more local than it).
        width: elements per token it moves, at full width (priced ``/ tp * param_bytes / cp``).
        steps: ring steps per element moved (``ranks - 1``).
        per: what ``steps`` is divided by (``ranks`` for an all-to-all, 1 for a gather).
        rounds: rounds per layer without checkpointing (forward and backward).
        recompute_rounds: more rounds when checkpointing recomputes the forward.
        calls: launches per round (each pays the group's latency).
        recomputes_attention: a runtime that gathers it without saving it re-runs the attention forward in
            backward (priced when the runtime profile says so, ``RuntimeProfile.kv_gather_recomputes_attention``).
        ring: it can travel as a ring, each of its ``steps`` posted before a ring step's attention and
            waited after it (priced hidden behind attention when the runtime says so,
            ``RuntimeProfile.cp_comm_overlap``; otherwise ``calls`` is per step).
        tail: ring steps per layer after the last kernel (never hidden; the backward's last dK / dV shift).
    """

    what: str
    ranks: int
    span: int
    stride: int
    width: int
    steps: int
    per: int
    rounds: int
    recompute_rounds: int
    calls: int
    recomputes_attention: bool = False
    ring: bool = False
    tail: int = 0


def _kv_heads_per_tp_rank(shape: Any, tp: int) -> int:
    """The kv heads a tp rank's attention holds: ``n_kv_heads / tp``, or the one its q heads use when tp exceeds
    them (``models/tp_plan.py``'s ``replicated_partial`` KV projections)."""
    return shape.n_kv_heads // tp if shape.n_kv_heads % tp == 0 else 1


def _all_to_all(shape: Any, tp: int, cp: int, cp_kv: int) -> Exchange:
    """The Ulysses part's all-to-alls: fused q / k / v and the output, each its ``1 / tp`` head slice. K / V
    travel as ``parallel/ulysses.py``'s ``exchange_qkv`` sends them: a tp rank's kv heads repeated until ``u``
    divides them (``lcm(kv heads per tp rank, u)``), so with fewer kv heads per tp rank than ``u`` the exchange
    carries ``u / gcd`` times their bytes (the output: q's heads)."""
    u = cp // cp_kv
    heads = _kv_heads_per_tp_rank(shape, tp)
    sent_kv = math.lcm(heads, u) if u > 1 else heads  # per tp rank, after the repeat
    width = 2 * shape.n_heads * shape.head_dim + 2 * tp * sent_kv * shape.head_dim
    return Exchange(what="all-to-all of q / k / v and of the output", ranks=u, span=tp * u, stride=tp,
                    width=width, steps=u - 1, per=u, rounds=2, recompute_rounds=1, calls=2)


def _kv_gather(shape: Any, tp: int, cp: int, cp_kv: int) -> Exchange:
    """The gather part's K / V around the ring forward, K / V and dK / dV around it again backward (the bytes
    of an all-gather forward, a re-gather and a dK / dV reduce-scatter backward, plus the last dK / dV
    shift, ``tail``; ``parallel/kv_ring.py``). Its rows are the kv heads a rank holds after the Ulysses
    part, which repeats them until it divides them (``u`` of them for one kv head per tp rank)."""
    u = cp // cp_kv
    heads = _kv_heads_per_tp_rank(shape, tp)
    after = heads * (u // math.gcd(heads, u)) // u  # per rank, after the Ulysses exchange
    return Exchange(what="ring of K / V (of K / V and dK / dV in backward)", ranks=cp_kv,
                    span=tp * cp, stride=tp * u, width=2 * tp * u * after * shape.head_dim,
                    steps=cp_kv - 1, per=1, rounds=3, recompute_rounds=1, calls=1, recomputes_attention=True,
                    ring=True, tail=1)


def _ulysses_exchanges(shape: Any, tp: int, cp: int, cp_kv: int) -> tuple[Exchange, ...]:
    return (_all_to_all(shape, tp, cp, cp_kv),) if cp > 1 else ()


def _kv_exchanges(shape: Any, tp: int, cp: int, cp_kv: int) -> tuple[Exchange, ...]:
    return (_kv_gather(shape, tp, cp, cp_kv),)


def _hybrid_exchanges(shape: Any, tp: int, cp: int, cp_kv: int) -> tuple[Exchange, ...]:
    return _all_to_all(shape, tp, cp, cp_kv), _kv_gather(shape, tp, cp, cp_kv)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _offer_hybrid(tp: int, cp: int, devices_per_node: int) -> int | None:
    """When tp x cp crosses a node: the ``cp_kv`` whose Ulysses part is the largest that stays in it."""
    inside = [u for u in _divisors(cp) if 1 < u < cp and tp * u <= devices_per_node]
    return cp // max(inside) if tp * cp > devices_per_node and inside else None


@dataclass(frozen=True, kw_only=True)
class CpKind:
    """One kind of context parallelism.

    Args:
        name: its name (``Layout.cp_kind``; the key its attention call and memory terms are bound by).
        summary: one line: what it is.
        suffix: how a layout name writes it, for docs (``""``, ``":kv"``, ``":kv<m>"``).
        holds: ``(cp, cp_kv) -> bool``: a layout with these degrees is of this kind (exactly one
            kind holds each pair, also one a layout is about to reject, so its message can name it).
        pattern: the regex of its name suffix (None: it has none, the default kind).
        cp_kv_of: ``(cp, digits) -> cp_kv`` of a name whose suffix matched ``pattern`` (``digits``: the
            number written in it, or None).
        suffix_of: ``(cp, cp_kv) -> str``: its suffix in a layout's name.
        scatters_heads: its Ulysses part scatters heads (``cp // cp_kv`` must divide the query heads a
            tp rank holds).
        gathers_kv: it moves K / V over its gather part (around a ring).
        offer: ``(tp, cp, devices_per_node) -> cp_kv or None``: the ``cp_kv`` ``layouts="auto"``
            offers for a tp x cp group (None: not offered).
        exchanges: ``(shape, tp, cp, cp_kv) -> tuple[Exchange, ...]``: the collectives it issues per
            layer (the cost model's terms).
    """

    name: str
    summary: str
    suffix: str
    holds: Callable[[int, int], bool]
    pattern: str | None
    cp_kv_of: Callable[[int, str | None], int]
    suffix_of: Callable[[int, int], str]
    scatters_heads: bool
    gathers_kv: bool
    offer: Callable[[int, int, int], int | None]
    exchanges: Callable[[Any, int, int, int], tuple[Exchange, ...]]


_RECORDS = (
    CpKind(name="ulysses", suffix="", summary="Ulysses: an all-to-all scatters heads over all cp ranks "
           "(cp must divide the query heads a tp rank holds)",
           holds=lambda cp, kv: kv == 1, pattern=None, cp_kv_of=lambda cp, digits: 1,
           suffix_of=lambda cp, kv: "", scatters_heads=True, gathers_kv=False,
           offer=lambda tp, cp, n: 1, exchanges=_ulysses_exchanges),
    CpKind(name="kv", suffix=":kv", summary="KV ring: queries stay, K / V travel around all cp ranks "
           "(splits no heads)",
           holds=lambda cp, kv: kv == cp != 1, pattern=r":kv", cp_kv_of=lambda cp, digits: cp,
           suffix_of=lambda cp, kv: ":kv", scatters_heads=False, gathers_kv=True,
           offer=lambda tp, cp, n: cp if cp > 1 else None, exchanges=_kv_exchanges),
    CpKind(name="hybrid", suffix=":kv<m>", summary="Ulysses over the cp / m most local cp ranks (inside a "
           "node), the KV ring over m groups of them",
           holds=lambda cp, kv: kv not in (1, cp), pattern=r":kv(\d+)", cp_kv_of=lambda cp, digits: int(digits),
           suffix_of=lambda cp, kv: f":kv{kv}", scatters_heads=True, gathers_kv=True,
           offer=_offer_hybrid, exchanges=_hybrid_exchanges),
)

#: every registered kind by name, in the order candidates offer them
CP_KINDS: dict[str, CpKind] = {k.name: k for k in _RECORDS}

#: the regex of any kind's name suffix (``Layout.parse``'s grammar)
CP_SUFFIX = "|".join(f"(?:{k.pattern})" for k in _RECORDS if k.pattern is not None)


def kind_of(cp: int, cp_kv: int) -> CpKind:
    """The kind a layout with ``cp`` ranks, ``cp_kv`` of them in its gather part, is of.

    Args:
        cp: the context-parallel degree.
        cp_kv: its gather part (a divisor of ``cp``).
    """
    held = [k for k in _RECORDS if k.holds(cp, cp_kv)]
    if len(held) != 1:
        raise ValueError(f"cp={cp!r}, cp_kv={cp_kv!r}: expected exactly one registered cp kind, "
                         f"{[k.name for k in held]} hold it")
    return held[0]


def parse_suffix(suffix: str, cp: int) -> int:
    """The ``cp_kv`` a layout name's cp-kind suffix (a match of :data:`CP_SUFFIX`) gives ``cp`` ranks.

    Args:
        suffix: the suffix as written (lower case), e.g. ``":kv"`` or ``":kv2"``.
        cp: the layout's cp degree.
    """
    for k in _RECORDS:
        match = re.fullmatch(k.pattern, suffix) if k.pattern is not None else None
        if match is not None:
            return k.cp_kv_of(cp, match.group(1) if match.groups() else None)
    raise ValueError(f"{suffix!r} is no cp-kind suffix; registered: {[k.suffix for k in _RECORDS if k.suffix]}")


def check_bound(bound: Collection[str], what: str) -> None:
    """Raises unless ``bound`` names every registered kind once and nothing else.

    Args:
        bound: the kind names an implementation binds (a dict's keys).
        what: what is bound, for the message (e.g. "parallel/core_attention.py's attention calls").
    """
    missing, extra = sorted(set(CP_KINDS) - set(bound)), sorted(set(bound) - set(CP_KINDS))
    if missing or extra:
        raise ValueError(f"{what}: every registered cp kind needs exactly one; missing {missing}, "
                         f"not registered {extra}")


def _check_records() -> None:
    """Each (cp, cp_kv) is of one kind, its name suffix reads back as the same cp_kv, and its flags
    say what its split holds (a Ulysses part > 1 scatters heads, a gather part > 1 gathers K / V)."""
    for cp in range(1, 65):
        for cp_kv in _divisors(cp):
            record = kind_of(cp, cp_kv)
            written = record.suffix_of(cp, cp_kv)
            if (written == "") != (record.pattern is None) or (written and parse_suffix(written, cp) != cp_kv):
                raise ValueError(f"cp kind {record.name!r}: its suffix {written!r} for cp={cp}, cp_kv={cp_kv} "
                                 f"does not read back through its pattern {record.pattern!r}")
            if cp > 1 and (record.scatters_heads != (cp // cp_kv > 1) or record.gathers_kv != (cp_kv > 1)):
                raise ValueError(f"cp kind {record.name!r}: scatters_heads / gathers_kv disagree with its "
                                 f"split of cp={cp} (Ulysses part {cp // cp_kv}, gather part {cp_kv})")


_check_records()
