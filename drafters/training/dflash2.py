"""Training DFlash2 (drafter: dflash2): its recipe (DFlash's plus the `dflash2` section), its build and the path
selector's training signal. Everything else is DFlash's (drafters.training.dflash): the block, anchors, labels, slot
weights and inputs come from the recipe's `dflash` section, the objective is `block_loss` (the dynamic convolutions
train through it like any backbone weight) plus `selector_loss` as its extra term, and the held-out evaluation is
`evaluate_dflash` (per-slot accuracy and tau_pred of the unary argmax, on DFlash's scale).
"""

from dataclasses import dataclass, field, replace
from functools import partial
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from drafters.dflash2 import SEARCHES, DFlash2Config, DFlash2Drafter
from drafters.draft_vocab import DraftVocab
from drafters.training.dflash import BlockSlots, DFlashObjective, DFlashRecipe, recipe_mask_token
from drafters.training.recipe import RecipeError


@dataclass
class DFlash2Options:  # the recipe's `dflash2:` section
    conv_kernel_size: int = 2  # taps of the dynamic convolutions (2: the published two-tap)
    conv_group_size: int = 16  # channels sharing one dynamic tap value; must divide the target's hidden size
    selector_rank: int = 64  # r of the selector's (V x r) codebooks
    path_top_k: int = 16  # candidates per slot the selector chooses among
    path_search: str = "viterbi"  # a greedy chain's path: viterbi (best joint path) or walk (slot by slot)
    selector_weight: float = 1.0  # alpha: the pairwise cross-entropy's weight in the loss


@dataclass(kw_only=True)
class DFlash2Recipe(DFlashRecipe):  # DFlash's recipe (its `dflash` section is the block) + the dflash2 section
    drafter: Literal["dflash2"] = "dflash2"
    output_dir: str = "outputs/dflash2"
    dflash2: DFlash2Options = field(default_factory=DFlash2Options)

    def problems(self) -> list[str]:
        return super().problems() + check_dflash2(self)


def check_dflash2(recipe: DFlash2Recipe) -> list[str]:
    o, problems = recipe.dflash2, []
    vocab = recipe.draft_vocab_size if recipe.draft_vocab_coverage is None else None  # else known after counting
    if not _count(o.path_top_k, 1) or (vocab is not None and o.path_top_k > vocab):
        problems.append(f"dflash2.path_top_k={o.path_top_k!r} must be in [1, draft_vocab_size="
                        f"{recipe.draft_vocab_size}]: the selector chooses among each slot's top-k draft ids")
    if not _count(o.conv_kernel_size, 1) or o.conv_kernel_size > recipe.dflash.block_size:
        problems.append(f"dflash2.conv_kernel_size={o.conv_kernel_size!r} must be in [1, dflash.block_size="
                        f"{recipe.dflash.block_size}]: a tap reads a slot before it in the block")
    if not _count(o.conv_group_size, 1):
        problems.append(f"dflash2.conv_group_size={o.conv_group_size!r} must be an integer >= 1 dividing the "
                        "target's hidden size")
    if not _count(o.selector_rank, 1):
        problems.append(f"dflash2.selector_rank={o.selector_rank!r} must be an integer >= 1")
    if o.path_search not in SEARCHES:
        problems.append(f"dflash2.path_search={o.path_search!r} must be one of {', '.join(SEARCHES)}")
    if not o.selector_weight >= 0:
        problems.append(f"dflash2.selector_weight={o.selector_weight} must be >= 0")
    return problems


def _count(value, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def target_problems(o: DFlash2Options, vocab_size: int, hidden_size: int) -> list[str]:
    """The dflash2 fields that need the target and the counted draft vocabulary: one sentence each."""
    problems = []
    if hidden_size % o.conv_group_size:
        problems.append(f"dflash2.conv_group_size={o.conv_group_size} must divide the target's hidden size "
                        f"{hidden_size}")
    if o.path_top_k > vocab_size:
        problems.append(f"dflash2.path_top_k={o.path_top_k} is more than the draft vocabulary ({vocab_size} ids)")
    return problems


def build_dflash2(recipe: DFlash2Recipe, target, train_rows, vocab: DraftVocab, say) -> "DFlash2Objective":
    o, s = recipe.dflash, recipe.dflash2
    problems = target_problems(s, vocab.size, target.config.get_text_config().hidden_size)
    if problems:
        raise RecipeError("recipe: " + "; ".join(problems))
    config = DFlash2Config.from_target_config(
        target.config, vocab.size, mask_token_id=recipe_mask_token(recipe, target, train_rows), layers=recipe.layers,
        num_layers=o.num_layers, block_size=o.block_size, conv_kernel_size=s.conv_kernel_size,
        conv_group_size=s.conv_group_size, selector_rank=s.selector_rank, path_top_k=s.path_top_k,
        path_search=s.path_search)
    drafter = DFlash2Drafter(config, vocab).to(target.device).attach_head(target.lm_head.weight.float())
    say(f"eagle: DFlash2 drafter {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M parameters, "
        f"{config.num_hidden_layers} layers, block {config.block_size}, {config.conv_kernel_size}-tap dynamic "
        f"convolutions (groups of {config.conv_group_size}), path selector rank {config.selector_rank} over the "
        f"top {config.path_top_k} ({config.path_search}), mask token {config.mask_token_id}, aux layers "
        f"{config.aux_layers}, draft vocab {vocab.size} of {target.vocab_size}")
    return DFlash2Objective(drafter, o, recipe.seed, selector_weight=s.selector_weight)


class DFlash2Objective(DFlashObjective):
    """DFlash's objective (anchors, checkpointed generator, block_loss) with the selector's cross-entropy added."""

    def __init__(self, drafter: DFlash2Drafter, options, seed: int = 0, selector_weight: float = 1.0):
        super().__init__(drafter, options, seed)
        self.loss_options = replace(self.loss_options, extra_loss=partial(selector_loss, weight=selector_weight))


def selector_loss(drafter: DFlash2Drafter, slots: BlockSlots, weights: Tensor, total: Tensor, *,
                  weight: float = 1.0) -> Tensor:
    """The path selector's training signal, a pairwise cross-entropy on the true adjacent pair. At every counted slot
    j (teacher forcing: prev = the true token a+j-1, the anchor for j = 1), with y = the draft id of the target's
    argmax (the label), C = the top-k of the slot's unary logits U_j (indices detached; where y is missing it takes
    the k-th candidate's place, in the loss only: drafting never sees it), and S_j(prev, b) drafters.dflash2's score:
        CE_j = -log softmax_{b in C} S_j(prev, b) [y]
    -> weight x sum_j w_j sum CE_j / sum_j w_j count_j (the block loss's slot weights w (Bk-1,) and total).
    Gradients reach the codebooks, the gate H and, through U_j(b), the backbone."""
    counted = slots.counted  # (B, N, Bk-1)
    slot = torch.arange(counted.shape[-1], device=counted.device).expand_as(counted)[counted]  # (M,) j - 1
    normed, prev = slots.normed[counted], slots.prev[counted]  # (M, h), (M,)
    label = slots.argmax_draft[slots.index[counted]]  # (M,)
    unary = drafter.compute_logits(normed)  # (M, Vd)
    cand = unary.detach().topk(drafter.config.path_top_k, dim=-1).indices  # (M, k)
    cand[:, -1] = torch.where((cand == label[:, None]).any(-1), cand[:, -1], label)
    scores = drafter.transition_scores(normed, unary.gather(-1, cand), cand, prev[:, None])[:, 0]  # (M, k)
    ce = F.cross_entropy(scores.float(), (cand == label[:, None]).int().argmax(-1), reduction="none")  # (M,)
    return weight * (weights[slot] * ce).sum() / total
