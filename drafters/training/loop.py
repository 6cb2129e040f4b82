"""The training loop every family shares: the run's set-up, the loop, and the `Run` protocol it drives.

    start_run(recipe, script)  threads, accelerator, the frozen target on its device, resume checks, the split
    fit(...)                   AdamW, accelerate's prepare, the lr schedule, resume, train_loop, a last
                               evaluation and checkpoint-final
    train_loop(run, ...)       optimizer steps; SIGINT / SIGTERM stop only at a step boundary (StopRequests)
                               and save a resumable checkpoint; a non-finite loss stops before it is applied

A family provides a RunBase subclass (the `Run` protocol: micro_step, held_out, describe, step_loss_is).
The recipe sections are drafters.training.schema's, batches drafters.training.batches', metrics
drafters.training.metrics' and checkpoints / resume drafters.training.resume'. Knows nothing about
drafters or losses.
"""

import copy
import json
import math
import signal
import threading
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from functools import cached_property, partial
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

from drafters.checkpoint import prune_checkpoints, step_checkpoints, target_info
from drafters.files import data_sha256
from drafters.targets import Target, resolve_precision
from drafters.training.batches import LengthBuckets, load_examples, lr_factor, plan_steps
from drafters.training.resume import (
    Position,
    check_resume,
    check_trusted,
    claim_output_dir,
    load_run_state,
    resume_checkpoint,
    save_run_checkpoint,
)
from drafters.training.launch import check_launch_config, check_split, outside_zero3, shards_parameters, split_target
from drafters.training.metrics import MetricsLog, StepMetrics, wandb_sink
from drafters.training.memory import check_step_memory
from drafters.training.optimizers import build_optimizer
from drafters.training.recipe import RecipeError, to_dict
from drafters.errors import Stopped, UserError


def mixed_precision_of(accelerator) -> str:
    return str(accelerator.mixed_precision).lower()  # "no" | "bf16" | "fp16"


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
    mixed_precision = check_launch_config(recipe, gpu)
    # DeepSpeed on CPUs: accelerate drops it under cpu=True, so it gets cpu=False and gloo
    deepspeed_on_cpu = not gpu and os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true"
    fsdp_on_cpu = not gpu and os.environ.get("ACCELERATE_USE_FSDP") == "true"
    handlers = [InitProcessGroupKwargs(backend="gloo")] if deepspeed_on_cpu else []
    accelerator = Accelerator(mixed_precision=mixed_precision, kwargs_handlers=handlers,
                              cpu=not gpu and not deepspeed_on_cpu)
    if fsdp_on_cpu and accelerator.num_processes > 1:
        # accelerate turns FSDP on for accelerator devices only; on CPUs its processes are gloo MULTI_CPU, where
        # FSDP2's fully_shard works as well: hand it the plugin the launch asked for
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin()
        # both shared states: every later AcceleratorState() copies the process state's distributed_type back
        accelerator.state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    if accelerator.state.deepspeed_plugin is not None:
        if recipe.grad_accum != 1:  # DeepSpeed steps its engine at every backward under our own accumulation
            raise RecipeError(f"grad_accum={recipe.grad_accum} under DeepSpeed is not supported yet: use grad_accum=1 "
                              "and a larger batch_size or more processes for the same global batch")
        # the loader's batches come from a batch sampler, which DeepSpeed cannot read the size of
        config = accelerator.state.deepspeed_plugin.deepspeed_config
        config["train_micro_batch_size_per_gpu"] = recipe.batch_size
        # DeepSpeed clips inside its engine (accelerate's clip_grad_norm_ only reads the norm back): the recipe's
        # max_grad_norm becomes its gradient_clipping, and a different value in the engine's config is refused
        clip = float(recipe.optim.max_grad_norm or 0.0)
        given = config.get("gradient_clipping", "auto")
        if given not in ("auto", None) and float(given) != clip:
            raise RecipeError(f"the DeepSpeed config sets gradient_clipping: {given} but the recipe's "
                              f"optim.max_grad_norm is {recipe.optim.max_grad_norm}: the recipe decides; remove "
                              "gradient_clipping from the accelerate config or set the same value in both")
        config["gradient_clipping"] = clip
        if shards_parameters(accelerator):  # get_state_dict gathers ZeRO-3 shards only with this set
            config.setdefault("zero_optimization", {})["stage3_gather_16bit_weights_on_model_save"] = True
    if recipe.optim.clip_value is not None and accelerator.distributed_type.value in ("DEEPSPEED", "FSDP"):
        raise RecipeError(f"optim.clip_value={recipe.optim.clip_value}: {accelerator.distributed_type.value} clips "
                          "gradients by their norm only; set optim.clip_value=null and optim.max_grad_norm (e.g. "
                          "0.5), or train with DDP (recipes/accelerate/ddp_8gpu.yaml)")
    accelerator.print(f"{script}: {accelerator.num_processes} process(es), {accelerator.distributed_type.value}, "
                      f"device {accelerator.device}, mixed precision {accelerator.mixed_precision}")
    return accelerator


def start_run(recipe, script: str, decoder: bool = True):
    """The start every training script shares: threads, accelerator, the frozen target on its
    device, the resume checks (before any work) and the train / held-out split. decoder=False loads the target's
    embeddings, final norm and LM head only (a run whose features all come from a store: drafters.targets).
    -> (accelerator, target, resume checkpoint or None, train rows, held-out rows)."""
    from drafters.checkpoint import load_checkpoint
    from drafters.targets import load_target

    if recipe.threads:
        torch.set_num_threads(recipe.threads)
    accelerator = make_accelerator(recipe, script)
    claim_output_dir(recipe, accelerator)
    # the autocast the Accelerator was given (launch_precision: a recipe's auto takes the launch's "no")
    dtype, _, precision = resolve_precision(recipe.dtype, mixed_precision_of(accelerator), accelerator.device)
    accelerator.print(precision)
    check_split(recipe, accelerator, decoder)
    with outside_zero3():
        # a split target's layers wait on the meta device: each process reads only its shards (split_target)
        target = load_target(recipe.target, dtype=dtype, decoder="meta" if recipe.split_target else decoder)
    if recipe.split_target:  # before the move: each device receives its shards, never the whole target
        held, whole = split_target(target, accelerator)
        accelerator.print(f"target: decoder layers split across {accelerator.num_processes} processes: each holds "
                          f"{held / 1e6:.2f}M of its {whole / 1e6:.2f}M parameters")
    target.model.to(accelerator.device)  # frozen: never given to the optimizer or to prepare()
    if not decoder:
        held = sum(p.numel() for p in target.model.parameters())
        accelerator.print(f"target: embeddings, final norm and LM head only ({held / 1e6:.1f}M parameters); its "
                          f"{target.num_layers} decoder layers are not loaded: the features come from the store")
    resume = resume_checkpoint(recipe, accelerator.print)
    if resume is not None:  # before any work: a wrong checkpoint or a changed recipe fails here
        check_resume(load_checkpoint(resume), to_dict(recipe), recipe.drafter, target, recipe.allow_recipe_changes,
                     schema=type(recipe))
        check_trusted(resume, recipe)  # last: its trainer state is unpickled only after this
    train_rows, held_out = load_examples(recipe, target, accelerator.print)
    return accelerator, target, resume, train_rows, held_out


# ---- the loop ---------------------------------------------------------------------------------------


class NonFiniteLoss(UserError):
    """A loss that is not finite: the message names the step, its data rows and the last good checkpoint."""


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
               start_step: int = 0, start: Position | None = None) -> tuple[list[float], Position]:
    """Optimizer steps start_step+1 .. total_steps -> (losses, the data position after the last step).
    `run` (a training script's Run) provides micro_step(batch, acc) -> summed metric tensors, log
    (MetricsLog), flush_due(step, total), reduce_sum, periodic(step, total, position) (evaluation,
    checkpoints), save(path, step, result, position), rows_of(pass, micro) -> 'file:line' of a
    micro-batch's rows, recipe, accelerator and objective. Ctrl-C or SIGTERM lets the running step
    finish, then saves a resumable checkpoint of it (StopRequests); a non-finite loss stops before
    the optimizer applies it (the last checkpoint stays the last good one)."""
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
                if hasattr(grad_norm, "full_tensor"):  # FSDP2: the norm over every process's shards, a DTensor
                    grad_norm = grad_norm.full_tensor()
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
    return run.log.losses, position


def save_and_exit(run, step: int, position: Position, signal_name: str | None) -> None:
    accelerator = run.accelerator
    if run.log.pending:
        run.log.flush(run.reduce_sum, accelerator.num_processes)
    accelerator.print(f"{signal_name or 'a signal to another process'}: saving the state after step {step}")
    path = run.save(run.output_dir / f"checkpoint-{step}", step, None, position)
    raise Stopped(f"interrupted: saved the state after step {step} to {path}; continue with "
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
        family, name: str) -> Summary:
    """The part of every training script after its drafter and objective exist: the optimizer on the drafter's
    parameters, accelerate's prepare, the lr schedule, resume, train_loop, a last evaluation and
    checkpoint-final. `family` is the drafters.training.families.TrainingFamily being trained; its `run`, the
    family's RunBase subclass, drives the loop."""
    say = accelerator.print
    if recipe.optim.name == "muon" and accelerator.distributed_type.name in ("DEEPSPEED", "FSDP"):
        raise RecipeError(f"optim.name=muon orthogonalises whole weight matrices, and this launch "
                          f"({accelerator.distributed_type.name}) flattens or shards them: use optim.name=adamw, or "
                          "launch with DDP (accelerate launch --multi_gpu)")
    optimizer = build_optimizer(recipe.optim, objective.drafter)
    check_step_memory(family, recipe, target, objective.drafter, accelerator.device, say)  # before any step
    sampler = loader.batch_sampler
    # a whole copy for evaluation and checkpoints, made before prepare() shards the drafter (main process only)
    whole = copy.deepcopy(objective.drafter) if shards_parameters(accelerator) and accelerator.is_main_process else None
    objective, optimizer, loader = accelerator.prepare(objective, optimizer, loader)
    total_steps = plan_steps(recipe, len(loader))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, recipe.optim, total_steps))
    accelerator.register_for_checkpointing(scheduler)

    output_dir = Path(recipe.output_dir)
    step, position, resumed = 0, Position(), None
    if resume is not None:
        step, position, tokens = load_run_state(accelerator, resume, total_steps)
        follow_schedule(scheduler, step)
        resumed = (step, tokens)
        say(f"{name}: resumed from {resume} at step {step} (pass {position.passes}, micro-batch {position.micro})")
    run = family.run(family, recipe, accelerator, target, objective, RunData(train_rows, sampler, eval_batches),
                     resumed=resumed, whole=whole)
    losses, position = train_loop(run, optimizer, scheduler, loader, sampler, total_steps, step, position)
    result = run.evaluate(total_steps)
    # resumable, so that raising max_steps continues the finished run (resume_from=latest takes it) rather than
    # training again the steps after its newest checkpoint-<step>; written atomically over an earlier one
    checkpoint = run.save(output_dir / "checkpoint-final", total_steps, result, position)
    say(f"{name}: {total_steps} steps, {run.tokens_total} tokens; saved {checkpoint}")
    if run.sink is not None:
        run.sink.finish()
    summary = Summary(total_steps, run.tokens_total, losses, result, checkpoint, target, run.whole_drafter())
    if accelerator.num_processes > 1:  # every process done, then the group ended; that alone does not stop gloo's
        accelerator.wait_for_everyone()  # threads from aborting the process at interpreter exit: run_main skips it
        accelerator.end_training()  # (drafters.training.recipe.exit_launched_process)
    return summary


def follow_schedule(scheduler, step: int) -> None:
    """The resumed run's next step takes its lr from this run's schedule: the restored optimizer holds the lr the
    saved run's schedule set last, which is another once max_steps changed (a finished run's cosine had reached 0,
    so its continuation's first step would not move). The same value when nothing changed: resume stays exact."""
    scheduler.last_epoch = step - 1
    scheduler.step()  # sets every param group's lr to base lr x lr_factor(step) and get_last_lr() with it


class Run(Protocol):
    """What train_loop and fit drive: RunBase below plus the three things each family adds."""

    step_loss_is: str  # what StepMetrics.parts are (per TTT step, per head, ...), written into metrics.jsonl

    def micro_step(self, batch: dict, acc: StepMetrics | None) -> StepMetrics:
        """Forward + backward of one micro-batch; its metrics summed into `acc` (None: the first of a step)."""

    def held_out(self, drafter) -> dict:
        """The held-out evaluation's metrics of `drafter` (whole; main process only)."""

    def describe(self, result: dict) -> str:
        """held_out's result as one line."""


@dataclass(frozen=True)
class RunData:
    """The rows one run reads, as fit hands them to the family's run."""

    train_rows: list  # Example rows; the sampler's batches index them (rows_of names a bad micro-batch's)
    sampler: LengthBuckets  # the loader's batch sampler: which rows micro-batch m of pass p holds
    eval_batches: list  # the held-out batches, collated (or read from the feature store)


class RunBase:
    """The pieces of one training run that the loop, the evaluation and the saving share, the same for
    every family. A subclass provides micro_step(batch, acc) (forward + backward of one micro-batch ->
    summed metric tensors), held_out(drafter) -> the evaluation's metrics dict and describe(result) -> its
    one-line summary (the Run protocol above); step_loss_is (what its StepMetrics.parts are, written into
    every metrics.jsonl row) is the family's loss_parts. The run writes into recipe.output_dir. resumed: (step,
    tokens) of the checkpoint resumed. whole: under an engine that shards parameters (shards_parameters), the main
    process's unsharded copy of the drafter that whole_drafter() fills from the gathered weights; None otherwise."""

    def __init__(self, family, recipe, accelerator, target, objective, data: RunData, *,
                 resumed: tuple[int, int] | None = None, whole=None):
        self.family, self.step_loss_is, self.resumed = family, family.loss_parts, resumed
        self.sharded, self.whole = shards_parameters(accelerator), whole
        self.recipe, self.accelerator, self.target = recipe, accelerator, target
        self.objective, self.output_dir = objective, Path(recipe.output_dir)
        self.train_rows, self.sampler, self.eval_batches = data.train_rows, data.sampler, data.eval_batches
        self.drafter = accelerator.unwrap_model(objective).drafter
        self.sink = wandb_sink(recipe, self.output_dir, accelerator.is_main_process)
        self.log = MetricsLog(self.output_dir / "metrics.jsonl", accelerator.is_main_process, resume=resumed,
                              sink=self.sink, step_loss_is=self.step_loss_is)
        self.tokens_total = self.log.tokens_total
        if accelerator.is_main_process and resumed is None:
            (self.output_dir / "eval.jsonl").write_text("")  # a new run starts new files

    def evaluate(self, step: int) -> dict | None:
        """Held-out metrics on the main process (None without held-out rows), appended to eval.jsonl. With a split
        target every process evaluates (its forward is collective) and the main process reports."""
        from tqdm import tqdm

        result = None
        drafter = self.whole_drafter()  # every process: gathering shards is collective
        main = self.accelerator.is_main_process
        if self.eval_batches and not main and self.target.shards > 1:
            self.held_out(drafter)  # a split target's forward is collective: every process evaluates, one reports
        if self.eval_batches and main:
            result = self.held_out(drafter)
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

    def whole_drafter(self):
        """The drafter with every parameter whole: the trained module itself, or under an engine that shards
        parameters the main process's copy loaded from the gathered weights (None on the other processes, which
        must call this too: the gathering is collective)."""
        if not self.sharded:
            return self.drafter
        state = self.accelerator.get_state_dict(self.objective)  # full tensors on the main process
        if not self.accelerator.is_main_process:
            return None
        prefix = "drafter."  # every family's objective holds its drafter as .drafter
        self.whole.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
        return self.whole

    def save(self, path: Path, step: int, result: dict | None, position: Position | None = None) -> Path:
        """The drafter's checkpoint; with a data position (every one the loop saves): resumable, trainer state too."""
        self.tokens_total = self.log.tokens_total
        drafter = self.whole_drafter()
        checkpoint = {"family": self.recipe.drafter, "config": asdict(self.drafter.config),
                      "target": target_info(self.target), "state_dict": None if drafter is None else drafter.state_dict(),
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


@dataclass(frozen=True)
class FeatureBatch:
    """One batch as a feature-level family's loss reads it (ttt_loss, chain_loss, block_loss, parallel_loss): the
    target's side computed without grad, online or from the feature store. An objective's forward takes the five
    fields (what accelerate's engines hand a prepared module) and gives its loss this."""

    features: Tensor  # (B, T, n*h) the fused aux layers (EAGLE-3, DFlash, DSpark, P-EAGLE) or (B, T, h) (EAGLE-1)
    input_ids: Tensor  # (B, T)
    target_logits: object  # (B, T, V) tensor, or drafters.losses.LabelLogits (computed at the rows read only)
    loss_mask: Tensor  # (B, T): loss_mask[s] = 1 iff token s is learnt
    embed: torch.nn.Module  # the target's frozen token embedding
    # B x the batch's longest row, before collate's padding to data.pad_multiple (what a "positions"-normalised loss
    # divides by, so that padding changes nothing); None = B x T
    num_positions: int | Tensor | None = None


class FeatureRun(RunBase):
    """The run of the feature-level families (EAGLE-3, EAGLE-1, DFlash, DSpark, P-EAGLE): one objective call on
    (features, input ids, target logits, loss mask, the target's embedding), the fields of a FeatureBatch; the
    family's own inputs, evaluation and summary come from its TrainingFamily entry."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.inputs = self.family.inputs(self.recipe, self.target, self.drafter)  # batch -> (features, labels)

    def micro_step(self, batch: dict, acc: StepMetrics | None) -> StepMetrics:
        """Forward + backward of one micro-batch; metrics are summed into `acc` as tensors."""
        features, target_logits = self.inputs(batch)
        # B x the longest row (rows are right-padded), a 0-d tensor: reading it on the host would add a device sync
        # to every micro-step
        mask = batch["attention_mask"]  # (B, T)
        out = self.objective(features, batch["input_ids"], target_logits, batch["loss_mask"],
                             self.target.embed_tokens, num_positions=mask.shape[0] * mask.sum(1).max())
        self.accelerator.backward(out.loss / self.recipe.grad_accum)
        scale = 1.0 / self.recipe.grad_accum
        metrics = StepMetrics(loss=out.loss.detach() * scale, parts=out.step_losses.detach() * scale,
                              correct=out.step_accuracies * out.step_counts,  # (K,) correct top-1 per part
                              counted=out.step_counts, tokens=batch["attention_mask"].sum())
        return metrics if acc is None else acc + metrics

    def held_out(self, drafter) -> dict:
        return self.family.evaluate(drafter, self.inputs, self.target.embed_tokens, self.eval_batches,
                                    self.recipe, self.accelerator)

    def describe(self, result: dict) -> str:
        return self.family.describe(result)
