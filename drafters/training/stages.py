"""A recipe's `stages:`: training passes run in order, each a set of overrides of the shared recipe.

    stages:
      - name: first                  # trains into output_dir/stage-1-first/
        data: {path: a.jsonl}
        optim: {lr: 1.0e-3}
      - name: again                  # output_dir/stage-2-again/, from stage 1's checkpoint-final
        optim: {lr: 3.0e-4, warmup_steps: 0}

Stage i is the recipe with the stage's keys in place of the shared ones (any recipe key but those the chain sets:
CHAINED), trained into output_dir/stage-<i>-<name>/. Stage 1 starts as the recipe does (its init_from, or a fresh
drafter); stage i > 1 from stage i-1's checkpoint-final, as init_from does: its weights and draft vocabulary, a fresh
optimizer, schedule and step. Every stage runs with resume_from=latest, so the same command run again skips the
finished stages (checkpoint-final written) and continues an interrupted one from its newest checkpoint.
output_dir/checkpoint-final is then a link to the last stage's. A stage's input is checked before any stage trains:
a features.dir with no finished store (unless features.make: the stage makes it when its turn comes), a damaged index,
or a store made from another data file, is refused naming the stage and the command that makes the store.

Knows nothing about drafters, targets or the loop: drafters.training.families.train_stages runs what this plans.
"""

import dataclasses
import difflib
import json
import os
import re
import shlex
import typing
from dataclasses import dataclass
from pathlib import Path

import yaml

from drafters.checkpoint import damage
from drafters.files import data_sha256
from drafters.training.features import FeatureStoreError, read_index
from drafters.training.recipe import RecipeError

# what the chain of stages sets in each stage's recipe: a stage that sets one is refused
CHAINED = ("output_dir", "init_from", "resume_from", "overwrite_output_dir", "stages", "drafter")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class Stage:
    index: int  # 1-based, as its folder and messages name it
    name: str
    overrides: tuple[str, ...]  # key=value of the shared recipe, dotted (data.path=..., optim.lr=...)
    directory: Path  # output_dir/stage-<index>-<name>

    @property
    def label(self) -> str:
        return f"stage {self.index} ({self.name})"

    @property
    def final(self) -> Path:
        return self.directory / "checkpoint-final"


def plan_stages(where: str, stages: list, output_dir: str, schema: type) -> list[Stage]:
    """The recipe's `stages:` list -> its Stages, every key checked against the recipe's schema (a stage's
    unknown key is refused naming the stage and the key)."""
    if not stages:
        raise RecipeError(f"{where}: stages: is an empty list; give at least one stage, or remove stages:")
    planned, names = [], set()
    for index, entry in enumerate(stages, 1):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not NAME.fullmatch(entry["name"]):
            raise RecipeError(f"{where}: stage {index} must be a mapping with a name (letters, digits, _ . -) and "
                              f"the recipe keys it changes, e.g. {{name: again, optim: {{lr: 3.0e-4}}}}; got {entry!r}")
        name = entry["name"]
        if name in names:
            raise RecipeError(f"{where}: stage {index} ({name}): the name is given to an earlier stage too; name "
                              "each stage once")
        names.add(name)
        label = f"stage {index} ({name})"
        pairs = stage_keys({k: v for k, v in entry.items() if k != "name"}, schema, f"{where}: {label}")
        chained = [key for key, _ in pairs if key.split(".")[0] in CHAINED]
        if chained:
            raise RecipeError(f"{where}: {label} sets {chained[0]}, which the stages set themselves (each stage "
                              "trains into output_dir/stage-<i>-<name> from the previous stage's checkpoint-final, "
                              "resumed when run again); set it at the recipe's top level, or remove it")
        overrides = tuple(f"{key}={override_value(value)}" for key, value in pairs)
        planned.append(Stage(index, name, overrides, Path(output_dir) / f"stage-{index}-{name}"))
    return planned


def stage_keys(section: dict, schema: type, where: str, prefix: str = "") -> list[tuple[str, object]]:
    """A stage's mapping -> (dotted key, value) for each recipe value it sets; a key the schema lacks is refused
    with the valid keys and the closest match. Recurses into the recipe's sections, not into values that are
    mappings themselves (data.chat_template_kwargs)."""
    fields = {f.name: f for f in dataclasses.fields(schema)}
    hints = typing.get_type_hints(schema)
    pairs = []
    for key, value in section.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1, cutoff=0.5)
            hint = f" (did you mean {prefix + close[0]!r}?)" if close else ""
            raise RecipeError(f"{where}: unknown key {prefix + str(key)!r}{hint}; valid keys"
                              + (f" of {prefix.rstrip('.')}" if prefix else "") + f": {', '.join(sorted(fields))}")
        section_type = next((a for a in (hints[key], *typing.get_args(hints[key])) if dataclasses.is_dataclass(a)),
                            None)
        if section_type is not None and isinstance(value, dict):
            pairs += stage_keys(value, section_type, where, f"{prefix}{key}.")
        else:
            pairs.append((f"{prefix}{key}", value))
    return pairs


def override_value(value) -> str:
    """A stage's value as the command line writes it: a string as it is where YAML reads it back as the same string
    (paths, names), anything else as JSON, which YAML reads (3e-4 -> 0.0003, lists, null)."""
    if isinstance(value, str) and value and not value.startswith(("\"", "'")):
        try:
            if yaml.safe_load(value) == value:
                return value
        except yaml.YAMLError:
            pass
    return json.dumps(value)


def stage_argv(argv: list[str], stage: Stage, previous: Stage | None) -> list[str]:
    """The command line of one stage: the recipe, the command line's overrides, the stage's (which win over the
    shared recipe's and the command line's), then what the chain sets."""
    chain = [f"output_dir={stage.directory}", "resume_from=latest", "stages=null"]
    if previous is not None:
        chain.append(f"init_from={previous.final}")
    return [argv[0], *argv[1:], *stage.overrides, *chain]


def finished(stage: Stage) -> bool:
    """The stage wrote its checkpoint-final (atomically: present means complete, unless damaged since)."""
    return (stage.final / "drafter.json").is_file() and damage(stage.final) is None


# keys train/features.py does not read (the loop's and the optimizer's): left out of the command it is given
NOT_FEATURES = CHAINED + ("optim", "epochs", "max_steps", "save_every", "keep_last", "eval_every", "log_every",
                          "grad_accum", "grow_vocab", "draft_vocab_size", "draft_vocab_coverage")


def features_command(argv: list[str], stage: Stage, *more: str) -> str:
    """The command that writes (or updates) a stage's feature store: the recipe with the command line's and the
    stage's overrides that shape the store."""
    kept = [o for o in (*argv[1:], *stage.overrides) if o.partition("=")[0].strip().split(".")[0] not in NOT_FEATURES]
    return shlex.join(["python", "train/features.py", argv[0], *kept, *more])


def missing_input(argv: list[str], stage: Stage, recipe, offline: bool) -> str | None:
    """One sentence when the stage's data file is not there, or (offline: a family that reads features.dir) its
    features.dir holds no finished store, or one made from another data file than the stage's data.path; None when
    its input is there. The full check (target, layers, dtype) is the store's own, when the stage starts."""
    path = recipe.data.path
    if path.endswith((".json", ".jsonl")) and not Path(path).exists():
        return (f"{stage.label} reads data.path={path}, which does not exist yet; make it first (a recipe with stages "
                "says how in its header), or point the stage's data.path at your file")
    directory = recipe.features.dir if offline else None
    if not directory:
        return None
    try:
        index = read_index(Path(directory))
    except FeatureStoreError as err:
        remake = ("then run this command again (features.make makes it)" if recipe.features.make else
                  f"then make it with: {features_command(argv, stage)}")
        return f"{stage.label} reads features.dir={directory}: {err}; {remake}"
    if recipe.features.make and not (index or {}).get("complete"):
        return None  # the stage makes its store when its turn comes (drafters.training.families.train)
    if index is None:
        return (f"{stage.label} reads features.dir={directory}, which holds no feature store yet; make it first with: "
                f"{features_command(argv, stage)}")
    if not index.get("complete"):
        return (f"{stage.label} reads features.dir={directory}, whose store is not finished; finish it with: "
                f"{features_command(argv, stage)}")
    stored, wanted = index.get("data", {}).get("sha256"), data_sha256(recipe.data.path)
    if wanted is not None and stored != wanted:
        return (f"{stage.label} reads features.dir={directory}, a store made from another data file than its "
                f"data.path={recipe.data.path}; update it with: {features_command(argv, stage, 'features.update=true')}"
                " (or give the stage its own features.dir)")
    return None


def check_output_dir(output_dir: str) -> None:
    """output_dir/checkpoint-final becomes a link to the last stage's: an earlier plain run's is not replaced."""
    final = Path(output_dir) / "checkpoint-final"
    if final.exists() and not final.is_symlink():
        raise RecipeError(f"output_dir={output_dir} holds an earlier run's checkpoint-final, which a recipe with "
                          "stages: replaces by a link to its last stage's; choose another output_dir")


def link_final(output_dir: str, last: Stage) -> Path:
    """output_dir/checkpoint-final -> the last stage's checkpoint-final (a relative link, replaced atomically)."""
    link = Path(output_dir) / "checkpoint-final"
    tmp = link.with_name(f".checkpoint-final.tmp-{os.getpid()}")
    if tmp.is_symlink():
        tmp.unlink()
    os.symlink(Path(last.directory.name) / "checkpoint-final", tmp, target_is_directory=True)
    os.replace(tmp, link)
    return link
