"""Training Medusa-1 and Blockwise heads on a frozen target (train/train.py), online: target features are computed per
batch. Two families of drafters.training.families.TRAINING_FAMILIES are made of what is here.

Flow: recipe -> frozen target -> examples (chat template + assistant loss mask) -> deterministic
train / held-out split -> heads (drafters.medusa: K heads of residual blocks + an LM head copied
from the target's, or the target's own with medusa.share_lm_head; drafters.blockwise: one hidden
layer d -> K*f -> K*d, residual per head, the frozen target LM head) -> AdamW with linear warmup then
cosine or constant lr -> loop: the target's last hidden state (and its logits when distilling; no
grad) -> per-head cross-entropy, head k on token t+k+2 (drafters.heads) -> backward -> clip -> step.

Losses: medusa  sum_k medusa.step_weight^k CE_k (0.8: Medusa's decay; 1.0: the plain sum)
        blockwise  mean_k CE_k, or (blockwise.loss=sample_one, the paper's memory-saving rule) the
                CE of one head drawn uniformly per micro-batch (the same head on every process)
        distill=true: CE against the target's own distribution for token t+k+2 (self-distillation)
                instead of the data token.
Held-out evaluation = calibration: per head, how often its rank-r candidate is the target's greedy
token; from these, the draft tree (tree.kind greedy: the tree.budget nodes of highest acceptance
probability, drafters.training.heads_tree) and its predicted mean accepted length tau_pred.

What a run writes: train/train.py.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor, nn

from drafters.acceptance import chain_tau
from drafters.blockwise import BlockwiseConfig, BlockwiseHeads
from drafters.decode.proposers.heads import TREE_FILE
from drafters.heads import TOPK_METRIC, HeadsOutput, heads_loss, rank_hits
from drafters.losses import LabelLogits
from drafters.medusa import MedusaConfig, MedusaHeads
from drafters.targets import FrozenHead, Target
from drafters.training.resume import Position
from drafters.training.heads_tree import HeadsTree, accuracy_table, cartesian_tree, chain_tree, greedy_tree
from drafters.training.loop import RunBase
from drafters.training.metrics import StepMetrics
from drafters.training.recipe import RecipeError
from drafters.training.schema import TrainRecipe


@dataclass
class MedusaOptions:
    num_layers: int = 1  # residual blocks per head
    share_lm_head: bool = False  # true: every head projects with the frozen target LM head ("version 2")
    step_weight: float = 0.8  # head k's loss weighs step_weight ** k; 1.0 = the plain sum


@dataclass
class BlockwiseOptions:
    loss: Literal["mean", "sample_one"] = "mean"  # sample_one: one head per micro-batch, drawn uniformly
    hidden_per_head: int = 0  # f: the hidden layer is num_heads * f wide; 0 = the target's hidden size


@dataclass
class TreeOptions:
    kind: Literal["greedy", "cartesian", "chain"] = "greedy"  # greedy: calibrated for the budget
    budget: int = 63  # greedy: draft nodes, root excluded
    topk: int = 10  # candidates per head measured on the held-out set; greedy uses ranks < topk
    cartesian: list[int] = field(default_factory=lambda: [4, 3, 2, 1])  # kind=cartesian: top-k per depth


@dataclass(kw_only=True)
class HeadsRecipe(TrainRecipe):  # + target, data, optim, batches, steps, precision, checkpoints, logging
    """What Medusa and Blockwise recipes share; each family's recipe adds its own section."""

    num_heads: int = 4  # head k predicts token t+k+2
    distill: bool = False  # train on the target's distribution for token t+k+2 instead of the data token
    tree: TreeOptions = field(default_factory=TreeOptions)

    def problems(self) -> list[str]:
        problems = super().problems()
        if self.num_heads < 1:
            problems.append(f"num_heads={self.num_heads} must be >= 1")
        if self.data.max_length < self.num_heads + 2:
            # head k trains on (position t, token t+k+2): the last head needs K+2 tokens in a sequence
            problems.append(f"num_heads={self.num_heads} needs data.max_length >= num_heads + 2 = "
                            f"{self.num_heads + 2} (head k predicts token t+k+2), got {self.data.max_length}; lower "
                            "num_heads or raise max_length")
        tree = self.tree
        if tree.budget < 1 or tree.topk < 1:
            problems.append(f"tree.budget={tree.budget} and tree.topk={tree.topk} must be >= 1")
        if tree.kind == "cartesian" and (not tree.cartesian or len(tree.cartesian) > self.num_heads
                                         or min(tree.cartesian) < 1 or max(tree.cartesian) > tree.topk):
            problems.append(f"tree.cartesian={tree.cartesian} must list 1..num_heads={self.num_heads} top-k values, "
                            f"each in [1, tree.topk={tree.topk}] (depth d is drafted by head d-1)")
        return problems


@dataclass(kw_only=True)
class MedusaRecipe(HeadsRecipe):
    drafter: Literal["medusa"] = "medusa"
    output_dir: str = "outputs/medusa"
    medusa: MedusaOptions = field(default_factory=MedusaOptions)

    def problems(self) -> list[str]:
        problems, medusa = super().problems(), self.medusa
        if medusa.num_layers < 0 or medusa.step_weight <= 0:
            problems.append(f"medusa.num_layers={medusa.num_layers} must be >= 0 and medusa.step_weight="
                            f"{medusa.step_weight} > 0")
        return problems


@dataclass(kw_only=True)
class BlockwiseRecipe(HeadsRecipe):
    drafter: Literal["blockwise"] = "blockwise"
    output_dir: str = "outputs/blockwise"
    blockwise: BlockwiseOptions = field(default_factory=BlockwiseOptions)

    def problems(self) -> list[str]:
        problems = super().problems()
        if self.blockwise.hidden_per_head < 0:
            problems.append(f"blockwise.hidden_per_head={self.blockwise.hidden_per_head} must be >= 1 "
                            "(0 = hidden size)")
        return problems


def check_heads_have_labels(recipe: HeadsRecipe, rows) -> None:
    # the last head trains on (t, t+K+1) pairs whose token t+K+1 is a target: at least one must exist
    shift = recipe.num_heads + 1
    if not any(any(example.loss_mask[shift:]) for example in rows):
        raise RecipeError(f"num_heads={recipe.num_heads}: no training example has a target token at position >= "
                          f"{shift}, so head {recipe.num_heads - 1} (token t+{shift}) would never train; lower "
                          "num_heads or use longer conversations")


# ---- set-up ---------------------------------------------------------------------------------------


def medusa_heads(recipe: MedusaRecipe, target: Target) -> MedusaHeads:
    m = recipe.medusa
    config = MedusaConfig.from_target_config(target.config, num_heads=recipe.num_heads, num_layers=m.num_layers,
                                             share_lm_head=m.share_lm_head)
    drafter = MedusaHeads(config)
    drafter.init_from_target(target.lm_head.weight.float())  # no-op with share_lm_head
    return drafter


def blockwise_heads(recipe: BlockwiseRecipe, target: Target) -> BlockwiseHeads:
    config = BlockwiseConfig.from_target_config(target.config, num_heads=recipe.num_heads,
                                                hidden_per_head=recipe.blockwise.hidden_per_head)
    return BlockwiseHeads(config)


def build_medusa(recipe: MedusaRecipe, target: Target, train_rows, vocab, say) -> "HeadsObjective":
    """The family's build (drafters.training.families.TrainingFamily): the heads, wrapped in their objective."""
    return _heads_objective(medusa_heads(recipe, target), recipe, target, say)


def build_blockwise(recipe: BlockwiseRecipe, target: Target, train_rows, vocab, say) -> "HeadsObjective":
    return _heads_objective(blockwise_heads(recipe, target), recipe, target, say)


def _heads_objective(drafter, recipe: HeadsRecipe, target: Target, say) -> "HeadsObjective":
    drafter = drafter.to(target.device)
    trainable = sum(p.numel() for p in drafter.parameters())
    say(f"heads: {recipe.drafter} drafter, {recipe.num_heads} heads, {trainable / 1e6:.2f}M trainable parameters "
        f"(target: {sum(p.numel() for p in target.model.parameters()) / 1e6:.1f}M, frozen)")
    return HeadsObjective(drafter)


def loss_weights(recipe: HeadsRecipe, micro_index: int | None = None) -> dict[int, float]:
    """{head k: weight}. micro_index: the run's global micro-batch count, which picks sample_one's head
    (a pure function of seed and count, so every process and a resumed run pick the same one)."""
    return LOSS_WEIGHTS[recipe.drafter](recipe, micro_index)


def medusa_weights(recipe: MedusaRecipe, micro_index: int | None) -> dict[int, float]:
    return {k: recipe.medusa.step_weight ** k for k in range(recipe.num_heads)}  # 0.8^k: Medusa's decay


def blockwise_weights(recipe: BlockwiseRecipe, micro_index: int | None) -> dict[int, float]:
    K = recipe.num_heads
    if recipe.blockwise.loss == "sample_one" and micro_index is not None:
        generator = torch.Generator().manual_seed(recipe.seed * 1_000_003 + micro_index)
        return {int(torch.randint(K, (), generator=generator)): 1.0}
    return {k: 1.0 / K for k in range(K)}


LOSS_WEIGHTS = {"medusa": medusa_weights, "blockwise": blockwise_weights}  # one entry per heads family


class HeadsObjective(nn.Module):
    """What accelerate prepares (DDP syncs gradients through forward): the heads' loss on one batch.
    The target stays outside; its last hidden state, logits and LM head weight are arguments."""

    def __init__(self, drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, hidden, input_ids, loss_mask, lm_head, weights, teacher_logits=None) -> HeadsOutput:
        return heads_loss(self.drafter, hidden, input_ids, loss_mask, lm_head, weights=weights,
                          teacher_logits=teacher_logits)


def target_inputs(target: Target, batch: dict, dtype: torch.dtype, logits: bool):
    """-> last hidden state (B, T, d) in the heads' dtype, and the target's logits (B, T, V) as a LabelLogits (the
    frozen head applied at the rows a head reads, drafters.losses: never the whole (B, T, V)) or None; no grad."""
    out = target.features(batch["input_ids"], batch["attention_mask"], logits=False)
    labels = LabelLogits(out.last_hidden, FrozenHead.from_target(target, "normed")) if logits else None
    return out.last_hidden.to(dtype), labels


# ---- the loop (drafters.training.loop.train_loop) ------------------------------------------------------


class HeadsRun(RunBase):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.dtype = next(self.drafter.parameters()).dtype
        self.lm_head = self.target.lm_head.weight.detach().to(self.dtype)  # (V, d) frozen, a copy in the heads' dtype
        self.micro_index = 0 if self.resumed is None else self.resumed[0] * self.recipe.grad_accum  # picks sample_one's head

    def micro_step(self, batch: dict, acc: StepMetrics | None) -> StepMetrics:
        """Forward + backward of one micro-batch; metrics are summed into `acc` as tensors."""
        hidden, teacher = target_inputs(self.target, batch, self.dtype, logits=self.recipe.distill)
        weights = loss_weights(self.recipe, self.micro_index)
        self.micro_index += 1
        out = self.objective(hidden, batch["input_ids"], batch["loss_mask"], self.lm_head, weights, teacher)
        self.accelerator.backward(out.loss / self.recipe.grad_accum)
        scale = 1.0 / self.recipe.grad_accum
        metrics = StepMetrics(loss=out.loss.detach() * scale,
                              parts=out.head_losses * scale,  # (K,) per head; 0 for a head sample_one skipped
                              correct=out.correct, counted=out.counts, tokens=batch["attention_mask"].sum(),
                              correct_top5=out.correct_top5)  # (K,) label in the top-5
        return metrics if acc is None else acc + metrics

    def checkpoint_extra(self, step: int, result: dict | None) -> dict:
        # an evaluated checkpoint carries its calibrated tree (extra.tree and a copy in tree.json)
        return {**super().checkpoint_extra(step, result), "tree": None if result is None else result["tree"]}

    def save(self, path: Path, step: int, result: dict | None, position: Position | None = None) -> Path:
        super().save(path, step, result, position)
        if self.accelerator.is_main_process and result is not None:  # a copy of extra.tree, for --tree static:
            (path / TREE_FILE).write_text(json.dumps(result["tree"]["paths"]) + "\n")
        self.accelerator.wait_for_everyone()
        return path

    def held_out(self, drafter) -> dict:
        return evaluate(drafter, self.target, self.eval_batches, self.recipe, self.accelerator, self.lm_head)

    def describe(self, result: dict) -> str:
        return format_eval(result)

    def logged(self, result: dict) -> dict:  # scalars and per-head lists; the tree as its node count
        scalars = {k: v for k, v in result.items() if k not in ("rank_acc", "tree")}
        return {**scalars, "tree_draft_nodes": result["tree"]["draft_nodes"]}


# ---- held-out evaluation and tree calibration -----------------------------------------------------


@torch.no_grad()
def evaluate(drafter, target: Target, batches: list[dict], recipe: HeadsRecipe, accelerator, lm_head: Tensor) -> dict:
    """On the held-out rows, per head k (predicting token t+k+2 from position t):
        rank_acc[k][r] = P(head k's rank-r candidate == the target's greedy token for t+k+2), the
                         token greedy verification accepts after a correct prefix (drafters.heads.rank_hits)
        top1 = rank_acc[k][0], top5 = sum_{r<5} rank_acc[k][r]
        loss, head_loss = the training objective (sample_one evaluates the mean over heads)
    The tree is built from rank_acc (drafters.training.heads_tree, heads assumed independent) and
        tau_pred = 1 + sum over its nodes of prod_{depth d} rank_acc[d-1][r_d]
    predicts the mean accepted length (bonus token included) of greedy decoding with it; tau_pred_chain
    the same for a chain of each head's top-1. The tree is calibrated on these same rows."""
    drafter.eval()
    K, ranks = recipe.num_heads, max(recipe.tree.topk, TOPK_METRIC)
    hits, counts = torch.zeros(K, ranks), torch.zeros(K)
    loss, head_losses = torch.zeros(()), torch.zeros(K)
    weights = loss_weights(recipe)  # no micro index: all heads
    for batch in batches:
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        hidden, target_logits = target_inputs(target, batch, lm_head.dtype, logits=True)
        with accelerator.autocast():
            out = heads_loss(drafter, hidden, batch["input_ids"], batch["loss_mask"], lm_head, weights=weights,
                             teacher_logits=target_logits if recipe.distill else None)
            batch_hits, batch_counts = rank_hits(drafter, hidden, target_logits, batch["loss_mask"], lm_head, ranks)
        hits += batch_hits.cpu()
        counts += batch_counts.cpu()
        loss += out.loss.cpu()
        head_losses += out.head_losses.cpu()
    rank_acc = accuracy_table(hits, counts)
    tree = build_tree(recipe, [row[: recipe.tree.topk] for row in rank_acc])
    return {"loss": (loss / len(batches)).item(), "head_loss": (head_losses / len(batches)).tolist(),
            "head_top1": [row[0] for row in rank_acc], "head_top5": [sum(row[:TOPK_METRIC]) for row in rank_acc],
            "rank_acc": rank_acc, "supervised": [int(c) for c in counts.tolist()],
            "tau_pred": tree.expected_tau, "tau_pred_chain": chain_tau([row[0] for row in rank_acc]),
            "tree": tree.to_dict()}


def build_tree(recipe: HeadsRecipe, rank_acc: list[list[float]]) -> HeadsTree:
    tree = recipe.tree
    if tree.kind == "greedy":
        return greedy_tree(rank_acc, tree.budget)
    if tree.kind == "cartesian":
        return cartesian_tree(rank_acc, tree.cartesian)
    return chain_tree(rank_acc, recipe.num_heads)


def format_eval(result: dict) -> str:
    top1 = " ".join(f"{a:.3f}" for a in result["head_top1"])
    top5 = " ".join(f"{a:.3f}" for a in result["head_top5"])
    tree = result["tree"]
    return (f"eval @ step {result['step']}: loss {result['loss']:.4f}, per-head top-1 [{top1}] top-5 [{top5}] "
            f"(vs the target's greedy token, {result['supervised'][0]} positions for head 0); {tree['kind']} tree "
            f"of {tree['draft_nodes']} draft nodes excl. root: tau_pred {result['tau_pred']:.3f} (chain of "
            f"{len(result['head_top1'])}: {result['tau_pred_chain']:.3f})")
