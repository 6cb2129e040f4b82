"""Peak memory and tokens/s of one training step as sequences and vocabularies grow (a benchmark, not a test).

    python eval/memory_bench.py                                     # the default grid below, one thread
    python eval/memory_bench.py --families eagle3 --seq 512,2048,8192 --vocab 32000 --ttt 3,7 --json mem.json
    python eval/memory_bench.py --estimate-only --seq 32768 --vocab 128000   # the estimate alone, in seconds
    python eval/memory_bench.py --families eagle3 --ttt 7 --vocab-memory table,recompute   # EAGLE-3's two modes

Each setting is one optimizer step of the family's real objective (drafters.training.scale.measure_step: the
family's tiny recipe with the setting's overrides, the frozen target's forward, the drafter's loss, backward,
the optimizer) on a random-weight Llama of a narrow width (--hidden, 8 layers), so that activations and logits,
not weights, fill memory. Every setting runs in its own child process, and its peak is that process's maximum
resident set (getrusage), so one setting's allocations never count in another's:

    rss_before   resident GB after the target and drafter are built, before the step
    peak         the process's maximum resident GB (the build included)
    step         peak - rss_before: what the step itself added
    estimate     drafters.training.memory's estimate of the step (what fit checks against free memory before the
                 first step), to compare with `step`
    dense        what the dense tensors the step avoids would take, for scale: the (T, V) float32 logits of a
                 whole sequence, and EAGLE-3's (T, kT) float32 training-time-test mask (k = TTT steps)

The target's vocabulary is --vocab and so is the draft vocabulary (EAGLE-3, DSpark, P-EAGLE: draft_vocab_size;
DFlash drafts over it). --vocab-memory steps EAGLE-3 with each of its recipe's vocab_memory modes (table: the label
table and each TTT step's head gradient kept; recompute: both recomputed in backward, flat in V). Settings whose
child fails (out of memory, a crash) are reported with the reason.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("eagle3", "dflash", "dspark", "peagle")
LAYERS = 8  # the random target's depth: EAGLE-3's default aux layers [2, 4, 5] need at least 6


def family_overrides(family: str, ttt: int, vocab_memory: str = "table") -> tuple[str, ...]:
    """The setting's recipe overrides: the TTT depth and vocab_memory where the family has them (EAGLE-3), DFlash's
    block shape."""
    if family == "eagle3":
        return (f"eagle3.ttt_steps={ttt}", f"eagle3.vocab_memory={vocab_memory}")
    if family in ("dflash", "dspark"):
        return ("dflash.block_size=8", "dflash.num_layers=1", "dflash.anchors=64")
    return ()


def spec_overrides(spec: dict) -> tuple[str, ...]:
    return family_overrides(spec["family"], spec["ttt"], spec.get("vocab_memory", "table"))


def narrow_target(spec: dict, device):
    import torch

    from drafters.training.scale import SHAPES, random_target

    shape = {**SHAPES["tiny"], "hidden_size": spec["hidden"], "intermediate_size": 2 * spec["hidden"],
             "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": spec["hidden"] // 4, "max_position_embeddings": max(4096, spec["seq"])}
    return random_target(shape, dtype=torch.bfloat16, device=device, vocab_size=spec["vocab"])


def child(spec: dict) -> dict:
    """One setting in this process -> its measurements (called with --child)."""
    import torch

    from drafters.training.scale import StepSetting, measure_step

    torch.set_num_threads(spec["threads"])
    target = narrow_target(spec, torch.device("cpu"))
    setting = StepSetting(spec["family"], spec["seq"], spec_overrides(spec), draft_vocab=spec["vocab"])
    before = rss_gb()
    result = measure_step(setting, target, steps=1, warmup=0, count=False)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    return {"status": result.status, "detail": result.detail, "tokens_per_s": result.tokens_per_s,
            "rss_before_gb": before, "peak_gb": peak, "step_gb": peak - before,
            "estimate_gb": result.estimate_gb, "drafter_params_m": result.drafter_params_m}


def estimate_only(spec: dict) -> dict:
    """The setting's drafters.training.memory estimate, from the built drafter, without running the step."""
    import torch

    from drafters.training.families import TRAINING_FAMILIES
    from drafters.training.memory import estimate_step
    from drafters.training.scale import StepSetting, build_step, recipe_for

    shape = TRAINING_FAMILIES[spec["family"]].memory_shape
    if shape is None:
        return {"status": "not estimated"}
    target = narrow_target(spec, torch.device("cpu"))  # random weights, built in a second
    setting = StepSetting(spec["family"], spec["seq"], spec_overrides(spec), draft_vocab=spec["vocab"])
    objective, _, _ = build_step(setting, target)
    recipe = recipe_for(setting, target.vocab_size)
    estimate = estimate_step(shape(recipe, objective.drafter), recipe, target, objective.drafter, online=True)
    return {"status": "ok", "estimate_gb": estimate.total / 2**30, "parts": estimate.describe()}


def rss_gb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def run_setting(spec: dict, timeout: float) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"])}
    try:
        done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": f"timed out after {timeout:.0f} s"}
    if done.returncode != 0:
        reason = "killed (out of memory?)" if done.returncode < 0 else f"exit {done.returncode}"
        return {"status": reason, "detail": done.stderr.strip().splitlines()[-1:] or ""}
    return json.loads(done.stdout.strip().splitlines()[-1])


def dense_gb(spec: dict) -> str:
    seq, vocab, steps = spec["seq"], spec["vocab"], spec["ttt"] if spec["family"] == "eagle3" else 1
    logits = seq * vocab * 4 / 2**30
    mask = seq * steps * seq * 4 / 2**30
    return f"{logits:.2f} / {mask:.2f}" if spec["family"] == "eagle3" else f"{logits:.2f} / -"


def table(rows: list[dict]) -> str:
    lines = ["| family | T | V | TTT | vocab_memory | status | tok/s | rss_before GB | peak GB | step GB | "
             "estimate GB | dense (T,V) / (T,kT) GB |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ok = r["status"] == "ok"
        number = (lambda key, f: format(r[key], f) if ok and r.get(key) is not None else "-")
        eagle3 = r["family"] == "eagle3"
        mode = r.get("vocab_memory", "table") if eagle3 else "-"
        lines.append(f"| {r['family']} | {r['seq']} | {r['vocab']} | {r['ttt'] if eagle3 else '-'} | {mode} "
                     f"| {r['status']} | {number('tokens_per_s', '.0f')} | {number('rss_before_gb', '.2f')} | "
                     f"{number('peak_gb', '.2f')} | {number('step_gb', '.2f')} | {number('estimate_gb', '.2f')} | "
                     f"{dense_gb(r)} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default="eagle3,dflash,dspark,peagle")
    p.add_argument("--seq", default="512,2048,8192", help="sequence lengths T (comma-separated)")
    p.add_argument("--vocab", default="32000,128000", help="vocabularies V (comma-separated)")
    p.add_argument("--ttt", default="3,7", help="EAGLE-3's training-time-test depths (others ignore it)")
    p.add_argument("--vocab-memory", default="table",
                   help="EAGLE-3's vocab_memory modes to step (comma-separated: table, recompute)")
    p.add_argument("--hidden", type=int, default=256, help="the random target's width (default 256)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=float, default=900, help="seconds per setting before it is reported as such")
    p.add_argument("--estimate-only", action="store_true",
                   help="print drafters.training.memory's estimate of each setting without running it (seconds)")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return []
    families = args.families.split(",")
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise SystemExit(f"--families: {unknown} are not families this bench steps; choose from {', '.join(FAMILIES)}")
    try:
        seqs, vocabs, ttts = ([int(x) for x in getattr(args, k).split(",")] for k in ("seq", "vocab", "ttt"))
    except ValueError as err:
        raise SystemExit(f"--seq, --vocab and --ttt take comma-separated integers ({err})") from None
    modes = args.vocab_memory.split(",")
    if not set(modes) <= {"table", "recompute"}:
        raise SystemExit(f"--vocab-memory {args.vocab_memory}: use table, recompute or both, comma-separated")
    rows = []
    for family in families:
        for seq in seqs:
            for vocab in vocabs:
                for ttt in (ttts if family == "eagle3" else ttts[:1]):
                    for mode in (modes if family == "eagle3" else ["table"]):
                        spec = {"family": family, "seq": seq, "vocab": vocab, "ttt": ttt, "hidden": args.hidden,
                                "threads": args.threads, "vocab_memory": mode}
                        rows.append({**spec, **(estimate_only(spec) if args.estimate_only else
                                                run_setting(spec, args.timeout))})
                        print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
