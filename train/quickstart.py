"""The main job on the embedded default, end to end on a CPU machine:

    python train/quickstart.py [--out outputs/quickstart] [--shipped-rows 1000] [--questions 3] [--max-new-tokens 128]

1. regenerate: SmolLM2-135M-Instruct answers the project's own 320 prompts
   (recipes/regenerate_quickstart.yaml; resumable): through a llama-server it starts on the target's shipped
   GGUF when the llama.cpp build is there (.ci/setup makes it), else in-process with `generate`;
2. train: an EAGLE-3 drafter, one pass over those conversations plus --shipped-rows of the target's answers
   the repository ships (recipes/data/smollm2_general.jsonl, spread evenly over it; recipes/eagle3_quickstart.yaml,
   about 25 minutes on one core);
3. export: SGLang and vLLM formats, each reloaded and checked by the independent reader;
4. measure: tau and speedup over plain `generate` on the first MT-bench questions, for the
   EAGLE-3 drafter (EAGLE-2 dynamic tree) next to the untrained baseline (prompt lookup);
5. serve it with llama.cpp (eval/llama_cpp.py; needs the build .ci/setup makes): the drafter exported as GGUF
   and served next to the target's F32 GGUF, plain decoding and llama.cpp's ngram-simple, on the same prompts;
   llama.cpp's own tokens/s, speedup and acceptance, and its accepted count next to our decoder's on the same ids.

Each step is the project's own entry script run as a subprocess, so this file is only the
sequence; run any step alone with the command it prints. Steps whose output already exists are
skipped, so re-running after an interruption continues where it stopped.
"""

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from drafters.engines import llama_cpp

ROOT = Path(__file__).resolve().parents[1]
TARGET = "smollm2-135m-instruct"
# A CPU-sized tree: verifying costs grow with the node count on a CPU (61 nodes cost about 3x a
# one-token forward of SmolLM2 here); the EAGLE-2 evaluation default is total=60,depth=6,topk=10.
EAGLE_TREE = "dynamic:total=10,depth=4,topk=3"
BASELINE_TREE = "chain:4"
SHIPPED = ROOT / "recipes" / "data" / "smollm2_general.jsonl"  # the target's own answers to the general prompts


def step(title: str, args: list[str]) -> None:
    command = [sys.executable, *args]
    print(f"\n== {title}\n$ {shlex.join(['python', *args])}", flush=True)
    start = time.monotonic()
    with subprocess.Popen(command, cwd=ROOT) as child:
        try:
            code = child.wait()
        except KeyboardInterrupt:  # the step got the same Ctrl-C: let it save its state and stop
            code = child.wait()
    if code != 0:
        raise SystemExit(f"{title}: exited with status {code}; re-run train/quickstart.py to continue where it stopped")
    print(f"== {title}: done in {time.monotonic() - start:.0f} s", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="outputs/quickstart", help="everything is written under this directory")
    p.add_argument("--shipped-rows", type=int, default=1000,
                   help="how many of the shipped answers (recipes/data/smollm2_general.jsonl) train beside the "
                        "regenerated ones (0: the regenerated ones alone)")
    p.add_argument("--questions", type=int, default=3, help="MT-bench questions (2 turns each) to measure on")
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.shipped_rows < 0:
        p.error(f"--shipped-rows {args.shipped_rows} must be >= 0 (0 trains on the regenerated answers alone)")
    regenerated, mixed, run_dir = out / "regenerated.jsonl", out / "train.jsonl", out / "eagle3"
    checkpoint = run_dir / "checkpoint-final"

    step("1/5 regenerate the training conversations with the target",
         ["train/regenerate.py", "recipes/regenerate_quickstart.yaml", f"output={regenerated}"])
    if not (ROOT / checkpoint).is_dir():
        mix(ROOT / regenerated, SHIPPED, args.shipped_rows, ROOT / mixed)
        step("2/5 train the EAGLE-3 drafter",
             ["train/train.py", "recipes/eagle3_quickstart.yaml", f"data.path={mixed}", f"output_dir={run_dir}",
              "resume_from=latest"])  # an interrupted run continues from the checkpoint its Ctrl-C saved
    for fmt in ("sglang", "vllm"):
        step(f"3/5 export ({fmt}) and validate",
             ["eval/export.py", str(checkpoint), "--format", fmt, "--out", str(out / f"export-{fmt}"),
              "--target", TARGET, "--overwrite"])
    results = {}
    for name, proposer, tree in (("EAGLE-3", str(checkpoint), EAGLE_TREE),
                                 ("prompt lookup", "prompt-lookup", BASELINE_TREE)):
        report = out / f"tau-{name.replace(' ', '-').lower()}.json"
        step(f"4/5 tau and speedup: {name}",
             ["eval/tau.py", "--target", TARGET, "--proposer", proposer, "--tree", tree, "--bench", "mt_bench",
              "--temperature", "0", "--limit", str(args.questions), "--max-new-tokens", str(args.max_new_tokens),
              "--json", str(report)])
        results[name] = (tree, json.loads((ROOT / report).read_text()))
    engine = out / "llama-cpp.json"
    if llama_cpp.available():
        step("5/5 serve it with llama.cpp (F32 target, chain of 3): speed and acceptance as llama.cpp counts them",
             ["eval/llama_cpp.py", "--target", TARGET, "--weights", "f32", "--drafter", f"{checkpoint}@3",
              "--ngram", "ngram-simple", "--limit", str(args.questions), "--max-new-tokens", str(args.max_new_tokens),
              "--repeats", "2", "--exports", str(out / "llama.cpp"), "--json", str(engine)])
    else:
        print(f"\n== 5/5 skipped: no llama.cpp build ({llama_cpp.BUILD_COMMAND} makes one; .ci/setup runs it)")
    print_summary(results, args.questions)
    if (ROOT / engine).is_file() and llama_cpp.available():
        print_engine_summary(json.loads((ROOT / engine).read_text()))


def mix(regenerated: Path, shipped: Path, rows: int, out: Path) -> None:
    """out = every regenerated conversation, then `rows` shipped ones spread evenly over their file (it is ordered by
    when prompts were answered, each batch a few categories, so its head would miss some). Both are the target's own
    greedy answers to the project's prompts, none from MT-bench; the loader buckets rows by length, so order is moot.
    Rewritten whole each time, so a changed --shipped-rows is never mixed with an older file."""
    from drafters.files import write_text_atomic

    own = [line for line in regenerated.read_text().splitlines() if line.strip()]
    available = [line for line in shipped.read_text().splitlines() if line.strip()]
    if rows > len(available):
        raise SystemExit(f"--shipped-rows {rows}: {shipped} holds {len(available)} rows; pass at most that")
    more = [available[i * len(available) // rows] for i in range(rows)]
    write_text_atomic(out, "\n".join(own + more) + "\n")
    print(f"\n== training data: {len(own)} regenerated + {len(more)} shipped conversations -> {out}", flush=True)


def print_summary(results: dict, questions: int) -> None:
    print(f"\n== {TARGET}, first {questions} MT-bench questions (both turns), temperature 0")
    print(f"{'proposer':<15} {'tree (draft nodes excl. root)':<36} {'tau':>6} {'speedup':>8} {'greedy == generate':>19}")
    for name, (tree, r) in results.items():
        budget = r["tree_budget"]["draft_nodes_excl_root"]
        check = r["greedy_check"]
        ok = f"{check['checked'] - check['mismatches']}/{check['checked']}"
        print(f"{name:<15} {f'{tree} ({budget})':<36} {r['tau']:>6.2f} {r['speedup']:>7.2f}x {ok:>19}")


def print_engine_summary(r: dict) -> None:
    print(f"\n== the same drafter in llama.cpp ({r['weights']} target GGUF, {r['prompts']} prompts, turn 1, "
          f"{r['threads']} thread, speed: median of {r['repeats']} A B runs)")
    print(f"{'mode':<30} {'tok/s':>7} {'speedup':>8} {'accepted/drafted':>17} {'tau':>5}")
    for row in r["rows"]:
        acc = "-" if row["acceptance"] is None else f"{row['accepted']}/{row['drafted']}"
        print(f"{row['mode']:<30} {row['tokens_per_s']:>7.1f} {row['speedup']:>7.2f}x {acc:>17} {row['tau']:>5.2f}")
    for name, ref in r["referee"].items():
        if "skipped" not in ref:
            print(f"same ids, exact float32, {name}: accepted by our decoder {ref['ours_accepted']}, by llama.cpp "
                  f"{ref['engine_accepted']}, over {ref['shared_tokens']} tokens of shared greedy text "
                  f"({ref['identical_text']}/{ref['prompts']} prompts with identical text)")


if __name__ == "__main__":
    main()
