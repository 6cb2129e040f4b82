"""Training EAGLE-1 (drafter: eagle1): its recipe, the objective accelerate prepares, the target inputs of a batch
(online, or from offline features), the held-out evaluation. The loop, logging and checkpointing are
drafters.training.loop's, shared by every family.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from drafters.acceptance import chain_tau
from drafters.eagle1 import FEATURES, Eagle1Config, Eagle1Drafter
from drafters.layers import shift_left, ttt_label_mask
from drafters.losses import LabelLogits, in_row_chunks, soft_cross_entropy
from drafters.targets import FrozenHead
from drafters.training.loop import FeatureBatch
from drafters.training.schema import FeatureRecipe


@dataclass
class Eagle1Options:
    feature: Literal["pre_norm", "normed"] = "normed"  # drafters.eagle1; pre_norm trains but does not export
    feature_weight: float = 1.0  # SmoothL1(predicted feature_{t+1}, target feature_{t+1})
    token_weight: float = 0.1  # soft CE(target distribution at t+1, head(predicted feature))
    noise: float = 0.1  # half-width a of U(-a, a) added to the input features, training only (paper: 0.1)
    eval_steps: int = 5  # length K of the self-fed chain of the held-out evaluation


@dataclass(kw_only=True)
class Eagle1Recipe(FeatureRecipe):  # + target, data, optim, batches, steps, precision, layers, features, ...
    drafter: Literal["eagle1"] = "eagle1"
    output_dir: str = "outputs/eagle1"
    eagle1: Eagle1Options = field(default_factory=Eagle1Options)

    def problems(self) -> list[str]:
        return super().problems() + check_eagle1(self)


def check_eagle1(recipe: Eagle1Recipe) -> list[str]:
    o, problems = recipe.eagle1, []
    if o.feature not in FEATURES:
        problems.append(f"eagle1.feature={o.feature!r} must be one of {', '.join(FEATURES)}")
    if o.feature_weight < 0 or o.token_weight < 0 or o.feature_weight + o.token_weight == 0:
        problems.append(f"eagle1.feature_weight={o.feature_weight}, token_weight={o.token_weight} must be >= 0, "
                        "not both 0")
    if o.noise < 0:
        problems.append(f"eagle1.noise={o.noise} must be >= 0 (0 = no noise)")
    if o.eval_steps < 1:
        problems.append(f"eagle1.eval_steps={o.eval_steps} must be >= 1")
    if recipe.layers is not None:
        problems.append(f"layers={recipe.layers}: EAGLE-1 reads the last hidden state only; set layers: null")
    return problems


# eagle1.feature -> what the stored `features` hold, in words (HF hidden_states indices, docs/conventions.md)
LAYER_SPECS = {
    "pre_norm": "output of the last decoder layer before the final norm (input of the final norm)",
    "normed": "hidden_states[L]: the final-normed last hidden state",
}


def eagle1_layer_spec(recipe, target) -> dict:
    """What an EAGLE-1 feature store holds (drafters.training.features): its one feature, compared on reading."""
    return {"features": recipe.eagle1.feature, "what": LAYER_SPECS[recipe.eagle1.feature]}


def build_eagle1(recipe, target, train_rows, vocab, say) -> "Eagle1Objective":
    """The family's build (drafters.training.families.TrainingFamily): no draft vocabulary, the target's head."""
    drafter = build_eagle1_drafter(recipe, target)
    say(f"eagle: EAGLE-1 drafter {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M parameters, "
        f"{drafter.config.feature} features {'from ' + recipe.features.dir if recipe.features.dir else 'online'}, "
        f"full vocab {target.vocab_size}")
    return Eagle1Objective(drafter, recipe.eagle1, recipe.seed)


def build_eagle1_drafter(recipe, target) -> Eagle1Drafter:
    config = Eagle1Config.from_target_config(target.config, recipe.eagle1.feature)
    drafter = Eagle1Drafter(config).to(target.device)  # float32 master weights (mixed_precision autocasts)
    return drafter.attach_head(FrozenHead.from_target(target, config.feature))


@dataclass
class Eagle1Output:
    loss: Tensor  # () feature_weight * feature_losses[0] + token_weight * token_losses[0]
    feature_losses: Tensor  # (K,) SmoothL1 of chain step i: mean over h, averaged over its counted positions
    token_losses: Tensor  # (K,) soft CE vs the target's distribution, averaged over counted positions
    step_accuracies: Tensor  # (K,) top-1 of the drafter == target argmax, over counted positions
    step_counts: Tensor  # (K,) counted (supervised) positions of each step
    step_logits: list[Tensor]  # if asked, step i: (B, T-1-i, V)

    @property
    def step_losses(self) -> Tensor:  # (2,) what metrics.jsonl logs as step_loss: [feature, token] of step 0
        return torch.stack([self.feature_losses[0], self.token_losses[0]])


def feature_loss(predicted: Tensor, target: Tensor) -> Tensor:
    """predicted, target (M, h) at the counted positions -> () sum_m mean_d SmoothL1_beta=1 / max(M, 1)
    (as the official trainer: SmoothL1 averaged over the hidden dims, then over counted positions)."""
    per_position = F.smooth_l1_loss(predicted.float(), target.float(), reduction="none").mean(-1)  # (M,)
    return per_position.sum() / max(per_position.numel(), 1)


def chunked_token_loss(drafter: Eagle1Drafter, predicted: Tensor, target_logits, rows: Tensor
                       ) -> tuple[Tensor, Tensor, Tensor]:
    """The soft cross-entropy of the drafter's (M, V) logits (its frozen head on predicted (M, h)) against the
    target's rows where `rows` (B, T) bool, in the order of its True rows, as `soft_cross_entropy` with every row
    counted -> (mean loss, accuracy, M). The (M, V) logits, labels and softmax exist a chunk of rows at a time,
    recomputed in backward (drafters.losses.in_row_chunks)."""
    batch_index, position = rows.nonzero(as_tuple=True)  # (M,), (M,)
    total = len(batch_index)

    def token_rows(part: slice) -> tuple[Tensor, Tensor]:
        target = target_logits[batch_index[part], position[part]]  # (c, V)
        with torch.no_grad():
            target_p, target_argmax = torch.softmax(target.float(), dim=-1), target.argmax(-1)  # (c, V), (c,)
        everywhere = torch.ones(len(target), dtype=torch.bool, device=target.device)  # (c,)
        logits = drafter.compute_logits(predicted[part])  # (c, V)
        loss = soft_cross_entropy(logits, target_p, everywhere, target_argmax, everywhere,
                                  num_positions=max(total, 1))[0]  # the chunk's share of the mean
        return loss, (logits.detach().argmax(-1) == target_argmax).sum()

    loss, correct = in_row_chunks(token_rows, total, drafter.config.vocab_size)
    count = torch.tensor(total, device=predicted.device)
    return loss, correct / count.clamp(min=1), count


def chain_loss(drafter: Eagle1Drafter, batch: FeatureBatch, *, steps: int = 1, feature_weight: float = 1.0,
               token_weight: float = 0.1, noise: Tensor | None = None, return_logits: bool = False) -> Eagle1Output:
    """The EAGLE-1 objective on drafter.chain_unroll's steps. batch.target_logits (B, T, V), or a LabelLogits (read
    at the counted rows only: drafters.losses); batch.loss_mask (B, T) with
    loss_mask[s] = 1 iff token s is learnt. Step i at position t is scored against the target's row t+1+i
    (feature_{t+1+i}; its logits predict token t+2+i) where loss_mask[t+2+i]: SmoothL1 on the feature and
    soft CE against the target's distribution. The loss is that of step 0 only (the paper's objective);
    later steps are the held-out chain's metrics."""
    features, target_logits, loss_mask = batch.features, batch.target_logits, batch.loss_mask
    metrics, step_logits = [], []
    for step, hidden in drafter.chain_unroll(features, batch.input_ids, batch.embed, steps, noise):
        counted = ttt_label_mask(loss_mask, step).bool()  # (B, T-1-i): t -> loss_mask[t+2+i]
        num_rows = counted.shape[1]
        predicted = hidden[:, :num_rows][counted]  # (M, h)
        target_feature = shift_left(features, 1 + step)[:, :num_rows][counted]  # (M, h) feature t+1+i
        # (M, V) the target's row t+1+i: a (B, T) mask of those rows (same (b, t) order), so that a LabelLogits
        # computes them alone, never the (B, T, V) logits
        rows = torch.zeros(loss_mask.shape, dtype=torch.bool, device=loss_mask.device)
        rows[:, 1 + step:1 + step + num_rows] = counted
        if return_logits:
            logits = drafter.compute_logits(hidden[:, :num_rows])  # (B, T-1-i, V)
            step_logits.append(logits)
            target_rows = target_logits[rows]
            with torch.no_grad():
                target_p = torch.softmax(target_rows.float(), dim=-1)  # (M, V)
            everywhere = torch.ones(target_p.shape[0], dtype=torch.bool, device=target_p.device)  # (M,)
            token_loss, accuracy, count = soft_cross_entropy(
                logits[counted], target_p, everywhere, target_rows.argmax(-1), everywhere)
        else:  # only counted rows hit the head, a chunk of them at a time (drafters.losses.in_row_chunks)
            token_loss, accuracy, count = chunked_token_loss(drafter, predicted, target_logits, rows)
        metrics.append((feature_loss(predicted, target_feature), token_loss, accuracy, count))
    while len(metrics) < steps:  # rows too short for the later steps: nothing counted
        zero = features.new_zeros((), dtype=torch.float32)
        metrics.append((zero, zero, zero, zero.long()))
    feature_losses, token_losses, accuracies, counts = (torch.stack(m) for m in zip(*metrics))
    return Eagle1Output(loss=feature_weight * feature_losses[0] + token_weight * token_losses[0],
                        feature_losses=feature_losses, token_losses=token_losses,
                        step_accuracies=accuracies, step_counts=counts, step_logits=step_logits)


class Eagle1Objective(nn.Module):
    """What accelerate prepares: step 0 of `chain_loss` (the EAGLE-1 loss) on one batch, with
    U(-a, a) noise on the input features while training (a = eagle1.noise). Same call signature as
    Eagle3Objective. The noise has its own generator (seeded by the recipe's seed) whose state is a buffer
    of this module, so accelerate's save_state / load_state carry it: a resumed run draws the noise an
    uninterrupted run would. It is drawn on the CPU (one generator state whatever the device)."""

    def __init__(self, drafter: Eagle1Drafter, options: Eagle1Options, seed: int = 0):
        super().__init__()
        self.drafter, self.options = drafter, options
        self.register_buffer("noise_generator", torch.Generator().manual_seed(seed).get_state())  # (5056,) uint8

    def forward(self, features, input_ids, target_logits, loss_mask, embed, num_positions=None) -> Eagle1Output:
        o = self.options
        noise = self.draw_noise(features) if self.training and o.noise else None
        return chain_loss(self.drafter, FeatureBatch(features, input_ids, target_logits, loss_mask, embed), steps=1,
                          feature_weight=o.feature_weight, token_weight=o.token_weight, noise=noise)

    def draw_noise(self, features: Tensor) -> Tensor:
        generator = torch.Generator()
        generator.set_state(self.noise_generator.cpu())
        uniform = torch.rand(features.shape, generator=generator)  # U(0, 1) (B, T, h)
        self.noise_generator.copy_(generator.get_state())
        return ((uniform * 2 - 1) * self.options.noise).to(features.device, features.dtype)  # U(-a, a)


def eagle1_inputs_fn(recipe, target, drafter: Eagle1Drafter) -> Callable[[dict], tuple[Tensor, Tensor]]:
    """-> batch -> (features (B, T, h) in the drafter's dtype, the target's logits (B, T, V) as a LabelLogits: the
    frozen head (drafter.head: the final norm too for the pre-norm feature) applied at the rows the loss reads);
    no grad. Online: one target forward, without its LM head. Offline: the batch's stored features
    (drafters.training.features: exact up to the storage dtype)."""
    feature, dtype = drafter.config.feature, drafter.fc.weight.dtype

    @torch.no_grad()
    def offline(batch: dict):
        features = batch["features"]  # (B, T, h) storage dtype, zero on padding
        return features.to(dtype), LabelLogits(features, drafter.head)

    @torch.no_grad()
    def online(batch: dict):
        out = target.features(batch["input_ids"], batch["attention_mask"], pre_norm_last=feature == "pre_norm",
                              logits=False)
        features = out.pre_norm_last if feature == "pre_norm" else out.last_hidden
        return features.to(dtype), LabelLogits(features, drafter.head)

    return offline if recipe.features.dir else online


@torch.no_grad()
def evaluate_eagle1(drafter: Eagle1Drafter, inputs, embed, batches: list[dict], recipe, accelerator) -> dict:
    """Per chain step k (k = 1 .. K = eagle1.eval_steps; step k drafts the k-th token of a chain):
        acc_k    = top-1 of head(predicted feature) == target argmax, over supervised positions
        tau_pred = 1 + sum_{k=1..K} prod_{j<=k} acc_j
    Step k > 1 feeds the drafter its own predicted feature of step k-1 and the TRUE token (teacher-forced),
    as drafting does along an accepted chain, so acc_k estimates P(draft k accepted | drafts 1..k-1
    accepted) and tau_pred the mean accepted length of a greedy chain of K drafts (bonus included).
    loss / feature_loss / token_loss: the training loss of step 1, no noise, averaged over batches."""
    drafter.eval()
    o, steps = recipe.eagle1, recipe.eagle1.eval_steps
    correct, counted = (torch.zeros(steps, device=accelerator.device) for _ in range(2))
    sums = torch.zeros(3, device=accelerator.device)  # loss, feature loss, token loss of step 1
    for batch in batches:
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        features, target_logits = inputs(batch)
        with accelerator.autocast():
            rows = FeatureBatch(features, batch["input_ids"], target_logits, batch["loss_mask"], embed)
            out = chain_loss(drafter, rows, steps=steps, feature_weight=o.feature_weight, token_weight=o.token_weight)
        correct += out.step_accuracies * out.step_counts
        counted += out.step_counts
        sums += torch.stack([out.loss, out.feature_losses[0], out.token_losses[0]])
    accuracy = (correct / counted.clamp(min=1)).tolist()
    loss, feature_loss, token_loss = (sums / max(len(batches), 1)).tolist()
    return {"loss": loss, "feature_loss": feature_loss, "token_loss": token_loss, "step_acc": accuracy,
            "supervised": int(counted[0]), "tau_pred": chain_tau(accuracy)}
