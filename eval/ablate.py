"""Ablations of the EAGLE-3 recipe at an equal budget, from one offline feature store (a benchmark, not a test).

    python train/features.py recipes/eagle3_smollm2.yaml features.dir=outputs/features/smollm2_regen threads=1
    python eval/ablate.py --features outputs/features/smollm2_regen --budget 240 --out outputs/ablate
    python eval/ablate.py --features ... --settings specforge,lr1e-3 --mt-bench 20   # + MT-bench chain tau

Every setting is a real run of train/eagle.py (the recipe, then the common overrides, then the setting's own)
in a child process, one after another, each on `--threads` threads. The target runs once: all settings
stream the same stored features, so they see the same training conversations and the same held-out rows.

    budget        training conversations per run: max_steps = budget / (batch_size x grad_accum), so a
                  setting with smaller batches takes more, smaller steps over the same tokens
    tau_pred@K    held-out 1 + sum_k prod_(j<=k) acc_j over the first K TTT steps (drafters.training.eagle3
                  evaluate_eagle3, at eval_ttt_steps=7 whatever the setting trains at); acc_1 = first draft.
                  DFlash rows: its own per-block tau_pred (1 + mean leading correct slots, blocks of 3 drafts) under @3
    mt-bench      with --mt-bench N: tau of a greedy chain of --chain drafts on the first N MT-bench
                  questions (--mt-bench-turns, default turn 1; --mt-bench-tokens new tokens, default 128) in this
                  project's decoder (eval/tau.py); issue 35's protocol is --mt-bench 80 --mt-bench-turns 2
                  --mt-bench-tokens 32
    cpu_s         the training run's wall time x threads (start-up and the final evaluation included)

Results go to OUT/results.json (one entry per setting, rewritten after each) and a markdown table to
OUT/results.md; a rerun skips settings whose entry was made by the same command, so it resumes after an
interruption (a half-finished run is started over: its output_dir is overwritten).
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import yaml

from drafters.acceptance import chain_tau
from drafters.files import write_text_atomic

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/eagle3_smollm2.yaml"
# Every setting starts from the recipe as it was before these ablations (its defaults have since become the winners):
# TTT 7, draft vocab 16000, no norm options, AdamW at lr 1e-4 with 50 warmup steps, batch 4 x 2.
BASE = ["eagle3.ttt_steps=7", "draft_vocab_size=16000", "draft_vocab_coverage=null", "norm_before_fc=false",
        "optim.lr=1e-4", "optim.warmup_steps=50", "batch_size=4", "grad_accum=2", "optim.name=adamw"]
# SpecForge's EAGLE-3 defaults (TTT 7, draft vocab 32000, lr 1e-4 with its warmup) on this recipe's batches
SPECFORGE = ["eagle3.ttt_steps=7", "draft_vocab_size=32000", "optim.lr=1e-4", "optim.warmup_steps=50"]
FAST = ["optim.lr=1e-3", "optim.warmup_steps=5"]  # the small-budget learning rate (settled by the lr rows)
COMBO = ["eagle3.ttt_steps=3", "draft_vocab_coverage=0.95", "norm_before_fc=true", "batch_size=2", "grad_accum=1"]
SETTINGS = {  # name -> (what it tests, overrides after the common ones[, another recipe])
    "specforge": ("SpecForge defaults: TTT 7, vocab 32000, lr 1e-4, warmup 50", SPECFORGE),
    "vocab16k": ("the recipe's 16k draft vocabulary, else SpecForge's", [*SPECFORGE, "draft_vocab_size=16000"]),
    "lr3e-4": ("(a) lr 3e-4, warmup 5", ["optim.lr=3e-4", "optim.warmup_steps=5"]),
    "lr1e-3": ("(a) lr 1e-3, warmup 5", FAST),
    "lr3e-3": ("(a) lr 3e-3, warmup 5", ["optim.lr=3e-3", "optim.warmup_steps=5"]),
    "lr1e-3-b2": ("(a) lr 1e-3, batch 2 x 1 (4x the steps)", [*FAST, "batch_size=2", "grad_accum=1"]),
    "ttt3": ("(b) TTT 3 steps, lr 1e-3", [*FAST, "eagle3.ttt_steps=3"]),
    "ttt4": ("(b) TTT 4 steps, lr 1e-3", [*FAST, "eagle3.ttt_steps=4"]),
    "cov95": ("(c) draft vocab covering 95% of training tokens, lr 1e-3", [*FAST, "draft_vocab_coverage=0.95"]),
    "init-last": ("(d) decoder layer from the target's last, lr 1e-3", [*FAST, "eagle3.init_layer=-1"]),
    "init-mid": ("(d) decoder layer from the target's middle layer (15), lr 1e-3", [*FAST, "eagle3.init_layer=15"]),
    "norm-fc": ("(e) norm_before_fc (one RMSNorm over the fused 3h; llama.cpp runs it), lr 1e-3",
                [*FAST, "norm_before_fc=true"]),
    "fc-norm": ("(e) EAGLE-3.1 fc_norm (an RMSNorm per aux layer; vLLM / speculators only), lr 1e-3",
                [*FAST, "fc_norm=true"]),
    "norm-res": ("(e) norm_before_residual (llama.cpp runs it), lr 1e-3", [*FAST, "norm_before_residual=true"]),
    # the winners of the rows above together: TTT 3, the 95%-coverage vocabulary, norm_before_fc, batch 2 x 1
    "combo-lr1e-3": ("TTT 3 + vocab at 95% coverage + norm_before_fc + batch 2 x 1, lr 1e-3",
                     [*FAST, *COMBO]),
    "combo-lr3e-3": ("TTT 3 + vocab at 95% coverage + norm_before_fc + batch 2 x 1, lr 3e-3",
                     ["optim.lr=3e-3", "optim.warmup_steps=5", *COMBO]),
    "combo-init": ("the combo, lr 1e-3, decoder layer from the target's last", [*FAST, *COMBO, "eagle3.init_layer=-1"]),
    # (f) epochs against distinct tokens: the combo, lr 1e-3, on half the budget's rows, seen twice
    "combo-2ep": ("(f) the combo, lr 1e-3, 2 epochs over budget / 2 training rows (data.train_rows)",
                  [*FAST, *COMBO, "data.train_rows={half}"]),
    # (h) issue 35: the loss, from today's recipe (the combo above) at lr 1e-3; "kl" is that recipe unchanged
    "kl": ("(h) the recipe before Muon: soft cross-entropy (KL), AdamW, the combo at lr 1e-3", [*FAST, *COMBO]),
    "lk": ("(h) LK loss: -log acceptance probability (divergence=lk)", [*FAST, *COMBO, "eagle3.divergence=lk"]),
    "kl-tv": ("(h) KL + total variation (tv_weight=1)", [*FAST, *COMBO, "eagle3.tv_weight=1.0"]),
    "jsd": ("(h) Jensen-Shannon divergence", [*FAST, *COMBO, "eagle3.divergence=jsd"]),
    "reverse-kl": ("(h) reverse KL, KL(q || p)", [*FAST, *COMBO, "eagle3.divergence=reverse_kl"]),
    "argmax": ("(h) hard labels: cross-entropy against the target's argmax",
               [*FAST, *COMBO, "eagle3.divergence=argmax"]),
    "muon": ("(h) Muon on the hidden matrices, AdamW on the rest (optim.name=muon), lr 1e-3",
             [*FAST, *COMBO, "optim.name=muon"]),
    "muon-lr3e-3": ("(h) Muon on the hidden matrices, AdamW on the rest, lr 3e-3",
                    ["optim.lr=3e-3", "optim.warmup_steps=5", *COMBO, "optim.name=muon"]),
    # (j) issue 35, the draft vocabulary's size: Muon's arm with a fixed size instead of 95% coverage of the
    # training tokens (4,007 ids on the general store), which holds only 83-87% of the target's MT-bench tokens
    **{f"muon-v{k}k": (f"(j) Muon's arm, draft vocabulary of {k * 1000} ids (not 95% coverage)",
                       [*FAST, *COMBO, "optim.name=muon", "draft_vocab_coverage=null", f"draft_vocab_size={k * 1000}"])
       for k in (8, 16, 32)},
    # (g) DFlash from the same store: blocks of 4 = 3 drafts a pass, what a chain of 3 serves; its full vocabulary
    # is what llama.cpp's DFlash converter needs (no d2t mapping there)
    "dflash-b4": ("(g) DFlash, block 4 (3 drafts a pass), full vocab, lr 1e-3", [*FAST, "dflash.block_size=4"],
                  "recipes/dflash_smollm2.yaml"),
    # (i) issue 35, drafter size: DFlash (the family with a layer count) at 1, 2 and 4 decoder layers, blocks of 4,
    # the combo's batches; one epoch of the budget each
    **{f"dflash-l{n}": (f"(i) DFlash, {n} decoder layer{'s' if n > 1 else ''}, block 4, batch 2 x 1, lr 1e-3",
                        [*FAST, "dflash.block_size=4", f"dflash.num_layers={n}", "batch_size=2", "grad_accum=1"],
                        "recipes/dflash_smollm2.yaml") for n in (1, 2, 4)},
    # (h) issue 35, D-PACE for block drafters: dflash-l1 with the slots weighted by D-PACE instead of the fixed decay
    "dflash-dpace": ("(h) DFlash as dflash-l1, slots weighted by D-PACE (dflash.weighting=dpace, alpha 0.5)",
                     [*FAST, "dflash.block_size=4", "dflash.num_layers=1", "batch_size=2", "grad_accum=1",
                      "dflash.weighting=dpace"], "recipes/dflash_smollm2.yaml"),
}


def recipe_value(recipe: str, overrides: list[str], key: str):
    for item in reversed(overrides):
        if item.startswith(key + "="):
            return yaml.safe_load(item.split("=", 1)[1])
    return yaml.safe_load((ROOT / recipe).read_text()).get(key, 1)


def train_command(name: str, args) -> tuple[list[str], int]:
    recipe = SETTINGS[name][2] if len(SETTINGS[name]) > 2 else args.recipe  # a setting of another family
    overrides = (BASE if recipe == RECIPE else []) + SETTINGS[name][1]
    per_step = recipe_value(recipe, overrides, "batch_size") * recipe_value(recipe, overrides, "grad_accum")
    steps = max(1, args.budget // per_step)
    depth = ["eagle3.eval_ttt_steps=7"] if recipe_value(recipe, overrides, "drafter") == "eagle3" else []
    data = [f"data.path={args.data}"] if args.data else []  # the rows the store was written for
    common = [f"features.dir={args.features}", *data, f"threads={args.threads}", *depth, "epochs=null",
              f"max_steps={steps}", "save_every=0", "eval_every=0", "log_every=5", "overwrite_output_dir=true",
              f"output_dir={args.out}/{name}"]
    overrides = [o.format(half=args.budget // 2) for o in overrides]
    return ["python", "train/eagle.py", recipe, *common, *overrides], steps


def mt_bench_command(name: str, args) -> list[str]:
    return ["python", "eval/tau.py", "--target", args.target, "--proposer",
            f"{args.out}/{name}/checkpoint-final", "--bench", "mt_bench", "--tree", f"chain:{args.chain}",
            "--limit", str(args.mt_bench), "--max-turns", str(args.mt_bench_turns), "--max-new-tokens",
            str(args.mt_bench_tokens), "--temperature", "0", "--no-baseline",
            "--threads", str(args.threads), "--json", f"{args.out}/{name}/mt_bench-chain{args.chain}.json"]


def run(command: list[str], log: Path, threads: int) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    start = time.perf_counter()
    with open(log, "w") as out:
        done = subprocess.run([sys.executable, *command[1:]], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"failed (exit {done.returncode}): {shlex.join(command)}\nlast lines of {log}:\n"
                         + "\n".join(log.read_text().splitlines()[-15:]))
    return time.perf_counter() - start


def measure(name: str, args) -> dict:
    command, steps = train_command(name, args)
    out = ROOT / args.out / name
    out.mkdir(parents=True, exist_ok=True)
    wall = run(command, out.parent / f"{name}.log", args.threads)
    final = json.loads((out / "eval.jsonl").read_text().splitlines()[-1])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    acc = final["step_acc"]
    entry = {"setting": name, "what": SETTINGS[name][0], "command": shlex.join(command), "steps": steps,
             "train_tokens": sum(r["tokens"] for r in rows), "wall_s": round(wall, 1),
             "cpu_s": round(wall * args.threads, 1), "tokens_per_s": rows[-1]["tokens_per_s"],
             "acc_1": acc[0], "tau_pred@3": chain_tau(acc[:3]), "tau_pred@7": chain_tau(acc[:7]),
             "held_out_tokens": final["supervised"], "step_acc": acc}
    if len(acc) < 7:  # DFlash: acc_k per block slot, not conditional; its own tau_pred counts leading correct
        entry.update({"tau_pred@3": final["tau_pred"], "tau_pred@7": None})  # slots per block (3 drafts a pass)
    if args.mt_bench:
        bench = mt_bench_command(name, args)
        run(bench, out.parent / f"{name}-mt_bench.log", args.threads)
        report = json.loads((out / f"mt_bench-chain{args.chain}.json").read_text())
        entry.update({"mt_bench_command": shlex.join(bench), f"mt_bench_tau_chain{args.chain}": report["tau"],
                      **mt_bench_details(report)})
    return entry


def mt_bench_details(report: dict) -> dict:
    """From an eval/tau.py report: acceptance per chain depth (d1 = the first draft accepted), rounds, tau per turn."""
    turns = {}
    for row in report["per_prompt"]:
        turns.setdefault(row["turn"], []).append(row)
    tau_by_turn = {str(t): sum(r["tau"] * r["rounds"] for r in rows) / sum(r["rounds"] for r in rows)
                   for t, rows in sorted(turns.items())}  # each prompt's tau weighted by its rounds, as the total
    return {"mt_bench_acceptance": report["per_depth_acceptance"], "mt_bench_rounds": report["rounds"],
            "mt_bench_tau_by_turn": tau_by_turn}


def table(entries: list[dict], chain: int) -> str:
    key = f"mt_bench_tau_chain{chain}"
    lines = ["| setting | what | steps | train tokens | CPU s | tok/s | acc_1 | tau_pred@3 | tau_pred@7 | "
             f"MT-bench chain-{chain} tau | MT-bench acceptance d1 d2 d3 |", "|---" * 11 + "|"]
    for e in entries:
        bench = f"{e[key]:.3f}" if key in e else "not run"
        depth = " ".join(f"{a:.3f}" for a in e["mt_bench_acceptance"]) if "mt_bench_acceptance" in e else "-"
        lines.append(f"| {e['setting']} | {e['what']} | {e['steps']} | {e['train_tokens']} | {e['cpu_s']:.0f} | "
                     f"{e['tokens_per_s']:.0f} | {e['acc_1']:.3f} | {e['tau_pred@3']:.3f} | "
                     f"{'n/a' if e['tau_pred@7'] is None else format(e['tau_pred@7'], '.3f')} | "
                     f"{bench} | {depth} |")
    lines.append("")
    lines += [f"- {e['setting']}: `{e['command']}`" for e in entries]
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default=RECIPE, help=f"the train/eagle.py recipe every setting starts from ({RECIPE})")
    p.add_argument("--target", default="smollm2-135m-instruct", help="the recipe's target, for --mt-bench")
    p.add_argument("--features", required=True, help="the offline feature store (train/features.py) all runs read")
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of: {', '.join(SETTINGS)}")
    p.add_argument("--data", default=None, help="the data file the store was written for, when it is not the "
                   "recipe's data.path")
    p.add_argument("--budget", type=int, default=240, help="training conversations per run (default 240)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--mt-bench", type=int, default=0, help="also measure chain tau on the first N MT-bench questions")
    p.add_argument("--chain", type=int, default=3, help="chain length for --mt-bench (default 3)")
    p.add_argument("--mt-bench-turns", type=int, default=1, help="MT-bench turns per question (1 or 2; default 1)")
    p.add_argument("--mt-bench-tokens", type=int, default=128, help="new tokens per MT-bench turn (default 128)")
    p.add_argument("--out", default="outputs/ablate")
    p.add_argument("--table", action="store_true", help="only rewrite OUT/results.md from OUT/results.json")
    args = p.parse_args(argv)
    names = args.settings.split(",")
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        raise SystemExit(f"--settings: unknown {unknown}; choose from {', '.join(SETTINGS)}")
    if not (ROOT / args.features / "index.json").is_file():
        raise SystemExit(f"--features {args.features}: no index.json there; write the store first with "
                         f"python train/features.py {args.recipe} features.dir={args.features} threads=1")
    results_path = ROOT / args.out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    if args.table:  # the table again from what the runs left, MT-bench details read from their reports
        for name, entry in results.items():
            report = ROOT / args.out / name / f"mt_bench-chain{args.chain}.json"
            if "mt_bench_acceptance" not in entry and report.is_file():
                entry.update(mt_bench_details(json.loads(report.read_text())))
        write_text_atomic(results_path, json.dumps(results, indent=1) + "\n")
        write_text_atomic(ROOT / args.out / "results.md", table(list(results.values()), args.chain))
        return list(results.values())
    for name in names:
        done = results.get(name)
        if done and done["command"] == shlex.join(train_command(name, args)[0]) and \
                (not args.mt_bench or f"mt_bench_tau_chain{args.chain}" in done):
            print(f"{name}: done earlier, skipped")
            continue
        results[name] = measure(name, args)
        write_text_atomic(results_path, json.dumps(results, indent=1) + "\n")
        e = results[name]
        print(f"{name:12s} tau_pred@3 {e['tau_pred@3']:.3f} @7 {e['tau_pred@7']} acc_1 {e['acc_1']:.3f} "
              f"({e['train_tokens']} tokens, {e['cpu_s']:.0f} CPU s)", flush=True)
    write_text_atomic(ROOT / args.out / "results.md", table(list(results.values()), args.chain))
    return list(results.values())


if __name__ == "__main__":
    main()
