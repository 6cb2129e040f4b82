"""Training a target's native MTP layer (drafter: mtp): its recipe, the objective accelerate prepares, the target
inputs of a batch, the held-out evaluation. The drafter starts as the target's own MTP layer (drafters.mtp), read
from its checkpoint directory; the target, its embedding and its head stay frozen. The loop, logging and
checkpointing are drafters.training.loop's.

Objective, chain step i = 0 .. mtp.ttt_steps-1 (drafters.mtp.MtpDrafter.chain_unroll): position t reads
(h_{i-1,t}, token_{t+1+i}) and is scored by the cross-entropy of head(norm(y_i,t)) against token_{t+2+i} where that
token is supervised (loss_mask[t+2+i]); loss = sum_i w^i CE_i (w = mtp.step_weight), each CE_i the mean over its
supervised positions. ttt_steps 1 is the MTP layer's own pre-training objective (DeepSeek-V3's depth 1).
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from drafters.acceptance import chain_tau
from drafters.layers import shift_left, ttt_label_mask
from drafters.mtp import MtpDrafter, check_mtp_target, read_target_mtp
from drafters.targets import FrozenHead
from drafters.training.loop import FeatureBatch
from drafters.training.schema import FeatureRecipe


@dataclass
class MtpOptions:
    layer: int = 0  # j: the target's MTP layer to train (model.layers.{N+j} / mtp.layers.{j})
    ttt_steps: int = 1  # chain steps trained: the layer rerun on its own output, as the engines draft with it
    step_weight: float = 0.8  # w: step i's loss weighs w^i
    eval_steps: int = 3  # chain length K of the held-out tau_pred


@dataclass(kw_only=True)
class MtpRecipe(FeatureRecipe):  # + target, data, optim, batches, steps, precision, ...
    drafter: Literal["mtp"] = "mtp"
    output_dir: str = "outputs/mtp"
    mtp: MtpOptions = field(default_factory=MtpOptions)

    def problems(self) -> list[str]:
        return super().problems() + check_mtp(self)


def check_mtp(recipe: MtpRecipe) -> list[str]:
    """The mtp fields, and, for a target that is a local directory, its MTP layers (before any work)."""
    o, problems = recipe.mtp, []
    for name in ("ttt_steps", "eval_steps"):
        if getattr(o, name) < 1:
            problems.append(f"mtp.{name}={getattr(o, name)} must be >= 1")
    if not 0 < o.step_weight <= 1:
        problems.append(f"mtp.step_weight={o.step_weight} must be in (0, 1]")
    if recipe.layers is not None:
        problems.append(f"layers={recipe.layers}: an MTP layer reads the target's last hidden state only; set "
                        "layers: null")
    if recipe.features.dir:
        problems.append(f"features.dir={recipe.features.dir}: MTP trains online only; set features.dir=null")
    path = Path(recipe.target).expanduser()
    if not problems and (path / "config.json").is_file():
        from transformers import AutoConfig

        try:
            check_mtp_target(path, AutoConfig.from_pretrained(path).get_text_config(), o.layer, f"target={path}")
        except Exception as err:  # noqa: BLE001  MtpError, or a config transformers cannot read: said as is
            problems.append(str(err))
    return problems


def build_mtp(recipe: MtpRecipe, target, train_rows, vocab, say) -> "MtpObjective":
    """The family's build (drafters.training.families.TrainingFamily): the target's own MTP layer, its head."""
    config, state = read_target_mtp(target, recipe.mtp.layer)  # MtpError (one sentence) where it has none
    drafter = MtpDrafter(config)
    drafter.load_state_dict(state, strict=True)
    drafter.to(target.device).attach_head(FrozenHead.from_target(target, "normed"))  # float32 master weights
    say(f"mtp: {target.name}'s MTP layer {config.layer} of {config.num_mtp_layers} ({config.layout} layout, "
        f"{type(drafter.layer.mtp_block).__name__}), {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M "
        f"parameters, {recipe.mtp.ttt_steps} chain step(s)")
    return MtpObjective(drafter, recipe.mtp)


@dataclass
class MtpOutput:
    loss: Tensor  # () sum_i w^i CE_i
    step_losses: Tensor  # (K,) CE_i: mean over step i's supervised positions
    step_accuracies: Tensor  # (K,) top-1 == the data's token_{t+2+i}
    step_counts: Tensor  # (K,) supervised positions of step i


def chain_loss(drafter: MtpDrafter, batch: FeatureBatch, steps: int, step_weight: float = 1.0) -> MtpOutput:
    """batch.features (B, T, H) the target's h_t; batch.input_ids (B, T); batch.loss_mask (B, T). Step i at position
    t (t = 0 .. T-2-i) predicts label[t] = token_{t+2+i}, counted where loss_mask[t+2+i] (drafters.layers)."""
    metrics = []
    for step, normed in drafter.chain_unroll(batch.features, batch.input_ids, batch.embed, steps):
        counted = ttt_label_mask(batch.loss_mask, step).bool()  # (B, T-1-i)
        labels = shift_left(batch.input_ids, 2 + step)[:, :counted.shape[1]][counted]  # (M,) token_{t+2+i}
        logits = drafter.compute_logits(normed[:, :counted.shape[1]][counted]).float()  # (M, V)
        loss = F.cross_entropy(logits, labels) if len(labels) else logits.sum() * 0
        correct = (logits.detach().argmax(-1) == labels).float().mean() if len(labels) else loss.detach() * 0
        metrics.append((loss, correct, torch.tensor(len(labels), device=logits.device)))
    while len(metrics) < steps:  # rows too short for the later steps: nothing counted
        zero = batch.features.new_zeros((), dtype=torch.float32)
        metrics.append((zero, zero, zero.long()))
    losses, accuracies, counts = (torch.stack(m) for m in zip(*metrics))
    weights = step_weight ** torch.arange(steps, device=losses.device, dtype=losses.dtype)  # (K,) w^i
    return MtpOutput((weights * losses).sum(), losses, accuracies, counts)


class MtpObjective(nn.Module):
    """What accelerate prepares: chain_loss on one batch (the FeatureRun signature; target logits unused: the labels
    are the data's tokens)."""

    def __init__(self, drafter: MtpDrafter, options: MtpOptions):
        super().__init__()
        self.drafter, self.options = drafter, options

    def forward(self, features, input_ids, target_logits, loss_mask, embed, num_positions=None) -> MtpOutput:
        # num_positions (the batch's padded size, FeatureRun's): unused, each step's CE is a mean over its labels
        o = self.options
        return chain_loss(self.drafter, FeatureBatch(features, input_ids, None, loss_mask, embed), o.ttt_steps,
                          o.step_weight)


def mtp_inputs_fn(recipe, target, drafter: MtpDrafter):
    """-> batch -> (h (B, T, H) the target's final-normed last hidden state in the drafter's dtype, None); one
    target forward without its LM head, no grad."""
    dtype = drafter.layer.eh_proj.weight.dtype

    @torch.no_grad()
    def online(batch: dict):
        out = target.features(batch["input_ids"], batch["attention_mask"], logits=False)
        return out.last_hidden.to(dtype), None

    return online


@torch.no_grad()
def evaluate_mtp(drafter: MtpDrafter, inputs, embed, batches: list[dict], recipe, accelerator) -> dict:
    """Per chain step k = 1 .. K (mtp.eval_steps; teacher-forced tokens, the drafter's own hidden states):
    acc_k = top-1 == the data's token, over supervised positions; tau_pred = 1 + sum_k prod_{j<=k} acc_j
    (drafters.acceptance.chain_tau); loss: step 1's CE averaged over batches."""
    drafter.eval()
    steps = recipe.mtp.eval_steps
    correct, counted = (torch.zeros(steps, device=accelerator.device) for _ in range(2))
    loss = torch.zeros((), device=accelerator.device)
    for batch in batches:
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        features, _ = inputs(batch)
        with accelerator.autocast():
            out = chain_loss(drafter, FeatureBatch(features, batch["input_ids"], None, batch["loss_mask"], embed),
                             steps)
        correct += out.step_accuracies * out.step_counts
        counted += out.step_counts
        loss += out.step_losses[0]
    accuracy = (correct / counted.clamp(min=1)).tolist()
    return {"loss": loss.item() / max(len(batches), 1), "step_acc": accuracy, "supervised": int(counted[0]),
            "tau_pred": chain_tau(accuracy)}
