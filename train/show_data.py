"""Print training rows as the drafter trains them: the tokens a recipe's data file renders to under its target's chat
template, the trained tokens between ⟦ and ⟧ (what the data report only counts).

    python train/show_data.py recipes/eagle3_smollm2.yaml [key=value ...] [--rows 1,7] [--limit 3]

Reads the same recipe (and overrides) as train/train.py: target (its tokenizer and chat template only: the decoder
layers are not loaded), data.path / fmt / split / reasoning / chat_template_kwargs / max_length. --rows picks rows by
their line number in the data file (as the data report names them); without it the first --limit rows are shown.
A row trained one assistant turn per example (templates that rewrite earlier turns) prints one block per turn.
"""

import argparse

from drafters.targets import load_target
from drafters.training.batches import max_length_for
from drafters.training.data import build_examples
from drafters.training.families import load_recipe
from drafters.training.recipe import RecipeError, run_main

OPEN, CLOSE = "⟦", "⟧"


def marked(tokenizer, input_ids: list[int], loss_mask: list[int]) -> str:
    # the rendered text with each run of trained tokens (loss_mask 1) between OPEN and CLOSE
    pieces, run, trained = [], [], False
    for token, keep in zip(input_ids, loss_mask):
        if bool(keep) != trained and run:
            text = tokenizer.decode(run, skip_special_tokens=False)
            pieces.append(f"{OPEN}{text}{CLOSE}" if trained else text)
            run = []
        run.append(token)
        trained = bool(keep)
    if run:
        text = tokenizer.decode(run, skip_special_tokens=False)
        pieces.append(f"{OPEN}{text}{CLOSE}" if trained else text)
    return "".join(pieces)


def main(argv: list[str]) -> list[str]:
    parser = argparse.ArgumentParser(prog="train/show_data.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("--rows", help="comma-separated row numbers (the data file's lines, as the report names them)")
    parser.add_argument("--limit", type=int, default=3, help="rows shown without --rows (default 3)")
    args, overrides = parser.parse_known_args(argv)
    rows = None
    if args.rows:
        try:
            rows = {int(r) for r in args.rows.split(",")}
        except ValueError:
            raise RecipeError(f"--rows {args.rows!r}: expected comma-separated row numbers, e.g. --rows 1,7") from None
    recipe = load_recipe([args.recipe, *overrides])
    target = load_target(recipe.target, dtype=recipe.dtype, decoder=False)
    data = recipe.data
    examples, report = build_examples(target.tokenizer, data.path, fmt=data.fmt, split=data.split, limit=data.limit,
                                      max_length=max_length_for(target, data.max_length, print),
                                      reasoning=data.reasoning, template_kwargs=data.chat_template_kwargs)
    print(report.summary())
    chosen = sorted({e.row for e in examples})[:args.limit] if rows is None else sorted(rows)
    missing = sorted(set(chosen) - {e.row for e in examples})
    if missing:
        print(f"rows {', '.join(map(str, missing))}: not among the usable rows (the report above says which were "
              "skipped and why)")
    blocks = []
    for e in (e for e in examples if e.row in chosen):
        turn = f", assistant turn {e.turn}" if e.turn else ""
        blocks.append(f"--- {e.source}:{e.row}{turn}: {len(e.input_ids)} tokens, {sum(e.loss_mask)} trained "
                      f"(between {OPEN} {CLOSE})\n{marked(target.tokenizer, e.input_ids, e.loss_mask)}")
        print(blocks[-1])
    return blocks


if __name__ == "__main__":
    run_main(main)
