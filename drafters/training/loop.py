"""Family-agnostic pieces of the training scripts (train/eagle.py, train/heads.py).

Recipe sections shared by every family (`Data`, `Optim`), the train / held-out split, the length-
bucketed loader, the step plan and lr schedule, the metrics JSONL writer, and the run's faults: the
loop stops for SIGINT / SIGTERM only at a step boundary, a new run never replaces an earlier one in
output_dir unasked, resume refuses a damaged checkpoint, changed data or a step past max_steps, a full
disk says which checkpoint to resume from. Functions that take a
`recipe` read only the fields they name (data, batch_size, seed, epochs, max_steps, grad_accum), so
every family's Recipe dataclass works with them. Knows nothing about drafters or losses.
"""

import dataclasses
import json
import math
import re
import shutil
import signal
import threading
import time
import typing
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from functools import cached_property, partial
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from drafters.checkpoint import (
    CheckpointError,
    check_target,
    damage,
    prune_checkpoints,
    save_checkpoint,
    step_checkpoints,
    target_info,
)
from drafters.training.data import Example, build_examples, collate
from drafters.dtypes import DtypeName
from drafters.files import data_sha256, disk_full, hold_lock
from drafters.training.recipe import RecipeError, build_overridden, check_override_key, read_recipe, to_dict
from drafters.targets import Target, resolve_precision


@dataclass
class Data:
    path: str  # JSON / JSONL file, save_to_disk folder or Hugging Face dataset name (drafters.training.data)
    fmt: Literal["auto", "sharegpt", "openai", "text"] = "auto"
    split: str = "train"
    max_length: int = 2048  # tokens; longer conversations are cut
    limit: int | None = None  # read the first N usable rows only
    eval_rows: int | None = None  # held-out rows; overrides eval_fraction
    eval_fraction: float = 0.02
    seed: int = 0  # of the train / held-out split

    def problems(self) -> list[str]:
        found = []
        if self.max_length < 3:
            found.append(f"data.max_length={self.max_length} must be >= 3 (a label needs 2 tokens of context)")
        if self.limit is not None and self.limit < 1:
            found.append(f"data.limit={self.limit} must be >= 1 or null (all rows)")
        if not 0 <= self.eval_fraction < 1 or (self.eval_rows is not None and self.eval_rows < 0):
            found.append(f"data.eval_fraction={self.eval_fraction} must be in [0, 1), data.eval_rows >= 0")
        return found


@dataclass
class Optim:
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_steps: int = 0  # linear from lr / warmup_steps up to lr
    schedule: Literal["cosine", "constant"] = "cosine"  # after warmup; cosine decays to 0
    max_grad_norm: float | None = 0.5  # null = no clipping (the norm is still logged)
    clip_value: float | None = None  # clip each gradient element to [-v, v] first (official EAGLE: 0.5)

    def problems(self) -> list[str]:
        found = []
        if self.lr <= 0 or self.warmup_steps < 0 or self.weight_decay < 0:
            found.append(f"optim.lr={self.lr} must be > 0, warmup_steps and weight_decay >= 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            found.append(f"optim.betas={self.betas} must be two numbers in [0, 1)")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            found.append(f"optim.max_grad_norm={self.max_grad_norm} must be > 0 or null (no clipping)")
        if self.clip_value is not None and self.clip_value <= 0:
            found.append(f"optim.clip_value={self.clip_value} must be > 0 or null (no clipping by value)")
        return found


@dataclass(kw_only=True)
class TrainRecipe:
    """What every training script's recipe has; each script's Recipe adds its family's fields."""

    target: str  # short name, model directory, .gguf file or Hub id (drafters.targets)
    data: Data
    optim: Optim = field(default_factory=Optim)
    batch_size: int = 1  # per process
    grad_accum: int = 1
    epochs: int | None = 1
    max_steps: int | None = None  # optimizer steps; with epochs, whichever comes first
    seed: int = 0
    # auto = bf16 where the hardware computes it (GPUs, CPUs with avx512_bf16 / AMX), else float32 / no:
    # emulated bf16 (e.g. an AVX2 CPU) is ~50x slower than float32 (drafters.targets.resolve_precision)
    dtype: Literal["auto", DtypeName] = "float32"  # the target's weights (drafters.dtypes)
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "no"  # autocast of the drafter (accelerate)
    threads: int = 0  # torch CPU threads; 0 = torch's default
    log_every: int = 10  # optimizer steps between metrics flushes (host syncs)
    save_every: int = 0  # 0 = only checkpoint-final; checkpoint-<step> directories also resume
    keep_last: int = 0  # keep only the newest N checkpoint-<step> directories; 0 = all
    eval_every: int = 0  # 0 = only at the end
    resume_from: str | None = None  # null | latest (newest checkpoint-<step> in output_dir) | a directory
    allow_recipe_changes: bool = False  # resume even though the recipe differs from the checkpoint's
    overwrite_output_dir: bool = False  # a new run into an output_dir holding an earlier run: remove that run's
    #                                     checkpoint-<step>/final, metrics.jsonl and eval.jsonl first (else refused)
    wandb_project: str | None = None  # also log to Weights & Biases (WANDB_MODE=offline works); null = off
    wandb_name: str | None = None  # the wandb run name; null = wandb's

    def problems(self) -> list[str]:
        """Every problem with the fields all training scripts share (batching, steps, checkpoints,
        logging, data, optim); each script adds only its own fields' (load_train_recipe)."""
        found = [f"{name}={getattr(self, name)} must be >= 1" for name in ("batch_size", "grad_accum", "log_every")
                 if getattr(self, name) < 1]
        found += [f"{name}={getattr(self, name)} must be >= 0 (0 = off)" for name in
                  ("save_every", "eval_every", "threads", "keep_last") if getattr(self, name) < 0]
        found += [f"{name}={getattr(self, name)} must be >= 1 or null" for name in
                  ("epochs", "max_steps") if getattr(self, name) is not None and getattr(self, name) < 1]
        if self.epochs is None and self.max_steps is None:
            found.append("set epochs or max_steps (or both: whichever ends first)")
        return found + self.data.problems() + self.optim.problems()

    def unread_fields(self) -> frozenset[str]:
        """Top-level fields this configuration never reads (another family's section): a resumed run
        ignores changes to them (recipe_diff)."""
        return frozenset()



# The entry script that trains each drafter family.
FAMILY_SCRIPTS = {"eagle3": "train/eagle.py", "eagle1": "train/eagle.py", "dflash": "train/eagle.py",
                  "medusa": "train/heads.py", "blockwise": "train/heads.py"}


def load_train_recipe(argv: list[str], schema, script: str, own_problems=None):
    """load_recipe, except that a recipe of another script's family is sent to that script instead of
    failing on the first key of its family (medusa's num_heads: 'did you mean threads?'). Then every
    check runs once, on one list: the shared sections' (TrainRecipe.problems) and the script's own
    fields' (own_problems(recipe) -> [str]); one RecipeError names them all."""
    raw = read_recipe(argv[0], argv[1:])
    drafter = raw.get("drafter")
    if isinstance(drafter, str) and FAMILY_SCRIPTS.get(drafter, script) != script:
        raise RecipeError(f"recipe {argv[0]} trains drafter={drafter}: run it with {FAMILY_SCRIPTS[drafter]}")
    for override in argv[1:]:
        check_override_key(schema, override)
    recipe = build_overridden(schema, raw, argv[0], argv[1:])
    check_recipe(recipe, own_problems)
    return recipe


def check_recipe(recipe: TrainRecipe, own_problems=None) -> None:
    problems = recipe.problems() + (own_problems(recipe) if own_problems else [])
    if problems:
        raise RecipeError("recipe: " + "; ".join(problems))


def make_accelerator(recipe, script: str):
    """The Accelerator of a training run. Without a GPU, cpu=True makes torchrun / accelerate launch
    with several processes run gloo DDP instead of independent copies; DeepSpeed (an accelerate
    config or ACCELERATE_USE_DEEPSPEED=true) brings its own CPU accelerator, which accelerate
    ignores under cpu=True, so it gets cpu=False and gloo."""
    import os

    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    gpu = torch.accelerator.is_available()
    if recipe.mixed_precision == "fp16" and not gpu:  # accelerate would train in fp32 and report fp16
        raise RecipeError("mixed_precision=fp16 needs a GPU: on a CPU accelerate leaves fp16 autocast off and "
                          "trains in fp32; use mixed_precision=bf16 (CPU autocast) or mixed_precision=no")
    deepspeed_on_cpu = not gpu and os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true"
    handlers = [InitProcessGroupKwargs(backend="gloo")] if deepspeed_on_cpu else []
    mixed_precision = resolve_precision("auto", recipe.mixed_precision)[1]
    accelerator = Accelerator(mixed_precision=mixed_precision, kwargs_handlers=handlers,
                              cpu=not gpu and not deepspeed_on_cpu)
    if accelerator.state.deepspeed_plugin is not None:
        if recipe.grad_accum != 1:  # DeepSpeed steps its engine at every backward under our own accumulation
            raise RecipeError(f"grad_accum={recipe.grad_accum} under DeepSpeed is not supported yet: use grad_accum=1 "
                              "and a larger batch_size or more processes for the same global batch")
        # the loader's batches come from a batch sampler, which DeepSpeed cannot read the size of
        accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = recipe.batch_size
    accelerator.print(f"{script}: {accelerator.num_processes} process(es), {accelerator.distributed_type.value}, "
                      f"device {accelerator.device}, mixed precision {accelerator.mixed_precision}")
    return accelerator


def start_run(recipe, script: str):
    """The start every training script shares: threads, accelerator, the frozen target on its
    device, the resume checks (before any work) and the train / held-out split.
    -> (accelerator, target, resume checkpoint or None, train rows, held-out rows)."""
    from drafters.checkpoint import load_checkpoint
    from drafters.targets import load_target

    if recipe.threads:
        torch.set_num_threads(recipe.threads)
    accelerator = make_accelerator(recipe, script)
    claim_output_dir(recipe, accelerator)
    dtype, _, precision = resolve_precision(recipe.dtype, recipe.mixed_precision, accelerator.device)
    accelerator.print(precision)
    target = load_target(recipe.target, dtype=dtype)
    target.model.to(accelerator.device)  # frozen: never given to the optimizer or to prepare()
    resume = resume_checkpoint(recipe, accelerator.print)
    if resume is not None:  # before any work: a wrong checkpoint or a changed recipe fails here
        check_resume(load_checkpoint(resume), to_dict(recipe), recipe.drafter, target, recipe.allow_recipe_changes,
                     schema=type(recipe), unread=recipe.unread_fields())
    train_rows, held_out = load_examples(recipe, target, accelerator.print)
    return accelerator, target, resume, train_rows, held_out


LOCK_FILE = ".run.lock"
# What a run writes into output_dir: what a new run would replace and overwrite_output_dir removes.
RUN_FILES = re.compile(r"checkpoint-(\d+|final)|metrics\.jsonl|eval\.jsonl")


def earlier_run_files(output_dir) -> list[Path]:
    directory = Path(output_dir)
    return sorted(p for p in directory.iterdir() if RUN_FILES.fullmatch(p.name)) if directory.is_dir() else []


def claim_output_dir(recipe, accelerator) -> None:
    """A new run never silently replaces an earlier one (its checkpoint-final, its metrics, and its
    checkpoint-<step> that resume_from=latest would later pick up): it is continued (resume_from),
    removed on request (overwrite_output_dir), or refused. Every process checks; the main one removes.
    The main process first locks output_dir for the run's life (.run.lock): a second run started into it,
    even at the same moment, is refused with the first one's PID."""
    if accelerator.is_main_process:
        hold_lock(Path(recipe.output_dir) / LOCK_FILE, f"output_dir={recipe.output_dir}")
    found = earlier_run_files(recipe.output_dir)
    if not found:
        return
    names = ", ".join(p.name for p in found[:6]) + (", ..." if len(found) > 6 else "")
    if recipe.overwrite_output_dir and recipe.resume_from is not None:
        raise RecipeError(f"overwrite_output_dir=true removes the run in {recipe.output_dir} and resume_from="
                          f"{recipe.resume_from} continues one: set only one of them")
    if not recipe.overwrite_output_dir and recipe.resume_from is None:
        raise RecipeError(f"output_dir={recipe.output_dir} holds an earlier run ({names}); a new run there would "
                          "replace its checkpoint-final and metrics. Continue it with resume_from=latest, start over "
                          "with overwrite_output_dir=true (removes those files only), or choose another output_dir")
    accelerator.wait_for_everyone()  # every process has looked before the main one removes
    if recipe.overwrite_output_dir and accelerator.is_main_process:
        accelerator.print(f"overwrite_output_dir=true: removing {names} from {recipe.output_dir}")
        for path in found:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
    accelerator.wait_for_everyone()


def load_examples(recipe, target: Target, say) -> tuple[list[Example], list[Example]]:
    data = recipe.data
    examples, report = build_examples(target.tokenizer, data.path, max_length=data.max_length,
                                      fmt=data.fmt, split=data.split, limit=data.limit)
    say(report.summary())
    num_held_out = data.eval_rows if data.eval_rows is not None else round(len(examples) * data.eval_fraction)
    if num_held_out >= len(examples):
        raise RecipeError(f"data.eval_rows / eval_fraction hold out {num_held_out} of the {len(examples)} "
                          "usable examples, leaving none to train on; lower them")
    # The split is a permutation by data.seed of the usable examples: the same file, max_length and
    # limit give the same held-out rows whatever the training seed.
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(data.seed)).tolist()
    held_out = [examples[i] for i in sorted(order[:num_held_out])]
    train_rows = [examples[i] for i in sorted(order[num_held_out:])]
    say(f"{len(train_rows)} training examples ({sum(map(num_tokens, train_rows))} tokens), "
        f"{len(held_out)} held out")
    return train_rows, held_out


def pad_id(target: Target) -> int:
    tokenizer = target.tokenizer
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(target.eos_token_ids)


def num_tokens(example: Example) -> int:
    return len(example.input_ids)


class LengthBuckets:
    """Batches of similar lengths, so padding stays small. Each pass shuffles the rows, sorts every
    window of `window` batches by length, cuts it into batches and shuffles the batch order. Pass n
    draws from seed + n: every process of a multi-process run sees the same batches, and a resumed
    run can rebuild any pass. `resume(pass_index, skip)` makes the next pass be pass `pass_index`
    with its first `skip` batches left out (batches of all processes: accelerate deals them out
    round-robin)."""

    drop_last = False  # read by accelerate when it shards batches over processes

    def __init__(self, lengths: list[int], batch_size: int, seed: int, window: int = 64):
        self.lengths, self.batch_size, self.seed, self.window = lengths, batch_size, seed, window
        self.passes, self.skip = 0, 0

    def __len__(self) -> int:
        return math.ceil(len(self.lengths) / self.batch_size)

    def resume(self, pass_index: int, skip: int) -> None:
        self.passes, self.skip = pass_index, skip

    def batches(self, pass_index: int) -> list[list[int]]:
        """Row indices of every batch of pass `pass_index`, in the order the pass yields them."""
        generator = torch.Generator().manual_seed(self.seed + pass_index)
        order = torch.randperm(len(self.lengths), generator=generator).tolist()
        span, batches = self.batch_size * self.window, []
        for start in range(0, len(order), span):
            rows = sorted(order[start:start + span], key=self.lengths.__getitem__)
            batches += [rows[i:i + self.batch_size] for i in range(0, len(rows), self.batch_size)]
        return [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]

    def __iter__(self):
        batches, skip = self.batches(self.passes), self.skip
        self.passes, self.skip = self.passes + 1, 0
        yield from batches[skip:]


def train_loader(recipe, rows: list[Example], pad: int) -> DataLoader:
    sampler = LengthBuckets([num_tokens(e) for e in rows], recipe.batch_size, recipe.seed)
    return DataLoader(rows, batch_sampler=sampler, collate_fn=partial(collate, pad_id=pad))


def length_sorted_batches(rows: list[Example], batch_size: int) -> list[list[Example]]:
    rows = sorted(rows, key=num_tokens)
    return [rows[i:i + batch_size] for i in range(0, len(rows), batch_size)]


def plan_steps(recipe, batches_per_epoch: int) -> int:
    # Micro-batches left over at the end of an epoch start the next epoch's first step.
    by_epochs = None if recipe.epochs is None else recipe.epochs * batches_per_epoch // recipe.grad_accum
    total = min(s for s in (by_epochs, recipe.max_steps) if s is not None)
    if total < 1:
        raise RecipeError(f"{batches_per_epoch} batches per epoch x epochs={recipe.epochs} is less than one "
                          f"optimizer step of grad_accum={recipe.grad_accum} batches; use more data or epochs")
    return total


def lr_factor(optim: Optim, total_steps: int, step: int) -> float:
    # step counts optimizer steps from 0; the lr of step s is optim.lr * lr_factor(s)
    if step < optim.warmup_steps:
        return (step + 1) / optim.warmup_steps
    if optim.schedule == "constant":
        return 1.0
    progress = (step - optim.warmup_steps) / max(1, total_steps - optim.warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class StepMetrics:
    """The training metrics of one micro-batch, or of the micro-batches of one optimizer step summed
    (`+`), as tensors: nothing leaves the device until MetricsLog flushes. K = the family's loss parts
    (RunBase.step_loss_is names them in metrics.jsonl).
        loss ()                    the objective / grad_accum
        parts (K,)                 its parts / grad_accum: metrics.jsonl's step_loss
        correct (K,), counted (K,) top-1 hits and counted positions: step_acc = correct / counted
        tokens ()                  real (non-pad) tokens of the micro-batch
        correct_top5 (K,) or None  hits in the top-5 (multi-head drafters): step_acc_top5"""

    loss: Tensor
    parts: Tensor
    correct: Tensor
    counted: Tensor
    tokens: Tensor
    correct_top5: Tensor | None = None

    def __add__(self, other: "StepMetrics") -> "StepMetrics":
        top5 = None if self.correct_top5 is None else self.correct_top5 + other.correct_top5
        return StepMetrics(self.loss + other.loss, self.parts + other.parts, self.correct + other.correct,
                           self.counted + other.counted, self.tokens + other.tokens, top5)


class MetricsLog:
    """Per-step metric tensors, written to metrics.jsonl at flushes: one host sync per flush."""

    def __init__(self, path: Path, write: bool, resume: tuple[int, int] | None = None, sink=None,
                 step_loss_is: str = ""):
        # resume = (step, tokens) of the checkpoint a run resumes from: rows up to that step are
        # kept (a killed run may have logged later steps, which the resumed run logs again)
        self.path, self.write, self.pending, self.losses, self.sink = path, write, [], [], sink
        self.step_loss_is = step_loss_is
        self.tokens_total, self.window_start, self.start = 0, time.perf_counter(), time.perf_counter()
        kept = []
        if resume is not None:
            self.tokens_total = resume[1]
            rows = path.read_text().splitlines() if path.is_file() else []
            kept = [row for row in rows if row.strip() and json.loads(row)["step"] <= resume[0]]
            self.losses = [json.loads(row)["loss"] for row in kept]
        if write:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(row + "\n" for row in kept))

    def add(self, step: int, acc: StepMetrics, grad_norm: Tensor, lr: float) -> None:
        self.pending.append((step, lr, acc, torch.as_tensor(grad_norm).detach().float()))

    def flush(self, reduce_sum, processes: int = 1) -> str:
        """Writes the pending rows; tokens_per_s is the rate over the steps since the last flush.
        reduce_sum sums a tensor over processes: tokens and accuracy counts are totals over all
        processes, losses their mean (each process's is the mean over its micro-batches), so a
        multi-process run logs the curve of the single-process run with the same global batch."""
        tokens = reduce_sum(torch.stack([acc.tokens for _, _, acc, _ in self.pending]))
        stacked = {k: (reduce_sum(torch.stack([getattr(acc, k).float() for _, _, acc, _ in self.pending]))
                       / (processes if k in ("loss", "parts") else 1)).tolist()
                   for k in ("loss", "parts", "correct", "counted", "correct_top5")
                   if getattr(self.pending[0][2], k) is not None}
        grad_norms = torch.stack([g.to(tokens.device) for *_, g in self.pending]).tolist()
        tokens = tokens.tolist()
        now = time.perf_counter()
        rate = sum(tokens) / max(now - self.window_start, 1e-9)
        rows = []
        for i, (step, lr, _, _) in enumerate(self.pending):
            accuracy = [c / max(n, 1) for c, n in zip(stacked["correct"][i], stacked["counted"][i])]
            rows.append({"step": step, "loss": stacked["loss"][i], "step_loss": stacked["parts"][i],
                         "step_loss_is": self.step_loss_is, "step_acc": accuracy, "lr": lr, "grad_norm": grad_norms[i], "tokens": tokens[i],
                         "tokens_per_s": rate, "elapsed_s": now - self.start, "peak_rss_gb": peak_rss_gb()})
            if "correct_top5" in stacked:  # multi-head drafters (train/heads.py): label in the top-5, per head
                rows[-1]["step_acc_top5"] = [c / max(n, 1) for c, n in zip(stacked["correct_top5"][i],
                                                                          stacked["counted"][i])]
        if self.write:
            with open(self.path, "a", encoding="utf-8") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)
            if self.sink is not None:
                for row in rows:
                    self.sink(row)
        self.losses += stacked["loss"]
        self.tokens_total += sum(tokens)
        self.pending, self.window_start = [], now
        last = rows[-1]
        return f"loss {last['loss']:.3f} acc0 {last['step_acc'][0]:.2f} {rate:.0f} tok/s"


def peak_rss_gb() -> float:
    """This process's peak resident memory so far, in GB (Linux reports kB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


class WandbSink:
    """Mirrors metrics.jsonl rows (and held-out evaluations, under eval/) to Weights & Biases.
    The run lives in output_dir/wandb; WANDB_MODE=offline writes it there without a network
    (`wandb sync` uploads it later). Created on the main process only."""

    def __init__(self, project: str, name: str | None, config: dict, output_dir: Path):
        import wandb  # optional: pip install -e .[wandb]

        output_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, name=name, config=config, dir=str(output_dir))

    def __call__(self, row: dict, prefix: str = "train/") -> None:
        flat = {}
        for key, value in row.items():
            if key == "step":
                continue
            if isinstance(value, list):  # per TTT step / per head
                flat.update({f"{prefix}{key}/{i}": v for i, v in enumerate(value)})
            elif isinstance(value, int | float):
                flat[prefix + key] = value
        self.run.log(flat, step=row["step"])

    def finish(self) -> None:
        import wandb

        self.run.finish()
        wandb.teardown()  # waits for the wandb service to write everything out


def wandb_sink(recipe, output_dir: Path, is_main: bool):
    if not recipe.wandb_project or not is_main:
        return None
    try:
        return WandbSink(recipe.wandb_project, recipe.wandb_name, _plain(recipe), output_dir)
    except ImportError:
        raise RecipeError("wandb_project is set but wandb is not installed: pip install -e .[wandb] "
                          "(or set wandb_project=null)") from None


def _plain(recipe) -> dict:
    import dataclasses

    return dataclasses.asdict(recipe)


# ---- the loop, checkpoints and resume -------------------------------------------------------------


class NonFiniteLoss(RuntimeError):
    pass


@dataclass
class Position:
    """Where the data stream stands at an optimizer-step boundary: `passes` complete passes over the
    training rows, then `micro` micro-batches (of each process) of the next pass."""

    passes: int = 0
    micro: int = 0


class StopRequests:
    """While the loop runs, SIGINT (Ctrl-C) and SIGTERM (schedulers, `kill`) only record that a stop
    was asked for; train_loop honours it at the next optimizer-step boundary, so a checkpoint never
    holds part of a step (e.g. Adam's step count moved on some parameters only). A second signal
    stops at once, saving nothing. The previous handlers are restored on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __enter__(self):
        self.signal, self.previous = None, {}
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            # a signal the launcher ignores stays ignored (a shell's background `cmd &` ignores SIGINT)
            self.previous = {s: signal.signal(s, self.record) for s in self.SIGNALS
                             if signal.getsignal(s) is not signal.SIG_IGN}
        return self

    def record(self, signum, frame) -> None:
        if self.signal is not None:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopped without saving")
        self.signal = signal.Signals(signum).name

    def __exit__(self, *exc) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    def agreed(self, accelerator) -> bool:
        # every process must stop at the same step; one collective per step with several processes
        if accelerator.num_processes == 1:
            return self.signal is not None
        flag = torch.tensor(float(self.signal is not None), device=accelerator.device)
        return bool(accelerator.reduce(flag, reduction="sum") > 0)


def train_loop(run, optimizer, scheduler, loader, sampler: LengthBuckets, total_steps: int,
               start_step: int = 0, start: Position | None = None) -> list[float]:
    """Optimizer steps start_step+1 .. total_steps. `run` (a training script's Run) provides
    micro_step(batch, acc) -> summed metric tensors, log (MetricsLog), flush_due(step, total),
    reduce_sum, periodic(step, total, position) (evaluation, checkpoints), save(path, step,
    result, position), rows_of(pass, micro) -> 'file:line' of a micro-batch's rows, recipe,
    accelerator and objective. Ctrl-C or SIGTERM lets the running step finish, then saves a
    resumable checkpoint of it (StopRequests); a non-finite loss stops before the optimizer applies
    it (the last checkpoint stays the last good one)."""
    from tqdm import tqdm

    recipe, accelerator, objective = run.recipe, run.accelerator, run.objective
    max_norm = recipe.optim.max_grad_norm or math.inf
    clip_value = getattr(recipe.optim, "clip_value", None)
    step, position = start_step, start or Position()
    sampler.resume(position.passes, position.micro * accelerator.num_processes)
    passes, micro = position.passes, position.micro
    bar = tqdm(total=total_steps, initial=start_step, unit="step", disable=not accelerator.is_main_process,
               dynamic_ncols=True)
    objective.train()
    acc = None
    with StopRequests() as stop:
        while step < total_steps:
            for batch in loader:
                micro += 1
                last_micro = micro % recipe.grad_accum == 0
                with nullcontext() if last_micro else accelerator.no_sync(objective):
                    acc = run.micro_step(batch, acc)
                if not last_micro:
                    continue
                check_finite(acc.loss, step + 1, run, passes, micro, recipe.grad_accum)
                if clip_value is not None:  # elementwise, before the norm clip (the official EAGLE setting)
                    accelerator.clip_grad_value_(objective.parameters(), clip_value)
                grad_norm = accelerator.clip_grad_norm_(objective.parameters(), max_norm)
                lr = scheduler.get_last_lr()[0]  # the lr this step used
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                position = Position(passes, micro)
                run.log.add(step, acc, grad_norm, lr)
                acc = None
                bar.update(1)
                if run.flush_due(step, total_steps):
                    bar.set_postfix_str(run.log.flush(run.reduce_sum, accelerator.num_processes))
                run.periodic(step, total_steps, position)
                if stop.agreed(accelerator):  # the step boundary: nothing of the next step has run
                    bar.close()
                    save_and_exit(run, step, position, stop.signal)
                if step == total_steps:
                    break
            else:
                passes, micro = passes + 1, 0
    bar.close()
    return run.log.losses


def save_and_exit(run, step: int, position: Position, signal_name: str | None) -> None:
    accelerator = run.accelerator
    if run.log.pending:
        run.log.flush(run.reduce_sum, accelerator.num_processes)
    accelerator.print(f"{signal_name or 'a signal to another process'}: saving the state after step {step}")
    path = run.save(run.output_dir / f"checkpoint-{step}", step, None, position)
    raise SystemExit(f"interrupted: saved the state after step {step} to {path}; continue with "
                     f"resume_from={path} (or resume_from=latest)")


@dataclass
class Summary:
    """What a training run returns (fit)."""

    steps: int
    tokens: int
    losses: list[float]  # total loss per optimizer step (main process)
    eval: dict | None
    checkpoint: Path
    target: Target
    drafter: torch.nn.Module


def fit(recipe, accelerator, target: Target, objective, loader, eval_batches: list, train_rows, resume,
        run_class, name: str) -> Summary:
    """The part of every training script after its drafter and objective exist: AdamW on the drafter's
    parameters, accelerate's prepare, the lr schedule, resume, train_loop, a last evaluation and
    checkpoint-final. `run_class(recipe, accelerator, target, objective, eval_batches, output_dir,
    train_rows, sampler, resumed)` is the family's RunBase subclass."""
    say = accelerator.print
    optimizer = torch.optim.AdamW(objective.drafter.parameters(), lr=recipe.optim.lr,
                                  betas=tuple(recipe.optim.betas), weight_decay=recipe.optim.weight_decay)
    sampler = loader.batch_sampler
    objective, optimizer, loader = accelerator.prepare(objective, optimizer, loader)
    total_steps = plan_steps(recipe, len(loader))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, recipe.optim, total_steps))
    accelerator.register_for_checkpointing(scheduler)

    output_dir = Path(recipe.output_dir)
    step, position, resumed = 0, Position(), None
    if resume is not None:
        step, position, tokens = load_run_state(accelerator, resume, total_steps)
        resumed = (step, tokens)
        say(f"{name}: resumed from {resume} at step {step} (pass {position.passes}, micro-batch {position.micro})")
    run = run_class(recipe, accelerator, target, objective, eval_batches, output_dir, train_rows, sampler, resumed)
    losses = train_loop(run, optimizer, scheduler, loader, sampler, total_steps, step, position)
    result = run.evaluate(total_steps)
    checkpoint = run.save(output_dir / "checkpoint-final", total_steps, result)
    say(f"{name}: {total_steps} steps, {run.tokens_total} tokens; saved {checkpoint}")
    if run.sink is not None:
        run.sink.finish()
    return Summary(total_steps, run.tokens_total, losses, result, checkpoint, target, run.drafter)


class RunBase:
    """The pieces of one training run that the loop, the evaluation and the saving share, the same for
    every family. A subclass provides micro_step(batch, acc) (forward + backward of one micro-batch ->
    summed metric tensors), held_out() -> the evaluation's metrics dict and describe(result) -> its
    one-line summary (drafters.training.loop.train_loop's docstring), and step_loss_is: what its
    StepMetrics.parts are, written into every metrics.jsonl row."""

    step_loss_is = ""

    def __init__(self, recipe, accelerator, target, objective, eval_batches, output_dir: Path, train_rows,
                 sampler, resumed: tuple[int, int] | None = None):
        self.recipe, self.accelerator, self.target = recipe, accelerator, target
        self.objective, self.eval_batches, self.output_dir = objective, eval_batches, output_dir
        self.train_rows, self.sampler = train_rows, sampler
        self.drafter = accelerator.unwrap_model(objective).drafter
        self.sink = wandb_sink(recipe, output_dir, accelerator.is_main_process)
        self.log = MetricsLog(output_dir / "metrics.jsonl", accelerator.is_main_process, resume=resumed,
                              sink=self.sink, step_loss_is=self.step_loss_is)
        self.tokens_total = self.log.tokens_total
        if accelerator.is_main_process and resumed is None:
            (output_dir / "eval.jsonl").write_text("")  # a new run starts new files

    def evaluate(self, step: int) -> dict | None:
        """Held-out metrics on the main process (None without held-out rows), appended to eval.jsonl."""
        from tqdm import tqdm

        result = None
        if self.eval_batches and self.accelerator.is_main_process:
            result = self.held_out()
            result["step"] = step
            tqdm.write(self.describe(result))  # keeps the progress bar intact
            with open(self.output_dir / "eval.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(result) + "\n")
            if self.sink is not None:
                self.sink(self.logged(result), prefix="eval/")
        self.accelerator.wait_for_everyone()
        return result

    def logged(self, result: dict) -> dict:
        """What of a held-out result goes to wandb (default: all of it)."""
        return result

    def save(self, path: Path, step: int, result: dict | None, position: Position | None = None) -> Path:
        """checkpoint-final: the drafter only; with a data position: resumable (trainer state too)."""
        self.tokens_total = self.log.tokens_total
        checkpoint = {"family": self.recipe.drafter, "config": asdict(self.drafter.config),
                      "target": target_info(self.target), "state_dict": self.drafter.state_dict(),
                      "extra": self.checkpoint_extra(step, result)}
        return save_run_checkpoint(self.accelerator, path, step, position, self.tokens_total, **checkpoint)

    def rows_of(self, passes: int, micro: int) -> str:
        # 'file:line, ...' of the rows in micro-batch `micro` (0-based) of pass `passes`, this process
        batches = self.sampler.batches(passes)[self.accelerator.process_index::self.accelerator.num_processes]
        rows = [self.train_rows[i] for i in batches[micro]] if micro < len(batches) else []
        return ", ".join(f"{e.source}:{e.row}" for e in rows) or "?"

    def flush_due(self, step: int, total_steps: int) -> bool:
        # log steps, the last step, and before a checkpoint (so its token count is exact)
        save_every = self.recipe.save_every
        return step % self.recipe.log_every == 0 or step == total_steps or bool(save_every and step % save_every == 0)

    def reduce_sum(self, values: Tensor) -> Tensor:
        return self.accelerator.reduce(values, reduction="sum")

    @cached_property
    def data_hash(self) -> str | None:
        return data_sha256(self.recipe.data.path)  # hashed once per run; resume compares it (check_resume)

    def checkpoint_extra(self, step: int, result: dict | None) -> dict:
        """What every family's checkpoint records about the run in drafter.json's extra."""
        return {"recipe": to_dict(self.recipe), "step": step, "tokens": self.tokens_total, "eval": result,
                "data_sha256": self.data_hash}

    def periodic(self, step: int, total_steps: int, position: Position) -> None:
        if step == total_steps:
            return  # the end of main() evaluates and saves checkpoint-final
        recipe = self.recipe
        if recipe.eval_every and step % recipe.eval_every == 0:
            result = self.evaluate(step)
            self.objective.train()
        else:
            result = None
        if recipe.save_every and step % recipe.save_every == 0:
            self.save(self.output_dir / f"checkpoint-{step}", step, result, position)
            if self.accelerator.is_main_process:
                prune_checkpoints(self.output_dir, self.recipe.keep_last)


def check_finite(loss: Tensor, step: int, run, passes: int, micro: int, grad_accum: int) -> None:
    # one host sync per optimizer step; the step is not applied, so the weights stay finite
    if bool(torch.isfinite(loss)):
        return
    rows = [run.rows_of(passes, m) for m in range(micro - grad_accum, micro)]
    saved = [p for _, p in step_checkpoints(run.output_dir)]
    raise NonFiniteLoss(
        f"step {step}: the loss is {loss.item()} (not finite); micro-batches {micro - grad_accum}..{micro - 1} of "
        f"pass {passes}, data rows {'; '.join(rows)}. The optimizer step was not applied; the last good "
        f"checkpoint is {saved[-1] if saved else 'none (no checkpoint was saved yet)'}. Lower optim.lr, keep "
        f"optim.max_grad_norm set, use mixed_precision=bf16 rather than fp16, or remove those rows.")


TRAINER_DIR, POSITION_FILE = "trainer", "position.json"


def save_run_checkpoint(accelerator, path: Path, step: int, position: Position | None, tokens: int,
                        **checkpoint) -> Path:
    """A checkpoint that also resumes: the drafter files (drafters.checkpoint) plus trainer/ =
    accelerate's state (optimizer, lr scheduler, RNG states of every process, and the prepared
    model, sharded as the engine shards it) and the data position, all in one atomic write.
    position None: the drafter files only (checkpoint-final), by the main process. Called by every
    process; `checkpoint` = save_checkpoint's keyword arguments."""
    path = Path(path)
    with disk_full_says(path):
        if position is None:
            if accelerator.is_main_process:
                save_checkpoint(path, **checkpoint)
        else:
            save_resumable(accelerator, path, step, position, tokens, checkpoint)
    accelerator.wait_for_everyone()
    return path


def save_resumable(accelerator, path: Path, step: int, position: Position, tokens: int, checkpoint: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-resumable")
    if accelerator.is_main_process:
        if tmp.exists():
            shutil.rmtree(tmp)  # left by a run killed while saving
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(str(tmp / TRAINER_DIR))
        accelerator.wait_for_everyone()
    except BaseException:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if accelerator.is_main_process:
        def write_position(directory: Path) -> None:
            (directory / TRAINER_DIR / POSITION_FILE).write_text(json.dumps(
                {"step": step, "passes": position.passes, "micro": position.micro, "tokens": tokens,
                 "num_processes": accelerator.num_processes}))
        save_checkpoint(path, write_more=write_position, tmp=tmp, **checkpoint)


@contextmanager
def disk_full_says(path: Path):
    """A full disk while saving ends the run with what to do (the writes are atomic: the temporary
    directory is gone and earlier checkpoints are intact), not an OSError traceback."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - re-raised unless it is a full disk
        if not disk_full(err):
            raise
        saved = [p for _, p in step_checkpoints(path.parent) if (p / TRAINER_DIR / POSITION_FILE).is_file()]
        then = f"resume from {saved[-1]} (resume_from=latest)" if saved else "run again (no checkpoint was saved yet)"
        raise SystemExit(f"no space left on device while writing {path.name} to {path.parent}; nothing was "
                         f"half-written; free space and {then}") from None


def resume_checkpoint(recipe, say) -> Path | None:
    """recipe.resume_from: null (fresh run), 'latest' (newest complete checkpoint-<step> of output_dir,
    skipping damaged ones with a printed line; a fresh run when there is none) or a checkpoint directory."""
    if recipe.resume_from is None:
        return None
    if recipe.resume_from != "latest":
        return resumable(Path(recipe.resume_from))
    found = [p for _, p in step_checkpoints(recipe.output_dir) if (p / TRAINER_DIR / POSITION_FILE).is_file()]
    if not found and (Path(recipe.output_dir) / "checkpoint-final").is_dir():
        raise RecipeError(f"resume_from=latest: {recipe.output_dir} holds a finished run (checkpoint-final) and "
                          "no resumable checkpoint-<step> to continue; set overwrite_output_dir=true (and "
                          "resume_from=null) to train it again, or choose another output_dir")
    for path in reversed(found):
        problem = damage(path)
        if problem is None:
            return path
        say(f"resume_from=latest: skipping {path}, it is incomplete: {problem}")
    if found:
        raise RecipeError(f"resume_from=latest: every checkpoint in {recipe.output_dir} is damaged (see above); "
                          "set overwrite_output_dir=true (and resume_from=null) to start over")
    return None


def resumable(path: Path) -> Path:
    if not (path / TRAINER_DIR / POSITION_FILE).is_file():
        raise RecipeError(f"resume_from={path}: not a resumable checkpoint (no {TRAINER_DIR}/{POSITION_FILE}); "
                          "checkpoint-<step> directories of a training run are, exported ones and "
                          "checkpoint-final are not")
    problem = damage(path)
    if problem is not None:
        raise RecipeError(f"resume_from={path}: the checkpoint is incomplete: {problem}; resume an earlier one "
                          "(resume_from=latest skips damaged checkpoints)")
    return path


# Recipe keys that may change between a run and its resumption without changing what is trained.
RESUMABLE_CHANGES = {"resume_from", "allow_recipe_changes", "overwrite_output_dir", "output_dir", "max_steps",
                     "log_every", "save_every", "eval_every", "keep_last", "threads", "wandb_project", "wandb_name"}


def recipe_diff(saved: dict, current: dict, prefix: str = "", schema: type | None = None,
                unread: frozenset[str] = frozenset()) -> list[str]:
    """'name: old -> new' for each recipe value that differs between a checkpoint's recipe and this one,
    except RESUMABLE_CHANGES, the top-level fields in `unread` (sections this configuration never reads,
    e.g. another family's) and fields the checkpoint's recipe lacks that are at their default in `schema`
    (the recipe's dataclass): fields added by a later version of drafters default to the behaviour they
    did not have before, so a run resumes across an upgrade."""
    lines = []
    defaults = {f.name: f for f in dataclasses.fields(schema)} if schema is not None else {}
    hints = typing.get_type_hints(schema) if schema is not None else {}
    for key in sorted(set(saved) | set(current)):
        name = prefix + key
        if not prefix and (key in RESUMABLE_CHANGES or key in unread):
            continue
        old, new = saved.get(key, "<absent>"), current.get(key, "<absent>")
        if key not in saved and key in defaults and new == field_default(defaults[key]):
            continue
        if isinstance(old, dict) and isinstance(new, dict):
            nested = hints.get(key)
            lines += recipe_diff(old, new, name + ".", nested if dataclasses.is_dataclass(nested) else None)
        elif old != new:
            lines.append(f"{name}: {old!r} -> {new!r}")
    return lines


def field_default(f: dataclasses.Field):
    """A recipe field's default as plain data (to_dict's form), or a sentinel where it has none."""
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return object()
    return asdict(value) if dataclasses.is_dataclass(value) else value


def check_resume(ckpt, recipe_dict: dict, family: str, target, allow_changes: bool, *, schema: type | None = None,
                 unread: frozenset[str] = frozenset()) -> None:
    """The checkpoint must be of this family and target, and trained by the same recipe (recipe_diff)."""
    if ckpt.family != family:
        raise RecipeError(f"resume_from={ckpt.path}: a {ckpt.family!r} checkpoint, but this recipe trains "
                          f"{family!r}; resume it with its own recipe or start a fresh run (resume_from=null)")
    try:
        check_target(ckpt, target)
    except CheckpointError as error:
        raise RecipeError(f"resume_from: {error}") from None
    diff = recipe_diff(ckpt.extra.get("recipe", {}), recipe_dict, schema=schema, unread=unread)
    if diff and not allow_changes:
        raise RecipeError(f"resume_from={ckpt.path}: the recipe changed since that checkpoint:\n  "
                          + "\n  ".join(diff) + "\nresume with the original values, or set "
                          "allow_recipe_changes=true to continue with the new ones")
    check_same_data(ckpt, recipe_dict["data"]["path"], allow_changes)


def check_same_data(ckpt, path: str, allow_changes: bool) -> None:
    # the split is a permutation of the usable rows: other bytes move training rows into the held-out set
    saved = ckpt.extra.get("data_sha256")  # absent in checkpoints of older versions: nothing to compare
    if saved is None or allow_changes or data_sha256(path) in (None, saved):
        return
    raise RecipeError(f"resume_from={ckpt.path}: data.path={path} changed since that checkpoint (its sha256 differs "
                      "from the one the checkpoint recorded), so the train / held-out split would move and "
                      "training rows could land in the held-out set; resume with the original file, or set "
                      "allow_recipe_changes=true to continue on the new one")


def load_run_state(accelerator, path: Path, total_steps: int) -> tuple[int, Position, int]:
    """Restores what save_run_checkpoint saved into the prepared objects -> (step, position, tokens)."""
    meta = json.loads((path / TRAINER_DIR / POSITION_FILE).read_text())
    if meta["step"] > total_steps:  # else the final checkpoint would carry its weights under step total_steps
        raise RecipeError(f"resume_from={path}: the checkpoint is at step {meta['step']}, past this run's last step "
                          f"{total_steps} (max_steps / epochs); raise max_steps or resume an earlier checkpoint")
    if meta["num_processes"] != accelerator.num_processes:
        raise RecipeError(f"resume_from={path}: saved by {meta['num_processes']} processes, resumed with "
                          f"{accelerator.num_processes}; the data position and RNG states need the same count")
    accelerator.load_state(str(path / TRAINER_DIR))
    return meta["step"], Position(meta["passes"], meta["micro"]), meta["tokens"]
