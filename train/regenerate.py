"""Re-answer the user turns of a dataset with the target, so drafters learn the target's own replies.

    python train/regenerate.py recipes/regenerate_smollm2.yaml [key=value ...]
    python train/regenerate.py recipes/regenerate_smollm2.yaml url=http://127.0.0.1:8000  # vLLM, SGLang, ...

Where the replies come from (a llama-server started here, any OpenAI-compatible server, or in-process
generate), what each row records, resume, retries and the checks that the server serves the target:
drafters.training.regenerate. Ctrl-C and SIGTERM stop it with whole rows written and the server stopped;
re-running the same command continues.
"""

import json
import signal
import sys
import threading
from pathlib import Path

from drafters.files import write_text_atomic
from drafters.training.recipe import load_dataclass, run_main
from drafters.training.regenerate import Incomplete, Recipe, Stats, regenerate


def main(argv: list[str]) -> Stats:
    if not argv:
        raise SystemExit("usage: python train/regenerate.py RECIPE.yaml [key=value ...]")
    recipe = load_dataclass(argv[0], argv[1:], schema=Recipe)
    stats = Stats()

    def terminate(signum, frame):  # a scheduler's SIGTERM stops like Ctrl-C: whole rows, the server stopped
        raise KeyboardInterrupt

    main_thread = threading.current_thread() is threading.main_thread()  # signal handlers live there only
    previous = signal.signal(signal.SIGTERM, terminate) if main_thread else None
    try:
        regenerate(recipe, stats)
    except KeyboardInterrupt:  # the server (if started here) is already stopped: its `with` block has exited
        print()
        print_report(stats, Path(recipe.output), recipe)  # what this run did before it stopped
        print(f"regenerate: interrupted; {stats.written} rows written this run, {stats.resumed + stats.written} in "
              f"{recipe.output} in all. Re-run the same command to continue where it stopped", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    print_report(stats, Path(recipe.output), recipe)
    if recipe.report:  # checked writable before any work (drafters.training.regenerate.regenerate)
        Path(recipe.report).parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(recipe.report, json.dumps({
            "engine": stats.engine, "written": stats.written, "resumed": stats.resumed, "tokens": stats.tokens,
            "seconds": stats.seconds, "tokens_per_s": stats.tokens_per_second(), "cut": stats.cut,
            "skipped": dict(stats.skipped), "retried": dict(stats.retried), "given_up": dict(stats.given_up),
            "given_up_ids": stats.given_up_ids}, indent=1))
    if stats.given_up:  # a partial set must not pass for a whole one (train/quickstart.py stops on the status)
        raise Incomplete(f"{sum(stats.given_up.values())} conversations were given up and are not in "
                         f"{recipe.output} (see above); re-run the same command to try them again", stats)
    return stats


def print_report(stats: Stats, output: Path, recipe: Recipe) -> None:
    skipped = ", ".join(f"{n} {reason}" for reason, n in stats.skipped.items()) or "none"
    print(f"regenerate ({stats.engine}): wrote {stats.written} rows to {output} ({stats.resumed} were already "
          f"there); skipped: {skipped}; {stats.cut} answers cut at max_new_tokens={recipe.max_new_tokens}; "
          f"{stats.tokens} tokens in {stats.seconds:.1f} s = {stats.tokens_per_second():.1f} tok/s")
    if stats.retried:
        print("  retried requests: " + ", ".join(f"{n} after {reason}" for reason, n in stats.retried.items()))
    if stats.given_up:
        ids = ", ".join(stats.given_up_ids[:10]) + (" ..." if len(stats.given_up_ids) > 10 else "")
        print(f"  gave up on {sum(stats.given_up.values())} conversations, not written ("
              + ", ".join(f"{n} {reason}" for reason, n in stats.given_up.items())
              + f"): {ids}; re-run the same command to try them again")


if __name__ == "__main__":
    run_main(main)
