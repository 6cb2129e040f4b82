"""Training the EAGLE families (train/eagle.py): the recipe schema both share, EAGLE-3's objective (the
training-time test of drafters.eagle3 on one batch), the target inputs it reads (online: a target
forward per batch; offline: drafters.training.features), and its held-out evaluation. EAGLE-1's own
pieces are in drafters.training.eagle1.
"""

import math
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

import torch
from torch import nn

from drafters.draft_vocab import DraftVocab
from drafters.eagle1 import FrozenHead
from drafters.eagle3 import Eagle3Config, Eagle3Drafter, TTTOutput, fuse_features, ttt_label_mask
from drafters.export.eagle3 import ENGINE_AUX_LAYERS
from drafters.losses import LabelLogits
from drafters.targets import Target
from drafters.training.eagle1 import Eagle1Options, Features, check_eagle1, eagle1_inputs_fn
from drafters.training.loop import TrainRecipe


@dataclass(kw_only=True)
class EagleRecipe(TrainRecipe):  # train/eagle.py's; + target, data, optim, batches, steps, precision, ...
    drafter: Literal["eagle3", "eagle1"] = "eagle3"
    output_dir: str = "outputs/eagle3"
    draft_vocab_size: int = 32000  # capped at the target vocab (with a printed line)
    layers: list[int] | None = None  # HF hidden_states indices; null = [2, L//2, L-3]
    ttt_steps: int = 7
    step_weight: float = 0.8  # loss of TTT step i weighs step_weight ** i
    eagle1: Eagle1Options = field(default_factory=Eagle1Options)  # drafter: eagle1 only
    features: Features = field(default_factory=Features)  # offline features (train/features.py)


def eagle_problems(recipe: EagleRecipe) -> list[str]:
    """The EAGLE fields' problems (the shared sections are TrainRecipe.problems')."""
    problems = [f"{name}={getattr(recipe, name)} must be >= 1" for name in ("draft_vocab_size", "ttt_steps")
                if getattr(recipe, name) < 1]
    if recipe.step_weight <= 0:
        problems.append(f"step_weight={recipe.step_weight} must be > 0")
    return problems + check_eagle1(recipe)


def warn_about_layers(recipe: EagleRecipe, say=print) -> None:
    if recipe.drafter == "eagle3" and recipe.layers is not None and len(recipe.layers) != ENGINE_AUX_LAYERS:
        say(f"eagle: warning: layers={recipe.layers} are {len(recipe.layers)} aux layers: training works, but "
            f"export to sglang / vllm will refuse the drafter (both engines build fc for exactly "
            f"{ENGINE_AUX_LAYERS}); only --format native keeps it")


# ---- set-up ---------------------------------------------------------------------------------------


def build_eagle3_drafter(recipe: EagleRecipe, target: Target, vocab: DraftVocab) -> Eagle3Drafter:
    config = Eagle3Config.from_target_config(target.config, vocab.size, recipe.layers)
    drafter = Eagle3Drafter(config, vocab).to(target.device)
    drafter.init_from_target(target.lm_head.weight.float(), vocab)  # rows of the draft vocab's ids
    return drafter


class Eagle3Objective(nn.Module):
    """What accelerate prepares (DDP syncs gradients through forward): the training-time test of
    `drafter` on one batch. The target stays outside; its features and embedding are arguments."""

    def __init__(self, drafter: Eagle3Drafter, steps: int, step_weight: float):
        super().__init__()
        self.drafter, self.steps, self.step_weight = drafter, steps, step_weight

    def forward(self, features, input_ids, target_logits, loss_mask, embed) -> TTTOutput:
        return self.drafter.ttt_forward(features, input_ids, target_logits, loss_mask, embed,
                                        steps=self.steps, step_weight=self.step_weight)


def target_inputs_fn(recipe: EagleRecipe, target: Target, drafter):
    """-> batch -> (features in the drafter's dtype, target logits (B, T, V) or LabelLogits), no grad, for
    recipe.drafter, online (a target forward) or offline (features.dir)."""
    if recipe.drafter == "eagle1":
        return eagle1_inputs_fn(recipe, target, drafter)
    head, dtype = FrozenHead.from_target(target, "normed"), drafter.fc.weight.dtype
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
def stored_inputs(head: FrozenHead, batch: dict, dtype: torch.dtype):
    """target_inputs from offline features (drafters.training.features: fused features and label_hidden stored)."""
    return batch["features"].to(dtype), LabelLogits(batch["label_hidden"], head)


# ---- held-out evaluation --------------------------------------------------------------------------


@torch.no_grad()
def evaluate_eagle3(drafter: Eagle3Drafter, inputs, embed, batches: list[dict], recipe: EagleRecipe, accelerator) -> dict:
    """Per TTT step k (k = 1 .. K, step k drafts the k-th token of a chain):
        acc_k          = correct top-1 / supervised positions (target argmax outside the draft vocab
                         counts as a miss: the drafter can never propose it)
        acc_in_vocab_k = correct top-1 / supervised positions whose target argmax is in the vocab
        tau_pred       = 1 + sum_{k=1..K} prod_{j<=k} acc_j
    TTT step k is teacher-forced on the true tokens but on the drafter's own hidden states, so acc_k
    estimates P(draft k accepted | drafts 1..k-1 accepted) and tau_pred the mean accepted length
    (bonus token included) of a greedy chain of K drafts. It ignores trees and sampling."""
    drafter.eval()
    steps = recipe.ttt_steps
    correct, counted, supervised = (torch.zeros(steps, device=accelerator.device) for _ in range(3))
    loss = torch.zeros((), device=accelerator.device)
    for batch in batches:
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        features, target_logits = inputs(batch)  # online or offline, as in training
        with accelerator.autocast():
            out = drafter.ttt_forward(features, batch["input_ids"], target_logits, batch["loss_mask"],
                                      embed, steps=steps, step_weight=recipe.step_weight)
        correct += out.step_accuracies * out.step_counts
        counted += out.step_counts
        supervised += torch.stack([ttt_label_mask(batch["loss_mask"], k).sum() for k in range(steps)])
        loss += out.loss
    accuracy = (correct / supervised.clamp(min=1)).tolist()
    tau_pred = 1 + sum(math.prod(accuracy[:k + 1]) for k in range(steps))
    return {"loss": (loss / len(batches)).item(), "step_acc": accuracy,
            "step_acc_in_vocab": (correct / counted.clamp(min=1)).tolist(),
            "supervised": int(supervised[0]), "tau_pred": tau_pred}


def format_eval(result: dict) -> str:
    accuracy = " ".join(f"{a:.3f}" for a in result["step_acc"])
    return (f"eval @ step {result['step']}: loss {result['loss']:.4f}, per-TTT-step top-1 accuracy [{accuracy}] "
            f"over {result['supervised']} supervised tokens; tau_pred (chain of {len(result['step_acc'])}, "
            f"1 + sum_k prod_(j<=k) acc_j) = {result['tau_pred']:.3f}")
