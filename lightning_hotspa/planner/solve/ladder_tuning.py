"""The cp ladder's tuning constants (:mod:`.ladder`), in one place, each with where its value came from.

Every value here changes plans: a change is a planner change (rerun the long grid,
``hotspa simulate --grid long --breakdown --json``, and record it in a dated note under benchmarks/).
"""

from __future__ import annotations

__all__ = ["BISECT_HALVINGS", "BRACKET_GROWTH", "BRACKET_MOST", "HEAD_MOST", "REPRICED", "REPRICED_TRIES",
           "ROUNDS", "ROUND_HEAD_LEAST_WORK", "ROUND_HEAD_SHARE", "T_TRIES"]

#: step-time multiples of the smallest tiling ``T`` that are priced exactly (larger ``T``: fewer,
#: cheaper-rate blocks). Evidence: benchmarks/2026-12-06-ladder-4.md, "Step-time tries `_T_TRIES`"
#: (1.0 / 1.2 won on the grid's seeds and lost on held-out ones; 1.0 / 1.1 / 1.2 / 1.3 gained a
#: little at +15 % planner time at 1024 ranks) and benchmarks/2026-12-04-ladder-3.md (dropping 1.25
#: lost H200 8B github at margin 0).
T_TRIES = (1.0, 1.1, 1.25)

#: halvings of the step-time bracket in :meth:`~.ladder.LadderPlanner._bisect` (2^-14: the step time
#: to about 6e-5 of the bracket). Hand-tuned, no evidence recorded.
BISECT_HALVINGS = 14
#: the bisection's upper bracket grows by this factor until an allocation tiles the world, and gives
#: up past ``BRACKET_MOST`` times the lower bound. Hand-tuned, no evidence recorded.
BRACKET_GROWTH = 1.5
BRACKET_MOST = 1e4

#: the most documents a ladder's head may hold (:meth:`~.ladder_head.LadderHeads.head_size`,
#: :meth:`~.ladder_head.LadderHeads.round_size`). Introduced in benchmarks/2026-12-04-ladder-2.md
#: (item 1, "the k <= 32 longest documents"); the value itself is hand-tuned, no comparison recorded.
HEAD_MOST = 32

#: :meth:`~.ladder_head.LadderHeads.round_size`: the documents of a round head each take at least
#: this share of the longest one's time on its world-sized entry, and there is a round head only
#: when the longest takes at least ``ROUND_HEAD_LEAST_WORK`` of the step's least work (rank-seconds
#: / world). Evidence: benchmarks/2026-12-06-ladder-4.md ("What changed" item 1, and the "round head
#: alone (kept)" row); the two values themselves were not swept.
ROUND_HEAD_SHARE = 0.5
ROUND_HEAD_LEAST_WORK = 0.25

#: (round_up, carry): a class keeps a dp group its work fills to 1 - round_up (the rest: spare
#: ranks, given by load), with or without the wider classes' idle time carried to it
#: (:meth:`~.ladder.LadderPlanner._allocate`); both are tried (the carry fills a long document's
#: wide block, but sometimes leaves the narrower classes too few groups). Evidence:
#: benchmarks/2026-12-04-ladder-2.md (the carry replacing the uncarried pass lost H200 13B github
#: and H100 70B github under the guard; the first ladder's second pass, round_up 0.25 without the
#: carry, gave way to the carry's pass to keep the planner's time).
ROUNDS = ((0.5, True), (0.5, False))

#: per rounding of ``ROUNDS``, its re-pricing passes (:meth:`~.ladder.LadderPlanner._repriced`), each
#: from the previous pass's allocation, and per pass its ladders: as allocated (False) and with its
#: small sharded blocks merged (True, :meth:`~.ladder.LadderPlanner._widen`), at its step time only
#: (``REPRICED_TRIES``). The carry's rounding gets two passes, the other one pass of one ladder.
#: Evidence: benchmarks/2026-12-04-ladder-3.md, "Tried and left out" (on the long cells, more
#: passes, more ladders per pass or 1.1 / 1.25 of the step time gained nothing more, and fewer lost;
#: the kept layout is the cheapest in planner time with the full figures).
REPRICED: dict[tuple[float, bool], tuple[tuple[bool, ...], ...]] = {(0.5, True): ((False, True), (False,)),
                                                                    (0.5, False): ((False,),)}
REPRICED_TRIES = (1.0,)
