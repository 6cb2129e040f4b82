"""Held-out top-1 accuracy by TTT step of an EAGLE-3 drafter, ours or another trainer's export, measured one way.

    python eval/heldout.py --target smollm2-135m-instruct --proposer outputs/peers/x/runs/speculators-defaults-s0/out/0 \
        --data recipes/data/smollm2_general.jsonl --rows 5120:5184 --steps 7 --json heldout.json

The drafter loads as our decoder loads it (drafters.decode.proposers.loading: a checkpoint of ours, an SGLang or vLLM
export, speculators' or SpecForge's included). The rows [A, B) (or I,J,K) of --data (data row indices, rendered with the
target's chat template and loss mask as training renders them, cut at --max-length) go through the frozen target
(online: no feature store) and the drafter's training-time test over --steps steps, teacher-forced on the true
tokens and on the drafter's own hidden states, by training's own held-out loop
(drafters.training.eagle3.heldout_accuracy, which evaluate_eagle3 runs):

    acc_k           correct top-1 at step k / supervised positions (a target argmax outside the draft vocabulary is a
                    miss: the drafter can never propose it)
    acc_in_vocab_k  the same over the positions whose target argmax is in the draft vocabulary
    tau_pred        1 + sum_k prod_{j<=k} acc_j (a greedy chain of --steps drafts)

so drafters trained by different trainers are compared on the same rows, without decoding.
"""

import argparse
import json
import sys
from functools import partial

import torch

from drafters.decode.proposers.loading import load_proposer
from drafters.decode.tree import parse_tree_spec
from drafters.errors import UserError
from drafters.files import write_text_atomic
from drafters.targets import FrozenHead, load_target
from drafters.training.batches import pad_id
from drafters.training.data import build_examples, collate
from drafters.training.eagle3 import TTTOptions, heldout_accuracy, target_inputs


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--proposer", required=True, help="an EAGLE-3 drafter directory (ours, or an SGLang / vLLM export)")
    p.add_argument("--data", required=True, help="the data file the rows are read from")
    p.add_argument("--rows", required=True, help="A:B, the data rows [A, B) (row indices of --data), or I,J,K")
    p.add_argument("--steps", type=int, default=7, help="TTT steps (depths of the chain) to score")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--dtype", default="auto", help="the target's weights (auto: bf16 where native, as training)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="write the result here (atomically)")
    return p.parse_args(argv)


def row_set(spec: str) -> set[int]:
    """A:B (the rows [A, B)) or I,J,K (those rows) -> the data row indices."""
    start, colon, end = spec.partition(":")
    if colon and start.isdigit() and end.isdigit() and int(end) > int(start):
        return set(range(int(start), int(end)))
    if not colon and all(part.strip().isdigit() for part in spec.split(",")):
        return {int(part) for part in spec.split(",")}
    raise UserError(f"--rows {spec!r}: want A:B with 0 <= A < B (the data rows [A, B)) or a list I,J,K")


def heldout(target, drafter, embed, examples, steps: int, batch_size: int, pad_id: int) -> dict:
    """drafters.training.eagle3.heldout_accuracy (training's held-out scoring) on the target's online features of
    `examples`, batch_size rows at a time, without autocast."""
    head = FrozenHead.from_target(target, "normed")
    dtype = drafter.fc.weight.dtype
    batches = (collate(examples[start:start + batch_size], pad_id) for start in range(0, len(examples), batch_size))
    inputs = partial(target_inputs, target, head, drafter.config.aux_layers, dtype=dtype)
    result = heldout_accuracy(drafter, inputs, embed, batches, TTTOptions(steps=steps), target.device)
    del result["loss"]  # the recipe's loss options are not known here: only the accuracies are comparable
    return result


def main(argv=None) -> dict:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        rows = row_set(args.rows)
        if args.steps < 1:
            raise UserError(f"--steps {args.steps} must be >= 1")
        if args.threads:
            torch.set_num_threads(args.threads)
        target = load_target(args.target, dtype=args.dtype)
        examples, _ = build_examples(target.tokenizer, args.data, max_length=args.max_length, limit=max(rows) + 1)
        examples = [e for e in examples if e.row in rows]
        if not examples:
            raise UserError(f"--rows {args.rows}: no usable row of {args.data} there")
        proposer = load_proposer(args.proposer, target, parse_tree_spec("chain:1"))
        if not hasattr(proposer, "drafter") or not hasattr(proposer.drafter, "ttt_unroll"):
            raise UserError(f"{args.proposer}: not an EAGLE-3 drafter (held-out accuracy by TTT step is EAGLE-3's)")
        result = heldout(target, proposer.drafter, proposer.embed, examples, args.steps, args.batch_size, pad_id(target))
    except (UserError, ValueError) as error:
        raise SystemExit(f"heldout: {error}") from None
    result.update(proposer=args.proposer, data=args.data, rows=args.rows, examples=len(examples), steps=args.steps)
    print(f"held-out top-1 by TTT step [{' '.join(f'{a:.3f}' for a in result['step_acc'])}] over "
          f"{result['supervised']} supervised tokens of {len(examples)} rows; tau_pred (chain of {args.steps}) "
          f"{result['tau_pred']:.3f}")
    if args.json:
        write_text_atomic(args.json, json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
