"""Side-by-side comparison of drafter families on one target, as a report with plots.

    python eval/compare.py --target smollm2-135m-instruct \
        --drafters runs/eagle3/checkpoint-final runs/medusa/checkpoint-final \
        --baselines prompt-lookup --bench mt_bench,humaneval --temperature 0,1 \
        --tree dynamic:total=60,depth=6,topk=10 --sweep chain:3 --sweep dynamic:total=20,depth=5,topk=4 \
        --out report/

Every drafter is evaluated by the same decoder (eval/tau.py, in this process) on the same prompts:
one run per drafter x bench x temperature at `--tree`, plus, at the first bench and temperature,
one run per `--sweep` tree for the speedup-vs-budget plot. Each run's JSON lands in
out/runs/ and is reused when the command is repeated with the same target and settings and the
drafter's files are unchanged (sha256): an interrupted comparison resumes; delete a JSON to redo it.
Training budgets and curves are read from each checkpoint's drafter.json and the metrics.jsonl of
its run directory. The report is
out/index.md with PNG plots beside it (drafters.decode.report).

A drafter trained by another tool is compared as its exported directory (config.json: SpecForge and
the EAGLE repository write the SGLang layout, speculators the vLLM one, Medusa its own), read by the
same readers as ours; its row label names the tool: `TOOL=DIR` (e.g. `SpecForge=runs/sf/epoch_9`),
else what the files tell (our exports carry a marker, the vLLM layout is speculators'), else the
layout only. `DIR:aux_layers=A,B,C` gives the HF hidden_states indices an EAGLE-3 directory without
layer ids drafts from (default: the serving engine's, which the report's settings state).

Refused with a clear error, before anything runs: a drafter directory that is not a checkpoint,
drafters trained for different targets, or for another target than --target. A drafter trained on a model of
--target's shape with other weights (its checkpoint's weights fingerprint differs) is measured, with a warning at the
top of index.md.
"""

import argparse
import json
import re
import sys
from pathlib import Path

from drafters.checkpoint import (CONFIG_FILE, OTHER_WEIGHTS_TAU, TARGET_FIELDS, CheckpointError, target_info,
                                 weights_differ)
from drafters.decode.evaluate import Options, measure  # what eval/tau.py runs, in this process
from drafters.decode.proposers.loading import CHECKPOINT_LOADERS, load_proposer, proposer_sha256, split_drafter_spec
from drafters.decode.report import Entry, render
from drafters.decode.tree import parse_tree_spec
from drafters.errors import UserError
from drafters.export.common import MARKER
from drafters.export.reading import ExportCheckError
from drafters.files import check_writable
from drafters.targets import load_target


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True, help="short name, HF directory, .gguf file or Hub id")
    p.add_argument("--drafters", nargs="*", default=[],
                   help="trained checkpoint directories, or exported ones (ours or another tool's: TOOL=DIR names "
                        "the tool in the row label, DIR:aux_layers=A,B,C sets the HF layer indices of an EAGLE-3 "
                        "directory that records none); DIR@TREE evaluates that one at its own tree spec (e.g. a "
                        "Medusa checkpoint's calibrated static:DIR/tree.json); a directory may repeat")
    p.add_argument("--baselines", default="", help="comma-separated untrained proposers, e.g. prompt-lookup")
    p.add_argument("--bench", default="mt_bench", help="comma-separated: mt_bench, humaneval or JSONL paths")
    p.add_argument("--temperature", default="0", help="comma-separated temperatures")
    p.add_argument("--tree", default="dynamic:total=60,depth=6,topk=10", help="tree spec of the main runs")
    p.add_argument("--sweep", action="append", default=[], help="tree spec for the speedup-vs-budget plot "
                                                                  "(repeat the option)")
    p.add_argument("--limit", type=int, default=None, help="first N items of each bench")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-turns", type=int, default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-speed", action="store_true", help="skip generate in the main runs (tau only)")
    p.add_argument("--engine", action="append", default=[],
                   help="an eval/llama_cpp.py --json report: its rows, measured by llama.cpp itself, join the report "
                        "(repeat the option; the target must be --target's)")
    p.add_argument("--out", required=True, help="report directory")
    args = p.parse_args(argv)
    args.benches = [b for b in args.bench.split(",") if b]
    args.baseline_specs = [b for b in args.baselines.split(",") if b]
    try:
        args.temperatures = [float(t) for t in args.temperature.split(",") if t]
    except ValueError:
        p.error(f"--temperature {args.temperature!r}: expected comma-separated numbers, e.g. 0,1")
    if not args.drafters and not args.baseline_specs and not args.engine:
        p.error("nothing to compare: give --drafters and/or --baselines")
    if args.no_speed and (len(args.temperatures) > 1 or args.temperatures[0] > 0):
        p.error("--no-speed works at temperature 0 only")
    return args


class BrokenDrafter(Exception):
    """A drafter whose files cannot be used (corrupt, truncated, non-finite): a failed row, not an abort."""


def main(argv=None) -> Path:
    args = parse_args(argv)
    try:
        check_writable(args.out, "--out", directory=True)  # before any drafter is measured
    except UserError as error:
        raise SystemExit(f"compare: {error}") from None
    entries, failed = [], []
    for spec in args.drafters:
        try:
            entries.append(checkpoint_entry(*spec.partition("@")[::2]))
        except BrokenDrafter as error:
            failed.append((spec, str(error)))
    target = load_target(args.target)
    args.target_name = target.name  # as eval/tau.py records it
    check_same_target(entries, target, args.target)
    entries += [Entry(label=spec, family="baseline", source=spec) for spec in args.baseline_specs]
    unique_labels(entries)
    failed += check_trees(entries, target, args)
    entries = [e for e in entries if e.label not in {label for label, _ in failed}]
    warnings = other_weights_warnings(entries, target)  # at the top of the report, not on the console only
    out = Path(args.out)
    for entry in entries:
        for bench in args.benches:
            for temperature in args.temperatures:
                entry.runs.append(evaluate(entry, args, bench, temperature, entry.tree or args.tree, out,
                                           speed=not args.no_speed))
        for spec in args.sweep:
            entry.sweep.append(evaluate(entry, args, args.benches[0], args.temperatures[0], spec, out, speed=True))
    settings = [*warnings, f"target: `{args.target}`", f"benches: {', '.join(args.benches)}"
                + (f" (first {args.limit} items)" if args.limit else ""),
                f"max_new_tokens {args.max_new_tokens}" + (f", first {args.max_turns} turn(s)" if args.max_turns else ""),
                f"main tree: `{args.tree}`", "tau = mean over rounds of accepted draft tokens + 1 (bonus)",
                "speedup = speculative tokens/s over plain `generate` tokens/s, same process, batch 1"]
    settings += [f"{entry.label}: {note}" for entry in entries  # defaults applied to another tool's files
                 for note in dict.fromkeys(n for r in entry.runs for n in r.get("proposer_notes", []))]
    engines = [read_engine_report(path, target.name) for path in args.engine]
    if not entries:  # engine rows only: none of our decoder's settings apply
        settings = [f"target: `{args.target}`"]
    index = render(entries, out, title=f"Drafters compared on {args.target}", settings=settings, engines=engines,
                   failed=failed)
    print(f"compare: wrote {index}")
    if failed:
        for label, reason in failed:
            print(f"compare: not measured: {label}: {reason}", file=sys.stderr)
        raise SystemExit(f"compare: {len(failed)} of {len(args.drafters)} drafters could not be measured (the report "
                         "lists them with the reason); the others are in the report")
    return index


def read_engine_report(path: str, target_name: str) -> dict:
    try:
        report = json.loads(Path(path).read_text())
        report["rows"]  # a report of eval/llama_cpp.py has its rows; read below by the report writer
        target = report["target"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise SystemExit(f"--engine {path}: not a report of eval/llama_cpp.py --json ({err})") from None
    if target != target_name:
        raise SystemExit(f"--engine {path} was measured on {target!r}, not on --target {target_name!r}")
    return report


def checkpoint_entry(directory: str, tree: str = "") -> Entry:
    tool, spec = split_tool(directory)
    try:
        path, _ = split_drafter_spec(spec)
    except ValueError as error:
        raise SystemExit(f"compare: {error}") from None
    meta_path = path / CONFIG_FILE
    if not meta_path.is_file():
        if (path / "config.json").is_file():
            return export_entry(path, spec, tree, tool)
        raise SystemExit(f"compare: {path} is not a drafter checkpoint (no {CONFIG_FILE}) nor an exported drafter "
                         "(no config.json); pass the checkpoint-final directory a training run wrote, or the "
                         "directory another tool saved")
    try:
        meta = json.loads(meta_path.read_text())
        meta["family"]
    except (ValueError, KeyError, TypeError) as error:
        raise BrokenDrafter(f"{meta_path}: not a readable drafter record ({error!r}); the checkpoint is corrupt: "
                            "use another checkpoint of the run or retrain") from None
    run_dir = path.parent
    name = run_dir.name if path.name.startswith("checkpoint") else path.name
    extra = meta.get("extra", {})
    metrics = read_metrics(run_dir / "metrics.jsonl")
    training = {"steps": extra.get("step", 0), "tokens": extra.get("tokens", 0),
                "wall_s": metrics[-1].get("elapsed_s") if metrics else None}
    kind, _, arg = tree.partition(":")
    shown = f"{kind}:{Path(arg).name}" if kind == "static" and "/" in arg else tree  # static:DIR/tree.json
    label = f"{meta['family']}:{name}" + (f" ({tool})" if tool else "") + (f" @{shown}" if tree else "")
    return Entry(label=label, family=meta["family"], source=spec, metrics=metrics, training=training,
                 target=meta.get("target", {}), tree=tree or None)


LAYOUTS = {"sglang-eagle3": ("eagle3", "SGLang layout"), "vllm-eagle3": ("eagle3", "vLLM layout"),
           "medusa": ("medusa", "Medusa layout"), "eagle1": ("eagle1", "EAGLE-1 layout")}


def split_tool(spec: str) -> tuple[str | None, str]:
    """TOOL=DIR... -> (TOOL, DIR...); a spec whose path is a directory, or whose part before '=' looks like
    a path or holds options, has no tool."""
    tool, eq, rest = spec.partition("=")
    if not eq or not tool or any(c in tool for c in "/:@") or Path(spec.partition(":")[0]).exists():
        return None, spec
    return tool, rest


def export_entry(path: Path, spec: str, tree: str, tool: str | None) -> Entry:
    """An exported directory (ours or another tool's): no training record; its label names the tool that
    made it: TOOL=DIR, else our export marker, else speculators for the vLLM layout, else the layout."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise SystemExit(f"compare: {path / 'config.json'}: not readable JSON ({error})") from None
    layout = next((name for name, (detect, _) in CHECKPOINT_LOADERS.items() if detect(config)), None)
    if layout is None:
        raise SystemExit(f"compare: {path}: config.json is no exported drafter layout this project reads "
                         f"({', '.join(LAYOUTS)})")
    family, layout_name = LAYOUTS[layout]
    if tool is None and (path / MARKER).is_file():
        tool = "drafters"  # written by eval/export.py
    elif tool is None and layout == "vllm-eagle3":
        tool = "speculators"
    made_by = f"{tool}, {layout_name}" if tool else f"{layout_name}, trainer not named (TOOL=DIR)"
    kind, _, arg = tree.partition(":")
    shown = f"{kind}:{Path(arg).name}" if kind == "static" and "/" in arg else tree
    label = f"{family}:{path.name} ({made_by})" + (f" @{shown}" if tree else "")
    return Entry(label=label, family=family, source=spec, training={"note": "not recorded (trained elsewhere)"},
                 target={}, tree=tree or None)


def read_metrics(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                print(f"compare: {path}:{number}: not JSON, skipped", file=sys.stderr)
    return rows


def check_same_target(entries: list[Entry], target, target_name: str) -> None:
    # exported directories record only part of it: load_proposer checks them against --target (check_trees)
    entries = [e for e in entries if e.target]
    if not entries:
        return
    fields = ("name", *TARGET_FIELDS)
    first = entries[0]
    for entry in entries[1:]:
        differ = [f"{k} {first.target.get(k)!r} vs {entry.target.get(k)!r}" for k in fields
                  if first.target.get(k) != entry.target.get(k)]
        if differ:
            raise SystemExit(f"compare: {first.source} and {entry.source} were trained for different targets ("
                             + "; ".join(differ) + "): a comparison needs one target")
    have = target_info(target)
    differ = [f"{k}: drafters {first.target.get(k)!r} vs --target {have[k]!r}" for k in TARGET_FIELDS
              if first.target.get(k) != have[k]]
    if differ:
        raise SystemExit(f"compare: the drafters were trained for {first.target.get('name')!r}, not --target "
                         f"{target_name!r}: " + "; ".join(differ))


def other_weights_warnings(entries: list[Entry], target) -> list[str]:
    """A line for each drafter trained on a model of --target's shape with other weights (the weights fingerprint its
    checkpoint records differs: another fine-tune, a merged LoRA): measured, but its tau is not its own target's."""
    have = target_info(target)
    return [f"**warning**: {e.label} {message}; {OTHER_WEIGHTS_TAU}" for e in entries
            if e.target and (message := weights_differ(e.target, have))]


def check_trees(entries: list[Entry], target, args) -> list[tuple[str, str]]:
    """Every drafter must be able to draft every tree it will be asked for (e.g. a 4-head Medusa
    cannot draft depth 5): refused here, before hours of evaluation, not in the middle of them. A drafter whose
    files are broken (truncated, corrupt, non-finite weights) -> (label, reason): a failed row."""
    failed = []
    for entry in entries:
        for tree in dict.fromkeys([entry.tree or args.tree, *args.sweep]):
            try:
                load_proposer(entry.source, target, parse_tree_spec(tree))
            except (CheckpointError, ExportCheckError) as error:
                failed.append((entry.label, str(error)))
                break
            except (ValueError, FileNotFoundError) as error:
                raise SystemExit(f"compare: {entry.label} cannot run tree {tree!r}: {error}. Give it a tree "
                                 f"it can draft with {entry.source}@TREE, or change --tree / --sweep") from None
    return failed


def unique_labels(entries: list[Entry]) -> None:
    seen: dict[str, int] = {}
    for entry in entries:
        count = seen[entry.label] = seen.get(entry.label, 0) + 1
        if count > 1:
            entry.label = f"{entry.label}#{count}"


def evaluate(entry: Entry, args, bench: str, temperature: float, tree: str, out: Path, *, speed: bool) -> dict:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{entry.label}-{Path(bench).stem}-t{temperature:g}-{tree}")
    path = out / "runs" / f"{slug}.json"
    options = Options(target=args.target, proposer=entry.source, bench=bench, tree=tree, temperature=temperature,
                      max_new_tokens=args.max_new_tokens, json=str(path), limit=args.limit or None,
                      max_turns=args.max_turns or None, threads=args.threads or None, no_baseline=not speed)
    if path.is_file():
        cached = json.loads(path.read_text())
        # the drafter's files, not only its path: a retrained checkpoint at the same path is run again
        wanted = {"target": args.target_name, "proposer": entry.source, "proposer_sha256": proposer_sha256(entry.source),
                  "bench": bench, "tree": tree, "max_new_tokens": args.max_new_tokens, "max_turns": args.max_turns,
                  "limit": args.limit}
        if all(cached.get(k) == v for k, v in wanted.items()) and cached["sampling"]["temperature"] == temperature \
                and cached.get("no_baseline") == (not speed):
            print(f"compare: reusing {path}")
            return cached
    print(f"compare: {entry.label} on {bench}, temperature {temperature:g}, tree {tree}")
    try:
        return measure(options)
    except UserError as error:
        raise SystemExit(f"compare: {entry.label}: {error}") from None


if __name__ == "__main__":
    main()
