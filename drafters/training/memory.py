"""Will one training step fit? An estimate of the memory a step of EAGLE-3, DFlash or DSpark adds, from the recipe
and the built drafter, checked against what the device has free before the first step (fit calls it), so a length
or vocabulary that cannot fit is refused in one sentence with the estimate and what to lower, not killed by the
kernel's out-of-memory killer halfway into a run.

The terms (bytes), B = batch_size, T = data.max_length, k = ttt_steps, Vd = the draft vocabulary, h = the drafter's
hidden size, P = its trainable parameters:

    labels       B T Vd 4             the target's distribution over the draft vocabulary at every supervised row,
                                      float32, held for the whole step (block families: their label rows only)
    head grads   k Vd h 4             each TTT step's LM-head gradient, kept by the fused loss until backward
    optimizer    P 12                 float32 gradients and two optimizer states (AdamW; Muon keeps one on matrices)
    activations  k B T h ACT_BYTES    what each TTT step keeps for backward (block families: the blocks' slots)
    transients   16 c Vd + 12 E       the fused loss's chunk (c rows: logits, log q, q, dz in float32) and a label
                                      chunk (E = drafters.losses.LABEL_CHUNK_ELEMENTS logits and their softmax)
    target       B T h_t (L+1) bytes  online features: every hidden state of the frozen target's forward

ACT_BYTES was fit on eval/memory_bench.py's grid (report/memory/index.md: a random Llama of width 256, bf16
autocast, CPU): the step's measured peak over these terms. The estimate is meant to be within a factor of about 1.5
of a measured peak, not exact; `check_memory: false` in a recipe skips the check.
"""

from dataclasses import dataclass

import torch

from drafters.losses import LABEL_CHUNK_ELEMENTS
from drafters.training.recipe import RecipeError

ACT_BYTES = 160  # per token, TTT step and unit of hidden size kept for backward (fit, bf16 autocast)
LOSS_CHUNK_ROWS = 256  # drafters.losses.linear_soft_cross_entropy's default chunk
FAMILIES = ("eagle3", "dflash", "dspark")  # the families estimated; the others are not checked


@dataclass
class StepEstimate:
    parts: dict[str, float]  # name -> bytes

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def describe(self) -> str:
        return ", ".join(f"{name} {size(value)}" for name, value in self.parts.items() if value)


def size(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GB" if num_bytes >= 2**28 else f"{num_bytes / 2**20:.0f} MB"


def estimate_step(recipe, target, drafter, *, online: bool) -> StepEstimate | None:
    """The memory one optimizer step adds for recipe.drafter (FAMILIES), given the built drafter; None for a family
    this module does not estimate."""
    if recipe.drafter not in FAMILIES:
        return None
    c = drafter.config
    batch, seq, vocab, hidden = recipe.batch_size, recipe.data.max_length, c.draft_vocab_size, c.hidden_size
    params = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    if recipe.drafter == "eagle3":
        steps, label_rows, act_tokens = recipe.ttt_steps, batch * seq, batch * seq
        head_grads = steps * vocab * hidden * 4
    else:  # a block drafter: its anchors' slots are the rows it scores and the tokens it runs
        block, anchors = recipe.dflash.block_size, recipe.dflash.anchors
        steps, label_rows, act_tokens = c.num_hidden_layers, batch * anchors * (block - 1), batch * anchors * block
        head_grads = 0  # the target's frozen head rows
    parts = {
        "labels": label_rows * vocab * 4,
        "head grads": head_grads,
        "optimizer": params * 12,
        "activations": steps * act_tokens * hidden * ACT_BYTES,
        "transients": 16 * LOSS_CHUNK_ROWS * vocab + 12 * LABEL_CHUNK_ELEMENTS,
    }
    if online:
        t = target.config.get_text_config()
        parts["target"] = batch * seq * t.hidden_size * (t.num_hidden_layers + 1) * target.dtype.itemsize
    return StepEstimate(parts)


def available_bytes(device: torch.device) -> int | None:
    """Free memory on `device`: CUDA's free bytes, or the host's MemAvailable (Linux); None where unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_step_memory(recipe, target, drafter, device: torch.device, say) -> None:
    """Raise RecipeError, before the first step, where the estimate exceeds the device's free memory."""
    if not recipe.check_memory or recipe.drafter not in FAMILIES:
        return
    estimate = estimate_step(recipe, target, drafter, online=not recipe.features.dir)
    free = available_bytes(device)
    if estimate is None or free is None:
        return
    if estimate.total <= free:
        say(f"memory: one step needs about {size(estimate.total)} ({estimate.describe()}); {size(free)} free")
        return
    lower = [f"data.max_length ({recipe.data.max_length})", f"batch_size ({recipe.batch_size})"]
    lower += [f"ttt_steps ({recipe.ttt_steps})"] if recipe.drafter == "eagle3" else [
        f"dflash.anchors ({recipe.dflash.anchors})"]
    lower.append(f"draft_vocab_size ({drafter.config.draft_vocab_size})")
    raise RecipeError(f"recipe: one training step needs about {size(estimate.total)} ({estimate.describe()}), "
                      f"more than the {size(free)} free on {device}: lower {', '.join(lower)}, or set "
                      "check_memory=false to try anyway (the estimate: drafters/training/memory.py)")
