"""Making a recipe's feature store: what train/features.py runs, and what training runs first when the recipe sets
`features.make: true` and its features.dir holds no finished store (so a recipe with a store is one command).

The store itself (format, resume, update, reading) is drafters.training.features; this module only turns a recipe
into the call: the target at the recipe's dtype, the recipe's examples, the family's header.
"""

from pathlib import Path

import torch

from drafters.files import check_writable
from drafters.targets import load_target
from drafters.training.batches import max_length_for
from drafters.training.data import build_examples
from drafters.training.features import Processes, features_header, read_index, write_features
from drafters.training.recipe import RecipeError


def store_finished(directory: str) -> bool:
    """features.dir holds a store whose every shard was written (index.json says complete); an index that is not
    JSON is refused naming it (drafters.training.features.read_index)."""
    return bool((read_index(Path(directory)) or {}).get("complete"))


def make_store(recipe, family, where: str = "train/features.py") -> dict:
    """Run recipe.target over every usable example of recipe.data and write (or finish, or with features.update
    update) the store in recipe.features.dir -> its index. `where` names the caller in refusals."""
    if not family.offline:
        raise RecipeError(f"{where}: drafter={recipe.drafter} trains online only (a target forward per batch); "
                          "there are no features to store for it")
    if not recipe.features.dir:
        raise RecipeError(f"{where}: features.dir is not set: pass features.dir=DIR (where to write the features; "
                          "train/train.py streams from it when the recipe sets it)")
    if recipe.split_target:
        raise RecipeError(f"{where}: split_target=true is for online training; a store is written by processes that "
                          "each hold the whole target, and a run from it loads none of the target's decoder layers: "
                          "set split_target=false")
    check_writable(recipe.features.dir, "features.dir=", directory=True)  # before the target loads
    if recipe.threads:
        torch.set_num_threads(recipe.threads)
    processes, device = launched_processes()
    target = load_target(recipe.target, dtype=recipe.dtype)
    target.model.to(device)
    header = features_header(recipe, target, family)
    data = recipe.data
    say = print if processes.rank == 0 else lambda line: None
    max_length = max_length_for(target, data.max_length, say)
    examples, report = build_examples(target.tokenizer, data.path, max_length=max_length, fmt=data.fmt,
                                      split=data.split, limit=data.limit, reasoning=data.reasoning,
                                      template_kwargs=data.chat_template_kwargs)
    say(report.summary())
    return write_features(recipe.features.dir, target, examples, header, batch_size=recipe.batch_size,
                          processes=processes, update=recipe.features.update)


def launched_processes() -> tuple[Processes, torch.device]:
    """One process, or the processes `accelerate launch` / torchrun started (gloo on CPUs): each writes its share
    of the shards on its own device."""
    from accelerate import PartialState

    state = PartialState(cpu=not torch.accelerator.is_available())
    return Processes(state.process_index, state.num_processes, state.wait_for_everyone), state.device
