"""Training EAGLE-3 (drafter: eagle3): its recipe, the objective (the training-time test of drafters.eagle3 on one
batch), the target inputs it reads (online: a target forward per batch; offline: drafters.training.features),
its held-out evaluation, and the run of every feature-level family. DFlash, DSpark and P-EAGLE read the same
inputs and draft vocabulary (their entries in drafters.training.families name these functions); each family's
own recipe and objective are in its own module.
"""

from contextlib import nullcontext
from dataclasses import dataclass, field, fields, replace
from functools import partial
from typing import ClassVar, Literal

import torch
from torch import Tensor, nn

from drafters.acceptance import chain_tau
from drafters.draft_vocab import DraftVocab, build_draft_vocab, count_tokens, coverage, size_for_coverage
from drafters.eagle3 import Eagle3Config, Eagle3Drafter, fuse_features
from drafters.layers import ENGINE_AUX_LAYERS, ttt_label_mask, ttt_label_rows
from drafters.losses import (DIVERGENCES, LabelLogits, NextTokenHead, dpace_weights, soft_cross_entropy,
                             supervised_targets)
from drafters.targets import FrozenHead, Target, default_eagle3_layers
from drafters.training.loop import FeatureBatch
from drafters.training.recipe import RecipeError
from drafters.training.schema import DraftVocabRecipe, DrafterNorms, FeatureRecipe


@dataclass
class Eagle3Options:  # the recipe's `eagle3:` section: what EAGLE-3 alone reads
    ttt_steps: int = 7
    step_weight: float = 0.8  # the loss of TTT step i weighs step_weight ** i (step_weights: fixed)
    # fixed: step_weight ** i; dpace: each batch's weights from D-PACE's derivation (dpace_step_weights), which
    # follow the drafter's measured acceptance per step instead of a constant decay
    step_weights: Literal["fixed", "dpace"] = "fixed"
    dpace_alpha: float = 0.5  # dpace: the smoothing of each step's acceptance towards 1 (SpecForge's default)
    # each position's loss adds tv_weight x the total variation distance between the target's and the draft's
    # distributions (1 - P(a sampled draft is accepted); drafters.losses.soft_cross_entropy)
    tv_weight: float = 0.0
    # each position's loss between the target's and the draft's distributions (drafters.losses.divergence_rows):
    # kl (EAGLE's soft cross-entropy), reverse_kl, jsd, lk (-log of the acceptance probability, the LK loss) or
    # argmax (hard labels: cross-entropy against the target's argmax)
    divergence: str = "kl"
    # the drafter's decoder layer starts as this target decoder layer (an index into the target's layers, -1 = the
    # last; Eagle3Drafter.init_layer_from), not random; null = random (SpecForge's start)
    init_layer: int | None = None
    # the drafter's decoder layers: 1 is EAGLE-3's (and all SGLang and llama.cpp serve); more stacks plain Llama layers
    # on the first (drafters.eagle3.Eagle3DeeperLayer), as vLLM's llama_eagle3 loads them
    num_layers: int = 1
    # with init_from: num_layers above the checkpoint's; its layers keep their weights and the added ones start as the
    # identity (o_proj = down_proj = 0), so the deeper drafter starts drafting exactly what the checkpoint drafted
    grow_layers: bool = False
    # the held-out evaluation's chain depth (evaluate_eagle3); null = ttt_steps. Set it to compare runs trained
    # at different depths on one scale
    eval_ttt_steps: int | None = None
    # what the loss keeps that grows with the draft vocabulary Vd (drafters.losses.LinearSoftCrossEntropy):
    # table = the (N, Vd) float32 label table and each TTT step's (Vd, h) head gradient, kept from forward to
    # backward (fastest); recompute = neither: labels and gradients recomputed chunk by chunk in backward, memory flat
    # in Vd beyond the weights, for about twice the LM heads' matmuls (report/memory)
    vocab_memory: Literal["table", "recompute"] = "table"
    # the LM head keeps the target's rows of the draft vocabulary (init_from_target) and is not trained, as
    # speculators does: no float32 gradient and AdamW moments for it (Vd x h x 12 bytes: 0.11 GiB at 16,384 x 576)
    # and no dL/dW matmul in backward; what it costs in acceptance: report/peers/README.md
    freeze_head: bool = False


@dataclass(kw_only=True)
class Eagle3Recipe(DraftVocabRecipe, DrafterNorms):  # + target, data, optim, ..., layers, features, draft vocab, norms
    drafter: Literal["eagle3"] = "eagle3"
    output_dir: str = "outputs/eagle3"
    eagle3: Eagle3Options = field(default_factory=Eagle3Options)
    reads_text: ClassVar[bool] = True  # features.source=text: text_inputs
    # earlier releases read these at the top level: moved under eagle3: with a deprecation line, for this release
    moved_keys: ClassVar[dict[str, str]] = {f.name: "eagle3" for f in fields(Eagle3Options)}

    def problems(self) -> list[str]:
        return super().problems() + self.norm_problems() + check_eagle3(self.eagle3, self.init_from)


def check_eagle3(o: Eagle3Options, init_from: str | None) -> list[str]:
    problems = []
    if o.ttt_steps < 1:
        problems.append(f"eagle3.ttt_steps={o.ttt_steps} must be >= 1")
    if o.step_weight <= 0:
        problems.append(f"eagle3.step_weight={o.step_weight} must be > 0")
    if o.step_weights not in ("fixed", "dpace"):
        problems.append(f"eagle3.step_weights={o.step_weights!r}: use fixed (step_weight ** i) or dpace (from the "
                        "acceptance measured per step)")
    if not 0.0 <= o.dpace_alpha <= 1.0:
        problems.append(f"eagle3.dpace_alpha={o.dpace_alpha} must be in [0, 1] (0 = the raw acceptance, 1 = none: "
                        "weights K - i)")
    if o.tv_weight < 0:
        problems.append(f"eagle3.tv_weight={o.tv_weight} must be >= 0 (0 = the divergence alone)")
    if o.divergence not in DIVERGENCES:
        problems.append(f"eagle3.divergence={o.divergence!r} is not a loss EAGLE-3 trains with: use one of "
                        f"{', '.join(DIVERGENCES)}")
    if o.vocab_memory not in ("table", "recompute"):
        problems.append(f"eagle3.vocab_memory={o.vocab_memory!r}: use table (keep the label table, fastest) or "
                        "recompute (memory flat in the draft vocabulary)")
    if o.num_layers < 1:
        problems.append(f"eagle3.num_layers={o.num_layers} must be >= 1 (EAGLE-3's drafter is one decoder layer)")
    if o.grow_layers and init_from is None:
        problems.append("eagle3.grow_layers=true stacks layers on init_from's checkpoint: set init_from, or drop "
                        "grow_layers (a fresh run builds eagle3.num_layers layers anyway)")
    if o.eval_ttt_steps is not None and o.eval_ttt_steps < 1:
        problems.append(f"eagle3.eval_ttt_steps={o.eval_ttt_steps} must be >= 1 or null (null = ttt_steps)")
    return problems


def warn_about_layers(recipe: FeatureRecipe, say=print) -> None:
    if recipe.layers is not None and len(recipe.layers) != ENGINE_AUX_LAYERS:
        say(f"eagle: warning: layers={recipe.layers} are {len(recipe.layers)} aux layers: training works, but "
            f"export to sglang / vllm will refuse the drafter (both engines build fc for exactly "
            f"{ENGINE_AUX_LAYERS}); only --format native keeps it")


# ---- set-up ---------------------------------------------------------------------------------------


def eagle3_layer_spec(recipe: FeatureRecipe, target: Target) -> dict:
    """What an EAGLE-3 feature store holds (drafters.training.features), also DFlash's: spec["features"] =
    "fused:2,15,27" (the aux layers, HF hidden_states indices) is compared on reading."""
    layers = default_eagle3_layers(target.num_layers) if recipe.layers is None else list(recipe.layers)
    return {"features": "fused:" + ",".join(map(str, layers)), "layers": layers,
            "what": f"cat(hidden_states[l] for l in {layers}): the EAGLE-3 fusion input, n*h wide",
            "label_hidden": "hidden_states[L], final-normed: soft labels = frozen head at supervised rows"}


def choose_draft_vocab(recipe: DraftVocabRecipe, target: Target, train_rows, say,
                       keep: DraftVocab | None = None) -> DraftVocab:
    """The draft vocabulary (EAGLE-3, DFlash): the draft_vocab_size (or draft_vocab_coverage) most frequent
    supervised token ids of the TRAIN rows (docs/conventions.md), with a printed line on its coverage. keep:
    init_from's vocabulary under grow_vocab, which the new one must hold and exceed."""
    counts = count_tokens([(e.input_ids, e.loss_mask) for e in train_rows], target.vocab_size)
    if recipe.draft_vocab_coverage is not None:
        size = size_for_coverage(counts, recipe.draft_vocab_coverage)
    else:
        size = min(recipe.draft_vocab_size, target.vocab_size)
        if recipe.draft_vocab_size > target.vocab_size:
            say(f"eagle: draft_vocab_size={recipe.draft_vocab_size} is larger than the target's vocabulary "
                f"({target.vocab_size}): using {target.vocab_size}")
    if keep is not None and size <= keep.size:
        wanted = f"draft_vocab_coverage={recipe.draft_vocab_coverage}" if recipe.draft_vocab_coverage is not None \
            else f"draft_vocab_size={recipe.draft_vocab_size}"
        raise RecipeError(f"grow_vocab: {wanted} makes a vocabulary of {size} ids on this data, but init_from's "
                          f"already holds {keep.size}: set draft_vocab_size above {keep.size} (with "
                          "draft_vocab_coverage=null), or drop grow_vocab to keep the checkpoint's")
    vocab = build_draft_vocab(counts, target.vocab_size, size, keep=keep)
    say(f"eagle: draft vocab {size} of {target.vocab_size} ids covers {coverage(counts, vocab):.2%} of the "
        f"{int(counts.sum())} supervised training tokens ({int((counts > 0).sum())} distinct ids seen)"
        + (f"; draft_vocab_coverage={recipe.draft_vocab_coverage}" if recipe.draft_vocab_coverage else "")
        + (f"; grow_vocab: holds init_from's {keep.size} ids" if keep is not None else ""))
    return vocab


def build_eagle3(recipe: Eagle3Recipe, target: Target, train_rows, vocab: DraftVocab, say) -> "Eagle3Objective":
    """The family's build (drafters.training.families.TrainingFamily): the drafter, wrapped in its TTT objective."""
    warn_about_layers(recipe, say)
    drafter = build_eagle3_drafter(recipe, target, vocab)
    say(f"eagle: drafter {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M parameters, "
        f"{drafter.config.num_hidden_layers} decoder layer{'s' if drafter.config.num_hidden_layers > 1 else ''}, "
        f"aux layers {drafter.config.aux_layers}, draft vocab {vocab.size} of {target.vocab_size}")
    return Eagle3Objective(drafter, TTTOptions.of(recipe.eagle3))


def build_eagle3_drafter(recipe: Eagle3Recipe, target: Target, vocab: DraftVocab, config: Eagle3Config | None = None,
                         module: type = Eagle3Drafter) -> Eagle3Drafter:
    # config / module: a family built on EAGLE-3 (EAGLE-4) hands its own; the head and init_layer start as EAGLE-3's
    if config is None:
        config = Eagle3Config.from_target_config(target.config, vocab.size, recipe.layers,
                                                 num_layers=recipe.eagle3.num_layers, **recipe.norms())
    drafter = module(config, vocab).to(target.device)
    drafter.init_from_target(target.lm_head.weight.float(), vocab)  # rows of the draft vocab's ids
    drafter.lm_head.weight.requires_grad_(not recipe.eagle3.freeze_head)  # the optimizer takes what requires grad
    init_layer = recipe.eagle3.init_layer
    if init_layer is not None:
        layers = target.decoder_layers
        if not -len(layers) <= init_layer < len(layers):
            raise RecipeError(f"eagle3.init_layer={init_layer} is not a decoder layer of {target.name} "
                              f"({len(layers)} layers: 0 .. {len(layers) - 1}, or -1 for the last)")
        try:
            drafter.init_layer_from(layers[init_layer])
        except ValueError as err:
            raise RecipeError(f"eagle3.init_layer={init_layer}: {err}") from None
    return drafter


@dataclass
class TTTOutput:
    loss: Tensor  # () sum_i weight^i * loss_i
    step_losses: Tensor  # (K,)
    step_accuracies: Tensor  # (K,)
    step_counts: Tensor  # (K,) positions counted in each step's loss
    step_logits: list[Tensor]  # if asked, step i: (B, T-1-i, Vd) at positions t = 0 .. T-2-i


@dataclass(frozen=True)
class TTTOptions:
    """How ttt_loss scores the training-time test: loss = sum_{i < steps} step_weight^i loss_i, loss_i step i's
    `divergence` (+ tv_weight x the total variation, drafters.losses) at its counted positions."""

    steps: int = 7  # K TTT steps
    step_weight: float = 0.8
    step_weights: str = "fixed"  # or "dpace": dpace_step_weights of the batch's step accuracies
    dpace_alpha: float = 0.5
    tv_weight: float = 0.0
    divergence: str = "kl"
    # positions: loss_i sums over counted positions / (B*T), the official trainer's and SpecForge's "averaged over
    # all positions"; counted: the mean over them
    normalize: str = "positions"
    # nothing kept that grows with the draft vocabulary (vocab_memory=recompute): the labels are a
    # drafters.losses.RecomputedLabels and the fused head computes its gradients in backward
    recompute: bool = False

    @classmethod
    def of(cls, o: Eagle3Options) -> "TTTOptions":  # the recipe's eagle3 section
        return cls(o.ttt_steps, o.step_weight, o.step_weights, o.dpace_alpha, o.tv_weight, o.divergence,
                   recompute=o.vocab_memory == "recompute")


def dpace_step_weights(accuracies: Tensor, counts: Tensor, alpha: float) -> Tensor:
    """D-PACE's weights (drafters.losses.dpace_weights) over the TTT steps, a chain of K drafts: a_k, step k's
    accuracy on the batch, stands for the acceptance of the draft at depth k, so that step i's weight is
    dE[L]/dlog s_i = sum_{j>=i} prod_{k<=j} s_k (E[L] = sum_j prod_{k<=j} s_k, the smoothed expected accepted
    length); a step with nothing counted is left out. Scaled so that w_0 = 1, as 0.8^0. accuracies, counts (K,) ->
    w (K,)"""
    weights = dpace_weights(accuracies.detach(), counts > 0, alpha)
    return weights / weights[0].clamp_min(torch.finfo(weights.dtype).tiny)


def ttt_loss(drafter: Eagle3Drafter, batch: FeatureBatch, options: TTTOptions = TTTOptions(), *,
             return_logits: bool = False) -> TTTOutput:
    """The EAGLE-3 objective on one batch: drafter.ttt_unroll's K = options.steps steps, each scored by the soft
    cross-entropy (or another `divergence`) against the target's distribution renormalised over the draft
    vocabulary, weighted step_weight^i (TTTOptions). batch.target_logits (B, T, V), or drafters.losses.LabelLogits
    (read only at the supervised rows, so the full (B, T, V) logits need not exist); batch.loss_mask (B, T),
    loss_mask[s] = 1 iff token s is learnt. return_logits keeps each step's draft logits in the output (tests; costs
    memory)."""
    o = options
    if o.normalize not in ("positions", "counted"):
        raise ValueError(f"normalize={o.normalize!r}: use 'positions' or 'counted'")
    loss_mask = batch.loss_mask
    batch_size, seq_len = batch.input_ids.shape
    # Only supervised positions are scored: norm + lm_head + soft CE run on their rows alone (prompt and
    # padding rows are skipped). Every step's label row r = t+1+i is supervised iff loss_mask[r+1] = 1,
    # the same rows at all steps, so the target side is computed once there.
    rows, targets = supervised_targets(drafter, batch.target_logits, loss_mask, recompute=o.recompute)
    if o.normalize == "positions":
        num_positions = batch_size * seq_len if batch.num_positions is None else batch.num_positions
    else:
        num_positions = None
    metrics, step_logits = [], []
    for step, hidden in drafter.ttt_unroll(batch.features, batch.input_ids, batch.embed, o.steps):
        label_rows = ttt_label_rows(rows, step)  # (B, T-1-i) index into targets, -1 = none
        label_mask = ttt_label_mask(loss_mask, step).bool()  # (B, T-1-i)
        counted = label_mask & (label_rows >= 0)  # supervised AND target argmax in vocab
        counted_rows = label_rows[counted]  # (M,) M = counted positions of this step
        num_rows = label_mask.shape[1]
        argmax_draft = targets[1][counted_rows]  # (M,)
        if return_logits:  # tests: every position's logits, scored at the counted ones
            target_p = targets[0][counted_rows]  # (M, Vd)
            logits = drafter.compute_logits(hidden[:, :num_rows])  # (B, T-1-i, Vd)
            step_logits.append(logits)
            all_counted = torch.ones_like(counted_rows, dtype=torch.bool)  # (M,)
            metrics.append(soft_cross_entropy(logits[counted], target_p, all_counted, argmax_draft,
                                              all_counted, num_positions=num_positions, tv_weight=o.tv_weight,
                                              divergence=o.divergence))
        else:  # the same loss, LM head fused in: no (M, Vd) tensor is held for backward
            normed = drafter.head_input(hidden[:, :num_rows][counted])  # (M, h)
            # the step's label rows are read from the whole table a chunk at a time (no (M, Vd) copy per step);
            # a module call: sharding engines (ZeRO-3, FSDP) gather the head's weight around it
            metrics.append(drafter.lm_head(normed, targets[0], argmax_draft, num_positions=num_positions,
                                           tv_weight=o.tv_weight, divergence=o.divergence, target_rows=counted_rows,
                                           recompute=o.recompute))
    step_losses, step_accuracies, step_counts = (torch.stack(m) for m in zip(*metrics))
    if o.step_weights == "dpace":
        weights = dpace_step_weights(step_accuracies, step_counts, o.dpace_alpha)
    else:
        weights = o.step_weight ** torch.arange(o.steps, device=step_losses.device)  # 0.8^i
    return TTTOutput(loss=(weights * step_losses).sum(), step_losses=step_losses,
                     step_accuracies=step_accuracies, step_counts=step_counts, step_logits=step_logits)


class Eagle3Objective(nn.Module):
    """What accelerate prepares (DDP syncs gradients through forward): the training-time test of
    `drafter` on one batch. The target stays outside; its features and embedding are arguments."""

    def __init__(self, drafter: Eagle3Drafter, options: TTTOptions):
        super().__init__()
        self.drafter, self.options = drafter, options

    def forward(self, features, input_ids, target_logits, loss_mask, embed, num_positions=None) -> TTTOutput:
        return ttt_loss(self.drafter, FeatureBatch(features, input_ids, target_logits, loss_mask, embed,
                                                   num_positions), self.options)


def target_inputs_fn(recipe: FeatureRecipe, target: Target, drafter):
    """-> batch -> (fused features in the drafter's dtype, target logits (B, T, V) as LabelLogits), no grad, for
    EAGLE-3 and DFlash, online (a target forward) or offline (features.dir); features.source=text (EAGLE-3): no
    target forward at all (text_inputs)."""
    head, dtype = FrozenHead.from_target(target, "normed"), drafter.fc.weight.dtype
    if recipe.features.source == "text":
        return partial(text_inputs, target.embed_tokens, len(drafter.config.aux_layers), head.out_features,
                       dtype=dtype)
    if recipe.features.dir:
        return partial(stored_inputs, head, dtype=dtype)
    return partial(target_inputs, target, head, drafter.config.aux_layers, dtype=dtype)


@torch.no_grad()
def target_inputs(target: Target, head: FrozenHead, aux_layers: list[int], batch: dict, dtype: torch.dtype):
    """-> fused features (B, T, n*h) in the drafter's dtype, the target's logits as LabelLogits (computed at
    the supervised rows only, drafters.losses); no grad."""
    out = target.features(batch["input_ids"], batch["attention_mask"], layers=aux_layers, logits=False)
    return fuse_features(out.hidden_states, aux_layers).to(dtype), LabelLogits(out.last_hidden, head)


@torch.no_grad()
def text_inputs(embed: nn.Module, num_aux: int, vocab_size: int, batch: dict, dtype: torch.dtype):
    """target_inputs for a pass over raw text, where the target never runs (features.source: text): the fused
    features are its embedding output, HF hidden_states[0] = embed(x_t), in each of the n aux slots, (B, T, n*h);
    the labels of row t are the data's token t+1 (NextTokenHead: cross-entropy on the text, over the draft
    vocabulary). The drafter's layer, fc and head learn the language from the text alone, and a later stage on the
    target's features (init_from, or the next of `stages:`) teaches fc what the deeper layers add. The last row has
    no next token: it repeats its own id, and no loss reads it (a label at row r needs loss_mask[r+1])."""
    ids = batch["input_ids"]  # (B, T)
    features = embed(ids).to(dtype).repeat(1, 1, num_aux)  # (B, T, n*h): cat of the same (B, T, h) n times
    next_ids = torch.cat([ids[:, 1:], ids[:, -1:]], 1)  # (B, T): row t -> x_{t+1}
    return features, LabelLogits(next_ids.unsqueeze(-1), NextTokenHead(vocab_size))


@torch.no_grad()
def stored_inputs(head: FrozenHead, batch: dict, dtype: torch.dtype):
    """target_inputs from offline features (drafters.training.features: fused features and label_hidden stored)."""
    return batch["features"].to(dtype), LabelLogits(batch["label_hidden"], head)


# ---- held-out evaluation --------------------------------------------------------------------------


@torch.no_grad()
def heldout_accuracy(drafter: Eagle3Drafter, inputs, embed, batches, options: TTTOptions, device,
                     autocast=nullcontext) -> dict:
    """Per TTT step k (k = 1 .. K = options.steps, step k drafts the k-th token of a chain):
        acc_k          = correct top-1 / supervised positions (target argmax outside the draft vocab
                         counts as a miss: the drafter can never propose it)
        acc_in_vocab_k = correct top-1 / supervised positions whose target argmax is in the vocab
        tau_pred       = 1 + sum_{k=1..K} prod_{j<=k} acc_j
    TTT step k is teacher-forced on the true tokens but on the drafter's own hidden states, so acc_k
    estimates P(draft k accepted | drafts 1..k-1 accepted) and tau_pred the mean accepted length
    (bonus token included) of a greedy chain of K drafts. It ignores trees and sampling.
    `inputs(batch) -> (features, target logits)`: online (the target's forward) or from a store; `loss` is the
    mean of ttt_loss over the batches. Training's evaluation and eval/heldout.py both score this way."""
    steps = options.steps
    correct, counted, supervised = (torch.zeros(steps, device=device) for _ in range(3))  # counts: exact < 2^24
    loss, n = torch.zeros((), device=device), 0
    for batch in batches:
        batch = {k: v.to(device) for k, v in batch.items()}
        features, target_logits = inputs(batch)
        with autocast():
            out = ttt_loss(drafter, FeatureBatch(features, batch["input_ids"], target_logits, batch["loss_mask"],
                                                 embed), options)
        correct += out.step_accuracies * out.step_counts
        counted += out.step_counts
        supervised += torch.stack([ttt_label_mask(batch["loss_mask"], k).sum() for k in range(steps)])
        loss, n = loss + out.loss, n + 1
    accuracy = (correct / supervised.clamp(min=1)).tolist()
    return {"loss": (loss / max(n, 1)).item(), "step_acc": accuracy,
            "step_acc_in_vocab": (correct / counted.clamp(min=1)).tolist(),
            "supervised": int(supervised[0]), "tau_pred": chain_tau(accuracy)}


def evaluate_eagle3(drafter: Eagle3Drafter, inputs, embed, batches: list[dict], recipe: Eagle3Recipe,
                    accelerator) -> dict:
    """heldout_accuracy over the recipe's held-out batches at eval_ttt_steps (or ttt_steps), under the run's
    autocast: the figures every EAGLE-3 run prints and writes to eval.jsonl."""
    drafter.eval()
    o = recipe.eagle3
    options = replace(TTTOptions.of(o), steps=o.eval_ttt_steps or o.ttt_steps, recompute=False)  # no backward
    return heldout_accuracy(drafter, inputs, embed, batches, options, accelerator.device, accelerator.autocast)


def format_eval(result: dict) -> str:
    accuracy = " ".join(f"{a:.3f}" for a in result["step_acc"])
    return (f"eval @ step {result['step']}: loss {result['loss']:.4f}, per-TTT-step top-1 accuracy [{accuracy}] "
            f"over {result['supervised']} supervised tokens; tau_pred (chain of {len(result['step_acc'])}, "
            f"1 + sum_k prod_(j<=k) acc_j) = {result['tau_pred']:.3f}")


# ---- the run ----------------------------------------------------------------------------------------
