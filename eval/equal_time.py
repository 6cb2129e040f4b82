"""Train several drafters for the same wall-clock budget each (a benchmark, not a test), one after another:

    python eval/equal_time.py --budget-s 600 --out outputs/side \
        --common "features.dir=outputs/features/smollm2_regen threads=1" \
        --run "eagle3 recipes/eagle3_smollm2.yaml" --run "dspark recipes/dspark_smollm2.yaml" \
        --run "peagle recipes/peagle_smollm2.yaml"

Per run (NAME RECIPE [key=value ...]): a probe of `--probe-steps` optimizer steps (log_every=1, no evaluation, no
checkpoint) measures seconds per step after the first two (start-up, target load and warm-up excluded); the run
itself then trains floor(budget / seconds per step) steps (epochs=null: a cheap family may pass over the data
more than once) into OUT/NAME, evaluates on its held-out rows and saves checkpoint-final as any run does.
It prints and writes OUT/equal_time.json: planned steps, the training seconds metrics.jsonl measured (elapsed_s
of the last step), tokens, and the final held-out result (tau_pred) of each run. Runs go one after another on
the threads the recipes ask for: give them a machine, or a core, that nothing else uses. An interrupted
command resumes: a run whose checkpoint-final exists is read, not retrained.
"""

import argparse
import json
import math
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budget-s", type=float, required=True, help="training seconds per run")
    p.add_argument("--run", action="append", required=True, help='"NAME RECIPE [key=value ...]" (repeat)')
    p.add_argument("--common", default="", help="key=value overrides given to every run")
    p.add_argument("--probe-steps", type=int, default=20)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.budget_s <= 0 or args.probe_steps < 4:
        p.error("--budget-s must be > 0 and --probe-steps >= 4 (the first two steps are not timed)")
    runs = [shlex.split(r) for r in args.run]
    bad = [r for r in args.run if len(shlex.split(r)) < 2]
    names = [r[0] for r in runs if len(r) >= 2]
    if bad or len(set(names)) != len(names):
        p.error(f"each --run is 'NAME RECIPE [key=value ...]' with a distinct NAME; got {args.run}")
    return args, runs


def train(recipe: str, overrides: list[str]) -> None:
    cmd = [sys.executable, str(ROOT / "train" / "eagle.py"), recipe, *overrides]
    print("$ " + shlex.join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=Path.cwd())


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def seconds_per_step(rows: list[dict]) -> float:
    timed = [r for r in rows if r["step"] >= 2]
    first, last = timed[0], timed[-1]
    return (last["elapsed_s"] - first["elapsed_s"]) / (last["step"] - first["step"])


def main(argv=None) -> list[dict]:
    args, runs = parse_args(argv)
    out = Path(args.out)
    common = shlex.split(args.common)
    results = []
    for name, recipe, *own in runs:
        run_dir = out / name
        if not (run_dir / "checkpoint-final").is_dir():
            probe = out / f"probe-{name}"
            train(recipe, [*common, *own, f"max_steps={args.probe_steps}", "epochs=null", "log_every=1",
                           "eval_every=0", "save_every=0", f"output_dir={probe}"])
            per_step = seconds_per_step(metrics(probe))
            steps = max(1, math.floor(args.budget_s / per_step))
            (out / f"probe-{name}.json").write_text(json.dumps({"seconds_per_step": per_step, "steps": steps}))
            train(recipe, [*common, *own, f"max_steps={steps}", "epochs=null", "eval_every=0",  # the end evaluates
                           f"output_dir={run_dir}"])
        plan = json.loads((out / f"probe-{name}.json").read_text())
        rows = metrics(run_dir)
        evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines() if line.strip()]
        final = evals[-1] if evals else {}
        results.append({"name": name, "recipe": recipe, "overrides": [*common, *own], "planned_steps": plan["steps"],
                        "probe_seconds_per_step": plan["seconds_per_step"], "steps": rows[-1]["step"],
                        "train_seconds": rows[-1]["elapsed_s"], "tokens": sum(r["tokens"] for r in rows),
                        "tau_pred": final.get("tau_pred"), "eval": final,
                        "checkpoint": str(run_dir / "checkpoint-final")})
    (out / "equal_time.json").write_text(json.dumps(results, indent=2))
    print(f"\n{'run':<10} {'steps':>6} {'train s':>8} {'tokens':>9} {'tau_pred':>9}")
    for r in results:
        tau = f"{r['tau_pred']:.3f}" if r["tau_pred"] is not None else "-"
        print(f"{r['name']:<10} {r['steps']:>6} {r['train_seconds']:>8.0f} {r['tokens']:>9} {tau:>9}")
    return results


if __name__ == "__main__":
    main()
