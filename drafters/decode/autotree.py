"""`--tree auto`: pick the draft tree that maximises predicted tokens per second on THIS machine.

tau alone favours the biggest tree; what a user wants is tokens/s, and on a CPU a 60-node
verification or a drafter step can cost more than the tokens it saves. So, on the loaded target and
proposer, at the prompt lengths in use:

1. Costs (median of repeats after warm-up runs, the sizes timed in turn so that load hits all):
   - verify(n): one target forward over a tree of n nodes (root included) on a cache holding a
     calibration prompt plus half its answer, for n in VERIFY_GRID; linear in between and beyond;
   - per candidate tree: its draft time per round (proposer.propose + proposer.update, what
     RoundStats.draft_s counts) and bookkeeping (RoundStats.other_s), from a short real decode
     with that tree (`probe_tokens` new tokens of the first calibration prompt, the first
     `warmup_rounds` rounds not timed); its mean node count and the shapes it drafted;
   - plain `generate`: ms per new token, (t(1 + m tokens) - t(1 token)) / m.
2. Acceptance by depth and rank, one of (`source`, stated in the output):
   - "calibration" (default): the first `prompts` bench prompts (turn 1) decoded with a wide tree
     (CALIBRATION_TREE, at most CALIBRATION_TOKENS new tokens each), pooled with the probe rounds of every candidate. From each round's tree and
     the committed tokens: for every depth d the true path reached, the rank r of the true child
     among its parent's children (children are in the proposer's rank order) or a miss. Then
         p(d, r) = #(true child at depth d had rank r) / (#(rounds whose true node at depth d-1
                   had more than r children) + 1)
     i.e. P(the proposer's rank-r candidate at depth d is the target's token | the path to d-1 was
     accepted). Pruned siblings count as misses, so wide ranks are under- not over-estimated; the
     +1 (one pseudo-miss) keeps a depth or rank seen in a handful of rounds from counting as certain.
   - "checkpoint": an EAGLE-3 / EAGLE-1 checkpoint's held-out per-TTT-step top-1 accuracy
     (drafter.json extra.eval.step_acc): p(d, 0) = step_acc[d-1], p(d, r > 0) = 0, i.e. every tree
     is credited only for the top-1 chain it contains (conservative for trees).
3. Model, per candidate (positional acceptance, as Medusa / Sequoia trees are sized):
       E[tau | tree] = 1 + sum over draft nodes v of prod_{u on root->v, u != root} p(depth u, rank u)
   (siblings are exclusive events, so the probabilities of the nodes of one depth add), averaged
   over the trees the candidate actually drafted in its probe (a lookup round with no match is a
   root-only tree: tau 1). A chain of k is 1 + sum_{d<=k} prod_{j<=d} p(j, 0).
       round_ms = draft_ms + verify(mean nodes incl. root) + other_ms
       tokens/s = 1000 * E[tau] / round_ms;   plain generate: 1000 / generate_ms_per_token
   The highest tokens/s wins; "none" (plain generate) is a candidate and wins on slow machines.
   Depths or ranks never observed count as never accepted (p = 0), and p(d, r) is clipped so the
   ranks of one depth sum to at most 1.

Prompts used for calibration are also among the prompts then measured (the choice has seen them).
This module runs the decoder and proposers; it knows nothing about eval/tau.py's report.
"""

import argparse
import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache

from drafters.acceptance import depth_acceptance, tree_tau
from drafters.checkpoint import CONFIG_FILE
from drafters.decode.benches import render_prompt
from drafters.decode.decoder import speculative_generate, tree_forward
from drafters.decode.proposers.loading import load_proposer
from drafters.decode.sampling import SamplingConfig
from drafters.decode.tree import Tree, TreeSpec, parse_tree_spec
from drafters.targets import with_cache
from drafters.timing import synced_clock

CANDIDATES = ("chain:1", "chain:2", "chain:3", "chain:4", "chain:5", "chain:6",
              "dynamic:total=6,depth=3,topk=2", "dynamic:total=10,depth=4,topk=3",
              "dynamic:total=20,depth=5,topk=4", "dynamic:total=40,depth=6,topk=6",
              "dynamic:total=60,depth=6,topk=10")
CALIBRATION_TREE = "dynamic:total=60,depth=6,topk=10"  # covers every candidate's depth and topk
CALIBRATION_TOKENS = 128  # new tokens per calibration prompt, at most
VERIFY_GRID = (1, 2, 4, 8, 16, 32, 64)
NO_SPECULATION = "none"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--tree auto (drafters.decode.autotree)")
    group.add_argument("--auto-prompts", type=int, default=2,
                       help="bench prompts (turn 1) decoded to calibrate acceptance, >= 1 (default 2; fewer are "
                            "used when fewer fit the target's context)")
    group.add_argument("--auto-acceptance", choices=("calibration", "checkpoint"), default="calibration",
                       help="acceptance by depth from a calibration decode (default) or from the drafter "
                            "checkpoint's held-out per-step accuracy (drafter.json extra.eval.step_acc)")
    group.add_argument("--auto-probe-tokens", type=int, default=32,
                       help="new tokens decoded with each candidate tree to time its draft, >= 1 (default 32)")
    group.add_argument("--auto-candidates", nargs="+", default=list(CANDIDATES), metavar="TREE",
                       help="tree specs to choose from (default: chain:1..6 and five dynamic trees)")
    group.add_argument("--speculate-anyway", action="store_true",
                       help="when plain generate is predicted fastest, measure the best speculative tree "
                            "anyway (default: report that and stop)")


# ---------------------------------------------------------------- acceptance by depth and rank


@dataclass
class RankCounts:
    # hits[d-1][r]: rounds whose true child at depth d was its parent's rank-r child;
    # exposed[d-1][r]: rounds whose true node at depth d-1 had more than r children
    hits: list[list[int]] = field(default_factory=list)
    exposed: list[list[int]] = field(default_factory=list)
    rounds: int = 0

    def add(self, depth: int, rank: int | None, children: int) -> None:
        while len(self.hits) < depth:
            self.hits.append([])
            self.exposed.append([])
        hits, exposed = self.hits[depth - 1], self.exposed[depth - 1]
        for row in (hits, exposed):
            row.extend([0] * (children - len(row)))
        for r in range(children):
            exposed[r] += 1
        if rank is not None:
            hits[rank] += 1

    def rates(self) -> list[list[float]]:
        # one pseudo-miss per (depth, rank): a rank seen once and accepted once is 0.5, not 1.0 (deep
        # depths and wide ranks are seen in few rounds); costs 1 / (n + 1) of a rate seen n times
        return clip_rates([[h / (n + 1) for h, n in zip(hits, exposed)]
                           for hits, exposed in zip(self.hits, self.exposed)])


def clip_rates(rates: list[list[float]]) -> list[list[float]]:
    # the ranks of one depth are exclusive events: their probabilities sum to at most 1
    out = []
    for row in rates:
        left, kept = 1.0, []
        for p in row:
            kept.append(min(max(p, 0.0), left))
            left -= kept[-1]
        out.append(kept)
    return out


class Recorder:
    """Wraps a proposer; per round records the draft time, the tree's shape and the rank of the true
    child at each depth the committed path reached (RankCounts). Changes nothing it forwards."""

    def __init__(self, proposer, counts: RankCounts):
        self.proposer, self.counts, self.needs = proposer, counts, proposer.needs
        self.greedy_only = getattr(proposer, "greedy_only", False)
        self.propose_s, self.update_s, self.shapes = [], [], []
        self.tree = None

    def reset(self, prompt_ids, features) -> None:
        self.proposer.reset(prompt_ids, features)
        self.tree = None

    def propose(self, context, pending, sampling):
        start = synced_clock(context.device)
        tree = self.proposer.propose(context, pending, sampling)
        self.propose_s.append(synced_clock(context.device) - start)
        self.tree = tree
        self.shapes.append(tuple(tree.parent_list))
        return tree

    def update(self, new_tokens, features, pending) -> None:
        # new_tokens = old pending + accepted drafts: the true path, as far as the tree had it
        start = synced_clock(new_tokens.device)
        self.proposer.update(new_tokens, features, pending)
        self.update_s.append(synced_clock(new_tokens.device) - start)
        self.counts.rounds += 1
        tree, node = self.tree, 0
        tokens = tree.tokens.tolist()
        for depth, token in enumerate(new_tokens[1:].tolist(), start=1):
            children = tree.children[node]
            rank = next((i for i, c in enumerate(children) if tokens[c] == token), None)
            if rank is None:  # not a tree node (a proposer that rewrites its tree): stop counting
                return
            self.counts.add(depth, rank, len(children))
            node = children[rank]
        if tree.children[node]:  # drafted one level deeper and none was accepted
            self.counts.add(len(new_tokens), None, len(tree.children[node]))


def checkpoint_rates(proposer_spec: str) -> list[list[float]] | None:
    # held-out top-1 accuracy per TTT step recorded by training (drafters.training.eagle3.evaluate)
    path = Path(proposer_spec.partition("+")[0]) / CONFIG_FILE
    if not path.is_file():
        return None
    extra = json.loads(path.read_text()).get("extra") or {}
    step_acc = (extra.get("eval") or {}).get("step_acc")
    return [[float(a)] for a in step_acc] if step_acc else None


# ---------------------------------------------------------------- the model


def expected_tau(rates: list[list[float]], parents) -> float:
    """1 + sum over draft nodes of the product of p(depth, rank) along the path (module docstring).
    parents: the tree's parent list (-1 for the root, parents before children)."""
    paths, seen = [()], {}  # paths[i]: node i's ranks among its siblings, from the root's child down
    for i, p in enumerate(parents[1:], start=1):
        rank = seen[p] = seen.get(p, -1) + 1  # index among p's children, in node order
        paths.append(paths[p] + (rank,))
    return tree_tau(paths[1:], rates)


def interpolate(grid: dict[int, float], n: float) -> float:
    # piecewise linear through the measured points, extended linearly past both ends
    xs = sorted(grid)
    if len(xs) == 1:
        return grid[xs[0]]
    i = next((j for j in range(1, len(xs) - 1) if n <= xs[j]), len(xs) - 1)
    x0, x1 = xs[i - 1], xs[i]
    return grid[x0] + (grid[x1] - grid[x0]) * (n - x0) / (x1 - x0)


@dataclass
class Probe:
    """What a short decode with one candidate tree measured."""
    spec: str
    draft_ms: float  # median propose + median update
    other_ms: float  # bookkeeping per round (RoundStats.other_s)
    shapes: list = field(default_factory=list)  # parent lists of the trees it drafted
    measured_tau: float | None = None
    rounds: int = 0


@dataclass
class Row:
    spec: str
    nodes: float  # mean tree nodes per round, root included
    tau: float  # predicted
    draft_ms: float
    verify_ms: float
    other_ms: float
    measured_tau: float | None = None  # on the probe's few rounds, for reference

    @property
    def round_ms(self) -> float:
        return self.draft_ms + self.verify_ms + self.other_ms

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 * self.tau / self.round_ms if self.round_ms > 0 else 0.0


def predict(probes: list[Probe], rates: list[list[float]], verify_ms: dict[int, float],
            generate_ms_per_token: float) -> list[Row]:
    """Every candidate plus plain generate, best predicted tokens/s first."""
    rows = [Row(NO_SPECULATION, 1.0, 1.0, 0.0, generate_ms_per_token, 0.0)]
    for probe in probes:
        nodes = statistics.fmean(len(s) for s in probe.shapes)
        tau = statistics.fmean(expected_tau(rates, s) for s in probe.shapes)
        rows.append(Row(probe.spec, nodes, tau, probe.draft_ms, interpolate(verify_ms, nodes), probe.other_ms,
                        probe.measured_tau))
    return sorted(rows, key=lambda r: -r.tokens_per_s)  # stable: "none" first on a tie


# ---------------------------------------------------------------- measuring


@dataclass
class AutoResult:
    rows: list[Row]
    acceptance_source: str
    rates: list[list[float]]
    verify_ms: dict[int, float]
    generate_ms_per_token: float
    context_tokens: int
    calibration: dict
    skipped: dict[str, str]

    @property
    def best(self) -> Row:
        return self.rows[0]

    @property
    def best_tree(self) -> Row | None:
        return next((r for r in self.rows if r.spec != NO_SPECULATION), None)

    def as_dict(self) -> dict:
        return {"chosen": self.best.spec, "acceptance_source": self.acceptance_source,
                "acceptance_by_depth_and_rank": self.rates, "verify_ms_by_nodes": self.verify_ms,
                "generate_ms_per_token": self.generate_ms_per_token, "context_tokens": self.context_tokens,
                "calibration": self.calibration, "skipped_candidates": self.skipped,
                "candidates": [asdict(r) | {"round_ms": r.round_ms, "tokens_per_s": r.tokens_per_s}
                               for r in self.rows]}


@dataclass(frozen=True)
class AutoTreeOptions:
    """How --tree auto measures (the module docstring's steps; eval/tau.py's --auto-* options)."""

    prompts: int = 2  # bench prompts (turn 1) decoded to calibrate acceptance
    acceptance: str = "calibration"  # or "checkpoint": the drafter's held-out per-step accuracy
    probe_tokens: int = 32  # new tokens decoded with each candidate to time its draft
    candidates: tuple[str, ...] = CANDIDATES
    calibration_tree: str = CALIBRATION_TREE
    warmup: int = 2  # untimed runs (and probe rounds) before the timed ones
    repeats: int = 5  # timed runs of each verification size, their median taken


def choose_tree(target, proposer_spec: str, items, sampling: SamplingConfig, max_new_tokens: int,
                options: AutoTreeOptions = AutoTreeOptions(), log=print) -> AutoResult:
    """The candidate with the most predicted tokens/s for `proposer_spec` (drafters.decode.proposers.loading
    loads a fresh proposer for each tree) decoding up to max_new_tokens; items: bench items (turn 1 is used)."""
    o = options
    if o.prompts < 1 or o.probe_tokens < 1:
        raise ValueError(f"--tree auto: --auto-prompts ({o.prompts}) and --auto-probe-tokens ({o.probe_tokens}) must "
                         "be >= 1")
    rates = checkpoint_rates(proposer_spec) if o.acceptance == "checkpoint" else None
    if o.acceptance == "checkpoint" and rates is None:
        raise ValueError(f"--auto-acceptance checkpoint: {proposer_spec} records no held-out per-step accuracy "
                         "(drafter.json extra.eval.step_acc); use --auto-acceptance calibration")
    calibration = _prompts(target, items, o.prompts, max_new_tokens)
    if not calibration:
        raise ValueError("--tree auto: no bench prompt fits the target's context for calibration")
    counts, eos = RankCounts(), target.eos_token_ids
    for spec in o.candidates:
        parse_tree_spec(spec)  # a bad candidate fails before anything is decoded

    def make_proposer(tree: TreeSpec):
        return load_proposer(proposer_spec, target, tree)

    needs = []

    def decode(spec: str, prompt, new_tokens: int):
        recorder = Recorder(make_proposer(parse_tree_spec(spec)), counts)
        needs.append(recorder.needs)
        if recorder.greedy_only and not sampling.greedy:
            raise ValueError("this proposer verifies greedily only; use --temperature 0")
        generator = torch.Generator(target.device).manual_seed(sampling.seed or 0)
        out, stats = speculative_generate(target.model, recorder, prompt, max_new_tokens=new_tokens,
                                          sampling=sampling, eos_token_ids=eos, generator=generator)
        return recorder, out, stats

    decode("chain:1", calibration[0], 4)  # warm-up: first calls pay for allocation
    calibration_tree = _loadable(o.calibration_tree, make_proposer)
    log(f"tree auto: calibrating on {len(calibration)} prompt(s) with {calibration_tree}")
    answers, cal_rounds, cal_accepted, cal_depths = [], 0, [], []
    for prompt in calibration:
        _, out, stats = decode(calibration_tree, prompt, min(max_new_tokens, CALIBRATION_TOKENS))
        answers.append(out)
        cal_rounds += stats.num_rounds
        cal_accepted += stats.accepted
        cal_depths += stats.tree_depths

    probes, skipped = [], {}
    for spec in o.candidates:
        try:
            recorder, _, stats = decode(spec, calibration[0], o.probe_tokens)
        except ValueError as error:  # e.g. a tree deeper than a Medusa drafter's heads
            skipped[spec] = str(error)
            continue
        timed = slice(o.warmup, None) if len(recorder.propose_s) > o.warmup + 2 else slice(None)
        draft_s = statistics.median(recorder.propose_s[timed]) + (
            statistics.median(recorder.update_s[timed] or recorder.update_s) if recorder.update_s else 0.0)
        probes.append(Probe(spec, 1e3 * draft_s, 1e3 * stats.other_s / max(stats.num_rounds, 1),
                            recorder.shapes, stats.tau, stats.num_rounds))
        log(f"tree auto: {spec}: draft {1e3 * draft_s:.2f} ms/round, tau {stats.tau:.2f} over "
            f"{stats.num_rounds} probe rounds")

    if not probes:  # nothing measured supports any prediction, "no speculation" included
        raise ValueError("--tree auto: no candidate tree could be run with this proposer ("
                         + "; ".join(f"{spec}: {why}" for spec, why in skipped.items())
                         + "); give --auto-candidates trees it can draft")
    context = answers[0][: calibration[0].numel() + max_new_tokens // 2]
    needs_hidden = needs[0].any  # the verification forward returns hidden states when the proposer reads them
    largest = max([max(len(s) for s in p.shapes) for p in probes] + [VERIFY_GRID[-1]])
    grid = [n for n in VERIFY_GRID if n < largest] + [largest]
    grid = [n for n in grid if context.numel() + n <= target.max_position_embeddings] or [1]
    verify_ms = time_verify(target.model, context, grid, needs_hidden, o.warmup, o.repeats)
    generate_ms = time_generate(target, calibration[0], o.warmup, max(o.repeats // 2, 2))

    if o.acceptance == "checkpoint":
        source = f"checkpoint {proposer_spec}: held-out per-step top-1 accuracy (top-1 chains only)"
    else:
        rates = counts.rates()
        source = (f"calibration: {len(calibration)} prompt(s) decoded with {calibration_tree} "
                  f"({cal_rounds} rounds) + the probe rounds of every candidate ({counts.rounds} rounds in all)")
    rows = predict(probes, rates, verify_ms, generate_ms)
    cal = {"tree": calibration_tree, "prompts": len(calibration), "rounds": cal_rounds,
           "tau": sum(a + 1 for a in cal_accepted) / max(cal_rounds, 1),
           "depth_acceptance": depth_acceptance(cal_accepted, cal_depths)}
    return AutoResult(rows, source, rates, verify_ms, generate_ms, context.numel(), cal, skipped)


def _loadable(spec: str, make_proposer) -> str:
    # the calibration tree, made shallower until the proposer takes it (Medusa / Blockwise heads
    # draft at most one depth per head)
    tree = parse_tree_spec(spec)
    for depth in range(getattr(tree, "depth", 1), 0, -1):
        shallower = spec if depth == tree.depth else f"dynamic:total={tree.total},depth={depth},topk={tree.topk}"
        try:
            make_proposer(parse_tree_spec(shallower))
            return shallower
        except ValueError:
            if not hasattr(tree, "topk"):
                raise
    raise ValueError(f"--tree auto: the proposer takes no calibration tree like {spec}")


def _prompts(target, items, count: int, max_new_tokens: int) -> list[torch.Tensor]:
    out = []
    for _, item in items:
        ids = torch.tensor(render_prompt(target.tokenizer, item, []), dtype=torch.long)
        if ids.numel() + max_new_tokens + 70 <= target.max_position_embeddings:
            out.append(ids)
        if len(out) == count:
            break
    return out


@torch.no_grad()
def time_verify(model, context: torch.Tensor, grid, hidden_states: bool, warmup: int = 2,
                repeats: int = 5) -> dict[int, float]:
    """ms of one target forward over a tree of n nodes (a chain; the mask's shape costs nothing) on a
    cache holding `context`, median of `repeats` after `warmup`; the cache is cropped back each time."""
    device = model.device
    cache = DynamicCache()
    model(input_ids=context[None].to(device), **with_cache(model, cache), use_cache=True)
    past = cache.get_seq_length()
    trees = {n: Tree.chain((context[-n:] if n <= context.numel() else context[torch.arange(n) % context.numel()])
                           .to(device)) for n in grid}
    times = {n: [] for n in grid}
    for _ in range(warmup + repeats):  # round-robin over n: a change in machine load hits every n alike
        for n, tree in trees.items():
            start = synced_clock(device)
            tree_forward(model, cache, tree, hidden_states=hidden_states)
            times[n].append(synced_clock(device) - start)
            for layer in cache.layers:  # back to `past` (DynamicCache.crop's meaning changed across versions)
                layer.keys, layer.values = layer.keys[:, :, :past], layer.values[:, :, :past]
    return {n: 1e3 * statistics.median(t[warmup:]) for n, t in times.items()}


@torch.no_grad()
def time_generate(target, prompt: torch.Tensor, warmup: int = 1, repeats: int = 3, new_tokens: int = 16) -> float:
    """ms per new token of plain greedy `generate`: (t(1 + m) - t(1)) / m, medians of `repeats`."""
    ids = prompt[None].to(target.device)

    def run(n: int) -> float:
        start = synced_clock(target.device)
        target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                              min_new_tokens=n, pad_token_id=target.tokenizer.pad_token_id,
                              eos_token_id=sorted(target.eos_token_ids))
        return synced_clock(target.device) - start

    for _ in range(warmup):
        run(2)
    pairs = [(run(1), run(1 + new_tokens)) for _ in range(repeats)]  # alternating, as A B A B
    one, many = (statistics.median(t) for t in zip(*pairs))
    return 1e3 * max(many - one, 1e-9) / new_tokens


# ---------------------------------------------------------------- the table


def format_table(result: AutoResult) -> str:
    lines = [f"tree auto: acceptance from {result.acceptance_source}",
             "tree auto: acceptance by depth (rank 0 | ranks 0..): " + "; ".join(
                 f"d{d + 1} {row[0] if row else 0:.2f} | {sum(row):.2f}" for d, row in enumerate(result.rates)),
             f"tree auto: verify ms by nodes at {result.context_tokens} context tokens: " + ", ".join(
                 f"{n}: {ms:.1f}" for n, ms in result.verify_ms.items()),
             f"tree auto: plain generate {result.generate_ms_per_token:.1f} ms per token",
             f"{'candidate':<34} {'nodes':>6} {'tau':>6} {'probe tau':>9} {'draft':>7} {'verify':>7} "
             f"{'other':>6} {'round ms':>8} {'tok/s':>7}"]
    for row in result.rows:
        mark = "  <- chosen" if row is result.best else ""
        probe = "-" if row.measured_tau is None else f"{row.measured_tau:.2f}"
        lines.append(f"{row.spec:<34} {row.nodes:>6.1f} {row.tau:>6.2f} {probe:>9} {row.draft_ms:>7.1f} "
                     f"{row.verify_ms:>7.1f} {row.other_ms:>6.1f} {row.round_ms:>8.1f} {row.tokens_per_s:>7.1f}{mark}")
    for spec, why in result.skipped.items():
        lines.append(f"{spec:<34} skipped: {why}")
    if result.best.spec == NO_SPECULATION:
        best = result.best_tree
        lines.append("tree auto: NO SPECULATION is predicted fastest on this machine: plain generate "
                     f"{result.best.tokens_per_s:.1f} tok/s" + (
                         f" vs {best.tokens_per_s:.1f} tok/s for the best tree {best.spec}" if best else ""))
    else:
        lines.append(f"tree auto: chose {result.best.spec} (predicted {result.best.tokens_per_s:.1f} tok/s, "
                     f"plain generate {1000 / result.generate_ms_per_token:.1f})")
    return "\n".join(lines)
