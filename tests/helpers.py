"""The tests' shared helpers, in ONE module (no test file imports another test file).

- the strategy under a real Trainer in the rank pool, and the single-process reference it must match
  (:func:`fit_and_compare`, :func:`reference_run`, :func:`rank_plans`, :func:`mixed_plan`, ...);
- the engine's step runner without Lightning (:class:`TinyLM`, :class:`TinyLlama`, :func:`setup_runner`,
  :func:`uneven_plan`, :func:`evaluate_plans`);
- tiny random Hugging Face models built locally and their per-document reference (:func:`hf_model`,
  :func:`hf_reference`);
- the logged history of an offline W&B run (:func:`history_rows`).

Spawned ranks import it by name too (tests/ is on their sys.path, as on the parent's). Lightning and
transformers are imported inside the helpers that need them.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_hotspa.data import DataError
from lightning_hotspa.layout import Layout, MeshShape
from lightning_hotspa.models import LlamaConfig, llama_tp_plan
from lightning_hotspa.plan import Block, Stage, StepPlan, block_dp_groups, pack_micro_batch, slice_plan


# ------------------------------------------------------------------ the strategy and its reference
@contextlib.contextmanager
def lightning_rank_env():
    """Tells Lightning the ranks already exist (as torchrun would), then cleans up."""
    rank, world = dist.get_rank(), dist.get_world_size()
    env = {"LOCAL_RANK": str(rank), "NODE_RANK": "0", "WORLD_SIZE": str(world), "RANK": str(rank),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "WANDB_MODE": "offline"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def make_docs(step: int, lengths, vocab: int = 256) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(zlib.crc32(f"docs/{step}".encode()))
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def deal(layout: Layout, doc_ids: list[int], per_micro_batch: int = 2) -> Stage:
    """Documents dealt to dp groups unevenly (group 0 gets the most), a few per micro-batch."""
    groups: list[list[tuple[int, ...]]] = [[] for _ in range(layout.dp)]
    chunks = [tuple(doc_ids[i:i + per_micro_batch]) for i in range(0, len(doc_ids), per_micro_batch)]
    for i, chunk in enumerate(chunks):
        groups[(i * i) % layout.dp].append(chunk)
    return Stage(layout, tuple(tuple(g) for g in groups), label=layout.name)


def mixed_plan(step: int, lengths: list[int], layouts: list[Layout]) -> StepPlan:
    """Documents split over every layout as its own stage (a stage may get few documents)."""
    share = -(-len(lengths) // len(layouts))
    stages = [deal(layout, list(range(i * share, min(len(lengths), (i + 1) * share))))
              for i, layout in enumerate(layouts) if i * share < len(lengths)]
    return StepPlan(step, tuple(lengths), tuple(stages))


def rank_plans(plans: list[StepPlan], layouts: list[Layout], rank: int):
    mesh = MeshShape.for_layouts(layouts, len(layouts) and layouts[0].world_size)
    return [slice_plan(p, make_docs(p.step, p.doc_lengths), mesh, rank) for p in plans]


def reference_run(model_factory, plans: list[StepPlan], clip: float | None = None):
    """Single process: the same optimizer on the whole global mini-batch, token-mean loss."""
    model = model_factory()
    optimizer = model.configure_optimizers()
    optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
    losses, grads = [], []
    for plan in plans:
        mb = pack_micro_batch(make_docs(plan.step, plan.doc_lengths))
        optimizer.zero_grad()
        loss = model.training_step(mb, 0)
        loss.backward()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        losses.append(float(loss))
    return model, losses, grads


def rel_errors(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    return {n: float((ours[n].double() - ref[n].double()).norm() / ref[n].double().norm().clamp(min=1e-30))
            for n in ref}


def groups_of(layouts: list[str], layout: Layout, ranks) -> tuple[int, ...]:
    """The dp groups of ``layout`` that hold ``ranks`` on the 4-rank mesh of ``layouts`` (dp order
    is not rank order on a 2x2 mesh)."""
    mesh = MeshShape.for_layouts([Layout.parse(x) for x in layouts], 4)
    return tuple(sorted({mesh.rank_coords(layout, r)[0] for r in ranks}))


def block_of(layouts: list[str], name: str, ranks, counts, docs: list[int]) -> Block:
    """A block of layout ``name`` on ``ranks`` (the 4-rank mesh of ``layouts``); its k-th dp group
    runs ``counts[k]`` micro-batches of up to 2 documents taken from the front of ``docs``."""
    layout = Layout.parse(name)
    groups = []
    for count in counts:
        mbs = []
        for _ in range(count):
            mbs.append(tuple(docs[:2]))
            del docs[:2]
        groups.append(tuple(mbs))
    return Block(layout, groups_of(layouts, layout, ranks), tuple(groups))


def evaluate_plans(layouts: list[str], make_model, plans: list[StepPlan]) -> list[tuple[float, float, object]]:
    """Per plan, evaluated with ``StepRunner.run_forward`` on the mesh of ``layouts``: the token-weighted
    sum of the micro-batch losses over all ranks, the single process's loss on the same documents, and
    the engine's active layout afterwards. ``make_model()`` builds the model (the same weights each call)."""
    from lightning_hotspa.engine.step_runner import StepRunner

    module, world, home, parallel, engine = setup_runner(layouts, make_model())
    runner = StepRunner(engine, parallel)
    out = []
    for plan in plans:
        docs = make_docs(plan.step, plan.doc_lengths, vocab=module.config.vocab_size)
        total = torch.zeros((), dtype=torch.float64)

        def weighted(mb, total=total):
            loss = module(mb)
            total.add_(loss.double() * mb.num_target_tokens / parallel.state.tp_size)  # tp ranks hold copies
            return loss

        with torch.no_grad():
            runner.run_forward(slice_plan(plan, docs, world.shape, world.rank), weighted)
        dist.all_reduce(total)
        with torch.no_grad():
            reference = float(make_model()(pack_micro_batch(docs)))
        out.append((float(total) / plan.global_target_tokens, reference, engine.active))
    return out


LENGTHS = [[7, 30, 12, 5, 64, 9, 3, 40, 17, 25, 11, 50, 8, 33],
           [20, 4, 44, 13, 6, 70, 15, 9, 31, 2, 27, 18],
           [60, 10, 21, 35, 5, 14, 48, 26, 7, 19, 3, 38, 12]]

#: the 4-rank layouts every strategy and planning test starts from (one of each tp and cp degree)
FOUNDATION = ["dp4", "dp2xtp2", "tp4", "dp2xcp2", "tp2xcp2"]
#: an 8-rank set: every dp x tp x cp split with tp and cp up to 4 (and tp8)
EIGHT = ["dp8", "dp4xtp2", "dp2xtp4", "tp8", "dp4xcp2", "tp4xcp2", "dp2xtp2xcp2"]

# stage order of each step's plan: every stage next to another tp degree (each reduces), then runs of
# same-tp stages (tp 4,2,2,1,1 and 1,1,2,2,4) that reduce once per run, with tp changes in between
STAGE_ORDERS = [FOUNDATION, ["tp4", "dp2xtp2", "tp2xcp2", "dp4", "dp2xcp2"],
                ["dp2xcp2", "dp4", "tp2xcp2", "dp2xtp2", "tp4"]]



def tiny_lm(dtype=torch.float32, kv_heads: int | None = None):
    """The tiny LlamaLM every strategy comparison starts from (seed 3), in ``dtype``; ``kv_heads``: the
    tiny preset with that many kv heads (e.g. 1: fewer than a block's tp or cp)."""
    from lightning_hotspa.models import LlamaConfig, LlamaLM

    config = "tiny" if kv_heads is None else LlamaConfig.preset("tiny", n_kv_heads=kv_heads)
    return LlamaLM(config, seed=3, lr=2e-3, weight_decay=0.1).to(dtype)


def _recorder():
    """A Lightning callback recording, per optimizer step, the pre-update home weights and gradients
    (full tensors), the losses, the stages' reductions and the backward hook counts."""
    from lightning.pytorch.callbacks import Callback

    class _Recorder(Callback):
        """Per optimizer step: the pre-update home weights and gradients (full tensors), and hook counts."""

        def __init__(self):
            self.before = self.after = 0
            self.losses, self.grads, self.weights, self.reductions = [], [], [], []

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            params = dict(pl_module.named_parameters())  # collectives: every rank gathers
            self.grads.append({n: p.grad.full_tensor() for n, p in params.items()})
            self.weights.append({n: p.detach().full_tensor() for n, p in params.items()})

        def on_before_backward(self, trainer, pl_module, loss):
            self.before += 1

        def on_after_backward(self, trainer, pl_module):
            self.after += 1

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(float(outputs["loss"]))
            self.reductions.append([(s.layout.name, s.layout.tp, s.reduce_collectives, s.reduce_bytes, s.reduce_s)
                                    for s in trainer.strategy.last_step.stages])

    return _Recorder()


def reference_grads(weights, plan, dtype, make_model=tiny_lm):
    """Single process, the same weights, the whole global mini-batch, token-mean loss."""
    model = make_model(dtype)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[n])
    loss = model.training_step(pack_micro_batch(make_docs(plan.step, plan.doc_lengths)), 0)
    loss.backward()
    return float(loss), {n: p.grad for n, p in model.named_parameters()}


def fit_and_compare(layout_names, steps=3, precision="32-true", stage_orders=None, plans=None, make_model=tiny_lm,
                    **strategy_kwargs):
    """3 optimizer steps of mixed plans (every layout a stage, uneven dp groups, stage orders of
    :data:`STAGE_ORDERS`, or the given ``plans``) under a real Trainer; ``make_model(dtype)`` builds the
    model (the same weights each call; default :func:`tiny_lm`).

    Returns, per step, the gradient error against the single process started from the SAME weights
    (the update's input: the core invariant), the loss errors, the error of the final weights
    against a single-process run of the same 3 AdamW steps, and each stage's gradient reduction.
    """
    import lightning as L

    from lightning_hotspa import HotSPaStrategy

    dtype = torch.float64 if precision == "64-true" else torch.float32
    layouts = [Layout.parse(x) for x in layout_names]
    orders = stage_orders or STAGE_ORDERS
    plans = plans or [mixed_plan(s, LENGTHS[s % len(LENGTHS)], [Layout.parse(x) for x in orders[s % len(orders)]])
                      for s in range(steps)]
    batches = rank_plans(plans, layouts, dist.get_rank())
    recorder = _recorder()
    with lightning_rank_env():
        trainer = L.Trainer(accelerator="cpu", devices=dist.get_world_size(),
                            strategy=HotSPaStrategy(layout_names, **strategy_kwargs),
                            max_steps=steps, precision=precision, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                            callbacks=[recorder])
        model = make_model()
        trainer.fit(model, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None,
                                                                         collate_fn=lambda x: x))
    ours = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    # Lightning's backward hooks run around each micro-batch's backward, but not inside a pp stage:
    # torch's pipeline schedule runs those backwards itself (parallel/pipeline.py)
    micro_batches = sum(len(s.micro_batches) for b in batches for s in b.stages if s.compute_layout.pp == 1)
    assert recorder.before == recorder.after == micro_batches, (recorder.before, micro_batches)
    if dist.get_rank() != 0:
        return None
    ref_dtype = torch.float32 if precision == "bf16-mixed" else dtype
    grad_errors, loss_errors = [], []
    for plan, weights, grads, loss in zip(plans, recorder.weights, recorder.grads, recorder.losses):
        ref_loss, ref = reference_grads(weights, plan, ref_dtype, make_model)
        grad_errors.append(rel_errors(grads, ref))
        loss_errors.append(abs(loss - ref_loss) / abs(ref_loss))
    ref_model, _, _ = reference_run(lambda: make_model(ref_dtype), plans)
    return {"grads": grad_errors, "losses": loss_errors, "global_step": trainer.global_step,
            "weights": rel_errors(ours, dict(ref_model.named_parameters())), "reductions": recorder.reductions}


def check_against_single_process(result, steps, grad_tol, loss_tol, weight_tol):
    """A :func:`fit_and_compare` result holds the invariant: ``steps`` optimizer steps, every step's
    gradients within ``grad_tol`` of the single process's from the same weights, the losses within
    ``loss_tol`` and the final weights within ``weight_tol``."""
    assert result["global_step"] == steps
    for step, errors in enumerate(result["grads"]):
        assert worst(errors)[1] <= grad_tol, (step, worst(errors))
    assert max(result["losses"]) <= loss_tol, result["losses"]
    assert worst(result["weights"])[1] <= weight_tol, worst(result["weights"])


def home_grad_errors(parallel, engine, home, loss_sum, ref_grads, ref_name=lambda name: name):
    """After a step's stages ran by hand: the home parameters back in place, ``loss_sum`` summed over
    the ranks (in place), and each home gradient's relative error against ``ref_grads[ref_name(name)]``
    (gradients cleared after).

    Args:
        parallel, engine, home: what :func:`setup_runner` returned.
        loss_sum: this rank's share of the loss (a tensor; all-reduced here).
        ref_grads: the single process's gradients.
        ref_name: the reference's name of a home parameter.
    """
    parallel.restore(home)
    engine.release()
    dist.all_reduce(loss_sum)
    engine.assign_home_grads()
    errors = {}
    for name, p in home.items():
        errors[name] = rel_error(p.grad.full_tensor(), ref_grads[ref_name(name)])
        p.grad = None
    engine.clear_grad_store()
    return errors


def worst(errors):
    """The (name, value) of the largest error."""
    name = max(errors, key=errors.get)
    return name, errors[name]


# ------------------------------------------------------------------ the step runner without Lightning
class TinyLM(nn.Module):
    """Embedding + head: a loss over packed micro-batches, every parameter replicated."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(32, 8), nn.Linear(8, 32)

    def forward(self, mb) -> torch.Tensor:  # the mean over the micro-batch's target tokens
        logits = self.head(self.emb(mb.input_ids))
        return nn.functional.cross_entropy(logits.view(-1, 32), mb.labels.view(-1), ignore_index=-100)


class TinyLlama(nn.Module):
    """The tiny Llama preset (seed 0) with the token-mean loss over a packed micro-batch."""

    def __init__(self, **overrides) -> None:
        from lightning_hotspa.models import Llama, LlamaConfig

        super().__init__()
        torch.manual_seed(0)
        self.config = LlamaConfig.preset("tiny", **overrides)
        self.model = Llama(self.config)

    def forward(self, mb) -> torch.Tensor:
        from lightning_hotspa.models import token_mean_cross_entropy

        return token_mean_cross_entropy(self.model(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.max_seqlen),
                                        mb.labels)


def setup_runner(layouts, module=None):
    """``(module, world, home, parallel, engine)`` of ``module`` (default :class:`TinyLM`) installed on the
    mesh of ``layouts`` in this rank's process group."""
    from lightning_hotspa.engine.switch import SwitchEngine, build_home_parameters
    from lightning_hotspa.mesh import WorldMesh
    from lightning_hotspa.parallel.model import ParallelModel
    from lightning_hotspa.placements import build_shardings

    module = module or TinyLM()
    world = WorldMesh(layouts)
    init = {n: p.detach().clone() for n, p in module.named_parameters()}
    roles = {n: "replicated" for n in init}
    if isinstance(module, TinyLlama):
        from lightning_hotspa.models import llama_tp_plan, param_roles

        roles = param_roles(module, llama_tp_plan(module.config, max(Layout.parse(x).tp for x in layouts),
                                                  prefix="model."))
    shardings = build_shardings({n: tuple(p.shape) for n, p in init.items()}, roles, world.shape)
    home = build_home_parameters(world, shardings, lambda name, shape: init[name])
    parallel = ParallelModel(module, roles, world)
    parallel.restore(home)
    return module, world, home, parallel, SwitchEngine(world, shardings, home)


def uneven_plan(world, layout_names, rounds=3):
    """One stage per layout; dp group 0 gets ``rounds`` micro-batches, the others one (idle rounds)."""
    lengths, stages, doc = [], [], 0
    for name in layout_names:
        lay = Layout.parse(name)
        groups = []
        for g in range(lay.dp):
            mbs = []
            for _ in range(rounds if g == 0 else 1):
                mbs.append((doc,))
                lengths.append(10 + 3 * doc)
                doc += 1
            groups.append(tuple(mbs))
        stages.append(Stage(lay, tuple(groups), label=name))
    g = torch.Generator().manual_seed(7)
    docs = [torch.randint(0, 32, (n,), generator=g) for n in lengths]
    return slice_plan(StepPlan(0, tuple(lengths), tuple(stages)), docs, world.shape, world.rank)


# ------------------------------------------------------------------ the tiny Llama losses (test_parallel's)
class LlamaLoss(nn.Module):
    """The tiny Llama (norm weights not all ones) with the token-mean loss on its logits; :meth:`plan`:
    its tp plan at the largest tp (kv ``replicated_partial``)."""

    """The LlamaLM contract without Lightning: logits are consumed only through ``loss_fn``."""

    vocab_parallel_loss = True  # opts in: its loss_fn may be wrapped by the vocab-parallel CE

    def __init__(self, config: LlamaConfig) -> None:
        from lightning_hotspa.models import Llama

        super().__init__()
        torch.manual_seed(0)
        self.model = Llama(config)
        for name, p in self.model.named_parameters():
            if name.endswith("norm.weight"):  # not all ones, so norm gradients are not symmetric
                nn.init.uniform_(p, 0.5, 1.5)
        from lightning_hotspa.models import token_mean_cross_entropy

        self.loss_fn = token_mean_cross_entropy

    def training_step(self, mb):
        logits = self.model(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.max_seqlen)
        return self.loss_fn(logits, mb.labels)

    @staticmethod
    def plan(config: LlamaConfig | None = None) -> dict[str, str]:
        # the largest tp: kv replicated_partial
        return llama_tp_plan(config or LlamaConfig.preset("tiny"), 4, prefix="model.")


class LlamaFusedLoss(LlamaLoss):
    """LlamaLM's default: the loss through the model's blocked head (labels into its forward), the
    vocabulary walked in blocks of 48 rows (several per tp shard of the 320 padded rows)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        self.model.output.vocab_block = 48

    def training_step(self, mb):
        return self.model(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.max_seqlen, labels=mb.labels)


def dealt_stage(layout: str, doc_ids: list[int], checkpointing: bool | str = False) -> Stage:
    """Documents dealt round-robin to dp groups; each dp group's share in two micro-batches."""
    lay = Layout.parse(layout)
    groups = [doc_ids[i::lay.dp] for i in range(lay.dp)]
    mbs = tuple(tuple(tuple(part) for part in (g[: (len(g) + 1) // 2], g[(len(g) + 1) // 2:]) if part)
                for g in groups)
    return Stage(lay, mbs, activation_checkpointing=checkpointing)


def single_process_reference(build, docs) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``build()``'s loss over the whole mini-batch ``docs``, its initial weights and its gradients."""
    model = build()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = model.training_step(pack_micro_batch(docs))  # token mean over the whole mini-batch
    loss.backward()
    return float(loss.detach()), init, {n: p.grad.clone() for n, p in model.named_parameters()}


#: a model small enough for the memory estimator's rows in seconds (test_memory's)
SMALLISH = LlamaConfig(vocab_size=1000, hidden=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=704,
                       vocab_multiple=64)


# ------------------------------------------------------------------ a local chat tokenizer
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|> {% endif %}")
WORDS = "hello world how are you fine thanks what is two plus equals four sky blue".split()


def make_tokenizer(folder):
    """A word-level chat tokenizer with :data:`TEMPLATE` saved in ``folder`` (built here: nothing is downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<unk>"]
    vocab = {w: i for i, w in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TEMPLATE, "eos_token": "<|end|>",
        "unk_token": "<unk>"}))
    return folder


# ------------------------------------------------------------------ tiny Hugging Face models
HF_DOC_LENGTHS = [40, 7, 25, 64, 3, 19, 33, 12]  # 40 and 64 are longer than Mistral's test window
HF_WINDOW = 24
HF_BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)


def hf_model(arch: str, seed: int = 0, **extra):
    """A random fp32 ``*ForCausalLM``; every tensor (biases and norms too) random, so no mapping
    mistake hides behind zeros or ones."""
    import transformers

    extra = dict(extra)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**HF_BASE, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32}, **extra)
        cls = transformers.LlamaForCausalLM
    elif arch == "mistral":
        cfg = transformers.MistralConfig(**HF_BASE, sliding_window=HF_WINDOW, **extra)
        cls = transformers.MistralForCausalLM
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**HF_BASE, **{"tie_word_embeddings": True, **extra})
        cls = transformers.Qwen2ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5 if "norm" in name else
                        0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return model


def hf_docs(vocab: int = 256) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(zlib.crc32(b"hf-docs"))
    return [torch.randint(0, vocab, (n,), generator=g) for n in HF_DOC_LENGTHS]


def hf_reference(model, documents):
    """Per-document logits (position t predicts token t+1, as in transformers), the token-mean loss
    over all documents, and the gradients (Hugging Face names)."""
    model.zero_grad()
    logits = [model(d[None]).logits[0] for d in documents]
    total = sum(F.cross_entropy(lg[:-1], d[1:], reduction="sum") for lg, d in zip(logits, documents))
    targets = sum(len(d) - 1 for d in documents)
    loss = total / targets
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return [lg.detach() for lg in logits], float(loss.detach()), grads


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


# ------------------------------------------------------------------ offline W&B history
_FILE_HEADER = 7
_BLOCK = 32768
_RECORD_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _payloads(data: bytes) -> list[bytes]:
    """The assembled records of a LevelDB-log byte string (after the file header)."""
    if data[:4] != b":W&B":
        raise ValueError(f"not a .wandb file (starts with {data[:4]!r})")
    out: list[bytes] = []
    pending = b""
    pos = _FILE_HEADER
    while pos + _RECORD_HEADER <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _RECORD_HEADER:  # a block's trailer: zero padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + _RECORD_HEADER])
        body = data[pos + _RECORD_HEADER:pos + _RECORD_HEADER + length]
        pos += _RECORD_HEADER + length
        if kind == 0 and length == 0:  # zero fill at the end of a block
            pos += _BLOCK - pos % _BLOCK if pos % _BLOCK else 0
            continue
        if kind == _FULL:
            out.append(body)
        elif kind == _FIRST:
            pending = body
        elif kind == _MIDDLE:
            pending += body
        elif kind == _LAST:
            out.append(pending + body)
            pending = b""
        else:
            raise ValueError(f"record of unknown type {kind} at byte {pos}")
    return out


def history_rows(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every history row of the offline run in ``run_dir`` (a folder holding one ``run-*.wandb``),
    in logging order, as ``{key: value}`` with values decoded from their JSON."""
    from wandb.proto import wandb_internal_pb2 as pb

    files = sorted(Path(run_dir).glob("run-*.wandb"))
    if len(files) != 1:
        raise ValueError(f"expected one run-*.wandb in {run_dir}, found {[f.name for f in files]}")
    rows = []
    for payload in _payloads(files[0].read_bytes()):
        record = pb.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") != "history":
            continue
        row = {}
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            row[key] = json.loads(item.value_json) if item.value_json else None
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------- bad inputs
# (tests/e2e/test_bad_inputs.py and tests/unit/test_bad_input_table.py: one row per bad input)
@dataclass(frozen=True)
class Bad:
    name: str
    area: str  # "config", "data" or "api"
    make: Callable[[Path], Callable[[], Any]]  # builds the input files, returns the call that must fail
    error: type[BaseException]
    says: tuple[str, ...]  # what the message must contain: the bad value and where it came from

def files_under(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()}

def half_written(root: Path, before: set[Path]) -> list[str]:
    """New files that are not part of a complete, valid token-cache entry (those are published
    atomically and are a legitimate product of tokenizing before a later check failed)."""
    from lightning_hotspa.data import TokenizedCorpus

    bad, valid = [], {}
    for path in sorted(files_under(root) - before):
        entry = path.parent
        if entry.parent.name == "cache" and entry not in valid:
            try:
                TokenizedCorpus.open(entry)
                valid[entry] = True
            except DataError:
                valid[entry] = False
        if not valid.get(entry, False):
            bad.append(str(path))
    return bad

def config_case(*overrides: str, build: bool = False) -> Callable[[Path], Callable[[], Any]]:
    def make(tmp: Path) -> Callable[[], Any]:
        def call() -> Any:
            from hydra import compose, initialize_config_dir

            from lightning_hotspa.adapter.recipes.hydra_recipe import (
                CONFIG_DIR,
                build_trainer,
                check_config,
                register_resolvers,
            )

            register_resolvers()
            with initialize_config_dir(version_base="1.3", config_dir=str(CONFIG_DIR)):
                cfg = compose("config", overrides=[f"output_dir={tmp / 'out'}", "run_name=t", "logger=none",
                                                   "hardware=cpu-gloo", *overrides])
            check_config(cfg)
            if build:
                build_trainer(cfg)
        return call
    return make

def write_data(tmp: Path, name: str, text: str) -> Path:
    (tmp / "data").mkdir(exist_ok=True)
    path = tmp / "data" / name
    path.write_text(text)
    return path

def datamodule_case(source: Any, tmp: Path, layouts=("dp1",), planner: Any = None, **kwargs: Any) -> Callable[[], Any]:
    """A HotSPaDataModule set up for world 1 with the token cache in tmp (so a failed build would show)."""
    from lightning_hotspa import HotSPaDataModule
    from lightning_hotspa.layout import Layout, MeshShape, parse_layouts
    from lightning_hotspa.planner.rule import ThresholdPlanner

    layouts = parse_layouts(list(layouts), Layout.parse(layouts[0]).world_size)
    planner = planner or ThresholdPlanner(layouts, 64)
    options = {"tokens_per_batch": 512, "context_length": 64, "cache_dir": str(tmp / "cache"), "rank": 0, **kwargs}

    def call() -> Any:
        dm = HotSPaDataModule(source() if callable(source) else source, planner=planner,
                              mesh_shape=MeshShape.for_layouts(layouts, layouts[0].world_size), **options)
        dm.prepare_data()
        dm.setup("fit")
        return dm.train_dataloader()
    return call

def jsonl_case(text: str, **kwargs: Any) -> Callable[[Path], Callable[[], Any]]:
    def make(tmp: Path) -> Callable[[], Any]:
        from lightning_hotspa.data import JsonlSource

        path = write_data(tmp, "corpus.jsonl", text)
        return datamodule_case(lambda: JsonlSource(path), tmp, **kwargs)
    return make

def raises_case(fn: Callable[[], Any]) -> Callable[[Path], Callable[[], Any]]:
    return lambda tmp: fn

def strategy_case(*args: Any, **kwargs: Any) -> Callable[[], Any]:
    from lightning_hotspa import HotSPaStrategy

    return lambda: HotSPaStrategy(*args, **kwargs)

def check_refused(case: Bad, tmp_path: Path) -> None:
    """``case``'s call raises its error type with every fragment in the message, and leaves no
    half-written file in ``tmp_path`` (tests/unit/test_bad_input_table.py runs its rows through this too)."""
    call = case.make(tmp_path)
    before = files_under(tmp_path)
    with pytest.raises(case.error) as info:
        call()
    message = str(info.value)
    for fragment in case.says:
        assert fragment in message, f"{fragment!r} not in: {message}"
    assert not half_written(tmp_path, before), f"left files behind: {half_written(tmp_path, before)}"


# ---------------------------------------------------------------------------------- checkpoint trust
# (tests/unit/test_checkpoint_trust.py and the bad-input table: tiny DCP folders and planted payloads)
class Payload:
    """Unpickling this creates ``marker`` (what a planted payload could do with any code)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))

def save_tiny(path: Path, value: float, step: int, **extra) -> Path:
    from lightning_hotspa.adapter.checkpoints import dcp_state as ck

    checkpoint = {"state_dict": {"w": torch.full((4,), value)}, "global_step": step, **extra}
    ck.save_distributed_checkpoint(checkpoint, path, is_rank_zero=True, barrier=lambda: None)
    return path

def rehash(folder: Path, *names: str) -> None:
    """What a hostile author does after planting a file: rewrite commit.json to match it."""
    from lightning_hotspa.adapter.checkpoints import dcp_state as ck

    commit = json.loads((folder / "commit.json").read_text())
    commit["files"].update(ck.file_entries(folder, names))
    reseal(folder, commit)


def reseal(folder: Path, commit: dict) -> None:
    """Writes ``commit`` as the folder's commit.json with its own checksum recomputed (a hostile author)."""
    from lightning_hotspa.adapter.checkpoints.trust import marker_digest

    (folder / "commit.json").write_text(json.dumps({**commit, "marker_sha256": marker_digest(commit)}))

def legacy_folder(folder: Path) -> Path:
    """A folder as main wrote it before commit markers (no commit.json, a pickled meta.pt)."""
    (folder / "commit.json").unlink()
    torch.save({"global_step": 2}, folder / "meta.pt")
    return folder


def load_recipe(name: str, monkeypatch: pytest.MonkeyPatch):
    """``recipes/<name>`` imported as the module ``<stem>`` (recipes/ first on sys.path, as ``python
    recipes/<name>`` has it), so its rank functions pickle by name and its ranks fork from the suite's
    preloaded server (tests/conftest.py) instead of a fresh interpreter importing torch and Lightning.

    Args:
        name: the file under recipes/, e.g. ``"benchmark_compile.py"``.
        monkeypatch: undoes the sys.path and sys.modules entries after the test.
    """
    import importlib.util
    import sys

    recipes = Path(__file__).resolve().parents[1] / "recipes"
    monkeypatch.syspath_prepend(str(recipes))
    stem = name.removesuffix(".py")
    spec = importlib.util.spec_from_file_location(stem, recipes / name)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, stem, module)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------------------------------
# plans shared by test files and the job scripts a test launches (tests/mixed_kill_job.py imports only
# this module): block stages of tests/distributed/test_blocks.py, the planner's mixed plans of
# tests/distributed/test_mixed_planner.py

#: the candidates of each world: every block's compute layout and, for a sharded one, its working layout
BLOCK_LAYOUTS = {
    4: ["dp4", "dp2xtp2", "dp2xcp2", "dp2xcp2:kv", "dp4:fsdp2", "dp2xcp2:fsdp2", "dp2xcp2:kv:fsdp2", "cp4:kv",
        "cp4:kv:fsdp"],
    8: ["dp8", "dp4xtp2", "dp2xcp4:kv", "dp2xcp4:kv2", "dp4xcp2", "dp8:fsdp2", "dp2xcp4:kv:fsdp4",
        "dp2xcp4:kv2:fsdp4", "dp4xcp2:fsdp4", "dp2xtp2xcp2", "dp8:fsdp4", "dp4xtp2:fsdp2"],
}

#: per world, per step: the block stage's blocks (layout, ranks, micro-batches per dp group, sharded,
#: checkpointing), and the plain stages before / after it
BLOCK_SHAPES = {
    4: [  # cp2 all-gather-KV sharded + a dp block sharded over 2 ranks with 2 and 1 micro-batches
        ([("dp2xcp2:kv", (0, 1), [1], True, "full"), ("dp4", (2, 3), [2, 1], True, None)], (), ()),
        # a replicated tp2 block beside a sharded dp block whose second group has no micro-batch
        ([("dp2xtp2", (0, 1), [2], False, None), ("dp4", (2, 3), [1, 0], True, "full")], ("dp4",), ("dp2xtp2",)),
        # Ulysses cp2 sharded, two replicated dp1 blocks, one without a micro-batch
        ([("dp2xcp2", (0, 1), [2], True, None), ("dp4", (2,), [2], False, "selective"),
          ("dp4", (3,), [0], False, None)], (), ("dp4",)),
        # one block over the world: cp4 all-gather-KV sharded over all 4 ranks
        ([("cp4:kv", (0, 1, 2, 3), [2], True, None)], ("dp2xcp2",), ()),
    ],
    8: [  # cp4 all-gather-KV sharded over 0-3, a sharded dp block 4-5, a replicated tp2 block 6-7
        ([("dp2xcp4:kv", range(4), [1], True, "full"), ("dp8", (4, 5), [2, 1], True, None),
          ("dp4xtp2", (6, 7), [2], False, None)], (), ()),
        # hybrid cp4 (kv2) sharded, a lockstep dp x cp2 block of two dp groups, one idle
        ([("dp2xcp4:kv2", range(4), [2], True, None), ("dp4xcp2", range(4, 8), [1, 0], True, "full")],
         ("dp8",), ()),
        # tp2 x cp2 replicated beside a sharded dp block of 4 ranks (3, 1, 0, 2 micro-batches)
        ([("dp2xtp2xcp2", range(4), [1], False, None), ("dp8", range(4, 8), [3, 1, 0, 2], True, None)],
         (), ("dp4xtp2",)),
        # a tp2 block sharded over its 4 ranks (two dp groups in lockstep) beside a sharded cp4 block
        ([("dp4xtp2", range(4), [2, 1], True, None), ("dp2xcp4:kv", range(4, 8), [1], True, "full")], ("dp8",), ()),
    ],
}


def block_plans(world: int) -> list[StepPlan]:
    """:data:`BLOCK_SHAPES` of ``world`` as step plans over :data:`LENGTHS`: the longest documents go
    to the blocks in order, the rest are dealt to the plain stages (or to the last busy block)."""
    mesh = MeshShape.for_layouts([Layout.parse(x) for x in BLOCK_LAYOUTS[world]], world)
    plans = []
    for step, (blocks, before, after) in enumerate(BLOCK_SHAPES[world]):
        lengths = LENGTHS[step % len(LENGTHS)]
        docs = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        built = []
        for name, ranks, counts, sharded, ac in blocks:
            layout = Layout.parse(name)
            groups = tuple(tuple(tuple(docs.pop(0) for _ in range(min(2, len(docs)))) for _ in range(c))
                           for c in counts)
            built.append((layout, block_dp_groups(layout, mesh, ranks), groups, sharded, ac))
        others = list(before) + list(after)
        rest = sorted(docs)
        if not others:  # the last block with micro-batches takes the rest, two documents each
            k = max(i for i, b in enumerate(built) if any(b[2]))
            layout, dp_groups, groups, sharded, ac = built[k]
            extra = tuple(tuple(rest[i:i + 2]) for i in range(0, len(rest), 2))
            built[k] = (layout, dp_groups, (groups[0] + extra,) + groups[1:], sharded, ac)
        stage = Stage(Layout.parse(blocks[0][0]), (), label="blocks", blocks=tuple(
            Block(layout, dp_groups, groups, sharded=sharded, activation_checkpointing=ac)
            for layout, dp_groups, groups, sharded, ac in built))
        stages: tuple[Stage, ...] = (stage,)
        if others:
            share = -(-len(rest) // len(others))
            normal = [deal(Layout.parse(x), rest[i * share:(i + 1) * share]) for i, x in enumerate(others)]
            stages = tuple(normal[:len(before)]) + (stage,) + tuple(normal[len(before):])
        plans.append(StepPlan(step, tuple(lengths), stages))
    return plans


PAIR_4 = ["dp4:fsdp", "dp2xcp2:fsdp"]
#: (tokens per rank, lengths) for which the planner (llama7b on H100 prices, capacities set small)
#: makes a mixed stage: a 2-rank cp2 block beside two cp1 ranks
MIXED_BATCHES = [(32, [8, 5, 5, 25, 10, 26, 19, 27, 18, 56, 34]),
                 (24, [6, 4, 4, 19, 8, 19, 14, 20, 14, 42, 26]),
                 (48, [46, 38, 33, 16, 29, 38, 34, 12, 20, 18, 33, 21, 21, 26, 28, 7, 44, 56])]


def planner_mixed_plans():
    """One plan per batch of :data:`MIXED_BATCHES`, each as the planner made it (step = index)."""
    from lightning_hotspa.planner.solve.solver import CostModelPlanner

    plans = []
    for step, (tokens, lengths) in enumerate(MIXED_BATCHES):
        planner = CostModelPlanner(PAIR_4, model="llama7b", hardware="H100", static_margin=0.0, mixed_rounds=True,
                                   world_size=4, tokens_per_rank=tokens, activation_checkpointing=False)
        plans.append(planner.plan(step, lengths))
    return plans
