"""Train an EAGLE-3 or EAGLE-1 drafter head on a frozen target (target features online per batch, or offline).

    accelerate launch train/eagle.py recipes/eagle3_smollm2.yaml [key=value ...]
    python train/eagle.py recipes/eagle3_tiny.yaml max_steps=3 output_dir=/tmp/run

Flow: recipe -> frozen target -> examples (chat template + assistant loss mask) -> deterministic
train / held-out split -> draft vocabulary counted on the TRAIN examples under the loss mask ->
Eagle3Drafter (lm_head = the target LM head's rows of the draft vocabulary) -> AdamW with linear
warmup then cosine or constant lr -> loop: target features (aux layers + logits, no grad) ->
training-time test unroll -> backward -> clip -> step.
EAGLE-1 (`drafter: eagle1`, drafters.eagle1 / drafters.training.eagle1): Eagle1Drafter on the target's
frozen head and embedding, no draft vocabulary; features = the last hidden state (eagle1.feature) +
logits; loss = eagle1.feature_weight * SmoothL1(feature_{t+1}) + eagle1.token_weight * soft CE(token
t+2), U(-eagle1.noise, eagle1.noise) on the input features while training; metrics.jsonl step_loss =
[feature, token] loss, step_acc = its top-1. With features.dir set (EAGLE-3 or EAGLE-1) the features are streamed from
what `python train/features.py RECIPE` precomputed (drafters.training.features) instead of running the target;
EAGLE-3's soft labels come from the stored final hidden state through the frozen head, at supervised rows.
optim.clip_value (null = off) clips each gradient element before max_grad_norm clips the norm.

Writes to output_dir (relative paths in the recipe are relative to the current directory):
    metrics.jsonl       one row per optimizer step (rewritten by each run), flushed at log steps
    eval.jsonl          one row per held-out evaluation
    checkpoint-{step}/  every save_every steps, and checkpoint-final/ (drafters.checkpoint format)
Metrics come from the main process's batches; tokens/s counts real (non-pad) tokens of all
processes. Knows nothing about decoding trees or export formats.
"""

import json
import math
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Literal

import torch
from accelerate.utils import set_seed
from torch import nn
from tqdm import tqdm

from drafters.checkpoint import target_info
from drafters.training.data import collate
from drafters.draft_vocab import DraftVocab, build_draft_vocab
from drafters.eagle1 import Eagle1Drafter, FrozenHead
from drafters.training.eagle1 import (
    Eagle1Objective,
    Eagle1Options,
    Features,
    build_eagle1_drafter,
    check_eagle1,
    eagle1_inputs_fn,
    evaluate_eagle1,
)
from drafters.eagle3 import Eagle3Config, Eagle3Drafter, TTTOutput, fuse_features, ttt_label_mask
from drafters.export.eagle3 import ENGINE_AUX_LAYERS
from drafters.training.features import FeatureStore, offline_batches, offline_loader
from drafters.losses import HeadRows
from drafters.training.recipe import RecipeError, run_main
from drafters.targets import Target
from drafters.training.loop import (
    MetricsLog,
    Position,
    RunBase,
    TrainRecipe,
    length_sorted_batches,
    load_run_state,
    load_train_recipe,
    lr_factor,
    pad_id,
    plan_steps,
    save_run_checkpoint,
    start_run,
    train_loader,
    train_loop,
    wandb_sink,
)


@dataclass(kw_only=True)
class Recipe(TrainRecipe):  # + target, data, optim, batches, steps, precision, checkpoints, logging
    drafter: Literal["eagle3", "eagle1"] = "eagle3"
    output_dir: str = "outputs/eagle3"
    draft_vocab_size: int = 32000  # capped at the target vocab (with a printed line)
    layers: list[int] | None = None  # HF hidden_states indices; null = [2, L//2, L-3]
    ttt_steps: int = 7
    step_weight: float = 0.8  # loss of TTT step i weighs step_weight ** i
    eagle1: Eagle1Options = field(default_factory=Eagle1Options)  # drafter: eagle1 only
    features: Features = field(default_factory=Features)  # offline features (train/features.py)


@dataclass
class Summary:
    steps: int
    tokens: int
    losses: list[float]  # total loss per optimizer step (main process)
    eval: dict | None
    checkpoint: Path
    target: Target
    drafter: Eagle3Drafter | Eagle1Drafter


def main(argv: list[str]) -> Summary:
    if not argv:
        raise SystemExit("usage: python train/eagle.py RECIPE.yaml [key=value ...]")
    recipe = load_train_recipe(argv, Recipe, "train/eagle.py")
    check(recipe)
    accelerator, target, resume, train_rows, held_out = start_run(recipe, "eagle")
    say = accelerator.print
    store = None
    if recipe.features.dir:  # offline: refuses features computed for other data, target or feature
        store = FeatureStore.open(recipe.features.dir)
        store.check(recipe, target)
        say(store.summary())
    if recipe.drafter == "eagle3":
        if recipe.draft_vocab_size > target.vocab_size:
            say(f"eagle: draft_vocab_size={recipe.draft_vocab_size} is larger than the target's vocabulary "
                f"({target.vocab_size}): using {target.vocab_size}")
        vocab = build_draft_vocab([(e.input_ids, e.loss_mask) for e in train_rows], target.vocab_size,
                                  min(recipe.draft_vocab_size, target.vocab_size))
        set_seed(recipe.seed)  # the drafter's initialisation and nothing before it
        drafter = build_drafter(recipe, target, vocab)
        say(f"eagle: drafter {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M parameters, "
            f"aux layers {drafter.config.aux_layers}, draft vocab {vocab.size} of {target.vocab_size}")
        objective = Eagle3Objective(drafter, recipe.ttt_steps, recipe.step_weight)
    else:
        set_seed(recipe.seed)
        drafter = build_eagle1_drafter(recipe, target)
        say(f"eagle: EAGLE-1 drafter {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M parameters, "
            f"{drafter.config.feature} features {'from ' + recipe.features.dir if store else 'online'}, "
            f"full vocab {target.vocab_size}")
        objective = Eagle1Objective(drafter, recipe.eagle1, recipe.seed)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=recipe.optim.lr, betas=tuple(recipe.optim.betas),
                                  weight_decay=recipe.optim.weight_decay)
    loader = train_loader(recipe, train_rows, pad_id(target)) if store is None else \
        offline_loader(recipe, store, train_rows, pad_id(target))
    sampler = loader.batch_sampler
    objective, optimizer, loader = accelerator.prepare(objective, optimizer, loader)
    total_steps = plan_steps(recipe, len(loader))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, recipe.optim, total_steps))
    accelerator.register_for_checkpointing(scheduler)
    eval_batches = length_sorted_batches(held_out, recipe.batch_size)
    eval_batches = [collate(batch, pad_id(target)) for batch in eval_batches] if store is None else \
        offline_batches(store, eval_batches, pad_id(target))

    output_dir = Path(recipe.output_dir)
    step, position, resumed = 0, Position(), None
    if resume is not None:
        step, position, tokens = load_run_state(accelerator, resume, total_steps)
        resumed = (step, tokens)
        say(f"eagle: resumed from {resume} at step {step} (pass {position.passes}, micro-batch {position.micro})")
    run = Run(recipe, accelerator, target, objective, eval_batches, output_dir, train_rows, sampler, resumed)
    losses = train_loop(run, optimizer, scheduler, loader, sampler, total_steps, step, position)
    result = run.evaluate(total_steps)
    checkpoint = run.save(output_dir / "checkpoint-final", total_steps, result)
    say(f"eagle: {total_steps} steps, {run.tokens_total} tokens; saved {checkpoint}")
    if run.sink is not None:
        run.sink.finish()
    return Summary(total_steps, run.tokens_total, losses, result, checkpoint, target,
                   accelerator.unwrap_model(objective).drafter)


def check(recipe: Recipe) -> None:
    positive = ["draft_vocab_size", "ttt_steps", "batch_size", "grad_accum", "log_every"]
    problems = [f"{name}={getattr(recipe, name)} must be >= 1" for name in positive if getattr(recipe, name) < 1]
    problems += [f"{name}={getattr(recipe, name)} must be >= 0 (0 = off)" for name in
                 ("save_every", "eval_every", "threads") if getattr(recipe, name) < 0]
    problems += [f"{name}={getattr(recipe, name)} must be >= 1 or null" for name in
                 ("epochs", "max_steps") if getattr(recipe, name) is not None and getattr(recipe, name) < 1]
    if recipe.epochs is None and recipe.max_steps is None:
        problems.append("set epochs or max_steps (or both: whichever ends first)")
    if recipe.step_weight <= 0:
        problems.append(f"step_weight={recipe.step_weight} must be > 0")
    data, optim = recipe.data, recipe.optim
    if data.max_length < 3:
        problems.append(f"data.max_length={data.max_length} must be >= 3 (a label needs 2 tokens of context)")
    if not 0 <= data.eval_fraction < 1 or (data.eval_rows is not None and data.eval_rows < 0):
        problems.append(f"data.eval_fraction={data.eval_fraction} must be in [0, 1), data.eval_rows >= 0")
    if optim.lr <= 0 or optim.warmup_steps < 0 or optim.weight_decay < 0:
        problems.append(f"optim.lr={optim.lr} must be > 0, warmup_steps and weight_decay >= 0")
    if len(optim.betas) != 2 or not all(0 <= b < 1 for b in optim.betas):
        problems.append(f"optim.betas={optim.betas} must be two numbers in [0, 1)")
    if optim.max_grad_norm is not None and optim.max_grad_norm <= 0:
        problems.append(f"optim.max_grad_norm={optim.max_grad_norm} must be > 0 or null (no clipping)")
    if optim.clip_value is not None and optim.clip_value <= 0:
        problems.append(f"optim.clip_value={optim.clip_value} must be > 0 or null (no clipping by value)")
    problems += check_eagle1(recipe)
    if problems:
        raise RecipeError("recipe: " + "; ".join(problems))
    if recipe.drafter == "eagle3" and recipe.layers is not None and len(recipe.layers) != ENGINE_AUX_LAYERS:
        print(f"eagle: warning: layers={recipe.layers} are {len(recipe.layers)} aux layers: training works, but "
              f"export to sglang / vllm will refuse the drafter (both engines build fc for exactly "
              f"{ENGINE_AUX_LAYERS}); only --format native keeps it")


# ---- set-up ---------------------------------------------------------------------------------------


def build_drafter(recipe: Recipe, target: Target, vocab: DraftVocab) -> Eagle3Drafter:
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


def target_inputs_fn(recipe: Recipe, target: Target, drafter):
    """-> batch -> (features in the drafter's dtype, target logits (B, T, V) or HeadRows), no grad, for
    recipe.drafter, online (a target forward) or offline (features.dir)."""
    if recipe.drafter == "eagle1":
        return eagle1_inputs_fn(recipe, target, drafter)
    head, dtype = FrozenHead.from_target(target, "normed"), drafter.fc.weight.dtype
    if recipe.features.dir:
        return partial(stored_inputs, head, dtype=dtype)
    return partial(target_inputs, target, head, drafter.config.aux_layers, dtype=dtype)


@torch.no_grad()
def target_inputs(target: Target, head: FrozenHead, aux_layers: list[int], batch: dict, dtype: torch.dtype):
    """-> fused features (B, T, n*h) in the drafter's dtype, the target's logits as HeadRows (computed at
    the supervised rows only, drafters.losses); no grad."""
    out = target.features(batch["input_ids"], batch["attention_mask"], layers=aux_layers, logits=False)
    return fuse_features(out.hidden_states, aux_layers).to(dtype), HeadRows(out.last_hidden, head)


@torch.no_grad()
def stored_inputs(head: FrozenHead, batch: dict, dtype: torch.dtype):
    """target_inputs from offline features (drafters.training.features: fused features and label_hidden stored)."""
    return batch["features"].to(dtype), HeadRows(batch["label_hidden"], head)


# ---- the loop -------------------------------------------------------------------------------------


class Run(RunBase):
    """The pieces of one training run that the loop, the evaluation and the saving share."""

    def __init__(self, recipe, accelerator, target, objective, eval_batches, output_dir: Path, train_rows,
                 sampler, resumed: tuple[int, int] | None = None):
        self.recipe, self.accelerator, self.target = recipe, accelerator, target
        self.objective, self.eval_batches, self.output_dir = objective, eval_batches, output_dir
        self.train_rows, self.sampler = train_rows, sampler
        self.drafter = accelerator.unwrap_model(objective).drafter
        self.inputs = target_inputs_fn(recipe, target, self.drafter)  # batch -> (features, target logits)
        self.sink = wandb_sink(recipe, output_dir, accelerator.is_main_process)
        self.log = MetricsLog(output_dir / "metrics.jsonl", accelerator.is_main_process, resume=resumed,
                              sink=self.sink)
        self.tokens_total = self.log.tokens_total
        if accelerator.is_main_process and resumed is None:
            (output_dir / "eval.jsonl").write_text("")  # a new run starts new files

    def micro_step(self, batch: dict, acc: dict | None) -> dict:
        """Forward + backward of one micro-batch; metrics are summed into `acc` as tensors."""
        features, target_logits = self.inputs(batch)
        out = self.objective(features, batch["input_ids"], target_logits, batch["loss_mask"],
                             self.target.embed_tokens)
        self.accelerator.backward(out.loss / self.recipe.grad_accum)
        scale = 1.0 / self.recipe.grad_accum
        metrics = {
            "loss": out.loss.detach() * scale,
            "step_losses": out.step_losses.detach() * scale,
            "correct": out.step_accuracies * out.step_counts,  # (K,) correct top-1 per step
            "counted": out.step_counts,
            "tokens": batch["attention_mask"].sum(),  # real tokens, no padding
        }
        return metrics if acc is None else {k: acc[k] + v for k, v in metrics.items()}

    def save(self, path: Path, step: int, result: dict | None, position: Position | None = None) -> Path:
        """checkpoint-final: the drafter only; with a data position: resumable (trainer state too)."""
        self.tokens_total = self.log.tokens_total
        checkpoint = {"family": self.recipe.drafter, "config": asdict(self.drafter.config),
                      "target": target_info(self.target), "state_dict": self.drafter.state_dict(),
                      "extra": self.checkpoint_extra(step, result)}
        return save_run_checkpoint(self.accelerator, path, step, position, self.tokens_total, **checkpoint)

    def evaluate(self, step: int) -> dict | None:
        result = None
        if self.eval_batches and self.accelerator.is_main_process:
            if self.recipe.drafter == "eagle1":
                result = evaluate_eagle1(self.drafter, self.inputs, self.target.embed_tokens, self.eval_batches,
                                         self.recipe, self.accelerator)
            else:
                result = evaluate(self.drafter, self.inputs, self.target.embed_tokens, self.eval_batches, self.recipe,
                                  self.accelerator)
            result["step"] = step
            tqdm.write(format_eval(result))  # keeps the progress bar intact
            with open(self.output_dir / "eval.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(result) + "\n")
            if self.sink is not None:
                self.sink(result, prefix="eval/")
        self.accelerator.wait_for_everyone()
        return result


# ---- held-out evaluation --------------------------------------------------------------------------


@torch.no_grad()
def evaluate(drafter: Eagle3Drafter, inputs, embed, batches: list[dict], recipe: Recipe, accelerator) -> dict:
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


if __name__ == "__main__":
    run_main(main)
