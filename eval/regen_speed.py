"""Regeneration speed: generated tokens/s in-process (Hugging Face generate, batched) against llama-server (its
parallel slots batched into one forward per step), on the same prompts, at each thread count and parallelism.

    python eval/regen_speed.py --target smollm2-135m-instruct --data train_prompts.jsonl \
        --prompts 16 --max-new-tokens 128 --threads 1,2 --parallel 1,4,8 --gguf shipped,f32 --repeats 2 \
        [--json report.json]

Each setting runs train/regenerate.py itself (greedy) into a fresh output; the settings run in turn and the whole
round repeats, so a slow moment of the machine hits every setting alike; tokens/s is the median over the repeats
of the generated tokens over the generating wall time (target loading, server start and the probe excluded).
Parallelism is `batch_size` in-process and `concurrency` (= slots) for llama-server. Set nothing else running:
a thread count above the free cores measures contention.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "regenerate_smollm2.yaml"


def regenerate(overrides: list[str], report: Path) -> dict:
    command = [sys.executable, str(ROOT / "train" / "regenerate.py"), str(RECIPE), *overrides, f"report={report}"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return json.loads(report.read_text())


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def settings(args) -> list[dict]:
    out = []
    for threads in ints(args.threads):
        for parallel in ints(args.parallel):
            out.append({"engine": "in-process", "threads": threads, "parallel": parallel, "weights": args.dtype})
            for gguf in args.gguf.split(","):
                out.append({"engine": "llama-server", "threads": threads, "parallel": parallel, "weights": gguf})
    return out


def overrides(setting: dict, args, output: Path) -> list[str]:
    common = [f"target={args.target}", f"data={args.data}", "fmt=auto", f"limit={args.prompts}", f"output={output}",
              f"max_new_tokens={args.max_new_tokens}", "temperature=0", f"threads={setting['threads']}"]
    if setting["engine"] == "in-process":
        return common + ["engine=in-process", f"batch_size={setting['parallel']}", f"dtype={args.dtype}"]
    return common + ["engine=llama-server", f"concurrency={setting['parallel']}", f"gguf={setting['weights']}",
                     f"server_threads={setting['threads']}"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--data", default=str(ROOT / "recipes" / "prompts" / "quickstart.jsonl"),
                   help="prompts (any format train/regenerate.py reads); default: the quickstart's 320")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--parallel", default="1,4,8")
    p.add_argument("--gguf", default="shipped,f32", help="llama-server weights, comma-separated")
    p.add_argument("--dtype", default="float32", help="in-process weights")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    runs = settings(args)
    for run in runs:
        run["tokens_per_s"], run["tokens"] = [], []
    with tempfile.TemporaryDirectory(prefix="regen-speed-") as tmp:
        for repeat in range(args.repeats):
            for k, run in enumerate(runs):
                output = Path(tmp) / f"{repeat}-{k}.jsonl"
                stats = regenerate(overrides(run, args, output), Path(tmp) / f"{repeat}-{k}.json")
                run["tokens_per_s"].append(stats["tokens_per_s"])
                run["tokens"].append(stats["tokens"])
                print(f"{run['engine']} {run['weights']} threads={run['threads']} parallel={run['parallel']}: "
                      f"{stats['tokens']} tokens, {stats['tokens_per_s']:.1f} tok/s", flush=True)
    print(f"\n{args.target}: {args.prompts} prompts, at most {args.max_new_tokens} new tokens, greedy; "
          f"median of {args.repeats} rounds")
    print(f"{'engine':<13} {'weights':<9} {'threads':>7} {'parallel':>8} {'tok/s':>7} {'x in-process':>12}")
    for run in runs:
        run["median"] = statistics.median(run["tokens_per_s"])
    for run in runs:
        base = next(r for r in runs if r["engine"] == "in-process" and r["threads"] == run["threads"]
                    and r["parallel"] == run["parallel"])
        run["vs_in_process"] = run["median"] / base["median"]
        print(f"{run['engine']:<13} {run['weights']:<9} {run['threads']:>7} {run['parallel']:>8} "
              f"{run['median']:>7.1f} {run['vs_in_process']:>11.2f}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
