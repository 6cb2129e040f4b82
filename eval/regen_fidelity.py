"""How faithfully two regenerations of the same prompts agree: how many replies are identical, and where and why
the others first part.

    python eval/regen_fidelity.py REFERENCE.jsonl OTHER.jsonl [OTHER2.jsonl ...] --target smollm2-135m-instruct \
        [--tie 0.01] [--json report.json]

The files are train/regenerate.py outputs of the same prompts (greedy), e.g. in-process and through llama-server.
Conversations are matched by id and compared turn by turn; a turn is compared only while all earlier turns were
identical (after a difference the prompts differ). Where two replies part, both are tokenised with the target's
tokenizer and the first differing token is scored by the in-process target after the shared prefix: its rank of
each engine's token, and the relative gap (top logit - logit) / |top logit| of the worse of the two. A parting
within --tie of the top is a near tie that arithmetic noise (another summation order, quantisation) can flip; a
larger gap means the other engine computes a different model there.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

from drafters.decode.referee import parting
from drafters.errors import UserError
from drafters.targets import load_target
from drafters.training.data import render


def read(path: Path) -> dict:
    if not path.is_file():
        raise UserError(f"{path}: no such file (a train/regenerate.py output)")
    rows = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
                rows[str(row["id"])] = row["conversations"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise UserError(f"{path}:{number}: not a row written by train/regenerate.py ({err!r})") from None
    return rows


def compare(target, reference: dict, other: dict, tie: float) -> dict:
    tokenizer = target.tokenizer
    shared = sorted(set(reference) & set(other))
    identical, partings = 0, []
    for row_id in shared:
        a, b = reference[row_id], other[row_id]
        for turn, (x, y) in enumerate(zip(a, b)):
            if x["role"] != "assistant" or x == y:
                continue
            prompt = tokenizer(render(tokenizer, a[:turn], add_generation_prompt=True),
                               add_special_tokens=False)["input_ids"]
            ids_a = tokenizer(x["content"], add_special_tokens=False)["input_ids"]
            ids_b = tokenizer(y["content"], add_special_tokens=False)["input_ids"]
            part = parting(target, prompt, ids_a, ids_b)
            if part is None:  # one reply is a prefix of the other: one engine stopped (EOS or length) earlier
                partings.append({"id": row_id, "turn": turn, "at": min(len(ids_a), len(ids_b)), "kind": "one stops",
                                 "lengths": [len(ids_a), len(ids_b)]})
            else:
                partings.append({
                    "id": row_id, "turn": turn, "at": part.at, "ranks": list(part.ranks),
                    "relative_gap": part.relative_gap, "kind": "near tie" if part.near_tie(tie) else "not a tie",
                    "tokens": [tokenizer.decode([t]) for t in part.tokens],
                    "context": tokenizer.decode(ids_a[max(part.at - 8, 0) : part.at])})
            break
        else:
            identical += len(a) == len(b)
    return {"compared": len(shared), "identical": identical, "partings": partings,
            "only_in_one": len(set(reference) ^ set(other))}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reference", type=Path)
    p.add_argument("others", type=Path, nargs="+")
    p.add_argument("--target", required=True, help="the target both files were generated with (scores partings)")
    p.add_argument("--tie", type=float, default=0.01, help="relative logit gap that counts as a near tie")
    p.add_argument("--json", type=Path, help="write the full report here")
    args = p.parse_args(argv)
    reference = read(args.reference)
    target = load_target(args.target)
    report = {"reference": str(args.reference), "target": args.target, "tie": args.tie, "files": {}}
    for path in args.others:
        result = compare(target, reference, read(path), args.tie)
        report["files"][str(path)] = result
        print_result(path, result, args.tie)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1, ensure_ascii=False))


def print_result(path: Path, r: dict, tie: float) -> None:
    partings = r["partings"]
    kinds = {k: sum(p["kind"] == k for p in partings) for k in ("near tie", "not a tie", "one stops")}
    where = f", first difference at token {statistics.median(p['at'] for p in partings):.0f} (median)" if partings else ""
    print(f"\n{path}: {r['identical']}/{r['compared']} conversations identical{where}; partings: "
          f"{kinds['near tie']} at a near tie (relative gap <= {tie:g}), {kinds['not a tie']} not a tie, "
          f"{kinds['one stops']} where one reply is a prefix of the other"
          + (f"; {r['only_in_one']} ids in only one file" if r["only_in_one"] else ""))
    if partings:
        print(f"  {'id':<10} {'turn':>4} {'token':>5} {'ranks':>7} {'gap':>8}  tokens (reference | other) after ...")
    for q in partings:
        if q["kind"] == "one stops":
            print(f"  {q['id']:<10} {q['turn']:>4} {q['at']:>5} {'':>7} {'':>8}  one stops: lengths {q['lengths']}")
        else:
            print(f"  {q['id']:<10} {q['turn']:>4} {q['at']:>5} {str(tuple(q['ranks'])):>7} {q['relative_gap']:>8.2e}"
                  f"  {q['tokens'][0]!r} | {q['tokens'][1]!r} after {q['context']!r}")


if __name__ == "__main__":
    try:
        main()
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
