"""How sure a target is of its own next token, by position in the answer: what caps a drafter's first draft there.

    python eval/confidence.py --target smollm2-135m-instruct --data recipes/data/smollm2_general.jsonl --limit 100

The rows of --data (the target's own answers, rendered with its chat template and loss mask as training renders them)
go through the target once each, teacher-forced. At every trained token t the target's probability of its argmax,
p = max softmax(logits at t-1), sorts t into a band (p < 0.5, 0.5 <= p < 0.9, p >= 0.9) and its answer position
(tokens since the answer began) into a range. On greedy answers the argmax is the token the target wrote, so
p < 0.5 marks a choice between near-equal tokens that no drafter predicts well. Printed: each position range's tokens,
the share of each band, and the mean p.
"""

import argparse
import json
import sys

import torch

from drafters.errors import UserError
from drafters.files import check_writable, write_text_atomic
from drafters.targets import load_target
from drafters.training.data import build_examples

POSITIONS = (32, 64, 128)  # answer-position ranges: 1-32, 33-64, 65-128, the rest
BANDS = (0.5, 0.9)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--data", required=True, help="the target's answers: a conversation file training reads")
    p.add_argument("--limit", type=int, default=100, help="the first N conversations of --data")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="write the table here (atomically)")
    return p.parse_args(argv)


def position_range(k: int) -> str:
    # k: 0-based position in the answer
    low = 1
    for high in POSITIONS:
        if k < high:
            return f"{low}-{high}"
        low = high + 1
    return f"{low}+"


@torch.no_grad()
def confidence(target, examples) -> dict:
    """position range -> {"tokens", "share": [p < 0.5, 0.5 <= p < 0.9, p >= 0.9], "mean_p"}, and "all"."""
    tally: dict[str, list] = {}
    for example in examples:
        ids, mask = torch.tensor(example.input_ids), torch.tensor(example.loss_mask, dtype=torch.bool)
        logits = target.model(ids[None].to(target.device)).logits[0].float()  # (T, V): row r predicts token r+1
        p = logits.softmax(-1).max(-1).values.cpu()  # (T,)
        trained = mask.nonzero().flatten().tolist()
        start = None
        for t in trained:
            if start is None or t == 0 or not mask[t - 1]:  # an answer begins after an untrained token (or at 0)
                start = t
            if t == 0:  # nothing predicts the first token
                continue
            band = sum(float(p[t - 1]) >= b for b in BANDS)
            for key in (position_range(t - start), "all"):
                counts = tally.setdefault(key, [0, [0, 0, 0], 0.0])
                counts[0] += 1
                counts[1][band] += 1
                counts[2] += float(p[t - 1])
    order = [position_range(k) for k in (0, *POSITIONS)] + ["all"]
    return {key: {"tokens": tally[key][0], "share": [n / tally[key][0] for n in tally[key][1]],
                  "mean_p": tally[key][2] / tally[key][0]} for key in order if key in tally}


def main(argv=None) -> dict:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.limit < 1:
            raise UserError(f"--limit {args.limit} must be >= 1")
        if args.json:
            check_writable(args.json, "--json", directory=False)  # before the target runs
        if args.threads:
            torch.set_num_threads(args.threads)
        target = load_target(args.target, dtype=args.dtype)
        examples, report = build_examples(target.tokenizer, args.data, max_length=args.max_length, limit=args.limit)
    except UserError as err:
        raise SystemExit(f"confidence: {err}") from None
    print(report.summary())
    table = confidence(target, examples)
    print(f"{target.name}, {len(examples)} rows of {args.data}: the target's probability p of its own argmax")
    print(f"{'answer tokens':>14} {'tokens':>7} {'p<0.5':>6} {'0.5-0.9':>8} {'p>=0.9':>7} {'mean p':>7}")
    for key, row in table.items():
        low, mid, high = row["share"]
        print(f"{key:>14} {row['tokens']:>7} {low:>6.3f} {mid:>8.3f} {high:>7.3f} {row['mean_p']:>7.3f}")
    result = {"target": target.name, "data": args.data, "examples": len(examples), "bands": list(BANDS), "table": table}
    if args.json:
        write_text_atomic(args.json, json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
