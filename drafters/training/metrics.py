"""What a training run reports: per-step metrics summed over micro-batches and processes, metrics.jsonl,
peak memory, and the optional Weights & Biases sink. Knows nothing about drafters or losses.
"""

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from drafters.training.recipe import RecipeError


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
        peaks = torch.zeros(processes, device=tokens.device)  # every process's peak memory, one slot each
        peaks[process_rank()] = peak_rss_gb()
        peaks = reduce_sum(peaks).tolist()
        tokens = tokens.tolist()
        now = time.perf_counter()
        rate = sum(tokens) / max(now - self.window_start, 1e-9)
        rows = []
        for i, (step, lr, _, _) in enumerate(self.pending):
            accuracy = [c / max(n, 1) for c, n in zip(stacked["correct"][i], stacked["counted"][i])]
            rows.append({"step": step, "loss": stacked["loss"][i], "step_loss": stacked["parts"][i],
                         "step_loss_is": self.step_loss_is, "step_acc": accuracy, "lr": lr, "grad_norm": grad_norms[i], "tokens": tokens[i],
                         "tokens_per_s": rate, "elapsed_s": now - self.start, "peak_rss_gb": peak_rss_gb(),
                         "peak_rss_gb_per_process": peaks})
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


def process_rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized() else 0


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
