"""HotSPaDataModule: every Lightning batch is this rank's slice of one optimizer step's plan.

Per step (docs/DESIGN.md §3): :class:`MiniBatchSampler` draws the global mini-batch (a token
budget) -> ``planner.plan`` assigns, packs and balances it -> :func:`slice_plan` cuts out this
rank's micro-batches. Every rank (and every loader worker) computes the same global plan from
(data, seed, step) alone, with no communication.

**A fixed number of plans per epoch.** Lightning reads ``len(train_dataloader)`` once, but the
number of token-budget mini-batches in one pass over the data changes a little with each pass's
shuffle. So a Lightning epoch is a fixed window of ``batches_per_epoch`` consecutive mini-batches
(default: the number in data pass 0) over the endless stream "pass 0, pass 1, ...", each pass
composed exactly as :class:`MiniBatchSampler` composes it. Nothing is dropped or repeated: a pass
with more mini-batches than an epoch simply continues into the next epoch, and epoch ``e`` step ``s``
is stream position ``e * batches_per_epoch + s``. Validation and prediction always use data pass 0.

**Samplers.** Plans are already per rank, so Lightning must not shard them again. When Lightning
re-creates the loader with a sampler of its own (its default ``DistributedSampler``, prediction's
index tracking) the loader keeps its own, silently; it warns only about a sampler the user set.

**Resume (Lightning 2.6).** The fit loop saves ``state_dict()`` of every training loader that has
``state_dict``/``load_state_dict`` (``_Stateful``, ``CombinedLoader._state_dicts``) and, when
restarting, loads it in ``FitLoop.setup_data`` right after ``train_dataloader()`` and before the
first ``iter``; it then lets the loop count on from the saved batch index (``fetched +=
batch_progress.current.ready``), so the loader must yield only the rest of the epoch while
``len()`` stays the full epoch. The DataModule's own ``state_dict`` is saved too and loaded after
``setup`` (also when Lightning does not restart the loader, e.g. after a finished epoch). Both
hold one position: the next (epoch, step) to hand out, advanced when a plan leaves the loader (not
when workers prefetch); a finished epoch rolls over on the next ``iter``. Lightning's
``set_epoch`` is ignored on purpose (see :meth:`_StepSampler.set_epoch`): the data is a pure
function of how many plans were consumed, so Lightning's epoch bookkeeping quirks, and
``limit_train_batches``, never skip or repeat mini-batches. The real iterator starts lazily on the
first ``next``. Positions do not depend on the world size or layouts: a run can resume on another
number of ranks and sees the same remaining mini-batches.
"""

from __future__ import annotations

import bisect
import dataclasses
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import lightning as L
import numpy as np
from torch.utils.data import Dataset

from ..checks import check_int, is_int
from ..layout import MeshShape
from ..plan import RankPlan, StepPlan, slice_plan
from ..planner.base import Planner, ProfiledPlanner, balance_cost, check_planner, is_profiled
from ..planner.plan_stats import plan_stats
from .cache import TokenizedCorpus
from .chat import check_chat_pairing
from .context import PlanningContext, PlanningProvider
from .errors import DataError
from .loader import STATE_FORMAT, PlanDataLoader, _Cursor, _identity, _load_position, pin_rank_plan
from .minibatches import ChunkRef, LongDocPolicy, MiniBatchSampler, chunk_tokens
from .sources import DocumentSource, build_source
from .tokenizer import Tokenizer, build_tokenizer

__all__ = ["HotSPaDataModule", "PlanDataLoader", "StepPlanDataset", "pin_rank_plan"]

_VAL_SPLIT_STREAM = 0x5EED  # second word of the val split's RNG seed: apart from any shuffle


class _PassIndex:
    """Maps a position in the endless stream of mini-batches to (data pass, step in that pass)."""

    def __init__(self, sampler: MiniBatchSampler) -> None:
        self._sampler = sampler
        self._starts = [0]  # stream position of each pass's first mini-batch, grown on demand

    def locate(self, position: int) -> tuple[int, int]:
        while self._starts[-1] <= position:
            self._starts.append(self._starts[-1] + self._sampler.num_batches(len(self._starts) - 1))
        p = bisect.bisect_right(self._starts, position) - 1
        return p, position - self._starts[p]


class _ChunkTokens(Sequence[np.ndarray]):
    """The mini-batch's chunks, read from the (memory-mapped) corpus only when a rank needs them."""

    def __init__(self, corpus: TokenizedCorpus, refs: Sequence[ChunkRef]) -> None:
        self._corpus, self._refs = corpus, refs

    def __len__(self) -> int:
        return len(self._refs)

    def __getitem__(self, i: int) -> np.ndarray:  # type: ignore[override]
        return chunk_tokens(self._corpus, self._refs[i])


class StepPlanDataset(Dataset[RankPlan]):
    """Item ``(epoch, step)`` (or ``step`` of the cursor's epoch) is this rank's plan of that step.

    Picklable for spawned workers: a cached corpus travels as its path, the rest is plain data.
    """

    def __init__(
        self,
        *,
        split: str,
        corpus: TokenizedCorpus,
        doc_index: np.ndarray,
        sampler: MiniBatchSampler,
        planner: Planner,
        mesh_shape: MeshShape,
        rank: int,
        batches_per_epoch: int,
        endless: bool,
        cursor: _Cursor | None = None,
        prompt_offset: int | None = None,
    ) -> None:
        self.split, self.corpus, self.doc_index, self.sampler = split, corpus, doc_index, sampler
        self.prompt_offset = prompt_offset  # chat data: prompt ids stored + offset (data/chat.py)
        self.planner, self.mesh_shape, self.rank = planner, mesh_shape, rank
        self.batches_per_epoch, self.endless = batches_per_epoch, endless
        self.cursor = cursor if cursor is not None else _Cursor()
        self._passes = _PassIndex(sampler)

    def __len__(self) -> int:
        return self.batches_per_epoch

    def locate(self, epoch: int, step: int) -> tuple[int, int, int]:
        """(stream position, data pass, step in that pass) of epoch ``epoch`` step ``step``."""
        if not 0 <= step < self.batches_per_epoch or epoch < 0:
            raise IndexError(f"{self.split} step {step} of epoch {epoch} is outside "
                             f"[0, {self.batches_per_epoch})")
        if not self.endless:
            return step, 0, step
        position = epoch * self.batches_per_epoch + step
        return (position, *self._passes.locate(position))

    def minibatch(self, epoch: int, step: int) -> list[ChunkRef]:
        """The global mini-batch of (epoch, step), with document indices into the corpus."""
        _, data_pass, pass_step = self.locate(epoch, step)
        return [ChunkRef(int(self.doc_index[r.doc]), r.start, r.length)
                for r in self.sampler.batch(data_pass, pass_step)]

    def global_plan(self, epoch: int, step: int) -> tuple[StepPlan, list[ChunkRef]]:
        """The plan every rank computes for (epoch, step), and the chunks its documents are.

        A profiled planner (its coefficients change during training) plans training step ``s`` with
        the version decided at step ``s - plan_lag`` (waiting for it in a loader worker), whatever
        process and however far ahead the plan is built; validation and prediction plans use its
        newest version, the same on every rank since they are built while training is paused
        (planner/profiled/schedule.py)."""
        position = self.locate(epoch, step)[0]
        refs = self.minibatch(epoch, step)
        lengths = [r.length for r in refs]
        return self.planner.plan(position, lengths, latest=self.split != "train" and is_profiled(self.planner)), refs

    def __getitem__(self, index: int | tuple[int, int]) -> RankPlan:
        epoch, step = index if isinstance(index, tuple) else (self.cursor.epoch, index)
        position, data_pass, pass_step = self.locate(int(epoch), int(step))
        plan, refs = self.global_plan(int(epoch), int(step))
        rank_plan = slice_plan(plan, _ChunkTokens(self.corpus, refs), self.mesh_shape, self.rank, self.planner.capacity)
        if self.prompt_offset is not None:  # loss on response tokens only
            from .chat import apply_prompt_mask

            rank_plan = apply_prompt_mask(rank_plan, _ChunkTokens(self.corpus, refs), self.prompt_offset)
        stats = plan_stats(plan, self.planner.capacity, balance_cost(self.planner))
        extras = {
            "split": self.split,
            "epoch": int(epoch),
            "step": int(step),
            "stream_step": position,
            "data_pass": data_pass,
            "pass_step": pass_step,
            "num_docs": len(refs),
            "num_tokens": plan.num_tokens,
            "rank": self.rank,
            "global_plan": plan,  # the plan every rank ran (the monitor's FLOPs and predictions)
            "planner": dict(plan.notes),  # e.g. the never-worse-than-static guard's decision
            **stats.as_dict(),
        }
        if is_profiled(self.planner):  # which coefficients planned it, and what it planned
            extras["planner_version"] = int(self.planner.last_version)  # type: ignore[attr-defined]
            extras["plan_digest"] = zlib.crc32(repr([(s.layout.name, s.activation_checkpointing, s.micro_batches)
                                                     for s in plan.stages]).encode())
        return dataclasses.replace(rank_plan, extras=extras)


def _no_validation() -> list:
    """``val_dataloader`` without held-out documents: none. It reads as the base method to Lightning
    (``__wrapped__``), which then skips validation instead of warning about an empty loader."""
    return []


_no_validation.__wrapped__ = L.LightningDataModule.val_dataloader  # type: ignore[attr-defined]


class HotSPaDataModule(L.LightningDataModule):
    """Token-budget mini-batches as per-rank step plans, resumable at any world size.

    Inside a Trainer, ``setup`` and the ``*_dataloader`` hooks plan with the strategy's
    :class:`~.context.PlanningContext` (``strategy.planning_context()``: the planner, the mesh
    shape whose layouts include the planner's, this rank). The ``planner=``, ``mesh_shape=`` and
    ``rank=`` arguments are used only where no such strategy is present (outside a Trainer, tests).
    Meant for ``use_distributed_sampler=False`` (the HotSPa strategy forces it); a sampler that
    Lightning injects anyway is ignored with a warning. Training resumes from either this module's
    ``state_dict`` or the train loader's (Lightning saves both; they agree).
    """

    def __init__(
        self,
        source: str | DocumentSource | TokenizedCorpus = "stdlib",
        source_kwargs: Mapping[str, Any] | None = None,
        tokenizer: str | Tokenizer = "byte",
        tokenizer_kwargs: Mapping[str, Any] | None = None,
        *,
        tokens_per_batch: int = 262_144,
        context_length: int = 16_384,
        seed: int = 0,
        long_doc_policy: LongDocPolicy = "split",
        val_fraction: float = 0.0,
        test_fraction: float = 0.0,
        val_seed: int = 0,
        val_tokens_per_batch: int | None = None,
        batches_per_epoch: int | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        multiprocessing_context: str | None = None,
        cache_dir: str | None = None,
        use_cache: bool = True,
        planner: Planner | None = None,
        mesh_shape: MeshShape | None = None,
        rank: int | None = None,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        if isinstance(source, TokenizedCorpus):
            self._corpus: TokenizedCorpus | None = source
            self._source: DocumentSource | None = None
        else:
            self._corpus = None
            self._source = source if isinstance(source, DocumentSource) else build_source(
                source, **dict(source_kwargs or {}))
        self._tokenizer = tokenizer if isinstance(tokenizer, Tokenizer) else build_tokenizer(
            tokenizer, **dict(tokenizer_kwargs or {}))
        check_chat_pairing(self._source, self._tokenizer, name)
        for key, value in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and 0.0 <= value < 1.0):
                raise DataError(f"{name}: {key} must be in [0, 1), got {value!r}")
        if val_fraction + test_fraction >= 1.0:
            raise DataError(f"{name}: val_fraction + test_fraction must be below 1 (some documents must be left "
                            f"to train on), got {val_fraction} + {test_fraction}")
        check_int(num_workers, f"{name}: num_workers", minimum=0, hint=" (0: load in the training process)",
                  error=DataError)
        if batches_per_epoch is not None:
            check_int(batches_per_epoch, f"{name}: batches_per_epoch", hint=" or None", error=DataError)
        self.tokens_per_batch, self.context_length = tokens_per_batch, context_length
        self.seed, self.long_doc_policy = seed, long_doc_policy
        self.val_fraction, self.val_seed = float(val_fraction), val_seed
        self.test_fraction = float(test_fraction)
        self.val_tokens_per_batch = val_tokens_per_batch
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.persistent_workers, self.multiprocessing_context = persistent_workers, multiprocessing_context
        self.cache_dir, self.use_cache = cache_dir, use_cache
        self._requested_batches_per_epoch = batches_per_epoch
        self._planner, self._mesh_shape, self._rank = planner, mesh_shape, rank
        self._cursor = _Cursor()
        self._pending_state: dict[str, Any] | None = None
        self._train_sampler: MiniBatchSampler | None = None
        self._val_sampler: MiniBatchSampler | None = None
        self._test_sampler: MiniBatchSampler | None = None
        self._train_ids = self._val_ids = self._test_ids = np.zeros(0, dtype=np.int64)
        self.batches_per_epoch: int | None = None

    # -- data ------------------------------------------------------------------------------
    def prepare_data(self) -> None:
        """Tokenize into the on-disk cache once per node (Lightning calls this on one process)."""
        if self._corpus is None and self.use_cache:
            TokenizedCorpus.build(self._source, self._tokenizer, self.cache_dir)

    def setup(self, stage: str | None = None) -> None:
        """Open the cached corpus, split off validation documents, build the mini-batch samplers."""
        if self._corpus is None:
            self._corpus = TokenizedCorpus.build(self._source, self._tokenizer, self.cache_dir,
                                                 use_cache=self.use_cache)
        self._check_vocabulary()
        if self._train_sampler is None:
            self._build_samplers(self._corpus)
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self.load_state_dict(state)
        if self._context() is not None:
            self._planning()  # fail early on a misconfigured strategy

    def _check_vocabulary(self) -> None:
        """The tokenizer's largest id must be a row of the Trainer's model (``config.vocab_size``),
        and ``context_length`` within the model's ``max_seq_len``."""
        module = getattr(getattr(self, "trainer", None), "lightning_module", None)
        model_vocab = getattr(getattr(module, "config", None), "vocab_size", None)
        max_seq_len = getattr(getattr(module, "config", None), "max_seq_len", None)
        if isinstance(max_seq_len, int) and isinstance(self.context_length, int) and self.context_length > max_seq_len:
            raise DataError(f"{type(self).__name__}: context_length={self.context_length} is longer than the model's "
                            f"max_seq_len={max_seq_len} (positions past it were never trained or are out of the "
                            f"model's RoPE range); lower context_length or use a model config with a longer "
                            f"max_seq_len")
        if self._source is not None and isinstance(model_vocab, int):
            from ..models.vocab import check_tokenizer_fits

            ids = getattr(self._tokenizer, "token_vocab_size", self._tokenizer.vocab_size)  # chat: see chat.py
            check_tokenizer_fits(ids, model_vocab, f"{type(self).__name__}: ")

    def _build_samplers(self, corpus: TokenizedCorpus) -> None:
        n = len(corpus)
        if n == 0:
            raise DataError(f"{type(self).__name__}: the corpus has no documents ({corpus!r})")
        k = int(round(self.val_fraction * n))
        if self.val_fraction > 0:
            k = max(1, k)
            if k >= n:
                raise DataError(f"val_fraction={self.val_fraction} would hold out all {n} documents")
        t = max(1, int(round(self.test_fraction * n))) if self.test_fraction > 0 else 0
        if k + t >= n:
            raise DataError(f"val_fraction={self.val_fraction} and test_fraction={self.test_fraction} would hold "
                            f"out all {n} documents")
        perm = np.random.default_rng([self.val_seed, _VAL_SPLIT_STREAM]).permutation(n)
        # the test share comes after the validation one: a run without it splits exactly as before
        self._val_ids, self._test_ids = np.sort(perm[:k]), np.sort(perm[k:k + t])
        self._train_ids = np.sort(perm[k + t:])
        self._train_sampler = self._sampler_over(corpus, self._train_ids, self.tokens_per_batch)
        self._test_sampler = self._sampler_over(
            corpus, self._test_ids, self.val_tokens_per_batch or self.tokens_per_batch) if t else None
        if k:
            self._val_sampler = self._sampler_over(
                corpus, self._val_ids, self.val_tokens_per_batch or self.tokens_per_batch)
            self.__dict__.pop("val_dataloader", None)
        else:
            self._val_sampler = None
            self.val_dataloader = _no_validation  # Lightning sees no val_dataloader: no validation, no warning
        self.batches_per_epoch = self._requested_batches_per_epoch or self._train_sampler.num_batches(0)

    def _sampler_over(self, corpus: TokenizedCorpus, ids: np.ndarray, budget: int) -> MiniBatchSampler:
        return MiniBatchSampler(corpus.lengths[ids], budget, self.context_length, self.seed,
                                self.long_doc_policy, doc_ids=[corpus.doc_ids[i] for i in ids])

    # -- planner, mesh, rank ---------------------------------------------------------------
    def _context(self) -> PlanningContext | None:
        """The Trainer's strategy's planning context, else one from the constructor's arguments
        (None where neither has a planner and a mesh shape yet)."""
        trainer = getattr(self, "trainer", None)
        strategy = trainer.strategy if trainer is not None else None
        if isinstance(strategy, PlanningProvider):
            context = strategy.planning_context()
            if context is not None:
                return context
        if self._planner is None or self._mesh_shape is None:
            return None
        rank = self._rank if self._rank is not None else (trainer.global_rank if trainer is not None else None)
        if rank is None:
            if self._mesh_shape.world_size > 1:
                raise DataError(f"{type(self).__name__}: outside a Trainer pass rank= (the mesh has "
                                f"{self._mesh_shape.world_size} ranks)")
            rank = 0
        return PlanningContext(self._planner, self._mesh_shape, rank, self._mesh_shape.world_size)

    def _planning(self) -> PlanningContext:
        """The planning context, its parts validated against each other."""
        name, trainer = type(self).__name__, getattr(self, "trainer", None)
        context = self._context()
        if context is None:
            where = f"strategy {type(trainer.strategy).__name__}" if trainer is not None else "no Trainer"
            raise DataError(f"{name} needs a planner and a mesh shape: the strategy's planning_context() "
                            f"(HotSPaStrategy provides it; here: {where}) or the planner= and mesh_shape= "
                            f"arguments")
        planner, mesh, rank = check_planner(context.planner, name, DataError), context.mesh_shape, context.rank
        if not isinstance(mesh, MeshShape):
            raise DataError(f"{name}: mesh_shape must be a MeshShape, got {type(mesh).__name__}")
        if context.world_size != mesh.world_size:
            raise DataError(f"{name}: the strategy's mesh covers {mesh.world_size} ranks but the "
                            f"Trainer runs {context.world_size}")
        foreign = [str(x) for x in planner.layouts if x not in mesh.layouts]
        if foreign:
            raise DataError(f"{name}: planner layouts {foreign} are not on the mesh "
                            f"({[str(x) for x in mesh.layouts]})")
        if not is_int(rank) or not 0 <= rank < mesh.world_size:
            raise DataError(f"{name}: rank {rank!r} is outside the mesh of {mesh.world_size} ranks")
        from ..planner.rule import ThresholdPlanner

        hand_set = planner.hand_set_bounds if isinstance(planner, ThresholdPlanner) else ()
        above = [b for b in hand_set if b > self.context_length]
        if isinstance(self.context_length, int) and above:
            raise DataError(f"{name}: context_length={self.context_length} is smaller than the hand-set bucket "
                            f"bound(s) {above} of {type(planner).__name__}: no document is longer than the "
                            f"context, so those buckets can never fill; lower the bounds or raise context_length")
        longest = planner.longest_document()
        if self.context_length > longest:
            raise DataError(f"{name}: context_length={self.context_length} is longer than any "
                            f"micro-batch of the planner holds ({longest} tokens); lower "
                            f"context_length or give the layouts more tokens per rank")
        return context

    # -- loaders ---------------------------------------------------------------------------
    def _dataset(self, split: str) -> StepPlanDataset:
        if self._train_sampler is None or self._corpus is None:
            raise DataError(f"{type(self).__name__}: call setup() before asking for a dataloader")
        context = self._planning()
        if split == "train":
            sampler, ids, n, endless = self._train_sampler, self._train_ids, self.batches_per_epoch, True
        elif split == "test":  # data pass 0 of the test documents
            sampler, ids, n, endless = self._test_sampler, self._test_ids, self._test_sampler.num_batches(0), False
        else:  # val and predict: data pass 0 of the held-out documents (predict: else of training)
            use_val = self._val_sampler is not None
            sampler = self._val_sampler if use_val else self._train_sampler
            ids = self._val_ids if use_val else self._train_ids
            n, endless = sampler.num_batches(0), False
        return StepPlanDataset(split=split, corpus=self._corpus, doc_index=ids, sampler=sampler,
                               planner=context.planner, mesh_shape=context.mesh_shape, rank=context.rank,
                               batches_per_epoch=n,
                               endless=endless, cursor=self._cursor if split == "train" else None,
                               prompt_offset=getattr(self._tokenizer, "prompt_offset", None))

    def _loader(self, dataset: StepPlanDataset, resumable: bool) -> PlanDataLoader:
        if dataset.split == "train" and self.num_workers > 0 and isinstance(dataset.planner, ProfiledPlanner):
            dataset.planner.ensure_plan_lag(self.num_workers * 2 + 2)  # workers prefetch 2 plans each
        return PlanDataLoader(dataset, num_workers=self.num_workers, pin_memory=self.pin_memory,
                              persistent_workers=self.persistent_workers,
                              multiprocessing_context=self.multiprocessing_context, resumable=resumable)

    def train_dataloader(self) -> PlanDataLoader:
        return self._loader(self._dataset("train"), resumable=True)

    def val_dataloader(self) -> PlanDataLoader | list:
        if self._val_sampler is None:
            return []  # no held-out documents: Lightning skips validation
        return self._loader(self._dataset("val"), resumable=False)

    def test_dataloader(self) -> PlanDataLoader:
        """Data pass 0 of the ``test_fraction`` share of the documents (held out of training and
        validation); an error naming ``test_fraction`` without one."""
        if self._train_sampler is not None and self._test_sampler is None:
            raise DataError(f"{type(self).__name__} has no test split: give test_fraction > 0 (a held-out share of "
                            f"the documents), or a DataModule of the test data to trainer.test")
        return self._loader(self._dataset("test"), resumable=False)

    def predict_dataloader(self) -> PlanDataLoader:
        return self._loader(self._dataset("predict"), resumable=False)

    # -- resume ----------------------------------------------------------------------------
    def _my_identity(self) -> dict[str, Any]:
        out = _identity(self._train_sampler, self.batches_per_epoch)
        out.update(val_fraction=self.val_fraction, val_seed=self.val_seed)
        if self.test_fraction:  # absent when 0: positions saved before the test split still load
            out["test_fraction"] = self.test_fraction
        return out

    def state_dict(self) -> dict[str, Any]:
        """The next training (epoch, step) plus what it depends on (Lightning checkpoints this)."""
        return {"format": STATE_FORMAT, "epoch": self._cursor.epoch, "step": self._cursor.step,
                **self._my_identity()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a saved position; checked against the data once ``setup`` has opened it."""
        if self._train_sampler is None:
            _load_position(_Cursor(), state, {})  # validate the shape now, the data at setup
            self._pending_state = dict(state)
            return
        _load_position(self._cursor, state, self._my_identity())

    # -- conveniences ----------------------------------------------------------------------
    @property
    def corpus(self) -> TokenizedCorpus | None:
        return self._corpus

    @property
    def val_doc_ids(self) -> np.ndarray:
        """Corpus indices of the held-out documents (empty without a validation split)."""
        return self._val_ids

    @property
    def test_doc_ids(self) -> np.ndarray:
        """Corpus indices of the test documents (empty without a test split)."""
        return self._test_ids

    @property
    def train_doc_ids(self) -> np.ndarray:
        return self._train_ids
