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
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
from accelerate.utils import set_seed
from tqdm import tqdm

from drafters.checkpoint import target_info
from drafters.draft_vocab import build_draft_vocab
from drafters.eagle1 import Eagle1Drafter
from drafters.eagle3 import Eagle3Drafter
from drafters.targets import Target
from drafters.training.data import collate
from drafters.training.eagle1 import Eagle1Objective, build_eagle1_drafter, evaluate_eagle1
from drafters.training.eagle3 import (
    Eagle3Objective,
    EagleRecipe,
    build_eagle3_drafter,
    eagle_problems,
    evaluate_eagle3,
    format_eval,
    target_inputs_fn,
    warn_about_layers,
)
from drafters.training.features import FeatureStore, offline_batches, offline_loader
from drafters.training.loop import (
    MetricsLog,
    Position,
    RunBase,
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
from drafters.training.recipe import run_main

Recipe = EagleRecipe  # this script's schema (tests/test_recipes.py reads each script's `Recipe`)


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
    recipe = load_train_recipe(argv, Recipe, "train/eagle.py", eagle_problems)
    warn_about_layers(recipe)
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
        drafter = build_eagle3_drafter(recipe, target, vocab)
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
                result = evaluate_eagle3(self.drafter, self.inputs, self.target.embed_tokens, self.eval_batches, self.recipe,
                                  self.accelerator)
            result["step"] = step
            tqdm.write(format_eval(result))  # keeps the progress bar intact
            with open(self.output_dir / "eval.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(result) + "\n")
            if self.sink is not None:
                self.sink(result, prefix="eval/")
        self.accelerator.wait_for_everyone()
        return result


if __name__ == "__main__":
    run_main(main)
