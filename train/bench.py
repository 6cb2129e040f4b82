"""Training throughput and peak memory of train/eagle.py, measured (a benchmark, not a test):

    python train/bench.py                                     # every setting below, A B A B
    python train/bench.py --settings reference,reference-offline --repeat 2 --steps 6

Each setting is a real run of train/eagle.py (the recipe plus the setting's overrides) in a child
process; nothing is simulated. Per run it prints
    tokens/s   real (non-pad) tokens of all processes per second over the last `--steps` optimizer steps
               (metrics.jsonl `tokens_per_s` of the last flush window: start-up, the target load and the
               first steps' warm-up are excluded)
    peak RSS   the training process's maximum resident set in GB: os.wait4's for one process, the largest of
               metrics.jsonl's `peak_rss_gb_per_process` (each process's own) for several
Settings run alternately (A B A B ...) so a change in machine load does not favour one of them.
The reference trainers' settings: training-time test 7 steps, draft vocabulary 32000, sequences cut at
512 tokens, bf16 target and autocast where bf16 is native (float32 where the CPU emulates bf16, ~50x
slower: drafters.targets.resolve_precision), 1 thread per process, batch 4 x grad_accum 2.
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from drafters.training.launch import SHIPPED, on_cpus

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/eagle3_smollm2.yaml"
# bf16 as the reference trainers ran it where bf16 is native; float32 on a CPU that emulates it (~50x slower)
REFERENCE = ["eagle3.ttt_steps=7", "draft_vocab_size=32000", "draft_vocab_coverage=null", "norm_before_fc=false",
             "data.max_length=512", "dtype=auto", "mixed_precision=auto", "batch_size=4", "grad_accum=2",
             "optim.name=adamw"]
LIMIT = 240  # conversations read: enough for 2 x 6 steps of 8, and offline features write in a few minutes
# the recipe's settings when the README's figures were measured (its defaults are now eval/ablate.py's winners)
PRE_ABLATION = ["eagle3.ttt_steps=7", "draft_vocab_size=16000", "draft_vocab_coverage=null", "norm_before_fc=false",
                "batch_size=4", "grad_accum=2", "optim.name=adamw"]
# the distributed engines: the recipe from the offline store, 4 x 1 per process, on 2 CPU processes, fp32 drafter
# (as on_cpus swaps), with SpecForge's 32,000-id draft vocabulary: a 22M-parameter drafter whose weights,
# gradients and Adam state (0.35 GB in fp32) are large enough for sharding them to show
ENGINE_RUN = ["features.dir={features}", "batch_size=4", "grad_accum=1", "mixed_precision=no",
              "draft_vocab_size=32000", "draft_vocab_coverage=null",
              "optim.name=adamw"]  # ZeRO / FSDP flatten or shard the matrices Muon orthogonalises
SETTINGS = {  # name -> (processes, threads per process, overrides after the recipe[, shipped accelerate config])
    "reference": (1, 1, REFERENCE),
    "reference-offline": (1, 1, [*REFERENCE, "features.dir={features}"]),
    "recipe-1proc-2threads": (1, 2, PRE_ABLATION),
    "recipe-2proc": (2, 1, [*PRE_ABLATION, "grad_accum=1"]),  # the same global batch: 2 processes x 4 x 1
    # recipes/accelerate/<file> with its device fields swapped for 2 CPU processes (drafters.training.launch)
    "ddp-2proc": (2, 1, ENGINE_RUN, "ddp_8gpu.yaml"),
    "zero2-2proc": (2, 1, ENGINE_RUN, "zero2_8gpu.yaml"),
    "zero3-2proc": (2, 1, ENGINE_RUN, "zero3_8gpu.yaml"),
    "fsdp2-2proc": (2, 1, ENGINE_RUN, "fsdp_8gpu.yaml"),
}


def command(name: str, steps: int, output_dir: Path, features: str) -> list[str]:
    processes, threads, overrides, *engine = SETTINGS[name]
    launcher = [sys.executable] if processes == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
    if engine:  # the shipped file, device fields swapped, next to the run's output
        config = output_dir / "accelerate.yaml"
        config.write_text(yaml.safe_dump(on_cpus(yaml.safe_load((SHIPPED / engine[0]).read_text()), processes)))
        launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    common = [f"threads={threads}", f"max_steps={2 * steps}", f"log_every={steps}", "save_every=0",
              "eval_every=0", f"data.limit={LIMIT}", "data.eval_rows=1", "epochs=null", f"output_dir={output_dir}"]
    return [*launcher, "train/eagle.py", RECIPE, *[o.format(features=features) for o in overrides], *common]


def measure(name: str, steps: int, features: str) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as tmp:
        args = command(name, steps, Path(tmp), features)
        env = {**os.environ, "OMP_NUM_THREADS": str(SETTINGS[name][1]), "DS_ACCELERATOR": "cpu"}
        start = time.perf_counter()
        log = Path(tmp) / "stderr.log"
        with open(log, "w") as stderr:
            child = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
            _, status, usage = os.wait4(child.pid, 0)  # the child's own peak RSS (a launcher's for torchrun)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"{name}: failed: {shlex.join(args)}\n{log.read_text()[-3000:]}")
        rows = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    # one process: what the OS measured; several: the main process's own record (metrics.jsonl)
    # several: the largest of the processes' own records (metrics.jsonl)
    peak = usage.ru_maxrss / 2 ** 20 if SETTINGS[name][0] == 1 else \
        max(rows[-1].get("peak_rss_gb_per_process", [rows[-1].get("peak_rss_gb", float("nan"))]))
    return {"setting": name, "tokens_per_s": rows[-1]["tokens_per_s"], "peak_rss_gb": peak,
            "peak_rss_gb_per_process": rows[-1].get("peak_rss_gb_per_process"),
            "tokens": sum(r["tokens"] for r in rows[-steps:]), "wall_s": time.perf_counter() - start,
            "command": shlex.join(["python" if a == sys.executable else a for a in args])}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of: {', '.join(SETTINGS)}")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps measured (after as many warm-up steps)")
    p.add_argument("--repeat", type=int, default=1, help="rounds of A B ... (alternating)")
    p.add_argument("--features", default="outputs/features/eagle3_smollm2_ref",
                   help="offline features for reference-offline and the engines; written first if missing (python "
                        f"train/features.py {RECIPE} data.limit={LIMIT} dtype=bfloat16 features.dir=DIR)")
    args = p.parse_args(argv)
    names = args.settings.split(",")
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        raise SystemExit(f"--settings: unknown {unknown}; choose from {', '.join(SETTINGS)}")
    offline = any("{features}" in " ".join(SETTINGS[n][2]) for n in names)
    if offline and not (Path(args.features) / "index.json").is_file():
        subprocess.run([sys.executable, "train/features.py", RECIPE, f"data.limit={LIMIT}", "data.eval_rows=1",
                        "threads=1", f"features.dir={args.features}"], cwd=ROOT, check=True)
    results = []
    for round_ in range(args.repeat):
        for name in names:
            result = measure(name, args.steps, args.features)
            results.append(result)
            print(f"[{round_ + 1}/{args.repeat}] {name:24s} {result['tokens_per_s']:7.1f} tok/s  "
                  f"peak RSS {result['peak_rss_gb']:.2f} GB/process{per_process(result)}  ({result['wall_s']:.0f} s)\n"
                  f"    {result['command']}",
                  flush=True)
    return results


def per_process(result: dict) -> str:
    peaks = result.get("peak_rss_gb_per_process") or []
    return f" (each: {', '.join(f'{p:.2f}' for p in peaks)})" if len(peaks) > 1 else ""


if __name__ == "__main__":
    main()
