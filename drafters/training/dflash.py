"""Training DFlash (drafter: dflash): its recipe, the mask token, the objective
(`block_loss`: drafters.dflash's block_unroll scored per slot with decaying weights; `DFlashObjective`, what
accelerate prepares, draws the anchors from a generator whose state is checkpointed), the held-out
evaluation.
The loop, logging and checkpointing are drafters.training.loop's; the target inputs (fused aux layers + soft
labels, online or from the EAGLE-3 feature store) are EAGLE-3's (drafters.training.eagle3), shared through the
family entries of drafters.training.families.
"""

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from drafters.dflash import (
    DFlashConfig,
    DFlashDrafter,
    block_label_mask,
    block_label_rows,
    block_prev_ids,
    sample_anchors,
)
from drafters.draft_vocab import DraftVocab
from drafters.losses import (chunked_draft_vocab_targets, dpace_weights, linear_soft_cross_entropy, soft_cross_entropy,
                             table_rows)
from drafters.training.data import choose_mask_token
from drafters.training.loop import FeatureBatch
from drafters.training.recipe import RecipeError
from drafters.training.schema import DraftVocabRecipe

LABELS = ("soft", "argmax")
WEIGHTINGS = ("decay", "dpace")


@dataclass
class DFlashOptions:
    block_size: int = 8  # B slots per block: the anchor + B-1 masks, B-1 drafts per drafter pass
    num_layers: int = 1  # drafter layers (the paper: 5 on Qwen3-8B)
    anchors: int = 32  # blocks per row and step, at random eligible anchors (fewer if the row has fewer)
    gamma: float = 4.0  # slot weight w_j = exp(-(j-1) / gamma); the paper: 4 at B = 8, 5 at B = 10, 7 at B = 16
    labels: Literal["soft", "argmax"] = "soft"  # CE against the target distribution or its argmax
    # the slots' weights: decay = the fixed exp(-(j-1) / gamma); dpace = D-PACE (arXiv 2605.18810), each block's
    # weights from the draft's own confidence, moving the loss to the slots that currently end its accepted prefix
    # (`dpace_weights`); dpace_alpha smooths that confidence (1: a slot weighs the counted slots to the block's end)
    weighting: Literal["decay", "dpace"] = "decay"
    dpace_alpha: float = 0.5
    mask_token_id: int | None = None  # null: the lowest target id that no training row contains


@dataclass(kw_only=True)
class DFlashRecipe(DraftVocabRecipe):  # + target, data, optim, ..., layers, features, draft vocabulary
    drafter: Literal["dflash"] = "dflash"
    output_dir: str = "outputs/dflash"
    dflash: DFlashOptions = field(default_factory=DFlashOptions)

    def problems(self) -> list[str]:
        return super().problems() + check_dflash(self.dflash)


def check_dflash(o: DFlashOptions) -> list[str]:
    problems = []
    if o.block_size < 2:
        problems.append(f"dflash.block_size={o.block_size} must be >= 2 (the anchor and at least one mask slot)")
    for name in ("num_layers", "anchors"):
        if getattr(o, name) < 1:
            problems.append(f"dflash.{name}={getattr(o, name)} must be >= 1")
    if not o.gamma > 0:
        problems.append(f"dflash.gamma={o.gamma} must be > 0")
    if o.weighting not in WEIGHTINGS:
        problems.append(f"dflash.weighting={o.weighting!r} must be one of {', '.join(WEIGHTINGS)}")
    if not 0 <= o.dpace_alpha <= 1:
        problems.append(f"dflash.dpace_alpha={o.dpace_alpha} must be in [0, 1]")
    if o.labels not in LABELS:
        problems.append(f"dflash.labels={o.labels!r} must be one of {', '.join(LABELS)}")
    if o.mask_token_id is not None and (isinstance(o.mask_token_id, bool) or o.mask_token_id < 0):
        problems.append(f"dflash.mask_token_id={o.mask_token_id} must be a token id >= 0, or null")
    return problems


def build_dflash(recipe, target, train_rows, vocab: DraftVocab, say) -> "DFlashObjective":
    """The family's build (drafters.training.families.TrainingFamily): the mask token from the training rows, the
    drafter on the target's frozen head rows of the draft vocabulary."""
    drafter = build_dflash_drafter(recipe, target, vocab, recipe_mask_token(recipe, target, train_rows))
    c = drafter.config
    say(f"eagle: DFlash drafter {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M parameters, "
        f"{c.num_hidden_layers} layers, block {c.block_size}, mask token {c.mask_token_id}, aux layers "
        f"{c.aux_layers}, draft vocab {vocab.size} of {target.vocab_size} (target head rows, frozen)")
    return DFlashObjective(drafter, recipe.dflash, recipe.seed)


def recipe_mask_token(recipe, target, train_rows) -> int:
    """dflash.mask_token_id, or the lowest target id no training row contains."""
    try:
        return choose_mask_token(train_rows, target.vocab_size, recipe.dflash.mask_token_id,
                                 key="dflash.mask_token_id")
    except ValueError as err:
        raise RecipeError(f"recipe: {err}") from None


def build_dflash_drafter(recipe, target, vocab: DraftVocab, mask_token_id: int) -> DFlashDrafter:
    o = recipe.dflash
    config = DFlashConfig.from_target_config(target.config, vocab.size, mask_token_id=mask_token_id,
                                             layers=recipe.layers, num_layers=o.num_layers, block_size=o.block_size)
    drafter = DFlashDrafter(config, vocab).to(target.device)  # float32 master weights
    return drafter.attach_head(target.lm_head.weight.float())


# ---- the objective ----------------------------------------------------------------------------------


def decay_weights(block_size: int, gamma: float, device=None) -> Tensor:
    """(B,) per-slot loss weights: w_0 = 0 (the anchor predicts nothing), w_j = exp(-(j-1) / gamma)."""
    j = torch.arange(block_size, device=device, dtype=torch.float32)
    return torch.where(j > 0, torch.exp(-(j - 1).clamp(min=0) / gamma), 0.0)


@dataclass
class BlockOutput:
    loss: Tensor  # () weighted mean over counted slots: sum_j w_j sum CE_j / sum_j w_j count_j
    step_losses: Tensor  # (Bk-1,) mean CE of slot j = 1..Bk-1 (unweighted), what metrics.jsonl logs
    step_accuracies: Tensor  # (Bk-1,) top-1 of slot j against the target's argmax, over counted slots
    step_counts: Tensor  # (Bk-1,) counted slots j
    step_supervised: Tensor  # (Bk-1,) supervised slots j (counted + those whose target argmax is outside the vocab)
    logits: Tensor | None = None  # if asked: (B, N, Bk-1, Vd) draft logits of slots 1..Bk-1
    labels: Tensor | None = None  # if asked: (B, N, Bk-1) draft id of the target argmax, -1 = not counted


@dataclass(frozen=True)
class BlockLossOptions:
    """How block_loss weighs and labels the slots (the recipe's dflash section, + dspark.confidence_weight)."""

    gamma: float = 4.0  # decay: w_j = exp(-(j-1) / gamma)
    labels: str = "soft"  # soft: CE against the target distribution; argmax: against its argmax (one-hot)
    weighting: str = "decay"  # decay: the fixed w_j; dpace: each block's `dpace_weights`
    dpace_alpha: float = 0.5
    confidence_weight: float = 1.0  # DSpark's confidence head: its BCE weighs this much in the loss
    # (drafter, BlockSlots, w (Bk-1,), sum_j w_j count_j) -> () added to the loss (DFlash2's path selector)
    extra_loss: Callable | None = None

    @classmethod
    def of(cls, o: DFlashOptions, confidence_weight: float = 1.0) -> "BlockLossOptions":
        return cls(o.gamma, o.labels, o.weighting, o.dpace_alpha, confidence_weight)


@dataclass(frozen=True)
class BlockSlots:
    """One batch's blocks as the loss reads them: slot j = 1..Bk-1 of block n in row b, its label the target's row
    a+j-1 (drafters.dflash.block_label_rows). The target side is computed once per distinct row."""

    normed: Tensor  # (B, N, Bk-1, h) the drafter's normed output at the slots
    prev: Tensor  # (B, N, Bk-1) the token before each slot's label (DSpark's Markov bias reads it)
    wanted: Tensor  # (B, N, Bk-1) bool: the label is supervised (block kept, loss_mask at the label)
    index: Tensor  # (B, N, Bk-1) into target_p / argmax_draft, -1 = not counted
    target_p: Tensor  # (R, Vd) float32 the target's distribution over the draft vocabulary (one-hot for argmax)
    argmax_draft: Tensor  # (R,) draft id of the target's argmax

    @property
    def counted(self) -> Tensor:  # (B, N, Bk-1) wanted AND the target's argmax is in the draft vocab
        return self.index >= 0


def block_loss(drafter: DFlashDrafter, batch: FeatureBatch, anchors, keep,
               options: BlockLossOptions = BlockLossOptions(), *, return_logits: bool = False) -> BlockOutput:
    """The DFlash objective on one batch: drafter.block_unroll's blocks at `anchors` (B, N) where `keep` (B, N),
    slot j = 1..Bk-1 scored against the target's row a+j-1 (drafters.dflash.block_label_rows / block_label_mask)
    and weighted w_j = exp(-(j-1) / gamma); loss = sum_j w_j sum CE_j / sum_j w_j count_j. batch.target_logits
    (B, T, V) or drafters.losses.LabelLogits (read at label rows only). labels "soft": CE against the target
    distribution renormalised over the draft vocabulary; "argmax": CE against the target's argmax (one-hot). A label
    whose full-vocabulary target argmax is outside the draft vocabulary is not counted (as EAGLE-3).
    DSpark (drafters.dspark): slot j's logits add the Markov bias of the true token a+j-1 (teacher forcing), and
    a confidence head, if any, adds confidence_weight x sum_j w_j sum BCE_j / sum_j w_j count_j, its label the
    probability that slot j's draft is accepted, 1 - TV(q_j, p_j) (detached; speculators' target).
    weighting "dpace": each counted slot's CE weighs its block's `dpace_weights` instead, loss = sum w CE / sum w
    (the weighted mean, as with the decay; the confidence head keeps the decay); the slots' logits are then kept.
    options.extra_loss adds its term (DFlash2's selector, drafters.training.dflash2), whatever the weighting.
    return_logits keeps every slot's logits (tests, evaluation)."""
    if options.labels not in LABELS:
        raise ValueError(f"labels={options.labels!r}: use one of {', '.join(LABELS)}")
    if options.weighting not in WEIGHTINGS:
        raise ValueError(f"weighting={options.weighting!r}: use one of {', '.join(WEIGHTINGS)}")
    c, device = drafter.config, batch.input_ids.device
    bk, seq_len = c.block_size, batch.input_ids.shape[1]
    normed = drafter.block_unroll(batch.features, batch.input_ids, batch.embed, anchors, keep)[:, :, 1:]
    rows = block_label_rows(anchors, bk)  # (B, N, Bk-1): target row a+j-1 labels slot j
    wanted = block_label_mask(anchors, keep, batch.loss_mask, bk)  # (B, N, Bk-1)
    index, (target_p, argmax_draft) = supervised_block_targets(drafter, batch.target_logits, rows, wanted, seq_len)
    if options.labels == "argmax":
        target_p = F.one_hot(argmax_draft, c.draft_vocab_size).float()
    slots = BlockSlots(normed, block_prev_ids(batch.input_ids, anchors, bk), wanted, index, target_p, argmax_draft)
    weights = decay_weights(bk, options.gamma, device)[1:]  # (Bk-1,) w_1 .. w_{Bk-1}
    counts = slots.counted.sum(dim=(0, 1))  # (Bk-1,)
    total = (weights * counts).sum().clamp(min=1e-12)  # sum_j w_j count_j
    extra = 0.0 if options.extra_loss is None else options.extra_loss(drafter, slots, weights, total)
    if options.weighting == "dpace":
        out = _dpace_block_loss(drafter, slots, weights, total, options, return_logits)
        return replace(out, loss=out.loss + extra)
    fused = not return_logits and c.final_logit_softcapping is None and drafter.fused_loss
    losses, accuracies, all_logits, confidence = [], [], [], []
    for j in range(bk - 1):  # slot j+1
        counted_j = slots.counted[:, :, j]  # (B, N)
        rows_j = index[:, :, j][counted_j]  # (M_j,) into target_p / argmax_draft
        want = argmax_draft[rows_j]  # (M_j,)
        scale = total / weights[j]  # loss_j = w_j sum CE / total
        if fused:  # the frozen head fused into the loss: no (M_j, Vd) logits kept for backward, nor labels copied
            loss, acc, _ = linear_soft_cross_entropy(normed[:, :, j][counted_j], drafter.head, target_p, want,
                                                     num_positions=scale, target_rows=rows_j)
        else:
            p = target_p[rows_j]  # (M_j, Vd)
            logits = drafter.slot_logits(normed[:, :, j], slots.prev[:, :, j])  # (B, N, Vd)
            if return_logits:
                all_logits.append(logits)
            ones = torch.ones_like(want, dtype=torch.bool)
            picked = logits[counted_j]  # (M_j, Vd)
            loss, acc, _ = soft_cross_entropy(picked, p, ones, want, ones, num_positions=scale)
            if drafter.confidence_head is not None:
                with torch.no_grad():  # P(accept a draft from q) = 1 - TV(q, p)
                    accept = 1 - 0.5 * (torch.softmax(picked.float(), -1) - p).abs().sum(-1)
                conf = drafter.confidence_logits(normed[:, :, j][counted_j], slots.prev[:, :, j][counted_j])
                confidence.append(F.binary_cross_entropy_with_logits(conf.float(), accept, reduction="sum") / scale)
        losses.append(loss)
        accuracies.append(acc)
    step_losses = torch.stack(losses)  # (Bk-1,) weighted shares of the loss
    with torch.no_grad():
        mean_ce = step_losses.detach() * total / (weights * counts.clamp(min=1))
    label_ids = None
    if return_logits:  # draft id of the target argmax where counted, else -1
        label_ids = torch.full_like(index, -1)
        label_ids[slots.counted] = argmax_draft[index[slots.counted]]
    loss = step_losses.sum() + (options.confidence_weight * torch.stack(confidence).sum() if confidence else 0.0) + \
        extra
    return BlockOutput(loss=loss, step_losses=mean_ce, step_accuracies=torch.stack(accuracies),
                       step_counts=counts, step_supervised=wanted.sum(dim=(0, 1)),
                       logits=torch.stack(all_logits, 2) if return_logits else None, labels=label_ids)


def _dpace_block_loss(drafter, slots: BlockSlots, decay: Tensor, decay_total: Tensor, options: BlockLossOptions,
                      return_logits: bool) -> BlockOutput:
    """block_loss under weighting "dpace": every slot's logits (B, N, Bk-1, Vd), each counted slot's CE (`soft`:
    against target_p; `argmax`: target_p is already one-hot), D-PACE's detached weights from the draft's probability
    of the target's argmax, loss = sum w CE / sum w. decay (Bk-1,) and decay_total = sum_j w_j count_j weigh the
    confidence head's BCE, as in block_loss."""
    normed, prev, counted = slots.normed, slots.prev, slots.counted
    logits = torch.stack([drafter.slot_logits(normed[:, :, j], prev[:, :, j]) for j in range(normed.shape[2])], 2)
    log_q = torch.log_softmax(logits.float(), dim=-1)  # (B, N, Bk-1, Vd)
    safe = slots.index.clamp(min=0)
    p, want = slots.target_p[safe], slots.argmax_draft[safe]  # (B, N, Bk-1, Vd), (B, N, Bk-1)
    ce = torch.where(counted, -(p * log_q).sum(-1), 0.0)  # (B, N, Bk-1)
    with torch.no_grad():
        weights = dpace_weights(log_q.gather(-1, want[..., None]).squeeze(-1).exp(), counted, options.dpace_alpha)
    total = (weights * counted).sum().clamp(min=1e-12)
    step_losses = (weights * ce).sum(dim=(0, 1)) / total  # (Bk-1,) weighted shares of the loss
    counts = counted.sum(dim=(0, 1))
    with torch.no_grad():
        mean_ce = ce.detach().sum(dim=(0, 1)) / counts.clamp(min=1)
        right = (logits.argmax(-1) == want) & counted
        accuracies = right.sum(dim=(0, 1)) / counts.clamp(min=1)
    loss = step_losses.sum()
    if drafter.confidence_head is not None:  # DSpark's confidence head: weighted by the decay, as in block_loss
        with torch.no_grad():  # P(accept a draft from q) = 1 - TV(q, p)
            accept = 1 - 0.5 * (log_q.exp() - p).abs().sum(-1)
        conf = torch.stack([drafter.confidence_logits(normed[:, :, j], prev[:, :, j]) for j in range(normed.shape[2])],
                           2)  # (B, N, Bk-1)
        bce = F.binary_cross_entropy_with_logits(conf.float(), accept, reduction="none")
        loss = loss + options.confidence_weight * (decay * torch.where(counted, bce, 0.0)).sum() / decay_total
    label_ids = torch.where(counted, want, -1) if return_logits else None
    return BlockOutput(loss=loss, step_losses=mean_ce, step_accuracies=accuracies, step_counts=counts,
                       step_supervised=slots.wanted.sum(dim=(0, 1)), logits=logits if return_logits else None,
                       labels=label_ids)


def supervised_block_targets(drafter: DFlashDrafter, target_logits, rows: Tensor, wanted: Tensor, seq_len: int):
    """The target side of the loss, computed once per distinct row: -> index (B, N, Bk-1) into the two
    tensors (-1 = not counted: not wanted, or the target's full-vocab argmax is outside the draft vocab),
    target_p (R, Vd) float32, argmax_draft (R,) long (`draft_vocab_targets`)."""
    batch = rows.shape[0]
    needed = torch.zeros(batch, seq_len, dtype=torch.bool, device=rows.device)
    b = torch.arange(batch, device=rows.device)[:, None, None].expand_as(rows)
    needed[b[wanted], rows[wanted]] = True
    target_p, in_vocab, argmax_draft = chunked_draft_vocab_targets(drafter, target_logits, needed)  # chunked rows
    row_index = table_rows(needed, in_vocab)  # (B, T)
    index = torch.where(wanted, row_index[b, rows.clamp(max=seq_len - 1)], -1)
    return index, (target_p, argmax_draft)


class DFlashObjective(nn.Module):
    """What accelerate prepares: the anchored-block loss of `drafter` on one batch (same call signature as
    Eagle3Objective). Anchors come from a CPU generator seeded with the recipe's seed whose state is a
    buffer of this module, so accelerate's save_state / load_state carry it: a resumed run draws the
    anchors an uninterrupted run would."""

    def __init__(self, drafter: DFlashDrafter, options: DFlashOptions, seed: int = 0, confidence_weight: float = 1.0):
        super().__init__()
        self.drafter, self.options = drafter, options
        self.loss_options = BlockLossOptions.of(options, confidence_weight)
        self.register_buffer("anchor_generator", torch.Generator().manual_seed(seed).get_state())  # uint8

    def forward(self, features, input_ids, target_logits, loss_mask, embed, num_positions=None) -> BlockOutput:
        generator = torch.Generator()
        generator.set_state(self.anchor_generator.cpu())
        anchors, keep = sample_anchors(loss_mask, self.options.anchors, generator)
        self.anchor_generator.copy_(generator.get_state())
        batch = FeatureBatch(features, input_ids, target_logits, loss_mask, embed)
        return block_loss(self.drafter, batch, anchors, keep, self.loss_options)


@torch.no_grad()
def evaluate_dflash(drafter: DFlashDrafter, inputs, embed, batches: list[dict], recipe, accelerator) -> dict:
    """On the held-out rows, at anchors drawn from a generator seeded with recipe.seed afresh at every
    evaluation (the same blocks each time), per block slot k = 1 .. B-1 (slot k drafts the k-th token):
        acc_k          = correct top-1 / supervised slots (a target argmax outside the draft vocab is a miss)
        acc_in_vocab_k = correct top-1 / supervised slots whose target argmax is in the draft vocab
        tau_pred       = 1 + mean over blocks of the number of leading correct slots
    A block's slots are drafted together, so tau_pred is measured per block (not a product of acc_k, which
    would assume independent slots): the mean accepted length (bonus included) of a greedy chain of B-1
    drafts when the target's own argmax continues the data (as on regenerated data)."""
    drafter.eval()
    o, slots = recipe.dflash, recipe.dflash.block_size - 1
    generator = torch.Generator().manual_seed(recipe.seed)
    # the held-out loss weighs the slots by the decay, whatever o.weighting, and DSpark's confidence BCE by 1
    options = BlockLossOptions(gamma=o.gamma, labels=o.labels)
    correct, counted, supervised = (torch.zeros(slots, device=accelerator.device) for _ in range(3))
    runs, blocks, loss = 0.0, 0, 0.0
    for batch in batches:
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        features, target_logits = inputs(batch)
        anchors, keep = sample_anchors(batch["loss_mask"], o.anchors, generator)
        with accelerator.autocast():
            out = block_loss(drafter, FeatureBatch(features, batch["input_ids"], target_logits, batch["loss_mask"],
                                                   embed), anchors, keep, options, return_logits=True)
        hit = (out.logits.argmax(-1) == out.labels) & (out.labels >= 0)  # (B, N, B-1)
        correct += hit.sum(dim=(0, 1))
        counted += out.step_counts
        supervised += out.step_supervised
        runs += float(hit.int().cumprod(-1).sum(-1)[keep].sum())  # leading correct slots per block
        blocks += int(keep.sum())
        loss += float(out.loss)
    return {"loss": loss / max(len(batches), 1), "step_acc": (correct / supervised.clamp(min=1)).tolist(),
            "step_acc_in_vocab": (correct / counted.clamp(min=1)).tolist(), "supervised": int(supervised[0]),
            "blocks": blocks, "tau_pred": 1 + runs / max(blocks, 1)}


def format_dflash_eval(result: dict) -> str:
    accuracy = " ".join(f"{a:.3f}" for a in result["step_acc"])
    return (f"eval @ step {result['step']}: loss {result['loss']:.4f}, per-slot top-1 accuracy [{accuracy}] over "
            f"{result['supervised']} supervised tokens; tau_pred (blocks of {len(result['step_acc'])} drafts, 1 + mean "
            f"leading correct slots over {result['blocks']} blocks) = {result['tau_pred']:.3f}")
