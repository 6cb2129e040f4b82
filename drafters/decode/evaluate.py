"""Mean accepted length (tau) and speedup of a proposer against plain `generate` on one target.

    python eval/tau.py --target smollm2-135m-instruct --proposer prompt-lookup --bench mt_bench \
        --temperature 0 --tree chain:4 --limit 5 --max-new-tokens 128 --json out.json

Both methods run in this process on the same prompts, batch 1, with the same sampling settings,
max_new_tokens and stop tokens: first `model.generate` (the baseline), then
`speculative_generate` with the proposer. Multi-turn items (MT-bench) ask turn 2 after the
baseline's own turn-1 answer, so both methods always see identical prompts. At temperature 0 the
two outputs must be equal token for token; a mismatch is a decoder bug: it is reported loudly and
the script exits non-zero (after writing the complete JSON).

Reported (and written atomically as JSON with --json):
  tau          mean over rounds of accepted draft tokens + 1 (bonus); rounds = target forwards
               after the prefill; the tree budget is stated with and without the root
  acceptance   per depth d: rounds that accepted depth d / rounds that drafted depth d
  draft vocab  for a drafter with a reduced draft vocabulary (EAGLE-3, DFlash, DSpark, P-EAGLE): the share of
               the answers' tokens the vocabulary holds. The others can never be drafted, so the share caps
               every depth's acceptance; a vocabulary chosen to cover 95% of the training text can hold far
               less of another text's tokens
  speed        tokens/s of both methods (prefill included), speedup, mean draft / verify /
               bookkeeping time per round
  model        expected speedup (1 - a^(k+1)) / ((1 - a)(c k + 1)) beside the measured one, with
               k = mean drafted depth per round, a = the per-token acceptance that gives the
               measured tau for a chain of k, i.e. the root of tau = (1 - a^(k+1)) / (1 - a)
               (chosen over averaging per-depth rates because it reproduces tau exactly; the mean
               per-depth rate is reported too), and c = (draft time per round / k) / (baseline
               time per generated token), the draft cost per token in target forwards
`--tree auto` first measures this machine's costs and the proposer's acceptance and runs the tree
with the most predicted tokens/s, or stops when plain generate wins (drafters.decode.autotree).
A prompt whose tokens + max_new_tokens + tree depth exceed the target's context is a counted
skip (with the rest of that item's turns), not an error.

Large benches on a GPU: `--shard I/N` evaluates bench items I, I+N, I+2N, ... so N processes can
share one device; `--merge A.json B.json ... --json all.json` combines their reports (the raw
per-round counts travel in each JSON, so the merged tau and per-depth acceptance are exact, not
averages of averages). It refuses anything but every shard I/N of one run exactly once: a repeated
or missing shard, shards of different N, or of different settings (target, proposer and the
sha256 of its files, bench, tree, sampling, limits). `--no-baseline` (temperature 0 only) skips `generate`: turn 2 then follows
the speculative turn-1 answer, which is the same text whenever the decoder is lossless, and no
speed or greedy check is reported; use it for tau sweeps, and measure speed without it.
"""

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from drafters.acceptance import geometric_chain_tau, position_acceptance
from drafters.decode import autotree
from drafters.decode.benches import BenchItem, load_bench, render_prompt
from drafters.decode.cache import has_recurrent_layers
from drafters.decode.decoder import RoundStats, speculative_generate
from drafters.decode.proposers.adaptive import AdaptiveChain
from drafters.decode.proposers.loading import load_proposer, proposer_sha256
from drafters.decode.sampling import SamplingConfig
from drafters.decode.tree import ChainSpec, parse_tree_spec
from drafters.errors import UserError
from drafters.files import check_writable, write_text_atomic
from drafters.targets import load_target


class EvaluationError(UserError):
    """A measurement that cannot run as asked (bad options, a prompt set nothing fits, a proposer that cannot run
    the tree), or a greedy output that differs from generate (a decoder bug, after the report is written)."""


@dataclass
class Options:
    """What one measurement runs: eval/tau.py's command line, field for field (its --help documents them)."""
    target: str
    proposer: str
    bench: str
    tree: str = "chain:4"  # chain:K | static:... | dynamic:total=,depth=,topk= | auto
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    limit: int | None = None
    max_new_tokens: int = 256
    max_turns: int | None = None
    threads: int | None = None
    dtype: str = "float32"
    adaptive: bool = False
    json: str | None = None
    device: str = "auto"
    shard: str | None = None
    no_baseline: bool = False
    # --tree auto (drafters.decode.autotree)
    auto_prompts: int = 2
    auto_acceptance: str = "calibration"
    auto_probe_tokens: int = 32
    auto_candidates: list[str] = field(default_factory=lambda: list(autotree.CANDIDATES))
    speculate_anyway: bool = False
    tree_auto: dict | None = field(default=None, init=False)  # set by --tree auto: what it measured and chose


@dataclass(frozen=True)
class Settings:
    """What one evaluation ran with, as its report states it. The shards of one run share all of it
    but `shard` and `device` (SAME_RUN); --merge reads it back from a shard's report."""
    target: str  # the loaded target's name
    proposer: str
    proposer_sha256: str | None  # what was measured, not just its path (None for a named proposer)
    proposer_notes: tuple[str, ...]  # how the drafter's files were read where they leave something out
    bench: str
    tree: str  # the spec as given
    temperature: float
    top_k: int
    top_p: float
    seed: int
    max_new_tokens: int
    max_turns: int | None
    limit: int | None
    adaptive: bool
    no_baseline: bool
    shard: str | None  # "I/N", None, or "merged N"
    device: str

    @staticmethod
    def from_report(report: dict, shard: str | None) -> "Settings":
        sampling = report["sampling"]
        return Settings(
            target=report["target"], proposer=report["proposer"], proposer_sha256=report.get("proposer_sha256"),
            proposer_notes=tuple(report.get("proposer_notes", [])),
            bench=report["bench"], tree=report["tree"], temperature=sampling["temperature"],
            top_k=sampling["top_k"], top_p=sampling["top_p"], seed=sampling["seed"],
            max_new_tokens=report["max_new_tokens"], max_turns=report["max_turns"], limit=report["limit"],
            adaptive=report["adaptive"], no_baseline=report["no_baseline"], shard=shard, device=report["device"])


@dataclass
class Run:
    stats: RoundStats = field(default_factory=RoundStats)  # all rounds of all prompts
    base_tokens: int = 0
    base_s: float = 0.0
    spec_tokens: int = 0
    spec_s: float = 0.0
    prompts: list[dict] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    mismatches: list[dict] = field(default_factory=list)


def measure(args: Options) -> dict:
    """The measurement (the module docstring): the report, also written to args.json; EvaluationError for
    what cannot run as asked."""
    tree, sampling, items = check_inputs(args)  # fail fast, before any model is loaded
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        target = load_target(args.target, dtype=args.dtype)
        layout_notes = recurrent_layout(target, tree, args.tree)  # or refused in one sentence, before any baseline
        device_used = str(device(args.device))
        target.model.to(device_used)
        sha256 = proposer_sha256(args.proposer)  # what was measured, not just its path
        if tree is None:  # --tree auto: every candidate meets --tree's context check before any is timed
            for spec in args.auto_candidates:
                check_depth(f"--auto-candidates {spec}", parse_tree_spec(spec).depth, args.max_new_tokens, target)
            tree, auto = pick_tree(args, target, items, sampling)
            if tree is None:
                return auto
        proposer = load_proposer(args.proposer, target, tree)
        # how a drafter's files were read where they leave something out (e.g. another tool's EAGLE-3
        # directory without layer ids: the engine's default layers): said here, recorded in the JSON
        notes = layout_notes + tuple(getattr(proposer, "notes", []))
        for note in notes:
            print(f"note: {note}")
        settings = Settings(
            target=target.name, proposer=args.proposer, proposer_sha256=sha256, proposer_notes=notes,
            bench=args.bench, tree=args.tree, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            seed=args.seed, max_new_tokens=args.max_new_tokens, max_turns=args.max_turns, limit=args.limit,
            adaptive=args.adaptive, no_baseline=args.no_baseline, shard=args.shard, device=device_used)
        if args.adaptive:
            proposer = AdaptiveChain(proposer)
        if getattr(proposer, "greedy_only", False) and args.temperature > 0:
            raise ValueError(f"--proposer {args.proposer}: verifies greedily only; use --temperature 0")
    except (ValueError, FileNotFoundError, NotImplementedError) as error:
        raise EvaluationError(f"{error}") from None
    run = Run()
    depth = AdaptiveChain.max_depth if args.adaptive else tree.depth  # the deepest draft of any round
    check_depth(f"--tree {args.tree}", depth, args.max_new_tokens, target)
    bar = tqdm(items, unit="item", desc="tau", dynamic_ncols=True)  # on stderr: stdout keeps the report
    for index, item in bar:
        evaluate_item(target, proposer, item, index, settings, sampling, depth, run)
        bar.set_postfix_str(f"tau {run.stats.tau:.2f}, {run.spec_tokens} tokens")
    if not run.prompts:
        first = run.skipped[0]
        raise EvaluationError(f"every prompt was skipped: prompt + --max-new-tokens {args.max_new_tokens} + tree depth "
                         f"{depth} exceed the context of {target.name} ({target.max_position_embeddings} positions; "
                         f"the first prompt needed {first['needed_positions']}); lower --max-new-tokens, use "
                         "shorter prompts or a shallower tree")
    extra = {"tree_auto": args.tree_auto} if args.tree_auto else None
    report = report_and_write(run, settings, tree.budget, torch.get_num_threads(), args.json, extra)
    if run.mismatches:
        raise EvaluationError(f"{len(run.mismatches)} greedy outputs differ from generate (a bug): "
                         f"{run.mismatches}")
    return report


def recurrent_layout(target, tree, spec: str) -> tuple[str, ...]:
    # a target with recurrent layers verifies chains (drafters.decode.decoder's docstring): --tree auto, which
    # times tree shapes, is refused; a tree spec is verified as its first-child chain, said as a note
    if not has_recurrent_layers(target.model):
        return ()
    if tree is None:
        raise EvaluationError(f"--tree auto: {target.name} has recurrent layers, so every round verifies a chain and "
                              "there is no tree shape to pick; pass --tree chain:K")
    if isinstance(tree, ChainSpec):
        return ()
    return (f"{target.name} has recurrent layers: each round verifies the first-child chain of --tree {spec} "
            "(its top path), and a rejected draft rolls the layers' states back from a snapshot",)


def check_inputs(args):
    if not args.temperature >= 0:
        raise EvaluationError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if args.max_turns is not None and args.max_turns < 1:
        raise EvaluationError(f"--max-turns must be >= 1, got {args.max_turns}")
    if args.max_new_tokens < 1:
        raise EvaluationError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    for option, value in (("--auto-prompts", args.auto_prompts), ("--auto-probe-tokens", args.auto_probe_tokens)):
        if value < 1:  # 0 used to calibrate on every prompt, or to skip every candidate and then predict anyway
            raise EvaluationError(f"{option} must be >= 1, got {value}")
    args.tree_auto = None
    if args.json:
        check_writable(args.json, "--json", directory=False)  # before any model loads
    try:
        tree = None if args.tree == "auto" else parse_tree_spec(args.tree)
        for spec in args.auto_candidates if tree is None else []:
            parse_tree_spec(spec)  # --tree auto: a bad candidate fails before any model is loaded
        sampling = SamplingConfig(args.temperature, args.top_k, args.top_p, seed=args.seed)
        items = list(enumerate(load_bench(args.bench, limit=args.limit)))  # (bench index, item)
    except (ValueError, FileNotFoundError) as error:
        raise EvaluationError(f"{error}") from None
    if args.adaptive and not isinstance(tree, ChainSpec):  # (auto included: it picks the tree)
        raise EvaluationError(f"--adaptive needs a chain tree spec (chain:K), got {args.tree!r}")
    if args.no_baseline and args.temperature > 0:
        raise EvaluationError("--no-baseline needs --temperature 0 (sampled turn-2 prompts would differ)")
    if args.shard is not None:
        index, slash, count = args.shard.partition("/")
        if not (slash and index.isdigit() and count.isdigit() and int(index) < int(count)):
            raise EvaluationError(f"--shard {args.shard!r}: expected I/N with 0 <= I < N, e.g. 0/4")
        items = items[int(index)::int(count)]  # items keep their bench index, so their seeds too
    return tree, sampling, items


def check_depth(what: str, depth: int, max_new_tokens: int, target) -> None:
    # no prompt could fit: the tree's fault, said before anything runs
    if depth + max_new_tokens >= target.max_position_embeddings:
        raise EvaluationError(f"{what} drafts {depth} tokens deep: with --max-new-tokens {max_new_tokens} that needs "
                              f"{depth + max_new_tokens} positions beyond the prompt, and {target.name} has "
                              f"{target.max_position_embeddings}; use a shallower tree")


def pick_tree(args, target, items, sampling):
    # --tree auto: -> (the chosen TreeSpec, None), or (None, the report) when plain generate is
    # predicted fastest and --speculate-anyway was not given
    options = autotree.AutoTreeOptions(prompts=args.auto_prompts, acceptance=args.auto_acceptance,
                                       probe_tokens=args.auto_probe_tokens, candidates=tuple(args.auto_candidates))
    result = autotree.choose_tree(target, args.proposer, items, sampling, args.max_new_tokens, options,
                                  log=lambda line: print(line, file=sys.stderr))
    print(autotree.format_table(result))
    args.tree_auto = result.as_dict()
    chosen = result.best if result.best.spec != autotree.NO_SPECULATION else result.best_tree
    if result.best.spec == autotree.NO_SPECULATION and not args.speculate_anyway or chosen is None:
        print("tree auto: not measuring speculative decoding (plain generate is the answer here); "
              "--speculate-anyway measures the best tree anyway")
        report = {"target": target.name, "proposer": args.proposer, "bench": args.bench, "tree": "auto",
                  "speculated": False, "tree_auto": args.tree_auto}
        if args.json:
            write_json_atomic(Path(args.json), report)
        return None, report
    args.tree_auto["measured"] = chosen.spec
    args.tree = chosen.spec
    return parse_tree_spec(chosen.spec), None


def device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        chosen = torch.device(name)
    except RuntimeError:
        raise EvaluationError(f"--device {name!r}: expected auto, cpu or cuda[:N]") from None
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise EvaluationError("--device cuda but torch sees no CUDA device; use --device cpu")
    return chosen


def evaluate_item(target, proposer, item: BenchItem, index: int, settings: Settings, sampling: SamplingConfig,
                  depth: int, run: Run) -> None:
    # every turn of bench item `index` (up to max_turns) into `run`; depth: the deepest draft of a round
    history, max_new_tokens = [], settings.max_new_tokens
    for turn in range(min(len(item.turns), settings.max_turns or len(item.turns))):
        prompt = torch.tensor(render_prompt(target.tokenizer, item, history), dtype=torch.long)
        needed = prompt.numel() + max_new_tokens + depth
        if needed > target.max_position_embeddings:
            run.skipped.append({"id": item.id, "turn": turn + 1, "prompt_tokens": prompt.numel(),
                                "needed_positions": needed, "context": target.max_position_embeddings})
            return
        seed = settings.seed + 1000 * index + turn
        base, base_s = (None, 0.0) if settings.no_baseline else baseline(target, prompt, max_new_tokens,
                                                                          sampling, seed)
        spec, stats, spec_s = speculative(target, proposer, prompt, max_new_tokens, sampling, seed)
        record(run, item, turn, prompt, base, base_s, spec, stats, spec_s, sampling, draftable_ids(proposer))
        answer = target.tokenizer.decode((spec if base is None else base)[prompt.numel():].tolist(),
                                         skip_special_tokens=True)
        history += [{"role": "user", "content": item.turns[turn]},
                    {"role": "assistant", "content": answer}]


@torch.no_grad()
def baseline(target, prompt, max_new_tokens, sampling, seed):
    torch.manual_seed(seed)
    ids = prompt[None].to(target.device)  # (1, T)
    # explicit neutral values: nothing from the model's generation_config changes the baseline
    kwargs = dict(do_sample=False) if sampling.greedy else dict(
        do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k,
        top_p=sampling.top_p)
    start = time.perf_counter()
    out = target.model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, min_new_tokens=0,
        eos_token_id=sorted(target.eos_token_ids), pad_token_id=target.tokenizer.pad_token_id,
        repetition_penalty=1.0, no_repeat_ngram_size=0, **kwargs)
    return out[0].cpu(), time.perf_counter() - start


def speculative(target, proposer, prompt, max_new_tokens, sampling, seed):
    torch.manual_seed(seed)  # draft models sample their drafts from the global generator
    generator = torch.Generator(target.device).manual_seed(seed)  # the verifier's own
    start = time.perf_counter()
    out, stats = speculative_generate(target.model, proposer, prompt, max_new_tokens=max_new_tokens,
                                      sampling=sampling, eos_token_ids=target.eos_token_ids,
                                      generator=generator)
    return out.cpu(), stats, time.perf_counter() - start


def draftable_ids(proposer) -> torch.Tensor | None:
    """The target ids a proposer can draft (its draft vocabulary's `used`, (Vd,)), or None: any id."""
    proposer = getattr(proposer, "proposer", proposer)  # through AdaptiveChain
    used = getattr(proposer, "used", None)
    return None if used is None else used.cpu()


def record(run: Run, item, turn, prompt, base, base_s, spec, stats: RoundStats, spec_s, sampling,
           draftable: torch.Tensor | None = None):
    n = prompt.numel()
    run.base_tokens += 0 if base is None else base.numel() - n
    run.base_s += base_s
    run.spec_tokens += spec.numel() - n
    run.spec_s += spec_s
    add_rounds(run.stats, stats)
    match = None
    if sampling.greedy and base is not None:
        match = torch.equal(base, spec)
        if not match:
            first = next((i for i, (a, b) in enumerate(zip(base[n:], spec[n:])) if a != b),
                         min(base.numel(), spec.numel()) - n)
            run.mismatches.append({"id": item.id, "turn": turn + 1, "first_difference": first})
            print(f"!!! MISMATCH: bench item {item.id} turn {turn + 1}: speculative output differs "
                  f"from generate at new token {first} (a decoder or proposer bug)", file=sys.stderr)
    run.prompts.append({"id": item.id, "turn": turn + 1, "category": item.category,
                        "prompt_tokens": n, "baseline_tokens": None if base is None else base.numel() - n,
                        "speculative_tokens": spec.numel() - n, "rounds": stats.num_rounds,
                        "tau": stats.tau, "match": match,
                        # answer tokens the draft vocabulary holds (None: the proposer drafts any id)
                        "in_draft_vocab": None if draftable is None else
                        int(torch.isin(spec[n:], draftable).sum())})


POSITION_BUCKET = 32  # tokens of an answer per by_answer_position group
# the RoundStats fields a report's "raw" holds: every round, so shards merge exactly
RAW_ROUNDS = ("accepted", "tree_sizes", "tree_depths", "prefill_s", "draft_s", "verify_s", "other_s")


def add_rounds(total: RoundStats, stats: RoundStats) -> None:
    # total += stats: the rounds of one more prompt (or of one more shard, --merge)
    total.accepted += stats.accepted
    total.tree_sizes += stats.tree_sizes
    total.tree_depths += stats.tree_depths
    total.prefill_s += stats.prefill_s
    total.draft_s += stats.draft_s
    total.verify_s += stats.verify_s
    total.other_s += stats.other_s


# ---------------------------------------------------------------- summary


def acceptance_from_tau(tau: float, k: float) -> float:
    # root a in [0, 1] of tau = 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a), increasing in a
    if k <= 0 or tau <= 1:
        return 0.0
    if tau >= k + 1:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(60):
        a = (low + high) / 2
        low, high = (a, high) if geometric_chain_tau(a, k) < tau else (low, a)
    return (low + high) / 2


def expected_speedup(a: float, k: float, c: float) -> float:
    return geometric_chain_tau(a, k) / (c * k + 1)


def summarize(run: Run, settings: Settings, budget: int, threads: int) -> dict:
    # budget: the tree spec's draft nodes per round, root excluded
    stats, rounds = run.stats, max(run.stats.num_rounds, 1)
    base_tps = run.base_tokens / run.base_s if run.base_s else 0.0
    spec_tps = run.spec_tokens / run.spec_s if run.spec_s else 0.0
    k = sum(stats.tree_depths) / rounds
    a = acceptance_from_tau(stats.tau, k)
    per_depth = stats.depth_acceptance()
    target_s_per_token = run.base_s / max(run.base_tokens, 1)
    c = (stats.draft_s / rounds) / k / target_s_per_token if k > 0 and target_s_per_token else 0.0
    measured = run.base_tokens > 0  # False with --no-baseline
    s = settings
    return {
        "target": s.target, "proposer": s.proposer, "proposer_sha256": s.proposer_sha256,
        "proposer_notes": list(s.proposer_notes),
        "bench": s.bench, "tree": s.tree,
        "tree_budget": {"draft_nodes_excl_root": budget, "nodes_incl_root": budget + 1},
        "mean_tree_nodes_incl_root": sum(stats.tree_sizes) / rounds,
        "sampling": {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "seed": s.seed},
        "max_new_tokens": s.max_new_tokens, "max_turns": s.max_turns, "limit": s.limit,
        "adaptive": s.adaptive,
        "shard": s.shard, "no_baseline": s.no_baseline, "device": s.device,
        "threads": threads,
        "num_prompts": len(run.prompts), "skipped": run.skipped,
        "rounds": stats.num_rounds, "tau": stats.tau, "per_depth_acceptance": per_depth,
        "draft_vocab": draft_vocab_coverage(run.prompts),
        # where in the answers the rounds were: acceptance early in an answer differs from later on
        "by_answer_position": position_acceptance(stats.accepted, stats.tree_depths,
                                                  [p["rounds"] for p in run.prompts], POSITION_BUCKET),
        "baseline": {"tokens": run.base_tokens, "seconds": run.base_s, "tokens_per_s": base_tps},
        "speculative": {"tokens": run.spec_tokens, "seconds": run.spec_s, "tokens_per_s": spec_tps},
        "speedup": spec_tps / base_tps if measured else None,
        "time_per_round_ms": {"draft": 1e3 * stats.draft_s / rounds,
                              "verify": 1e3 * stats.verify_s / rounds,
                              "other": 1e3 * stats.other_s / rounds},
        "model": {"k_mean_depth": k, "a_from_tau": a,
                  "a_mean_per_depth": sum(per_depth) / len(per_depth) if per_depth else 0.0,
                  "c_draft_over_target_per_token": c,
                  "expected_speedup": (expected_speedup(a, k, c) if k > 0 else 1.0) if measured else None},
        "greedy_check": None if s.temperature > 0 or not measured else {
            "checked": len(run.prompts), "mismatches": len(run.mismatches),
            "mismatched": run.mismatches},
        "per_prompt": run.prompts,
        # every round, so shards merge exactly (--merge)
        "raw": {**{key: getattr(stats, key) for key in RAW_ROUNDS}, "mismatches": run.mismatches},
    }


def draft_vocab_coverage(prompts: list[dict]) -> dict | None:
    """{answer_tokens, in_vocab, share} over every answer, from per_prompt (so --merge sums shards exactly);
    None when the proposer drafts any id."""
    counted = [p for p in prompts if p.get("in_draft_vocab") is not None]
    if not counted:
        return None
    tokens = sum(p["speculative_tokens"] for p in counted)
    held = sum(p["in_draft_vocab"] for p in counted)
    return {"answer_tokens": tokens, "in_vocab": held, "share": held / tokens if tokens else 1.0}


def report_and_write(run: Run, settings: Settings, budget: int, threads: int, out: str | None,
                     extra: dict | None = None) -> dict:
    # the report of a run or of merged shards: printed, and written atomically to `out` when given;
    # extra: more top-level keys (tree_auto: how --tree auto chose)
    report = summarize(run, settings, budget, threads) | (extra or {})
    print_report(report)
    if out:
        write_json_atomic(Path(out), report)
    return report


# what every shard of one run shares (device and threads may differ)
SAME_RUN = ("target", "proposer", "proposer_sha256", "bench", "tree", "sampling", "max_new_tokens", "max_turns",
            "limit", "adaptive", "no_baseline")


def merge(paths: list[str], out: str | None) -> dict:
    """One report from the reports of all shards of one run: each I/N exactly once, same settings."""
    reports = []
    for path in paths:
        try:
            reports.append(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as error:  # ValueError: bad JSON or not UTF-8
            raise EvaluationError(f"--merge: cannot read {path}: {error}") from None
    check_same_run(paths, reports)
    check_all_shards(paths, reports)
    run = Run()
    for r in reports:
        raw = r["raw"]
        add_rounds(run.stats, RoundStats(**{key: raw[key] for key in RAW_ROUNDS}))
        run.base_tokens += r["baseline"]["tokens"]
        run.base_s += r["baseline"]["seconds"]
        run.spec_tokens += r["speculative"]["tokens"]
        run.spec_s += r["speculative"]["seconds"]
        run.prompts += r["per_prompt"]
        run.skipped += r["skipped"]
        run.mismatches += raw["mismatches"]
    first = reports[0]
    settings = Settings.from_report(first, shard=f"merged {len(reports)}")
    return report_and_write(run, settings, parse_tree_spec(first["tree"]).budget, first["threads"], out)


def check_same_run(paths: list[str], reports: list[dict]) -> None:
    for path, r in zip(paths, reports):
        if "raw" not in r:
            raise EvaluationError(f"--merge: {path} has no per-round counts ('raw'); rerun it with this version")
        differ = [f"{k}: {r.get(k)!r} vs {reports[0].get(k)!r}" for k in SAME_RUN if r.get(k) != reports[0].get(k)]
        if differ:
            raise EvaluationError(f"--merge: {path} is not a shard of the same run as {paths[0]}: "
                             + "; ".join(differ))


def check_all_shards(paths: list[str], reports: list[dict]) -> None:
    # shard I/N for every I in 0..N-1, once each, one N: else the merged tau covers part of the bench
    shards = {}
    for path, r in zip(paths, reports):
        index, slash, count = str(r.get("shard")).partition("/")
        if not (slash and index.isdigit() and count.isdigit()):
            raise EvaluationError(f"--merge: {path} is not a shard (shard {r.get('shard')!r}); merge the --json "
                             "reports of the --shard I/N runs of one evaluation")
        shards.setdefault(int(count), {}).setdefault(int(index), []).append(path)
    if len(shards) > 1:
        raise EvaluationError("--merge: the shards split the bench in different ways: " + "; ".join(
            f"N={n}: {', '.join(p for ps in found.values() for p in ps)}" for n, found in sorted(shards.items())))
    (count, found), = shards.items()
    twice = [f"{i}/{count} ({', '.join(ps)})" for i, ps in sorted(found.items()) if len(ps) > 1]
    if twice:
        raise EvaluationError(f"--merge: shard given more than once: {'; '.join(twice)}")
    missing = [f"{i}/{count}" for i in range(count) if i not in found]
    if missing:
        raise EvaluationError(f"--merge: missing shard {', '.join(missing)} of {count}: run it with --shard "
                         f"and merge all {count}")


def print_report(r: dict) -> None:
    budget = r["tree_budget"]
    model = r["model"]
    times = r["time_per_round_ms"]
    rows = [
        ("target / proposer", f"{r['target']} / {r['proposer']}"),
        ("bench", f"{r['bench']}: {r['num_prompts']} prompts, {len(r['skipped'])} skipped (too long)"),
        ("tree", f"{r['tree']}: {budget['draft_nodes_excl_root']} draft nodes excl. root "
                 f"({budget['nodes_incl_root']} incl.), mean {r['mean_tree_nodes_incl_root']:.1f} "
                 "nodes incl. root per round"),
        ("sampling", f"temperature {r['sampling']['temperature']}, top-k {r['sampling']['top_k']}, "
                     f"top-p {r['sampling']['top_p']}, max_new_tokens {r['max_new_tokens']}"
                     + (", adaptive chain" if r["adaptive"] else "")),
        ("tau (accepted + bonus)", f"{r['tau']:.3f} over {r['rounds']} rounds"),
        ("acceptance by depth", " ".join(f"d{d + 1}:{x:.2f}" for d, x in
                                         enumerate(r["per_depth_acceptance"])) or "-"),
        *([("answers in draft vocab", f"{r['draft_vocab']['share']:.1%} of {r['draft_vocab']['answer_tokens']} "
                                      "tokens (the rest can never be drafted)")] if r.get("draft_vocab") else []),
        *([("by answer position", "; ".join(
            f"{g['start']}-{g['start'] + POSITION_BUCKET - 1}: tau {g['tau']:.2f}, d1 "
            f"{(g['per_depth_acceptance'] or [0.0])[0]:.2f} ({g['rounds']} rounds)"
            for g in r["by_answer_position"]))] if len(r.get("by_answer_position", [])) > 1 else []),
        ("baseline generate", f"{r['baseline']['tokens_per_s']:.2f} tok/s "
                              f"({r['baseline']['tokens']} tokens, {r['baseline']['seconds']:.1f} s)"),
        ("speculative", f"{r['speculative']['tokens_per_s']:.2f} tok/s "
                        f"({r['speculative']['tokens']} tokens, {r['speculative']['seconds']:.1f} s)"),
        ("speedup (measured)", "not measured (--no-baseline)" if r["speedup"] is None else f"{r['speedup']:.2f}x"),
        ("per round (ms)", f"draft {times['draft']:.1f}, verify {times['verify']:.1f}, "
                           f"bookkeeping {times['other']:.1f}"),
        ("speedup (formula)", f"{model['expected_speedup'] or 0:.2f}x with k={model['k_mean_depth']:.2f}, "
                              f"a={model['a_from_tau']:.3f} (from tau; mean per-depth "
                              f"{model['a_mean_per_depth']:.3f}), "
                              f"c={model['c_draft_over_target_per_token']:.3f}"),
    ]
    check = r["greedy_check"]
    if check is not None:
        verdict = "OK" if check["mismatches"] == 0 else "!!! BUG: outputs differ from generate !!!"
        rows.append(("greedy == generate", f"{check['checked'] - check['mismatches']}/"
                                           f"{check['checked']} match, {check['mismatches']} "
                                           f"mismatches  {verdict}"))
    width = max(len(name) for name, _ in rows)
    print("\n".join(f"{name:<{width}}  {value}" for name, value in rows))


def write_json_atomic(path: Path, report: dict) -> None:
    write_text_atomic(path, json.dumps(report, indent=2, allow_nan=False))

