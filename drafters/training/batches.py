"""Training rows to batches: the train / held-out split, length-bucketed batches that a resumed or
multi-process run can rebuild exactly, the step plan and the lr schedule. Knows nothing about drafters.
"""

import math
from functools import partial

import torch
from torch.utils.data import DataLoader

from drafters.targets import Target
from drafters.training.data import Example, build_examples, collate, repeat_mask
from drafters.training.recipe import RecipeError
from drafters.training.schema import Optim


def max_length_for(target: Target, max_length: int, say) -> int:
    """data.max_length, cut to the target's context: a longer row would train on positions the target never saw
    (and past a learned position table, fail). Said once, as the data report's first line."""
    context = getattr(target.config, "max_position_embeddings", None)
    if context and max_length > context:
        say(f"data.max_length={max_length} is above {target.name}'s context of {context} positions: rows are cut to "
            f"{context} tokens (set data.max_length={context} or less to have the recipe say so)")
        return context
    return max_length


def load_examples(recipe, target: Target, say) -> tuple[list[Example], list[Example]]:
    data = recipe.data
    max_length = max_length_for(target, data.max_length, say)
    examples, report = build_examples(target.tokenizer, data.path, max_length=max_length,
                                      fmt=data.fmt, split=data.split, limit=data.limit, reasoning=data.reasoning,
                                      template_kwargs=data.chat_template_kwargs)
    say(report.summary())
    # The split is by data row (a row trained one assistant turn per example keeps all its turns on one side): a
    # permutation by data.seed of the usable rows, so the same file, max_length and limit give the same held-out rows
    # whatever the training seed. With one example per row it is the permutation of the examples.
    rows = list(dict.fromkeys(e.row for e in examples))  # in file order
    num_held_out = data.eval_rows if data.eval_rows is not None else round(len(rows) * data.eval_fraction)
    if num_held_out >= len(rows):
        raise RecipeError(f"data.eval_rows / eval_fraction hold out {num_held_out} of the {len(rows)} "
                          "usable rows, leaving none to train on; lower them")
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(data.seed)).tolist()
    kept = order[num_held_out:] if data.train_rows is None else order[num_held_out:num_held_out + data.train_rows]
    held_out_rows, train_row_set = {rows[i] for i in order[:num_held_out]}, {rows[i] for i in kept}
    held_out = [e for e in examples if e.row in held_out_rows]
    train_rows = [e for e in examples if e.row in train_row_set]
    say(f"{len(train_rows)} training examples ({sum(map(num_tokens, train_rows))} tokens), "
        f"{len(held_out)} held out")
    if data.drop_repeats is not None:
        learnt = sum(sum(e.loss_mask) for e in train_rows)
        dropped = learnt - sum(sum(repeat_mask(e.input_ids, e.loss_mask, data.drop_repeats)) for e in train_rows)
        say(f"data.drop_repeats={data.drop_repeats}: {dropped} of the {learnt} answer tokens of the training rows "
            f"({dropped / max(learnt, 1):.1%}) repeat an earlier {data.drop_repeats}-token span of their example "
            "and are left out of the loss")
    return train_rows, held_out


def pad_id(target: Target) -> int:
    tokenizer = target.tokenizer
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(target.eos_token_ids)


def num_tokens(example: Example) -> int:
    return len(example.input_ids)


class LengthBuckets:
    """Batches of similar lengths, so padding stays small. Each pass shuffles the rows, sorts every
    window of `window` batches by length, cuts it into batches and shuffles the batch order. Pass n
    draws from seed + n: every process of a multi-process run sees the same batches, and a resumed
    run can rebuild any pass. `resume(pass_index, skip)` makes the next pass be pass `pass_index`
    with its first `skip` batches left out (batches of all processes: accelerate deals them out
    round-robin)."""

    drop_last = False  # read by accelerate when it shards batches over processes

    def __init__(self, lengths: list[int], batch_size: int, seed: int, window: int = 64):
        self.lengths, self.batch_size, self.seed, self.window = lengths, batch_size, seed, window
        self.passes, self.skip = 0, 0

    def __len__(self) -> int:
        return math.ceil(len(self.lengths) / self.batch_size)

    def resume(self, pass_index: int, skip: int) -> None:
        self.passes, self.skip = pass_index, skip

    def batches(self, pass_index: int) -> list[list[int]]:
        """Row indices of every batch of pass `pass_index`, in the order the pass yields them."""
        generator = torch.Generator().manual_seed(self.seed + pass_index)
        order = torch.randperm(len(self.lengths), generator=generator).tolist()
        span, batches = self.batch_size * self.window, []
        for start in range(0, len(order), span):
            rows = sorted(order[start:start + span], key=self.lengths.__getitem__)
            batches += [rows[i:i + self.batch_size] for i in range(0, len(rows), self.batch_size)]
        return [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]

    def __iter__(self):
        batches, skip = self.batches(self.passes), self.skip
        self.passes, self.skip = self.passes + 1, 0
        yield from batches[skip:]


def train_loader(recipe, rows: list[Example], pad: int) -> DataLoader:
    sampler = LengthBuckets([num_tokens(e) for e in rows], recipe.batch_size, recipe.seed)
    return DataLoader(rows, batch_sampler=sampler, collate_fn=partial(collate, pad_id=pad, **padding(recipe.data)))


def padding(data) -> dict:
    """collate's keywords for training batches of the recipe's `data` section."""
    return {"drop_repeats": data.drop_repeats, "multiple": data.pad_multiple, "cap": data.max_length}


def length_sorted_batches(rows: list[Example], batch_size: int) -> list[list[Example]]:
    rows = sorted(rows, key=num_tokens)
    return [rows[i:i + batch_size] for i in range(0, len(rows), batch_size)]


def plan_steps(recipe, batches_per_epoch: int) -> int:
    # Micro-batches left over at the end of an epoch start the next epoch's first step.
    by_epochs = None if recipe.epochs is None else recipe.epochs * batches_per_epoch // recipe.grad_accum
    total = min(s for s in (by_epochs, recipe.max_steps) if s is not None)
    if total < 1:
        raise RecipeError(f"{batches_per_epoch} batches per epoch x epochs={recipe.epochs} is less than one "
                          f"optimizer step of grad_accum={recipe.grad_accum} batches; use more data or epochs")
    return total


def lr_factor(optim: Optim, total_steps: int, step: int) -> float:
    # step counts optimizer steps from 0; the lr of step s is optim.lr * lr_factor(s)
    if step < optim.warmup_steps:
        return (step + 1) / optim.warmup_steps
    if optim.schedule == "constant":
        return 1.0
    progress = (step - optim.warmup_steps) / max(1, total_steps - optim.warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * progress))
