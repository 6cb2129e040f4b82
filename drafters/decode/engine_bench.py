"""Speed and acceptance measured by llama.cpp itself: one llama-server per mode (plain decoding, each of our
drafters, llama.cpp's own n-gram speculators), all up at once, and every prompt sent to every mode in turn
(A B C A B C ...), so that a slow minute of the machine falls on all modes alike; repeated with fresh servers. Numbers are
llama.cpp's own counters: decode time (`predicted_ms`, prompt excluded), tokens, drafted and accepted.

Knows nothing about training; drives llama.cpp only through drafters.engines.llama_cpp.LlamaServer.
"""

import statistics
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from drafters.engines.llama_cpp import Completion, LlamaServer

PLAIN = "plain"
WARM_UP_TOKENS = 8
NEVER_DRAFT = 2.0  # a p_min no probability reaches: every round runs the drafter's first step and drafts nothing


@dataclass
class Mode:
    name: str  # the row label
    spec_type: str | None = None  # None: plain decoding
    draft: Path | None = None  # a drafter GGUF (draft-eagle3 / draft-dflash)
    n_max: int | None = None  # draft length; None: llama.cpp's default for the type
    p_min: float = 0.0  # llama.cpp's --spec-draft-p-min (with n_max); NEVER_DRAFT: the drafter's step cost alone


@dataclass
class ModeResult:
    mode: Mode
    runs: list[list[Completion]] = field(default_factory=list)  # [repeat][prompt]

    def tokens_per_s(self, repeat: int) -> float:
        done = self.runs[repeat]
        return sum(len(c.tokens) for c in done) / max(sum(c.predicted_ms for c in done), 1e-9) * 1000

    def totals(self) -> dict:
        done = [c for run in self.runs for c in run]
        tokens, drafted, accepted = (sum(len(c.tokens) for c in done), sum(c.draft_n for c in done),
                                     sum(c.draft_accepted for c in done))
        return {"tokens": tokens, "drafted": drafted, "accepted": accepted,
                "acceptance": accepted / drafted if drafted else None,
                # target verification passes: each emits accepted + 1 tokens
                "tau": tokens / max(tokens - accepted, 1)}


def run_modes(target_file, modes: list[Mode], prompts: list[list[int]], max_new_tokens: int, *, repeats: int = 2,
              threads: int = 1, progress=print) -> dict[str, ModeResult]:
    """Every repeat starts every server afresh: llama.cpp's n-gram speculators keep what they saw across requests
    (ngram-mod accepted 530 of 530 drafts when the second repeat re-sent the first one's prompts to the same
    server), which would measure memory of the bench, not drafting."""
    results = {m.name: ModeResult(m) for m in modes}
    for repeat in range(repeats):
        with ExitStack() as stack:
            servers = {m.name: stack.enter_context(LlamaServer(target_file, draft=m.draft, spec_type=m.spec_type,
                                                               n_max=m.n_max, p_min=m.p_min,
                                                               threads=threads)) for m in modes}
            for server in servers.values():  # warm-up, untimed: the chat template's opening, one token
                server.complete(prompts[0][:WARM_UP_TOKENS], 1)
            for result in results.values():
                result.runs.append([])
            for i, prompt in enumerate(prompts):
                for name, server in servers.items():
                    results[name].runs[repeat].append(server.complete(prompt, max_new_tokens))
                progress(f"repeat {repeat + 1}/{repeats}, prompt {i + 1}/{len(prompts)}")
    return results


def summarize(results: dict[str, ModeResult]) -> list[dict]:
    """One row per mode: median tokens/s over repeats, median speedup over plain within each repeat, and
    llama.cpp's acceptance counters. Needs a `plain` mode."""
    plain = results[PLAIN]
    rows = []
    for name, result in results.items():
        repeats = range(len(result.runs))
        speeds = [result.tokens_per_s(r) for r in repeats]
        ratios = [result.tokens_per_s(r) / plain.tokens_per_s(r) for r in repeats]
        same = sum(c.tokens == p.tokens for run, plain_run in zip(result.runs, plain.runs)
                   for c, p in zip(run, plain_run))
        rows.append({"mode": name, "spec_type": result.mode.spec_type, "n_max": result.mode.n_max,
                     "tokens_per_s": statistics.median(speeds), "tokens_per_s_runs": speeds,
                     "speedup": statistics.median(ratios), "speedup_runs": ratios,
                     "same_as_plain": same, "outputs": sum(len(run) for run in result.runs), **result.totals()})
    return rows


def step_cost_ms(results: dict[str, ModeResult], probe: str) -> dict:
    """One drafter step as llama.cpp runs it, from a NEVER_DRAFT mode: each round is then one plain target step
    plus the drafter's first forward (and the target's output of the features the drafter reads), so
        step_ms = ms per token(probe) - ms per token(plain)
    within each repeat (the same prompts, the same minute of the machine); the median over repeats. Needs
    `plain`; the probe must have drafted nothing."""
    result, plain = results[probe], results[PLAIN]
    if result.totals()["drafted"]:
        raise ValueError(f"{probe}: drafted {result.totals()['drafted']} tokens; a step-cost probe drafts none")
    per_repeat = [1000 / result.tokens_per_s(r) - 1000 / plain.tokens_per_s(r) for r in range(len(result.runs))]
    return {"mode": probe, "step_ms": statistics.median(per_repeat), "step_ms_runs": per_repeat,
            "plain_ms_per_token": statistics.median(1000 / plain.tokens_per_s(r) for r in range(len(plain.runs)))}


def break_even_tau(forward_ms: dict[int, float], decode_ms: float, n: int, step_ms: float = 0.0) -> float:
    """The tau at which a chain of n drafts per round decodes as fast as plain decoding: a round costs one target
    forward over n + 1 tokens plus n drafter steps (an EAGLE-3 chain of n runs the drafter n times) and emits tau
    tokens, plain decoding costs decode_ms a token, so
        tau* = (forward(n + 1) + n * step_ms) / decode_ms.
    tau* above n + 1 (every draft accepted) means that chain cannot pay on this machine."""
    return (forward_ms[n + 1] + n * step_ms) / decode_ms


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'mode':<28} {'n_max':>5} {'tok/s':>7} {'speedup':>8} {'accepted/drafted':>17} {'tau':>5} "
             f"{'== plain':>9}"]
    for r in rows:
        acc = "-" if r["acceptance"] is None else f"{r['accepted']}/{r['drafted']} {r['acceptance']:.0%}"
        n_max = "-" if r["n_max"] is None else str(r["n_max"])
        lines.append(f"{r['mode']:<28} {n_max:>5} {r['tokens_per_s']:>7.1f} {r['speedup']:>7.2f}x {acc:>17} "
                     f"{r['tau']:>5.2f} {r['same_as_plain']:>4}/{r['outputs']:<4}")
    return "\n".join(lines)
