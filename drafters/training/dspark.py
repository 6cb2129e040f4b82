"""Training DSpark (drafter: dspark): its recipe (DFlash's plus the `dspark` section) and its build. Everything else is
DFlash's (drafters.training.dflash): the block, anchors, labels and slot weights come from the recipe's `dflash`
section, the objective is `block_loss` (which adds the Markov bias and the confidence loss for a DSpark
drafter), and the held-out evaluation is `evaluate_dflash` (teacher-forced prev tokens: along a block's leading
correct slots they are the tokens a greedy chain drafts, so tau_pred is the greedy chain's).
"""

from dataclasses import dataclass, field
from typing import Literal

from drafters.draft_vocab import DraftVocab
from drafters.dspark import VARIANTS, DSparkConfig, DSparkDrafter
from drafters.training.data import choose_mask_token
from drafters.training.dflash import DFlashObjective, DFlashRecipe
from drafters.training.recipe import RecipeError


@dataclass
class DSparkOptions:
    markov_rank: int = 64  # R of the bias W2 W1[prev]; W1 is (target vocab x R)
    variant: str = "vanilla"  # the Markov head type (llama.cpp runs vanilla only)
    confidence_head: bool = False  # P(accept) per slot, for llama.cpp's --spec-draft-p-min
    confidence_weight: float = 1.0  # its BCE's weight in the loss (speculators' confidence_head_alpha)


@dataclass(kw_only=True)
class DSparkRecipe(DFlashRecipe):  # DFlash's recipe (its `dflash` section is the block) + the Markov head
    drafter: Literal["dspark"] = "dspark"
    output_dir: str = "outputs/dspark"
    dspark: DSparkOptions = field(default_factory=DSparkOptions)

    def problems(self) -> list[str]:
        return super().problems() + check_dspark(self.dspark)


def check_dspark(o: DSparkOptions) -> list[str]:
    problems = []
    if isinstance(o.markov_rank, bool) or not isinstance(o.markov_rank, int) or o.markov_rank < 1:
        problems.append(f"dspark.markov_rank={o.markov_rank!r} must be an integer >= 1 (without a Markov head it is "
                        "DFlash: use drafter: dflash)")
    if o.variant not in VARIANTS:
        problems.append(f"dspark.variant={o.variant!r} must be one of {', '.join(VARIANTS)} (the Markov head "
                        "llama.cpp and vLLM run)")
    if not o.confidence_weight >= 0:
        problems.append(f"dspark.confidence_weight={o.confidence_weight} must be >= 0")
    return problems


def build_dspark(recipe: DSparkRecipe, target, train_rows, vocab: DraftVocab, say) -> DFlashObjective:
    try:
        mask_token_id = choose_mask_token(train_rows, target.vocab_size, recipe.dflash.mask_token_id,
                                          key="dflash.mask_token_id")
    except ValueError as err:
        raise RecipeError(f"recipe: {err}") from None
    o, s = recipe.dflash, recipe.dspark
    config = DSparkConfig.from_target_config(
        target.config, vocab.size, mask_token_id=mask_token_id, layers=recipe.layers, num_layers=o.num_layers,
        block_size=o.block_size, markov_rank=s.markov_rank, markov_head_type=s.variant,
        confidence_head=s.confidence_head)
    drafter = DSparkDrafter(config, vocab).to(target.device).attach_head(target.lm_head.weight.float())
    say(f"eagle: DSpark drafter {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M parameters, "
        f"{config.num_hidden_layers} layers, block {config.block_size}, Markov rank {config.markov_rank} "
        f"({config.markov_head_type}), confidence head {'on' if config.confidence_head else 'off'}, mask token "
        f"{mask_token_id}, aux layers {config.aux_layers}, draft vocab {vocab.size} of {target.vocab_size}")
    return DFlashObjective(drafter, o, recipe.seed, confidence_weight=s.confidence_weight)
