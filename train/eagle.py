"""Train an EAGLE-3, EAGLE-1 or DFlash drafter on a frozen target (target features online per batch, or offline).

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
[feature, token] loss, step_acc = its top-1.
DFlash (`drafter: dflash`, drafters.dflash / drafters.training.dflash): the same fused aux layers, soft labels
and draft vocabulary as EAGLE-3; per row dflash.anchors blocks of dflash.block_size slots at random eligible
anchors, loss weights exp(-(j-1) / dflash.gamma) per slot j; metrics.jsonl step_loss / step_acc = per slot.
With features.dir set (EAGLE-3, DFlash or EAGLE-1) the features are streamed from
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

from accelerate.utils import set_seed

from drafters.draft_vocab import build_draft_vocab, count_tokens, coverage, size_for_coverage
from drafters.training.data import collate
from drafters.training.dflash import (
    DFlashObjective,
    build_dflash_drafter,
    choose_mask_token,
    evaluate_dflash,
    format_dflash_eval,
)
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
from drafters.training.batches import length_sorted_batches, pad_id, train_loader
from drafters.training.loop import RunBase, Summary, fit, start_run
from drafters.training.metrics import StepMetrics
from drafters.training.schema import load_train_recipe
from drafters.training.recipe import RecipeError, run_main

Recipe = EagleRecipe  # this script's schema (tests/test_recipes.py reads each script's `Recipe`)


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
    if recipe.drafter in ("eagle3", "dflash"):
        counts = count_tokens([(e.input_ids, e.loss_mask) for e in train_rows], target.vocab_size)
        if recipe.draft_vocab_coverage is not None:
            size = size_for_coverage(counts, recipe.draft_vocab_coverage)
        else:
            size = min(recipe.draft_vocab_size, target.vocab_size)
            if recipe.draft_vocab_size > target.vocab_size:
                say(f"eagle: draft_vocab_size={recipe.draft_vocab_size} is larger than the target's vocabulary "
                    f"({target.vocab_size}): using {target.vocab_size}")
        vocab = build_draft_vocab(counts, target.vocab_size, size)
        say(f"eagle: draft vocab {size} of {target.vocab_size} ids covers {coverage(counts, size):.2%} of the "
            f"{int(counts.sum())} supervised training tokens ({int((counts > 0).sum())} distinct ids seen)"
            + (f"; draft_vocab_coverage={recipe.draft_vocab_coverage}" if recipe.draft_vocab_coverage else ""))
    if recipe.drafter == "eagle3":
        set_seed(recipe.seed)  # the drafter's initialisation and nothing before it
        drafter = build_eagle3_drafter(recipe, target, vocab)
        say(f"eagle: drafter {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M parameters, "
            f"aux layers {drafter.config.aux_layers}, draft vocab {vocab.size} of {target.vocab_size}")
        objective = Eagle3Objective(drafter, recipe.ttt_steps, recipe.step_weight, recipe.tv_weight)
    elif recipe.drafter == "dflash":
        try:
            mask_token_id = choose_mask_token(train_rows, target.vocab_size, recipe.dflash.mask_token_id)
        except ValueError as err:
            raise RecipeError(f"recipe: {err}") from None
        set_seed(recipe.seed)
        drafter = build_dflash_drafter(recipe, target, vocab, mask_token_id)
        c = drafter.config
        say(f"eagle: DFlash drafter {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M parameters, "
            f"{c.num_hidden_layers} layers, block {c.block_size}, mask token {c.mask_token_id}, aux layers "
            f"{c.aux_layers}, draft vocab {vocab.size} of {target.vocab_size} (target head rows, frozen)")
        objective = DFlashObjective(drafter, recipe.dflash, recipe.seed)
    else:
        set_seed(recipe.seed)
        drafter = build_eagle1_drafter(recipe, target)
        say(f"eagle: EAGLE-1 drafter {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M parameters, "
            f"{drafter.config.feature} features {'from ' + recipe.features.dir if store else 'online'}, "
            f"full vocab {target.vocab_size}")
        objective = Eagle1Objective(drafter, recipe.eagle1, recipe.seed)
    loader = train_loader(recipe, train_rows, pad_id(target)) if store is None else \
        offline_loader(recipe, store, train_rows, pad_id(target))
    eval_batches = length_sorted_batches(held_out, recipe.batch_size)
    eval_batches = [collate(batch, pad_id(target)) for batch in eval_batches] if store is None else \
        offline_batches(store, eval_batches, pad_id(target))
    return fit(recipe, accelerator, target, objective, loader, eval_batches, train_rows, resume, Run, "eagle")


class Run(RunBase):
    def __init__(self, recipe, *args, **kwargs):
        # EAGLE-3: one loss per TTT step; EAGLE-1: [feature SmoothL1, token soft CE] of step 0
        self.step_loss_is = "per TTT step" if recipe.drafter == "eagle3" else "feature, token"
        super().__init__(recipe, *args, **kwargs)
        self.inputs = target_inputs_fn(self.recipe, self.target, self.drafter)  # batch -> (features, labels)

    def micro_step(self, batch: dict, acc: StepMetrics | None) -> StepMetrics:
        """Forward + backward of one micro-batch; metrics are summed into `acc` as tensors."""
        features, target_logits = self.inputs(batch)
        out = self.objective(features, batch["input_ids"], target_logits, batch["loss_mask"],
                             self.target.embed_tokens)
        self.accelerator.backward(out.loss / self.recipe.grad_accum)
        scale = 1.0 / self.recipe.grad_accum
        metrics = StepMetrics(loss=out.loss.detach() * scale, parts=out.step_losses.detach() * scale,
                              correct=out.step_accuracies * out.step_counts,  # (K,) correct top-1 per step
                              counted=out.step_counts, tokens=batch["attention_mask"].sum())
        return metrics if acc is None else acc + metrics

    def held_out(self) -> dict:
        held_out = {"eagle1": evaluate_eagle1, "dflash": evaluate_dflash}.get(self.recipe.drafter, evaluate_eagle3)
        return held_out(self.drafter, self.inputs, self.target.embed_tokens, self.eval_batches, self.recipe,
                        self.accelerator)

    def describe(self, result: dict) -> str:
        return format_dflash_eval(result) if self.recipe.drafter == "dflash" else format_eval(result)


if __name__ == "__main__":
    run_main(main)
