"""The side-by-side report of drafters on one target: a Markdown table and PNG plots.

Input: `Entry` rows, one per drafter (a trained checkpoint or an untrained baseline such as prompt
lookup), each holding the eval/tau.py JSON reports of its runs and, for trained drafters, the
training metrics (metrics.jsonl rows written by train/*.py). Output, with deterministic names:

    index.md                          settings, the table, the plots
    tau_by_category-<bench>-t<T>.png  tau per bench category, one bar per drafter
    acceptance_by_depth-<bench>-t<T>.png
                                      measured acceptance at draft depth d (rounds that accepted
                                      depth d / rounds that drafted it), one line per drafter
    speedup_vs_budget.png             measured speedup over `generate` against the tree budget
                                      (draft nodes per round, root excluded), one line per drafter
    training_curves.png               loss and top-1 accuracy of the first TTT step / head per
                                      optimizer step, one line per trained drafter

tau of a category = sum over its prompts of tau_i * rounds_i / sum of rounds_i (= accepted tokens
+ bonus over rounds), the same definition as the overall tau. Knows nothing about decoding.
"""

import math
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt


@dataclass
class Entry:
    label: str  # unique, shown in legends and the table
    family: str  # a drafters.registry.FAMILIES name, or baseline
    source: str  # checkpoint directory or proposer spec
    runs: list[dict] = field(default_factory=list)  # eval/tau.py reports at the main tree
    sweep: list[dict] = field(default_factory=list)  # eval/tau.py reports over tree budgets
    metrics: list[dict] = field(default_factory=list)  # training metrics.jsonl rows
    training: dict | None = None  # steps, tokens, wall seconds (None for baselines)
    target: dict = field(default_factory=dict)  # what the checkpoint records (drafters.checkpoint.target_info)
    tree: str | None = None  # this entry's own tree spec for the main runs (None = the comparison's)


def category_tau(report: dict) -> dict[str, float]:
    totals: dict[str, list[float]] = {}
    for prompt in report["per_prompt"]:
        total = totals.setdefault(prompt["category"] or "-", [0.0, 0.0])
        total[0] += prompt["tau"] * prompt["rounds"]
        total[1] += prompt["rounds"]
    return {name: tokens / rounds for name, (tokens, rounds) in sorted(totals.items()) if rounds}


def bench_name(report: dict) -> str:
    return Path(report["bench"]).stem if "/" in report["bench"] or report["bench"].endswith(".jsonl") \
        else report["bench"]


def render(entries: list[Entry], out_dir: Path, *, title: str, settings: list[str], engines: list[dict] = (),
           failed: list[tuple[str, str]] = ()) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    images = []
    groups = sorted({(bench_name(r), r["sampling"]["temperature"]) for e in entries for r in e.runs})
    for bench, temperature in groups:
        runs = [(e.label, r) for e in entries for r in e.runs
                if bench_name(r) == bench and r["sampling"]["temperature"] == temperature]
        images.append(plot_category_bars(runs, out_dir / f"tau_by_category-{bench}-t{temperature:g}.png",
                                         bench, temperature))
        images.append(plot_acceptance(runs, out_dir / f"acceptance_by_depth-{bench}-t{temperature:g}.png",
                                      bench, temperature))
    if any(e.sweep for e in entries):
        images.append(plot_speedup(entries, out_dir / "speedup_vs_budget.png"))
    if any(e.metrics for e in entries):
        images.append(plot_training(entries, out_dir / "training_curves.png"))
    index = out_dir / "index.md"
    index.write_text(markdown(entries, images, title, settings, engines, failed))
    return index


# ---------------------------------------------------------------- table


def markdown(entries: list[Entry], images: list[Path], title: str, settings: list[str], engines=(),
             failed=()) -> str:
    not_measured = (["", "## Not measured", "", "| drafter | why |", "|---|---|"]
                    + [f"| {label} | {reason.replace('|', '/')} |" for label, reason in failed]) if failed else []
    if not entries:  # only rows measured by an engine, or none
        return "\n".join([f"# {title}", "", *[f"- {s}" for s in settings], *engine_markdown(engines), *not_measured,
                          ""])
    lines = [f"# {title}", "", *[f"- {s}" for s in settings], "", "## Results", "",
             "| drafter | family | bench | T | tree (draft nodes) | tau | speedup | acceptance d1..d4 | training |",
             "|---|---|---|---|---|---|---|---|---|"]
    for e in entries:
        for r in e.runs:
            speedup = "-" if r.get("speedup") is None else f"{r['speedup']:.2f}x"
            depth = " ".join(f"{a:.2f}" for a in r["per_depth_acceptance"][:4]) or "-"
            budget = r["tree_budget"]["draft_nodes_excl_root"]
            lines.append(f"| {e.label} | {e.family} | {bench_name(r)} | {r['sampling']['temperature']:g} | "
                         f"`{r['tree']}` ({budget}) | {r['tau']:.3f} | {speedup} | {depth} | "
                         f"{training_cell(e.training)} |")
    if any(e.sweep for e in entries):
        lines += ["", "## Speedup against tree budget", "", "| drafter | tree | draft nodes | tau | speedup |",
                  "|---|---|---|---|---|"]
        for e in entries:
            for r in sorted(e.sweep, key=lambda r: r["tree_budget"]["draft_nodes_excl_root"]):
                speedup = "-" if r.get("speedup") is None else f"{r['speedup']:.2f}x"
                lines.append(f"| {e.label} | `{r['tree']}` | {r['tree_budget']['draft_nodes_excl_root']} | "
                             f"{r['tau']:.3f} | {speedup} |")
    lines += engine_markdown(engines) + not_measured
    lines += ["", "## Plots", ""]
    for image in images:
        lines += [f"![{image.stem}]({image.name})", ""]
    return "\n".join(lines)


def engine_markdown(reports) -> list[str]:
    """eval/llama_cpp.py reports as rows measured by the serving engine itself: its tokens/s, speedup over its
    own plain decoding (A B runs), its acceptance counters, and the referee's accepted counts on the same ids."""
    if not reports:
        return []
    lines = ["", "## Measured by llama.cpp", "",
             "Greedy, turn 1, batch 1; tokens/s and speedup from llama.cpp's own decode timers (median of A B runs), "
             "tau = tokens / target passes; referee: accepted drafts over the shared greedy text, exact float32.", "",
             *[f"- {r['weights']}: {r['prompts']} prompts of {r['bench']}, {r['max_new_tokens']} new tokens, "
               f"{r['threads']} thread(s), {r['repeats']} repeats" for r in reports if "bench" in r], "",
             "| target GGUF | mode | draft length | tok/s | speedup | accepted / drafted | tau | referee: ours / llama.cpp |",
             "|---|---|---|---|---|---|---|---|"]
    for r in reports:
        for row in r["rows"]:
            ref = r.get("referee", {}).get(row["mode"], {})
            referee = f"{ref['ours_accepted']} / {ref['engine_accepted']}" if "ours_accepted" in ref else "-"
            acc = "-" if row["acceptance"] is None else f"{row['accepted']} / {row['drafted']}"
            lines.append(f"| {r['weights']} | {row['mode']} | {row['n_max'] or '-'} | {row['tokens_per_s']:.1f} | "
                         f"{row['speedup']:.2f}x | {acc} | {row['tau']:.2f} | {referee} |")
    return lines


def training_cell(training: dict | None) -> str:
    if not training:
        return "untrained"
    if "steps" not in training:  # a drafter another tool trained: its files record no budget
        return training.get("note", "not recorded")
    wall = training.get("wall_s")
    wall = "" if wall is None else f", {wall / 60:.1f} min"
    return f"{training['steps']} steps, {training['tokens'] / 1e3:.0f}k tokens{wall}"


# ---------------------------------------------------------------- plots


def plot_category_bars(runs: list[tuple[str, dict]], path: Path, bench: str, temperature: float) -> Path:
    categories = sorted({c for _, r in runs for c in category_tau(r)})
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(categories) * max(1, len(runs)) / 2), 4.2))
    width = 0.8 / max(1, len(runs))
    for i, (label, r) in enumerate(runs):
        taus = category_tau(r)
        xs = [j + (i - (len(runs) - 1) / 2) * width for j in range(len(categories))]
        budget = r["tree_budget"]["draft_nodes_excl_root"]
        ax.bar(xs, [taus.get(c, math.nan) for c in categories], width, label=f"{label} ({budget} draft nodes)")
    ax.set_xticks(range(len(categories)), categories, rotation=30, ha="right")
    ax.set_ylabel("tau (accepted drafts + 1 per round)")
    ax.set_title(f"Mean accepted length by category: {bench}, temperature {temperature:g}")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.legend(fontsize=8)
    return save(fig, path)


def plot_acceptance(runs: list[tuple[str, dict]], path: Path, bench: str, temperature: float) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, r in runs:
        rates = r["per_depth_acceptance"]
        ax.plot(range(1, len(rates) + 1), rates, marker="o", label=label)
    ax.set_xlabel("draft depth d")
    ax.set_ylabel("acceptance at depth d (fraction of rounds)")
    ax.set_ylim(0, 1)
    ax.set_title(f"Measured acceptance by draft depth: {bench}, temperature {temperature:g}")
    ax.legend(fontsize=8)
    return save(fig, path)


def plot_speedup(entries: list[Entry], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for e in entries:
        points = sorted((r["tree_budget"]["draft_nodes_excl_root"], r["speedup"]) for r in e.sweep
                        if r.get("speedup") is not None)
        if points:
            ax.plot(*zip(*points), marker="o", label=e.label)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xlabel("tree budget (draft nodes per round, root excluded)")
    ax.set_ylabel("speedup over plain generate (x)")
    ax.set_title("Measured speedup against tree budget")
    ax.legend(fontsize=8)
    return save(fig, path)


def plot_training(entries: list[Entry], path: Path) -> Path:
    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for e in entries:
        if not e.metrics:
            continue
        steps = [row["step"] for row in e.metrics]
        loss_ax.plot(steps, [row["loss"] for row in e.metrics], label=e.label)
        acc_ax.plot(steps, [row["step_acc"][0] for row in e.metrics], label=e.label)
    loss_ax.set_xlabel("optimizer step")
    loss_ax.set_ylabel("training loss (family's own objective)")
    loss_ax.set_title("Training loss")
    acc_ax.set_xlabel("optimizer step")
    acc_ax.set_ylabel("top-1 accuracy, first TTT step / head")
    acc_ax.set_ylim(0, 1)
    acc_ax.set_title("Training accuracy of the first draft token")
    for ax in (loss_ax, acc_ax):
        ax.legend(fontsize=8)
    return save(fig, path)


def save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
