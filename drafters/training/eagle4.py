"""Training EAGLE-4 (drafter: eagle4): its recipe, the two stages, and the held-out evaluation with candidate recall.

    stage 1  EAGLE-3's training-time test (drafters.training.eagle3: ttt_loss with the `eagle3:` section's options,
             the shared optim, max_steps / epochs) on the windowed drafter; the candidate head is frozen
    stage 2  after stage 1's last step: every stage-1 weight frozen, the candidate head re-initialised as the
             truncated SVD of the trained lm_head, then A and B alone trained for eagle4.stage2_steps AdamW steps
             at eagle4.stage2_lr on candidate_loss (every TTT depth), on the training rows in stage 1's batch order

Inputs (fused aux layers, online), the draft vocabulary and the loop are EAGLE-3's. Stage 2's metrics go to
candidate_head.jsonl in the output directory; the held-out evaluation adds candidate recall per depth.
"""

import json
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from drafters.draft_vocab import DraftVocab
from drafters.eagle4 import Eagle4Config, Eagle4Drafter, candidate_recall
from drafters.layers import ttt_label_mask
from drafters.training.batches import pad_id, padding
from drafters.training.data import collate
from drafters.training.eagle3 import (Eagle3Objective, Eagle3Options, TTTOptions, build_eagle3_drafter, check_eagle3,
                                      evaluate_eagle3, format_eval, warn_about_layers)
from drafters.training.loop import FeatureBatch, FeatureRun
from drafters.training.recipe import RecipeError
from drafters.training.schema import DraftVocabRecipe, DrafterNorms


@dataclass
class Eagle4Options:  # the recipe's `eagle4:` section
    rank: int = 64  # r of the candidate head A (Vd x r) B (r x h)
    candidates: int = 64  # k: the low-rank head's top-k, rescored by the full head
    window: int | None = None  # every decoder layer attends within this many positions (null: full attention)
    stage2_steps: int = 100  # AdamW steps on A and B after stage 1 (0: the SVD initialisation alone)
    stage2_lr: float = 1.0e-3


@dataclass(kw_only=True)
class Eagle4Recipe(DraftVocabRecipe, DrafterNorms):  # + target, data, optim, ..., layers, draft vocab, norms
    drafter: Literal["eagle4"] = "eagle4"
    output_dir: str = "outputs/eagle4"
    eagle3: Eagle3Options = field(default_factory=Eagle3Options)  # stage 1's training-time test
    eagle4: Eagle4Options = field(default_factory=Eagle4Options)

    def problems(self) -> list[str]:
        return super().problems() + self.norm_problems() + check_eagle3(self.eagle3, self.init_from) + \
            check_eagle4(self)


def check_eagle4(recipe: Eagle4Recipe) -> list[str]:
    o, problems = recipe.eagle4, []
    vocab = recipe.draft_vocab_size if recipe.draft_vocab_coverage is None else None  # else known after counting
    if o.rank < 1 or (vocab is not None and o.rank > vocab):
        problems.append(f"eagle4.rank={o.rank} must be in [1, min(draft vocabulary, hidden size)]: the candidate "
                        "head is a rank-r factorisation of the draft head")
    if o.candidates < 1 or (vocab is not None and o.candidates > vocab):
        problems.append(f"eagle4.candidates={o.candidates} must be in [1, draft_vocab_size={recipe.draft_vocab_size}]")
    if o.window is not None and o.window < 1:
        problems.append(f"eagle4.window={o.window} must be >= 1 position, or null (full attention)")
    if o.stage2_steps < 0:
        problems.append(f"eagle4.stage2_steps={o.stage2_steps} must be >= 0")
    if o.stage2_lr <= 0:
        problems.append(f"eagle4.stage2_lr={o.stage2_lr} must be > 0")
    if recipe.features.dir:
        problems.append(f"features.dir={recipe.features.dir}: EAGLE-4 trains online only (its stage 2 reads the "
                        "training rows again); set features.dir=null")
    return problems


def target_problems(o: Eagle4Options, vocab_size: int, text_config) -> list[str]:
    """The eagle4 fields that need the target and the counted draft vocabulary: one sentence each."""
    problems, hidden = [], text_config.hidden_size
    if o.rank > min(vocab_size, hidden):
        problems.append(f"eagle4.rank={o.rank} is larger than the draft head ({vocab_size} x {hidden}), whose rank "
                        f"is at most {min(vocab_size, hidden)}")
    if o.candidates > vocab_size:
        problems.append(f"eagle4.candidates={o.candidates} is more than the draft vocabulary ({vocab_size} ids)")
    if o.window is not None and o.window > text_config.max_position_embeddings:
        problems.append(f"eagle4.window={o.window} is larger than the target's context (max_position_embeddings="
                        f"{text_config.max_position_embeddings})")
    return problems


def build_eagle4(recipe: Eagle4Recipe, target, train_rows, vocab: DraftVocab, say) -> "Eagle4Objective":
    o = recipe.eagle4
    problems = target_problems(o, vocab.size, target.config.get_text_config())
    if problems:
        raise RecipeError("recipe: " + "; ".join(problems))
    warn_about_layers(recipe, say)
    config = Eagle4Config.from_target_config(target.config, vocab.size, recipe.layers, recipe.eagle3.num_layers,
                                             rank=o.rank, candidates=o.candidates, window=o.window, **recipe.norms())
    drafter = build_eagle3_drafter(recipe, target, vocab, config=config, module=Eagle4Drafter)
    for p in drafter.candidate_parameters:  # stage 1 trains everything else
        p.requires_grad_(False)
    say(f"eagle: EAGLE-4 drafter {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M parameters, candidate head "
        f"rank {o.rank}, {o.candidates} candidates, window {o.window or 'none'}, aux layers {config.aux_layers}, draft "
        f"vocab {vocab.size} of {target.vocab_size}")
    return Eagle4Objective(drafter, TTTOptions.of(recipe.eagle3))


class Eagle4Objective(Eagle3Objective):
    """Stage 1: EAGLE-3's objective on the EAGLE-4 drafter (its candidate head frozen)."""


@dataclass
class CandidateOutput:
    loss: Tensor  # () sum over depths of the mean KL
    step_kl: Tensor  # (K,) mean KL(full || low-rank) at depth i
    step_recall: Tensor  # (K,) candidate recall at depth i
    step_counts: Tensor  # (K,) positions counted


def candidate_loss(drafter: Eagle4Drafter, batch: FeatureBatch, steps: int) -> CandidateOutput:
    """Stage 2's objective: the frozen drafter's TTT unroll (steps depths, no grad); at each depth i and supervised
    position (ttt_label_mask), x = what lm_head reads (h), p = softmax(W x), p~ = softmax(A B x) over the draft
    vocabulary: KL(p || p~) = sum p (log p - log p~), averaged over the depth's positions and summed over depths.
    Gradients reach A and B only. Candidate recall: argmax W x among the top-k of A B x."""
    normed = []  # per depth i: (M_i, h) at its supervised positions
    with torch.no_grad():  # stage-1 weights: inputs only
        for i, hidden in drafter.ttt_unroll(batch.features, batch.input_ids, batch.embed, steps):
            label_mask = ttt_label_mask(batch.loss_mask, i).bool()  # (B, T-1-i)
            normed.append(drafter.head_input(hidden[:, :label_mask.shape[1]][label_mask]))
    kls, recalls, counts = [], [], []
    for x in normed:
        with torch.no_grad():
            full = drafter.lm_head(x).float()  # (M, Vd)
            log_p = full.log_softmax(-1)
        low = drafter.low_rank_logits(x).float()  # (M, Vd), grad to A, B
        kl = (log_p.exp() * (log_p - low.log_softmax(-1))).sum(-1)  # (M,)
        kls.append(kl.mean() if len(x) else low.sum() * 0)
        recalls.append(candidate_recall(full, low.detach(), drafter.config.candidates).float().mean() if len(x)
                       else torch.zeros((), device=low.device))
        counts.append(torch.tensor(len(x), device=low.device))
    step_kl = torch.stack(kls)
    return CandidateOutput(step_kl.sum(), step_kl.detach(), torch.stack(recalls), torch.stack(counts))


def train_candidate_head(drafter: Eagle4Drafter, inputs, embed, batches, steps: int, lr: float, ttt_steps: int,
                         autocast) -> list[dict]:
    """Stage 2 (module docstring): A, B <- SVD of the trained head, then `steps` AdamW steps on candidate_loss over
    `batches` (an iterator of collated training batches) -> one metrics dict per step. Every weight's requires_grad
    is as it was after."""
    was = {name: p.requires_grad for name, p in drafter.named_parameters()}
    drafter.requires_grad_(False)
    drafter.init_candidate_head()
    params = drafter.candidate_parameters
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    log = []
    for step in range(1, steps + 1):
        batch = next(batches)
        features, _ = inputs(batch)
        with autocast():
            out = candidate_loss(drafter, FeatureBatch(features, batch["input_ids"], None, batch["loss_mask"], embed),
                                 ttt_steps)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        optimizer.step()
        log.append({"stage2_step": step, "loss": out.loss.item(), "step_kl": out.step_kl.tolist(),
                    "candidate_recall": out.step_recall.tolist()})
    for name, p in drafter.named_parameters():
        p.requires_grad_(was[name])
    return log


class Eagle4Run(FeatureRun):
    """EAGLE-3's run (stage 1) with stage 2 after its last optimizer step, before the final evaluation and
    checkpoint-final. Stage 2 is not interruptible at a step boundary and is not resumed: a run stopped in it is
    resumed from its last stage-1 checkpoint and runs stage 2 again from the SVD."""

    def periodic(self, step: int, total_steps: int, position) -> None:
        if step == total_steps:
            self.candidate_stage()
        super().periodic(step, total_steps, position)

    def candidate_stage(self) -> None:
        o, say = self.recipe.eagle4, self.accelerator.print
        if self.sharded:
            raise RecipeError("EAGLE-4's stage 2 trains the candidate head on one whole drafter: launch with DDP or "
                              "one process, not ZeRO-3 / FSDP")
        log = train_candidate_head(self.drafter, self.inputs, self.target.embed_tokens, self._stage2_batches(),
                                   o.stage2_steps, o.stage2_lr, self.recipe.eagle3.ttt_steps, self.accelerator.autocast)
        if self.accelerator.is_main_process:
            with open(self.output_dir / "candidate_head.jsonl", "w", encoding="utf-8") as f:
                f.writelines(json.dumps(row) + "\n" for row in log)
        if log:
            recall = " ".join(f"{r:.3f}" for r in log[-1]["candidate_recall"])
            say(f"eagle4: stage 2, {len(log)} steps on the candidate head (rank {o.rank}): KL {log[0]['loss']:.4f} -> "
                f"{log[-1]['loss']:.4f}, candidate recall (top-{o.candidates}) per depth [{recall}]")

    def _stage2_batches(self):
        # stage 1's batch order (LengthBuckets pass 0, 1, ...), the same on every process
        pad, passes = pad_id(self.target), 0
        device = self.accelerator.device
        while True:
            for rows in self.sampler.batches(passes):
                batch = collate([self.train_rows[i] for i in rows], pad, **padding(self.recipe.data))
                yield {k: v.to(device) for k, v in batch.items()}
            passes += 1


# ---- held-out evaluation --------------------------------------------------------------------------


@torch.no_grad()
def evaluate_eagle4(drafter: Eagle4Drafter, inputs, embed, batches: list[dict], recipe: Eagle4Recipe,
                    accelerator) -> dict:
    """EAGLE-3's held-out metrics (evaluate_eagle3: per-step accuracy of the full head, tau_pred) plus, per TTT depth,
    candidate recall (the full head's argmax among the low-rank head's top-k, at supervised positions) and the mean
    KL(full || low-rank)."""
    result = evaluate_eagle3(drafter, inputs, embed, batches, recipe, accelerator)
    steps = recipe.eagle3.eval_ttt_steps or recipe.eagle3.ttt_steps
    hits = kl = counted = torch.zeros(steps, device=accelerator.device)
    for batch in batches:
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        features, _ = inputs(batch)
        with accelerator.autocast():
            out = candidate_loss(drafter, FeatureBatch(features, batch["input_ids"], None, batch["loss_mask"], embed),
                                 steps)
        hits, kl = hits + out.step_recall * out.step_counts, kl + out.step_kl * out.step_counts
        counted = counted + out.step_counts
    return {**result, "candidate_recall": (hits / counted.clamp(min=1)).tolist(),
            "candidate_kl": (kl / counted.clamp(min=1)).tolist(), "candidates": drafter.config.candidates}


def format_eagle4_eval(result: dict) -> str:
    recall = " ".join(f"{r:.3f}" for r in result["candidate_recall"])
    return f"{format_eval(result)}; candidate recall (top-{result['candidates']}) per depth [{recall}]"

