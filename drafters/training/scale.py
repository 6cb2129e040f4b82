"""One optimizer step of a family's real objective on a random-weight target of a real model's shape: time per
phase, FLOPs counted, peak device memory, and what filled memory when it ran out (eval/gpu_check.py is its
command line).

    target = random_target(SHAPES["llama-3.1-8b"], dtype=torch.bfloat16, device="cuda")
    row = measure_step(StepSetting("eagle3", seq_len=2048, overrides=("ttt_steps=7",)), target, steps=3)

The step is the trainer's own: the family's TrainingFamily builds the objective from a recipe (the family's tiny
recipe plus the setting's overrides), `inputs` runs the frozen target (online features), the objective runs the
drafter and its loss, then backward, AdamW. Only the weights are random (no file travels) and the batch is random
token ids with every position supervised. Knows nothing about decoding or reports.
"""

import gc
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from drafters.draft_vocab import DraftVocab
from drafters.targets import Target
from drafters.timing import synced_clock
from drafters.training.families import TRAINING_FAMILIES, load_recipe
from drafters.training.memory import estimate_step
from drafters.training.optimizers import build_optimizer

ROOT = Path(__file__).resolve().parents[2]
# Model shapes by name: a Llama config's fields. "tiny" keeps the CPU mode to seconds; only shapes differ.
SHAPES = {
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                         rope_theta=500000.0, rms_norm_eps=1e-5),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=4096),
}
PHASES = ("target forward", "drafter forward+backward", "optimizer")


@contextmanager
def default_dtype(dtype: torch.dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def random_target(shape: dict, *, dtype: torch.dtype, device, vocab_size: int | None = None, seed: int = 0) -> Target:
    """A frozen LlamaForCausalLM of `shape` with random weights, built directly on `device` in `dtype` (an 8B
    shape is 16 GB in bf16: never materialised on the host). No tokenizer: the batches are token ids."""
    config = LlamaConfig(**{**shape, **({"vocab_size": vocab_size} if vocab_size else {})}, tie_word_embeddings=False)
    torch.manual_seed(seed)
    with torch.device(device), default_dtype(dtype):
        model = LlamaForCausalLM(config)
    name = f"random Llama (hidden {config.hidden_size}, {config.num_hidden_layers} layers, vocab {config.vocab_size})"
    return Target(model.eval().requires_grad_(False), None, name)


@dataclass(frozen=True)
class StepSetting:
    family: str  # a TRAINING_FAMILIES name trained from EAGLE-3's inputs (eagle3, dflash, dspark, peagle)
    seq_len: int
    overrides: tuple[str, ...] = ()  # key=value on the family's tiny recipe
    draft_vocab: int = 32000
    batch_size: int = 1

    @property
    def name(self) -> str:
        return " ".join([self.family, f"T={self.seq_len}", *self.overrides])


@dataclass
class StepResult:
    setting: str
    target: str
    status: str = "ok"  # ok | out of memory | error
    ms: dict = field(default_factory=dict)  # phase -> median ms per step
    tokens_per_s: float | None = None
    flops_per_token: dict = field(default_factory=dict)  # phase -> FLOPs counted (torch.utils.flop_counter)
    mfu: float | None = None  # counted FLOPs per second / the device's bf16 dense peak
    peak_gb: float | None = None  # torch.cuda.max_memory_allocated over the measured steps (GiB)
    drafter_params_m: float | None = None
    estimate_gb: float | None = None  # drafters.training.memory's estimate of the step's memory (GiB), if it has one
    attention_flops: float = 0.0  # of one step's counted FLOPs, in attention kernels
    detail: str = ""  # out of memory: where, how much was asked for, the largest live tensors


def recipe_for(setting: StepSetting, vocab_size: int):
    """The family's tiny recipe with the setting's overrides: the same checks a user's recipe gets."""
    # mask tokens: no training rows, so the lowest id (choose_mask_token)
    argv = [str(ROOT / "recipes" / f"{setting.family}_tiny.yaml"),
            f"draft_vocab_size={min(setting.draft_vocab, vocab_size)}",
            "draft_vocab_coverage=null", f"data.max_length={setting.seq_len}", f"batch_size={setting.batch_size}",
            "dtype=bfloat16",
            "mixed_precision=bf16", *setting.overrides]
    return load_recipe(argv)


def build_step(setting: StepSetting, target: Target):
    """-> (objective, inputs, optimizer): what FeatureRun.micro_step and fit() build, for a random target."""
    family = TRAINING_FAMILIES[setting.family]
    recipe = recipe_for(setting, target.vocab_size)
    # the draft vocabulary: the lowest ids (a random target has no token counts to rank)
    vocab = DraftVocab.from_used(torch.arange(recipe.draft_vocab_size), target.vocab_size)
    objective = family.build(recipe, target, [], vocab, lambda *_: None)
    inputs = family.inputs(recipe, target, objective.drafter)
    optimizer = build_optimizer(recipe.optim, objective.drafter)
    return objective.train(), inputs, optimizer


def random_batch(setting: StepSetting, vocab_size: int, device) -> dict:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab_size, (setting.batch_size, setting.seq_len), generator=generator)
    ones = torch.ones_like(ids)
    return {"input_ids": ids.to(device), "attention_mask": ones.to(device), "loss_mask": ones.to(device)}


def one_step(objective, inputs, optimizer, batch: dict, embed, device) -> list[float]:
    """The trainer's step (FeatureRun.micro_step + train_loop's optimizer step) -> seconds per phase. The target's
    label logits are computed lazily inside the loss (LabelLogits), so they count as drafter time."""
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    start = synced_clock(device)
    features, labels = inputs(batch)
    after_target = synced_clock(device)
    with autocast:
        out = objective(features, batch["input_ids"], labels, batch["loss_mask"], embed)
    out.loss.backward()
    after_drafter = synced_clock(device)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    end = synced_clock(device)
    return [after_target - start, after_drafter - after_target, end - after_drafter]


def count_flops(objective, inputs, optimizer, batch: dict, embed, device) -> tuple[list[float], float]:
    """FLOPs of one step per phase as torch's FlopCounterMode counts the matmuls and attention kernels it runs
    (the CPU's fused attention is not counted), and the attention kernels' share of them (it grows as T^2)."""
    from torch.utils.flop_counter import FlopCounterMode

    counts, attention = [], 0.0
    with FlopCounterMode(display=False, custom_mapping=ATTENTION_FLOPS) as counter:
        features, labels = inputs(batch)
    counts.append(counter.get_total_flops())
    attention += attention_flops(counter)
    with FlopCounterMode(display=False, custom_mapping=ATTENTION_FLOPS) as counter, \
            torch.autocast(device.type, dtype=torch.bfloat16):
        out = objective(features, batch["input_ids"], labels, batch["loss_mask"], embed)
        out.loss.backward()
    counts.append(counter.get_total_flops())
    attention += attention_flops(counter)
    optimizer.zero_grad(set_to_none=True)  # the optimizer's elementwise work is not counted (no matmuls)
    counts.append(0)
    return counts, attention


def sdpa_forward_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    # S = Q K^T and O = P V for every query head: 2 b hq sq sk (d + dv). Grouped-query k / v heads are broadcast
    # (torch 2.11's own formula refuses hq != hkv); masked keys are computed all the same, so they count.
    b, hq, sq, d = query_shape
    return 2 * b * hq * sq * key_shape[-2] * (d + value_shape[-1])


def sdpa_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    # S = Q K^T recomputed, then dP = dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q: 2 b hq sq sk (3 d + 2 dv)
    b, hq, sq, d = query_shape
    return 2 * b * hq * sq * key_shape[-2] * (3 * d + 2 * value_shape[-1])


_aten = torch.ops.aten
ATTENTION_FLOPS = {op: sdpa_forward_flops for op in (
    _aten._scaled_dot_product_efficient_attention, _aten._scaled_dot_product_flash_attention,
    _aten._scaled_dot_product_cudnn_attention)} | {op: sdpa_backward_flops for op in (
    _aten._scaled_dot_product_efficient_attention_backward, _aten._scaled_dot_product_flash_attention_backward,
    _aten._scaled_dot_product_cudnn_attention_backward)}


def attention_flops(counter) -> float:
    return sum(n for op, n in counter.get_flop_counts().get("Global", {}).items() if "attention" in str(op))


def predicted_seconds(row: "StepResult", seq_len: int, ref_len: int) -> float | None:
    """A step's seconds at seq_len from a measured row at ref_len: the attention kernels' share of its FLOPs scaled
    by (T / T_ref)^2, the rest by T / T_ref (batch 1). Used to skip a setting that would outlast the check."""
    if row.status != "ok" or not row.flops_per_token:
        return None
    r, total = seq_len / ref_len, row.flops_per_token["step"] * ref_len
    share = row.attention_flops / total if total else 0.0
    return row.ms["step"] / 1e3 * ((1 - share) * r + share * r * r)


def measure_step(setting: StepSetting, target: Target, *, steps: int = 3, warmup: int = 1,
                 peak_flops: float | None = None, count: bool = True) -> StepResult:
    """Median phase times over `steps` after `warmup`, FLOPs of one more step (count), peak memory; out of memory is
    a result, not an exception (the caller goes on with the next setting)."""
    device = target.device
    result = StepResult(setting.name, target.name)
    phase = "building the drafter"
    try:
        objective, inputs, optimizer = build_step(setting, target)
        result.drafter_params_m = sum(p.numel() for p in objective.drafter.parameters()) / 1e6
        shape = TRAINING_FAMILIES[setting.family].memory_shape
        if shape is not None:
            recipe = recipe_for(setting, target.vocab_size)
            estimate = estimate_step(shape(recipe, objective.drafter), recipe, target, objective.drafter, online=True)
            result.estimate_gb = estimate.total / 2**30
        batch = random_batch(setting, target.vocab_size, device)
        reset_peak(device)
        phase = "the training step"
        times = [one_step(objective, inputs, optimizer, batch, target.embed_tokens, device)
                 for _ in range(warmup + steps)][warmup:]
        result.peak_gb = peak_gb(device)
        phase = "counting FLOPs"
        flops, result.attention_flops = count_flops(objective, inputs, optimizer, batch, target.embed_tokens, device) \
            if count else ([0.0] * len(PHASES), 0.0)
    except torch.OutOfMemoryError as err:
        result.status, result.peak_gb = "out of memory", peak_gb(device)
        result.detail = f"in {phase}: {asked_for(str(err))}; largest live tensors: {largest_tensors(device)}"
        return result
    finally:
        objective = inputs = optimizer = batch = None  # noqa: F841 (freed before the next setting)
        release(device)
    tokens = setting.batch_size * setting.seq_len
    ms = [1e3 * sorted(t)[len(t) // 2] for t in zip(*times)]
    result.ms = dict(zip(PHASES, ms)) | {"step": sum(ms)}
    result.tokens_per_s = tokens / (sum(ms) / 1e3)
    if count:
        result.flops_per_token = dict(zip(PHASES, (f / tokens for f in flops))) | {"step": sum(flops) / tokens}
    if peak_flops and count:
        result.mfu = sum(flops) / (sum(ms) / 1e3) / peak_flops
    return result


# ---- memory -------------------------------------------------------------------------------------------


def reset_peak(device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gb(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def release(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def asked_for(message: str) -> str:
    # CUDA's message: "Tried to allocate 14.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which ..."
    match = re.search(r"Tried to allocate ([\d.]+ [KMG]iB)", message)
    return f"asked for {match.group(1)} more" if match else message.splitlines()[0][:200]


def largest_tensors(device, count: int = 3) -> str:
    """The largest tensors alive on `device` (the failed step's frames are still held by the exception), by
    shape and dtype: what filled memory."""
    found = {}
    for obj in gc.get_objects():
        try:
            if issubclass(type(obj), torch.Tensor) and obj.device == device:  # type(): no __class__ lookups
                found[obj.untyped_storage().data_ptr()] = obj
        except Exception:  # objects that fail isinstance or storage access (weakref proxies, meta tensors)
            continue
    top = sorted(found.values(), key=lambda t: t.untyped_storage().nbytes(), reverse=True)[:count]
    return ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} "
                     f"{t.untyped_storage().nbytes() / 2**30:.2f} GiB" for t in top) or "none found"
