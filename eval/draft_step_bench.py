"""One draft step of EAGLE-4 against EAGLE-3 at SmolLM2-135M-Instruct's shape, in our decoder (a benchmark, not a
test; report/eagle4/README.md):

    OMP_NUM_THREADS=1 python eval/draft_step_bench.py                 # Vd 16384 and 32000, (r, k) 64:64 and 32:32
    python eval/draft_step_bench.py --cached 2048 --vocab 32000 --rank-candidates 64:64 --dtypes float32

A draft step is what EagleProposer (drafters.decode.proposers.eagle) runs per tree depth, its `_expander`'s expand:
the frontier's 4D mask, Eagle3Drafter.step on the frontier's F nodes (the decoder layer over a KV cache of P cached
positions, then `draft_logits`: EAGLE-3's full head W x; EAGLE-4's low-rank top-k rescored by W[cand] x and scattered
into a -inf row), log_softmax, the scatter into the target's vocabulary; then the tree's selection over that
(drafters.decode.tree: a chain's topk(1); a dynamic tree's NaN check, clamp and topk(10)). Width 1 is a chain, width
10 a dynamic (EAGLE-2) tree's frontier at topk 10. Also timed alone: `head` (draft_logits on a fixed hidden) and
`post` (log_softmax, scatter, selection on fixed logits); the rest of a step is the layer, the mask and Python.

Random weights (the cost does not depend on training): the EAGLE-4 drafter holds the EAGLE-3 one's weights plus its
SVD-initialised candidate head, both built as recipes/eagle3_smollm2.yaml and recipes/eagle4_smollm2.yaml build
them (norm_before_fc; EAGLE-4's sliding window 2048, --window). The calls alternate A B A B after a warm-up, for
--seconds per cell; medians in ms of the thread's CPU time (time.thread_time: the machine may be shared), and the
ratio of the wall-clock (time.perf_counter) medians beside it. Greedy drafting (temperature 0). --profile prints
torch.profiler's top operators of each drafter's steps instead.
"""

import argparse
import copy
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from drafters.decode.proposers.eagle import EagleProposer
from drafters.decode.proposers.eagle4 import draft_step_cost
from drafters.decode.sampling import SamplingConfig
from drafters.decode.tree import Frontier, parse_tree_spec
from drafters.draft_vocab import DraftVocab, scatter_to_target
from drafters.eagle3 import Eagle3Config, Eagle3Drafter
from drafters.eagle4 import Eagle4Config, Eagle4Drafter
from drafters.targets import TargetFeatures, bf16_is_native, load_target

TARGET = "smollm2-135m-instruct"


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else ():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def layer_macs(c: Eagle3Config, keys: int) -> int:
    # multiply-adds of one drafted position in the decoder layer: q/k/v read cat(embed, hidden) (2h), o, the MLP
    # (gate, up, down), attention scores and weighted values over `keys` keys
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return 2 * c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size \
        + 2 * c.num_attention_heads * keys * c.head_dim


def select(scores, width: int):
    # what drafters.decode.tree does with expand's (F, V): a chain's topk(1) (build_static_tree); a dynamic tree's
    # NaN check, clamp and topk (build_dynamic_tree)
    if width == 1:
        return scores.topk(1, dim=-1).indices.tolist()
    if torch.isnan(scores).any():
        raise ValueError("NaN draft log-probs")
    return scores.float().clamp(max=0).topk(width, dim=-1).indices.tolist()


class Drafting:
    """One proposer with P cached positions (P - 1 committed pairs and the root pair) and a depth-1 frontier of
    `width` nodes under the root: `step()` is one draft step, repeatable (the cache is cropped back to P)."""

    def __init__(self, drafter, embed, features: TargetFeatures, prompt, width: int):
        self.proposer = EagleProposer(drafter, embed, parse_tree_spec("chain:1"))
        self.proposer.reset(prompt, features)  # prefills the P - 1 committed pairs
        root_hidden, root_logits = self.proposer.draft_root(int(prompt[-1]))  # slot P - 1: P cached
        self.cached, self.width = len(self.proposer.cache), width
        self.expand, _ = self.proposer._expander(root_hidden[0], root_logits[0], SamplingConfig(), draws=0)
        tokens = torch.randint(drafter.config.vocab_size, (width + 1,))
        self.frontier = Frontier(1, torch.arange(1, width + 1), tokens[1:], torch.tensor([-1] + [0] * width), tokens)
        self.hidden = root_hidden.expand(1, width, -1).contiguous()  # (1, F, h): what the head reads, fixed
        self.logits = drafter.draft_logits(self.hidden)[0]  # (F, Vd)

    @torch.no_grad()
    def step(self):
        select(self.expand(self.frontier), self.width)  # (F, V) -> the tree's picks
        self.proposer.cache.crop(self.cached)

    @torch.no_grad()
    def head(self):
        self.proposer.drafter.draft_logits(self.hidden)

    @torch.no_grad()
    def post(self):
        scores = scatter_to_target(self.logits.float().log_softmax(-1), self.proposer.used,
                                   self.proposer.drafter.config.vocab_size, float("-inf"))
        select(scores, self.width)


def median_ms(calls: dict, seconds: float, warmup: int = 3, least: int = 10) -> tuple[dict, dict, int]:
    # interleaved: every round runs each call once, in order (A B C A B C ...), until `seconds` and `least` rounds.
    # -> (median wall ms, median CPU ms of this thread, rounds): the CPU time leaves out the time another process
    # held this core (the machine is shared); cache and memory contention stay in both
    wall, cpu = {name: [] for name in calls}, {name: [] for name in calls}
    for _ in range(warmup):
        for call in calls.values():
            call()
    start, rounds = time.perf_counter(), 0
    while time.perf_counter() - start < seconds or rounds < least:
        for name, call in calls.items():
            t, c = time.perf_counter(), time.thread_time()
            call()
            cpu[name].append(time.thread_time() - c)
            wall[name].append(time.perf_counter() - t)
        rounds += 1
    return ({name: 1e3 * statistics.median(v) for name, v in wall.items()},
            {name: 1e3 * statistics.median(v) for name, v in cpu.items()}, rounds)


def profile_steps(runs: dict, cell: str, steps: int = 100) -> None:
    from torch.profiler import ProfilerActivity, profile

    for name, run in runs.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                run.step()
        print(f"\n{cell}, {'EAGLE-3' if name == 'eagle3' else f'EAGLE-4 r, k = {name}'}, {steps} steps:")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))


def build(target, vocab: int, window: int | None, rank_candidates, seed: int = 0):
    # -> (EAGLE-3 drafter, {(r, k): EAGLE-4 drafter with the same weights plus its candidate head}), float32
    torch.manual_seed(seed)
    used = torch.randperm(target.vocab_size)[:vocab]
    draft_vocab = DraftVocab.from_used(used, target.vocab_size)
    eagle3 = Eagle3Drafter(Eagle3Config.from_target_config(target.config, vocab, norm_before_fc=True), draft_vocab)
    eagle3.eval().requires_grad_(False)  # as the proposer builders leave a drafter
    eagle4 = {}
    for r, k in rank_candidates:
        config = Eagle4Config.from_target_config(target.config, vocab, norm_before_fc=True, rank=r, candidates=k,
                                                 window=window)
        drafter = Eagle4Drafter(config, draft_vocab)
        missing = drafter.load_state_dict(eagle3.state_dict(), strict=False).missing_keys
        assert sorted(missing) == ["efficient_lm_head.weight", "efficient_lm_head_down_proj.weight"], missing
        drafter.init_candidate_head()  # the SVD of the head it now holds
        drafter.eval().requires_grad_(False)
        eagle4[r, k] = drafter
    return eagle3, eagle4


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, nargs="+", default=[16384, 32000], help="draft vocabulary sizes Vd")
    p.add_argument("--rank-candidates", nargs="+", default=["64:64", "32:32"], help="EAGLE-4's r:k pairs")
    p.add_argument("--widths", type=int, nargs="+", default=[1, 10], help="nodes per step (1: a chain)")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    p.add_argument("--cached", type=int, default=512, help="P: KV-cache positions before the step")
    p.add_argument("--window", type=int, default=2048, help="EAGLE-4's sliding window (0: full attention)")
    p.add_argument("--seconds", type=float, default=6.0, help="timing per cell (dtype, Vd, width), after the warm-up")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, help="also write the rows here")
    p.add_argument("--profile", action="store_true", help="instead of timing: the top operators of 100 steps of "
                   "each drafter per cell (torch.profiler, self CPU time)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rank_candidates = [tuple(int(x) for x in rk.split(":")) for rk in args.rank_candidates]
    target = load_target(TARGET, decoder=False)  # config and embedding only: no decoder layers are read
    print(f"{cpu_model()} ({torch.backends.cpu.get_cpu_capability()}), torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s), bf16 native on this CPU: {bf16_is_native('cpu')}; {TARGET} "
          f"(h {target.hidden_size}, V {target.vocab_size}), P = {args.cached} cached positions, EAGLE-4 window "
          f"{args.window or 'none'}, greedy; median ms per call (CPU time); rest = step - head - post")
    if not args.profile:
        print("| dtype | Vd | width | r, k | EAGLE-3 step | EAGLE-4 step | E4 / E3 | wall E4 / E3 | head E3 / E4 "
              "| post E3 / E4 | rest E3 / E4 | MACs per node E3 / E4 (ratio) | rounds |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for vocab in args.vocab:
        eagle3, eagle4 = build(target, vocab, args.window or None, rank_candidates)
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            rows += time_cells(args, target, eagle3, eagle4, dtype)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


def time_cells(args, target, eagle3, eagle4: dict, dtype) -> list[dict]:
    # one cell per width: EAGLE-3 and every EAGLE-4 (r, k) interleaved, each step, head and post
    torch.manual_seed(1)
    h, layers = target.hidden_size, eagle3.config.aux_layers
    features = TargetFeatures({i: torch.randn(1, args.cached, h, dtype=dtype) for i in layers}, None, None, None)
    prompt = torch.randint(target.vocab_size, (args.cached,))
    embed = torch.nn.Embedding.from_pretrained(target.embed_tokens.weight.to(dtype))
    rows = []
    for width in args.widths:
        runs = {"eagle3": Drafting(copy.deepcopy(eagle3).to(dtype), embed, features, prompt, width)}
        runs |= {rk: Drafting(copy.deepcopy(d).to(dtype), embed, features, prompt, width) for rk, d in eagle4.items()}
        if args.profile:
            profile_steps(runs, f"{dtype} Vd {eagle3.config.draft_vocab_size} width {width}")
            continue
        calls = {(part, name): getattr(run, part) for part in ("step", "head", "post") for name, run in runs.items()}
        wall, cpu, rounds = median_ms(calls, args.seconds)
        keys = args.cached + width  # a depth-1 node attends to the P cached slots and its frontier's
        for (r, k), drafter in eagle4.items():
            cost = draft_step_cost(drafter.config)
            macs3, macs4 = layer_macs(eagle3.config, keys) + cost["full_head"], \
                layer_macs(drafter.config, keys) + cost["candidate_head"]
            ms3, ms4 = ({part: cpu[part, name] for part in ("step", "head", "post")} for name in ("eagle3", (r, k)))
            rest3, rest4 = (ms["step"] - ms["head"] - ms["post"] for ms in (ms3, ms4))
            row = dict(dtype=str(dtype).removeprefix("torch."), vocab=eagle3.config.draft_vocab_size, width=width,
                       rank=r, candidates=k, cached=args.cached, threads=args.threads, rounds=rounds,
                       macs_eagle3=macs3, macs_eagle4=macs4, wall_step_eagle3=wall["step", "eagle3"],
                       wall_step_eagle4=wall["step", (r, k)], **{f"cpu_{p}_eagle3": v for p, v in ms3.items()},
                       **{f"cpu_{p}_eagle4": v for p, v in ms4.items()})
            rows.append(row)
            print(f"| {row['dtype']} | {row['vocab']} | {width} | {r}, {k} | {ms3['step']:.2f} | {ms4['step']:.2f} | "
                  f"**{ms4['step'] / ms3['step']:.2f}** | {wall['step', (r, k)] / wall['step', 'eagle3']:.2f} | "
                  f"{ms3['head']:.2f} / {ms4['head']:.2f} | {ms3['post']:.2f} / {ms4['post']:.2f} | "
                  f"{rest3:.2f} / {rest4:.2f} | {macs3 / 1e6:.2f}M / {macs4 / 1e6:.2f}M ({macs4 / macs3:.2f}) | "
                  f"{rounds} |", flush=True)
    return rows


if __name__ == "__main__":
    main()
