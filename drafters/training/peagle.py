"""Training P-EAGLE (drafter: peagle): its recipe, the mask token, the objective
(every depth of the chains `drafters.peagle.sample_chains` keeps, in one pass, scored by one count-normalised
soft cross-entropy over the draft vocabulary), and the held-out evaluation. Inputs (fused aux layers + the
target's logits, online or from the EAGLE-3 feature store), the draft vocabulary and the loop are EAGLE-3's.
"""

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor, nn

from drafters.draft_vocab import DraftVocab
from drafters.layers import ttt_label_mask, ttt_label_rows
from drafters.losses import soft_cross_entropy, supervised_targets
from drafters.peagle import PEagleConfig, PEagleDrafter, chain_label_mask, sample_chains
from drafters.training.data import choose_mask_token
from drafters.training.loop import FeatureBatch
from drafters.training.recipe import RecipeError
from drafters.training.schema import DraftVocabRecipe, DrafterNorms


@dataclass
class PEagleOptions:
    depth: int = 4  # K tokens drafted per pass
    down_sample_ratio: float = 0.7  # depth d keeps a fraction max(r^d, r_min) of the chains (speculators' names)
    down_sample_ratio_min: float = 0.2
    eval_chains: int = 64  # held-out chains per row, every depth kept
    mask_token_id: int | None = None  # null: the lowest target id that no training row contains


@dataclass(kw_only=True)
class PEagleRecipe(DraftVocabRecipe, DrafterNorms):  # + target, data, ..., features, draft vocabulary, norms
    drafter: Literal["peagle"] = "peagle"
    output_dir: str = "outputs/peagle"
    peagle: PEagleOptions = field(default_factory=PEagleOptions)

    def problems(self) -> list[str]:
        return super().problems() + self.norm_problems() + check_peagle(self.peagle)


def check_peagle(o: PEagleOptions) -> list[str]:
    problems = []
    if isinstance(o.depth, bool) or not isinstance(o.depth, int) or not 2 <= o.depth <= 64:
        problems.append(f"peagle.depth={o.depth!r} must be an integer in [2, 64] (tokens drafted per pass; depth 1 "
                        "is EAGLE-3 without its unroll)")
    for name in ("down_sample_ratio", "down_sample_ratio_min"):
        if not 0 < getattr(o, name) <= 1:
            problems.append(f"peagle.{name}={getattr(o, name)} must be in (0, 1]")
    if o.eval_chains < 1:
        problems.append(f"peagle.eval_chains={o.eval_chains} must be >= 1")
    if o.mask_token_id is not None and (isinstance(o.mask_token_id, bool) or o.mask_token_id < 0):
        problems.append(f"peagle.mask_token_id={o.mask_token_id} must be a token id >= 0, or null")
    return problems


def build_peagle(recipe: PEagleRecipe, target, train_rows, vocab: DraftVocab, say) -> "PEagleObjective":
    o = recipe.peagle
    try:
        mask_token_id = choose_mask_token(train_rows, target.vocab_size, o.mask_token_id, key="peagle.mask_token_id")
    except ValueError as err:
        raise RecipeError(f"recipe: {err}") from None
    norms = recipe.norms()
    config = PEagleConfig.from_target_config(target.config, vocab.size, recipe.layers, depth=o.depth,
                                             mask_token_id=mask_token_id, **norms)
    drafter = PEagleDrafter(config, vocab).to(target.device)
    drafter.init_from_target(target.lm_head.weight.float())
    say(f"eagle: P-EAGLE drafter {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M parameters, depth "
        f"{config.depth} per pass, chains kept per depth max({o.down_sample_ratio}^d, {o.down_sample_ratio_min}), "
        f"mask token {mask_token_id}, aux layers {config.aux_layers}, draft vocab {vocab.size} of {target.vocab_size}")
    return PEagleObjective(drafter, o, recipe.seed)


@dataclass
class ParallelOutput:
    loss: Tensor  # () sum over counted slots of every depth of CE / their count
    step_losses: Tensor  # (K,) mean CE at depth d
    step_accuracies: Tensor  # (K,) top-1 at depth d over counted slots
    step_counts: Tensor  # (K,)
    hits: Tensor | None = None  # if asked: (B, K, N) bool, chain n's depth-d slot correct (depth 0 = its start)


def parallel_loss(drafter: PEagleDrafter, batch: FeatureBatch, starts, keep, *,
                  return_hits: bool = False) -> ParallelOutput:
    """The P-EAGLE objective: drafter.parallel_unroll's slots for the chains at `starts` (B, N) kept to depth d
    where `keep` (B, K-1, N), each scored by the soft cross-entropy against the
    target's distribution renormalised over the draft vocabulary (as EAGLE-3; a label whose full-vocabulary
    argmax is outside the draft vocabulary is not counted); loss = sum over counted slots of all depths / their
    count (one mean, no per-depth weights: deeper depths weigh by how many chains reach them)."""
    loss_mask, seq_len = batch.loss_mask, batch.input_ids.shape[1]
    hidden = drafter.parallel_unroll(batch.features, batch.input_ids, batch.embed, starts, keep)  # (B, T + (K-1) N, h)
    rows, targets = supervised_targets(drafter, batch.target_logits, loss_mask)  # (B, T) -> index into targets
    n = starts.shape[1]
    # depth 0: row t drafts token t+2 (label row t+1, EAGLE-3's step 0)
    label0 = ttt_label_rows(rows, 0)  # (B, T-1)
    slots = [(hidden[:, :seq_len - 1], label0, ttt_label_mask(loss_mask, 0).bool() & (label0 >= 0))]
    wanted = chain_label_mask(loss_mask, starts, keep)  # (B, K-1, N)
    for d in range(1, keep.shape[1] + 1):  # depth d of chain n: label row starts + 1 + d
        label = rows.gather(1, (starts + 1 + d).clamp(max=seq_len - 1))  # (B, N)
        block = hidden[:, seq_len + (d - 1) * n: seq_len + d * n]  # (B, N, h)
        slots.append((block, label, wanted[:, d - 1] & (label >= 0)))
    total = sum(counted.sum() for _, _, counted in slots).clamp(min=1)
    losses, accuracies, counts, hits = [], [], [], []
    for block, label, counted in slots:
        argmax_draft = targets[1][label[counted]]  # (M,)
        if return_hits:
            target_p = targets[0][label[counted]]  # (M, Vd)
            logits = drafter.compute_logits(block)  # (B, ., Vd)
            ones = torch.ones_like(argmax_draft, dtype=torch.bool)
            loss, acc, _ = soft_cross_entropy(logits[counted], target_p, ones, argmax_draft, ones,
                                                  num_positions=total)
            correct = torch.zeros_like(counted)
            correct[counted] = logits[counted].argmax(-1) == argmax_draft
            hits.append(correct)
        else:  # the LM head fused into the loss (a module call: sharding engines gather it), reading the
            # slot's label rows from the whole table a chunk at a time
            loss, acc, _ = drafter.lm_head(drafter.norm(block[counted]), targets[0], argmax_draft,
                                           num_positions=total, target_rows=label[counted])
        losses.append(loss)
        accuracies.append(acc)
        counts.append(counted.sum())
    step_losses, counts = torch.stack(losses), torch.stack(counts)
    chain_hits = None
    if return_hits:  # depth 0 read at each chain's start
        start_hit = torch.cat([hits[0], torch.zeros_like(hits[0][:, :1])], 1).gather(1, starts)  # (B, N)
        chain_hits = torch.stack([start_hit, *hits[1:]], 1)  # (B, K, N)
    with torch.no_grad():
        mean_ce = step_losses.detach() * total / counts.clamp(min=1)
    return ParallelOutput(loss=step_losses.sum(), step_losses=mean_ce, step_accuracies=torch.stack(accuracies),
                          step_counts=counts, hits=chain_hits)


class PEagleObjective(nn.Module):
    """What accelerate prepares. The chains come from a CPU generator seeded with the recipe's seed whose state
    is a buffer (saved and restored with the run: a resumed run draws what an uninterrupted one would)."""

    def __init__(self, drafter: PEagleDrafter, options: PEagleOptions, seed: int = 0):
        super().__init__()
        self.drafter, self.options = drafter, options
        self.register_buffer("chain_generator", torch.Generator().manual_seed(seed).get_state())

    def forward(self, features, input_ids, target_logits, loss_mask, embed, num_positions=None) -> ParallelOutput:
        generator = torch.Generator()
        generator.set_state(self.chain_generator.cpu())
        o = self.options
        starts, keep = sample_chains(loss_mask, o.depth, o.down_sample_ratio, o.down_sample_ratio_min, generator)
        self.chain_generator.copy_(generator.get_state())
        return parallel_loss(self.drafter, FeatureBatch(features, input_ids, target_logits, loss_mask, embed), starts,
                             keep)


@torch.no_grad()
def evaluate_peagle(drafter: PEagleDrafter, inputs, embed, batches: list[dict], recipe, accelerator) -> dict:
    """On the held-out rows, up to peagle.eval_chains chains per row with every depth kept, drawn from a
    generator seeded with recipe.seed afresh each time (the same chains every evaluation):
        acc_d    = correct top-1 / counted slots at depth d (d = 0: every position, as EAGLE-3's step 0)
        tau_pred = 1 + mean over chains of the number of leading correct depths: a greedy chain of K drafts'
                   accepted length when the target's argmax continues the data (labels outside the draft
                   vocabulary or not learnt end a chain)
        tau_pred_by_length[n-1] = the same for a chain of the first n drafts (n = 1..K), to compare with
                   families scored at another length."""
    drafter.eval()
    o = recipe.peagle
    generator = torch.Generator().manual_seed(recipe.seed)
    correct = counted = None
    runs, chains, loss = torch.zeros(o.depth), 0, 0.0  # runs[n-1]: leading correct depths, capped at n
    for batch in batches:
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        features, target_logits = inputs(batch)
        starts, keep = sample_chains(batch["loss_mask"], o.depth, 1.0, 1.0, generator, max_chains=o.eval_chains)
        with accelerator.autocast():
            out = parallel_loss(drafter, FeatureBatch(features, batch["input_ids"], target_logits, batch["loss_mask"],
                                                      embed), starts, keep, return_hits=True)
        acc = out.step_accuracies * out.step_counts
        correct = acc if correct is None else correct + acc
        counted = out.step_counts if counted is None else counted + out.step_counts
        kept = keep[:, 0] if keep.shape[1] else torch.ones_like(starts, dtype=torch.bool)  # (B, N) chains
        leading = out.hits.int().cumprod(1).sum(1)[kept].cpu()  # (chains,)
        runs += torch.stack([leading.clamp(max=n).sum() for n in range(1, o.depth + 1)]).float()
        chains += int(kept.sum())
        loss += float(out.loss)
    return {"loss": loss / max(len(batches), 1), "step_acc": (correct / counted.clamp(min=1)).tolist(),
            "supervised": int(counted[0]), "chains": chains, "tau_pred": 1 + float(runs[-1]) / max(chains, 1),
            "tau_pred_by_length": (1 + runs / max(chains, 1)).tolist()}


def format_peagle_eval(result: dict) -> str:
    accuracy = " ".join(f"{a:.3f}" for a in result["step_acc"])
    return (f"eval @ step {result['step']}: loss {result['loss']:.4f}, per-depth top-1 accuracy [{accuracy}]; "
            f"tau_pred (chains of {len(result['step_acc'])} drafts in one pass, 1 + mean leading correct depths over "
            f"{result['chains']} chains) = {result['tau_pred']:.3f}")
