"""Will one training step fit? An estimate of the memory a training step adds, from the recipe, the built drafter
and its family's StepShape (TrainingFamily.memory_shape: EAGLE-3's TTT, DFlash's and DSpark's blocks), checked
against what the device has free before the first step (fit calls it), so a length or vocabulary that cannot fit
is refused in one sentence with the estimate and what to lower, not killed by the
kernel's out-of-memory killer halfway into a run.

The terms (bytes), B = batch_size, T = data.max_length, k = ttt_steps, Vd = the draft vocabulary, h = the drafter's
hidden size, P = its trainable parameters:

    labels       B T Vd 4             the target's distribution over the draft vocabulary at every supervised row,
                                      float32, held for the whole step (block families: their label rows only);
                 B T h_t 4            with EAGLE-3's vocab_memory=recompute: the target's final hidden state at
                                      those rows, the labels recomputed from it when read
    head grads   k Vd h 4             each TTT step's LM-head gradient, kept by the fused loss until backward
                 Vd h 4               vocab_memory=recompute: one at a time, computed in backward
    optimizer    P 12                 float32 gradients and two optimizer states (AdamW; Muon keeps one on matrices)
    activations  k n B T h ACT_BYTES  what each TTT step keeps for backward through the drafter's n decoder layers
                                      (block families: the blocks' slots through each layer)
    logits       4 R Vd 4             a loss without a fused head (DSpark's Markov bias, D-PACE's weights): R rows
                                      of logits, their log-softmax, softmax and gradient in float32
    transients   16 c Vd + 8 E        the fused loss's chunk (c = drafters.losses.loss_chunk_rows(Vd) rows: logits,
                                      log q, q, dz in float32, 2^23 elements each whatever Vd) and a label
                                      chunk (E = drafters.losses.LABEL_CHUNK_ELEMENTS logits and their softmax)
                 + 12 c V             vocab_memory=recompute: the chunk's labels, recomputed over the target's V
    target       B T h_t (L+1) bytes  online features: every hidden state of the frozen target's forward

ACT_BYTES was fit on eval/memory_bench.py's grid (report/memory/index.md: a random Llama of width 256, bf16
autocast, CPU): the step's measured peak over these terms. The estimate is meant to be within a factor of about 1.5
of a measured peak, not exact; `check_memory: false` in a recipe skips the check.
"""

from dataclasses import dataclass

import torch

from drafters.losses import LABEL_CHUNK_ELEMENTS, loss_chunk_rows
from drafters.training.recipe import RecipeError

ACT_BYTES = 128  # per token, TTT step and unit of hidden size kept for backward (fit: 70-111, bf16 autocast)


@dataclass
class StepShape:
    """What a family's step holds, in the units of the estimate (a TrainingFamily's memory_shape returns it)."""

    steps: int  # sequential passes whose activations backward keeps (TTT steps x layers; a block drafter's layers)
    label_rows: int  # rows of the (rows, Vd) label table
    act_tokens: int  # tokens each pass runs
    head_grad_steps: int  # passes that keep an LM-head gradient of their own (0: the head is frozen)
    knobs: tuple[str, ...]  # the recipe fields to lower, with their values
    logit_rows: int = 0  # rows whose (rows, Vd) logits the loss materialises (no fused head: DSpark's Markov bias)
    recomputed_labels: bool = False  # the labels are recomputed from the target's (rows, h_t) final hidden state
    switches: tuple[str, ...] = ()  # recipe settings that lower the step's memory, other than the knobs


def ttt_shape(recipe, drafter) -> StepShape:  # EAGLE-3: k TTT steps over every row, through each decoder layer
    steps, recompute = recipe.eagle3.ttt_steps, recipe.eagle3.vocab_memory == "recompute"
    tokens = recipe.batch_size * recipe.data.max_length
    knobs = (f"data.max_length ({recipe.data.max_length})", f"batch_size ({recipe.batch_size})",
             f"eagle3.ttt_steps ({steps})")
    head_grads = 0 if not drafter.lm_head.weight.requires_grad else 1 if recompute else steps  # 0: freeze_head
    return StepShape(steps * drafter.config.num_hidden_layers, tokens, tokens, head_grads, knobs,
                     recomputed_labels=recompute, switches=() if recompute else (
                         "eagle3.vocab_memory=recompute (labels and head gradients recomputed in backward: flat in the "
                         "draft vocabulary, slower)",))


def block_shape(recipe, drafter) -> StepShape:  # DFlash, DSpark: the anchors' blocks, through every layer
    block, anchors = recipe.dflash.block_size, recipe.dflash.anchors
    rows = recipe.batch_size * anchors * (block - 1)
    return StepShape(drafter.config.num_hidden_layers, rows, recipe.batch_size * anchors * block, 0, (
        f"data.max_length ({recipe.data.max_length})", f"batch_size ({recipe.batch_size})",
        f"dflash.anchors ({anchors})"),
        logit_rows=0 if drafter.fused_loss and recipe.dflash.weighting == "decay" else rows)  # dpace keeps logits


@dataclass
class StepEstimate:
    parts: dict[str, float]  # name -> bytes
    knobs: tuple[str, ...] = ()
    switches: tuple[str, ...] = ()

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def describe(self) -> str:
        return ", ".join(f"{name} {size(value)}" for name, value in self.parts.items() if value)


def size(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GB" if num_bytes >= 2**28 else f"{num_bytes / 2**20:.0f} MB"


def estimate_step(shape: StepShape, recipe, target, drafter, *, online: bool) -> StepEstimate:
    """The memory one optimizer step adds, from the family's StepShape and the built drafter."""
    vocab, hidden = drafter.config.draft_vocab_size, drafter.config.hidden_size
    params = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    label_width = target.config.get_text_config().hidden_size if shape.recomputed_labels else vocab
    parts = {
        "labels": shape.label_rows * label_width * 4,
        "head grads": shape.head_grad_steps * vocab * hidden * 4,
        "optimizer": params * 12,
        "activations": shape.steps * shape.act_tokens * hidden * ACT_BYTES,
        "transients": 16 * loss_chunk_rows(vocab) * vocab + 8 * LABEL_CHUNK_ELEMENTS
        + (12 * loss_chunk_rows(vocab) * target.vocab_size if shape.recomputed_labels else 0),
        "logits": shape.logit_rows * vocab * 4 * 4,  # float32 logits, log-softmax, softmax and their gradient
    }
    if online:
        t = target.config.get_text_config()
        tokens = recipe.batch_size * recipe.data.max_length
        parts["target"] = tokens * t.hidden_size * (t.num_hidden_layers + 1) * target.dtype.itemsize
    return StepEstimate(parts, (*shape.knobs, f"draft_vocab_size ({vocab})"), shape.switches)


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


def check_step_memory(family, recipe, target, drafter, device: torch.device, say) -> None:
    """Raise RecipeError, before the first step, where the estimate exceeds the device's free memory. `family` is
    the TrainingFamily trained: those without a memory_shape are not checked."""
    if not recipe.check_memory or family.memory_shape is None:
        return
    estimate = estimate_step(family.memory_shape(recipe, drafter), recipe, target, drafter,
                             online=not recipe.features.dir)
    free = available_bytes(device)
    if free is None:
        return
    if estimate.total <= free:
        say(f"memory: one step needs about {size(estimate.total)} ({estimate.describe()}); {size(free)} free")
        return
    raise RecipeError(f"recipe: one training step needs about {size(estimate.total)} ({estimate.describe()}), "
                      f"more than the {size(free)} free on {device}: lower {', '.join(estimate.knobs)}, "
                      + "".join(f"set {switch}, " for switch in estimate.switches) + "or set "
                      "check_memory=false to try anyway (the estimate: drafters/training/memory.py)")
