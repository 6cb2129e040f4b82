"""Mean accepted length (tau) and speedup of a proposer against plain `generate` on one target.

    python eval/tau.py --target smollm2-135m-instruct --proposer prompt-lookup --bench mt_bench \
        --temperature 0 --tree chain:4 --limit 5 --max-new-tokens 128 --json out.json

The command line over drafters.decode.evaluate.measure (which eval/compare.py calls in-process too); what is
measured and how is documented there and in `python eval/tau.py --help`. A measurement that cannot run as
asked ends with `tau: <why>` and exit status 1; a greedy output that differs from generate too (after the
JSON is written).
"""

import argparse
import sys
from dataclasses import fields

from drafters.decode import autotree, evaluate
from drafters.decode.evaluate import Options, measure, merge
from drafters.errors import UserError


def parse_args(argv):
    p = argparse.ArgumentParser(description=evaluate.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="short name, HF directory, .gguf file or Hub id")
    p.add_argument("--proposer", required=True,
                   help="prompt-lookup | draft-model:<target> | drafter checkpoint directory, ours or exported "
                        "by another tool (DIR:aux_layers=A,B,C: the HF hidden_states indices an EAGLE-3 "
                        "directory without layer ids drafts from, instead of the engine's default) | "
                        "DIR+prompt-lookup[:copy_ngram=N] (the drafter's tree plus lookup continuations, greedy; copy_ngram: "
                        "rounds where an N-gram match continues for the full depth verify lookup alone)")
    p.add_argument("--bench", required=True, help="mt_bench | humaneval | humaneval_edit (code edits that copy the prompt) | path to a JSONL file")
    p.add_argument("--tree", default="chain:4",
                   help="chain:K | static:... | dynamic:total=,depth=,topk= | auto (fastest on this machine)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, default=None, help="first N bench items")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-turns", type=int, default=None, help="ask at most the first N turns of each item")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--adaptive", action="store_true",
                   help="chain proposers: +2 after a fully accepted round, -1 otherwise")
    p.add_argument("--json", default=None, help="write the results here (atomically)")
    p.add_argument("--device", default="auto", help="auto (cuda when available, else cpu) | cpu | cuda[:N]")
    p.add_argument("--shard", default=None, help="I/N: only bench items with index %% N == I")
    p.add_argument("--no-baseline", action="store_true",
                   help="temperature 0 only: skip generate (tau sweeps); no speed or greedy check")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="combine the --json reports of the shards of one run (needs only --json)")
    autotree.add_arguments(p)
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--merge" in argv:  # the evaluation's required options do not apply
        for action in p._actions:
            action.required = False
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    try:
        if args.merge:
            return merge(args.merge, args.json)
        return measure(Options(**{f.name: getattr(args, f.name) for f in fields(Options) if f.init}))
    except UserError as error:
        raise SystemExit(f"tau: {error}") from None


if __name__ == "__main__":
    main()
