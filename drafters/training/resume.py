"""What a training run keeps on disk and how it comes back: claiming output_dir (a lock, never replacing an
earlier run unasked), resumable checkpoints (the drafter files plus accelerate's trainer state and the data
position, written atomically), a full disk, and resume's checks (same family, target, recipe and data).
"""

import dataclasses
import json
import math
import re
import shutil
import typing
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from drafters.checkpoint import (
    CheckpointError,
    check_target,
    damage,
    load_checkpoint,
    save_checkpoint,
    step_checkpoints,
)
from drafters.draft_vocab import DraftVocab
from drafters.errors import UserError
from drafters.files import check_writable, data_sha256, disk_full, hold_lock
from drafters.training.recipe import RecipeError
from drafters.training.schema import move_old_keys


@dataclass
class Position:
    """Where the data stream stands at an optimizer-step boundary: `passes` complete passes over the
    training rows, then `micro` micro-batches (of each process) of the next pass."""

    passes: int = 0
    micro: int = 0


LOCK_FILE = ".run.lock"
# What a run writes into output_dir: what a new run would replace and overwrite_output_dir removes.
RUN_FILES = re.compile(r"checkpoint-(\d+|final)|metrics\.jsonl|eval\.jsonl")


def earlier_run_files(output_dir) -> list[Path]:
    directory = Path(output_dir)
    return sorted(p for p in directory.iterdir() if RUN_FILES.fullmatch(p.name)) if directory.is_dir() else []


def claim_output_dir(recipe, accelerator) -> None:
    """A new run never silently replaces an earlier one (its checkpoint-final, its metrics, and its
    checkpoint-<step> that resume_from=latest would later pick up): it is continued (resume_from),
    removed on request (overwrite_output_dir), or refused. Every process checks; the main one removes.
    The main process first locks output_dir for the run's life (.run.lock): a second run started into it,
    even at the same moment, is refused with the first one's PID."""
    if accelerator.is_main_process:
        check_writable(recipe.output_dir, "output_dir=", directory=True)
        hold_lock(Path(recipe.output_dir) / LOCK_FILE, f"output_dir={recipe.output_dir}")
    found = earlier_run_files(recipe.output_dir)
    if not found:
        return
    names = ", ".join(p.name for p in found[:6]) + (", ..." if len(found) > 6 else "")
    if recipe.overwrite_output_dir and recipe.resume_from is not None:
        raise RecipeError(f"overwrite_output_dir=true removes the run in {recipe.output_dir} and resume_from="
                          f"{recipe.resume_from} continues one: set only one of them")
    if not recipe.overwrite_output_dir and recipe.resume_from is None:
        raise RecipeError(f"output_dir={recipe.output_dir} holds an earlier run ({names}); a new run there would "
                          "replace its checkpoint-final and metrics. Continue it with resume_from=latest, start over "
                          "with overwrite_output_dir=true (removes those files only), or choose another output_dir")
    accelerator.wait_for_everyone()  # every process has looked before the main one removes
    if recipe.overwrite_output_dir and accelerator.is_main_process:
        accelerator.print(f"overwrite_output_dir=true: removing {names} from {recipe.output_dir}")
        for path in found:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
    accelerator.wait_for_everyone()


TRAINER_DIR, POSITION_FILE = "trainer", "position.json"


def save_run_checkpoint(accelerator, path: Path, step: int, position: Position | None, tokens: int,
                        **checkpoint) -> Path:
    """A checkpoint that also resumes: the drafter files (drafters.checkpoint) plus trainer/ =
    accelerate's state (optimizer, lr scheduler, RNG states of every process, and the prepared
    model, sharded as the engine shards it) and the data position, all in one atomic write.
    position None: the drafter files only, by the main process. Called by every process; `checkpoint` =
    save_checkpoint's keyword arguments."""
    path = Path(path)
    with disk_full_says(path):
        if position is None:
            if accelerator.is_main_process:
                save_checkpoint(path, **checkpoint)
        else:
            save_resumable(accelerator, path, step, position, tokens, checkpoint)
    accelerator.wait_for_everyone()
    return path


def save_resumable(accelerator, path: Path, step: int, position: Position, tokens: int, checkpoint: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-resumable")
    if accelerator.is_main_process:
        if tmp.exists():
            shutil.rmtree(tmp)  # left by a run killed while saving
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(str(tmp / TRAINER_DIR))
        accelerator.wait_for_everyone()
    except BaseException:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if accelerator.is_main_process:
        def write_position(directory: Path) -> None:
            (directory / TRAINER_DIR / POSITION_FILE).write_text(json.dumps(
                {"step": step, "passes": position.passes, "micro": position.micro, "tokens": tokens,
                 "num_processes": accelerator.num_processes}))
        save_checkpoint(path, write_more=write_position, tmp=tmp, **checkpoint)


class Finished(RecipeError):
    """The run to resume already ended at this recipe's last step: nothing to train (a `measure:` section still
    runs: drafters.training.families.train_main)."""


class DiskFull(UserError):
    """The disk filled while a checkpoint was written; nothing is half-written, the message says what resumes."""


@contextmanager
def disk_full_says(path: Path):
    """A full disk while saving ends the run with what to do (the writes are atomic: the temporary
    directory is gone and earlier checkpoints are intact), not an OSError traceback."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - re-raised unless it is a full disk
        if not disk_full(err):
            raise
        saved = [p for _, p in step_checkpoints(path.parent) if (p / TRAINER_DIR / POSITION_FILE).is_file()]
        then = f"resume from {saved[-1]} (resume_from=latest)" if saved else "run again (no checkpoint was saved yet)"
        raise DiskFull(f"no space left on device while writing {path.name} to {path.parent}; nothing was "
                         f"half-written; free space and {then}") from None


def resume_checkpoint(recipe, say) -> Path | None:
    """recipe.resume_from: null (fresh run), 'latest' (the newest complete resumable checkpoint of output_dir,
    skipping damaged ones with a printed line; a fresh run when there is none) or a checkpoint directory."""
    if recipe.resume_from is None:
        return None
    if recipe.resume_from != "latest":
        return resumable(Path(recipe.resume_from))
    found = resumable_checkpoints(Path(recipe.output_dir))
    for path in reversed(found):
        problem = damage(path)
        if problem is None:
            return path
        say(f"resume_from=latest: skipping {path}, it is incomplete: {problem}")
    if found:
        raise RecipeError(f"resume_from=latest: every checkpoint in {recipe.output_dir} is damaged (see above); "
                          "set overwrite_output_dir=true (and resume_from=null) to start over")
    return None


def resumable_checkpoints(output_dir: Path) -> list[Path]:
    """The checkpoints of output_dir that resume, oldest first: checkpoint-<step> and a finished run's
    checkpoint-final, at its step. So raising max_steps continues a finished run from its end: the newest numbered
    checkpoint is older than it, and resuming that would train its steps again and replace it. At the same step a
    checkpoint-<step> counts as the newer: only a later run, resumed from an earlier checkpoint, writes one there."""
    found = [(step, 1, p) for step, p in step_checkpoints(output_dir) if (p / TRAINER_DIR / POSITION_FILE).is_file()]
    final = output_dir / "checkpoint-final"
    if (final / TRAINER_DIR / POSITION_FILE).is_file():  # unreadable: first in line, where damage() names it
        step = final_step(final)
        found.append((math.inf if step is None else step, 0, final))
    elif final.is_dir():
        check_final_is_behind(final, found)
    return [path for *_, path in sorted(found)]


def final_step(final: Path) -> int | None:
    """The step checkpoint-final was saved at (drafter.json's extra.step); None when unreadable."""
    try:
        return int(json.loads((final / "drafter.json").read_text())["extra"]["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_final_is_behind(final: Path, found: list[tuple[int, int, Path]]) -> None:
    """A checkpoint-final without trainer state (written by an older version of drafters) cannot be continued; the
    checkpoint-<step> resume_from=latest would take instead is only right when it is newer (an interrupted later
    run). Otherwise resuming it would rewind the finished run and replace its checkpoint-final: refused."""
    step = final_step(final)
    newest = found[-1] if found else None
    if newest is not None and step is not None and newest[0] > step:
        return
    said = f"resume_from=latest: {final}" + (f" (step {step})" if step is not None else "") + " holds no trainer " \
        "state (an older version of drafters wrote it), so the finished run cannot be continued from it"
    start_anew = f"start a new run from its weights (init_from={final}, another output_dir)"
    if newest is None or step is None:
        raise RecipeError(f"{said}; {start_anew}, or train it again (overwrite_output_dir=true, resume_from=null)")
    raise RecipeError(f"{said}, and resuming {newest[2].name} would train steps {newest[0] + 1}-{step} again and "
                      f"replace it; {start_anew}, or name resume_from={newest[2]} to train those steps again")


def check_trusted(path: Path, recipe) -> None:
    """Resuming unpickles the trainer state (accelerate's scheduler and RNG states, DeepSpeed's and FSDP's optimizer
    shards): a crafted file runs code. A checkpoint this run's own output_dir holds was written by this run; one
    from elsewhere must be said to be trusted (trust_checkpoint=true)."""
    own = Path(recipe.output_dir).resolve()
    if own in path.resolve().parents or recipe.trust_checkpoint:
        return
    raise RecipeError(f"resume_from={path} is outside output_dir={recipe.output_dir}: resuming unpickles its trainer "
                      "state (optimizer, scheduler and RNG states, as accelerate, DeepSpeed and FSDP save them), and "
                      "a pickle can run code. Resume only a checkpoint you trust, and say so with "
                      "trust_checkpoint=true")


def resumable(path: Path) -> Path:
    if not (path / TRAINER_DIR / POSITION_FILE).is_file():
        raise RecipeError(f"resume_from={path}: not a resumable checkpoint (no {TRAINER_DIR}/{POSITION_FILE}); "
                          "the checkpoint-<step> and checkpoint-final directories of a training run are, exported "
                          "ones and the checkpoint-final of older versions of drafters are not")
    problem = damage(path)
    if problem is not None:
        raise RecipeError(f"resume_from={path}: the checkpoint is incomplete: {problem}; resume an earlier one "
                          "(resume_from=latest skips damaged checkpoints)")
    return path


# Recipe keys (dotted within a section) that may change between a run and its resumption without changing what is
# trained.
RESUMABLE_CHANGES = {"resume_from", "allow_recipe_changes", "overwrite_output_dir", "trust_checkpoint", "output_dir",
                     "max_steps",
                     "log_every", "save_every", "eval_every", "keep_last", "threads", "wandb_project", "wandb_name",
                     "measure", "features.make"}


def recipe_diff(saved: dict, current: dict, prefix: str = "", schema: type | None = None) -> list[str]:
    """'name: old -> new' for each recipe value that differs between a checkpoint's recipe and this one,
    except RESUMABLE_CHANGES, fields this recipe's schema does not have (never read by this run: e.g. another
    family's section, saved by an older version whose one schema held several families) and fields the
    checkpoint's recipe lacks that are at their default in `schema` (the recipe's dataclass): fields added by a
    later version of drafters default to the behaviour they did not have before, so a run resumes across an
    upgrade."""
    lines = []
    defaults = {f.name: f for f in dataclasses.fields(schema)} if schema is not None else {}
    hints = typing.get_type_hints(schema) if schema is not None else {}
    for key in sorted(set(saved) | set(current)):
        name = prefix + key
        if name in RESUMABLE_CHANGES or schema is not None and key not in defaults:
            continue
        old, new = saved.get(key, "<absent>"), current.get(key, "<absent>")
        if key not in saved and key in defaults and new == field_default(defaults[key]):
            continue
        if isinstance(old, dict) and isinstance(new, dict):
            nested = hints.get(key)
            lines += recipe_diff(old, new, name + ".", nested if dataclasses.is_dataclass(nested) else None)
        elif old != new:
            lines.append(f"{name}: {old!r} -> {new!r}")
    return lines


def field_default(f: dataclasses.Field):
    """A recipe field's default as plain data (to_dict's form), or a sentinel where it has none."""
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return object()
    return asdict(value) if dataclasses.is_dataclass(value) else value


def check_made_for(ckpt, family: str, target, field: str, advice: str) -> None:
    """A checkpoint named by recipe `field` (resume_from, init_from) must be of this family and target."""
    if ckpt.family != family:
        raise RecipeError(f"{field}={ckpt.path}: a {ckpt.family!r} checkpoint, but this recipe trains {family!r}; "
                          f"{advice}")
    try:
        check_target(ckpt, target)
    except CheckpointError as error:
        raise RecipeError(f"{field}: {error}") from None


def check_resume(ckpt, recipe_dict: dict, family: str, target, allow_changes: bool, *,
                 schema: type | None = None) -> None:
    """The checkpoint must be of this family and target, and trained by the same recipe (recipe_diff)."""
    check_made_for(ckpt, family, target, "resume_from",
                   "resume it with its own recipe or start a fresh run (resume_from=null)")
    saved = json.loads(json.dumps(ckpt.extra.get("recipe", {})))  # a copy, laid out as this version reads recipes:
    move_old_keys(saved, schema.moved_keys if schema is not None else {}, f"resume_from={ckpt.path}")
    diff = recipe_diff(saved, recipe_dict, schema=schema)
    if diff and not allow_changes:
        raise RecipeError(f"resume_from={ckpt.path}: the recipe changed since that checkpoint:\n  "
                          + "\n  ".join(diff) + "\nresume with the original values, or set "
                          "allow_recipe_changes=true to continue with the new ones")
    check_same_data(ckpt, recipe_dict["data"]["path"], allow_changes)


def check_same_data(ckpt, path: str, allow_changes: bool) -> None:
    # the split is a permutation of the usable rows: other bytes move training rows into the held-out set
    saved = ckpt.extra.get("data_sha256")  # absent in checkpoints of older versions: nothing to compare
    if saved is None or allow_changes or data_sha256(path) in (None, saved):
        return
    raise RecipeError(f"resume_from={ckpt.path}: data.path={path} changed since that checkpoint (its sha256 differs "
                      "from the one the checkpoint recorded), so the train / held-out split would move and "
                      "training rows could land in the held-out set; resume with the original file, or set "
                      "allow_recipe_changes=true to continue on the new one")


def initial_checkpoint(recipe, target):
    """init_from's checkpoint, refused before any work unless it is a drafter of this recipe's family for this
    target -> drafters.checkpoint.Checkpoint, or None when init_from is null."""
    if recipe.init_from is None:
        return None
    path = Path(recipe.init_from)
    if not (path / "drafter.json").is_file():
        raise RecipeError(f"init_from={path}: not a drafter checkpoint directory (no drafter.json there); name a "
                          "checkpoint-<step> or checkpoint-final directory of an earlier run")
    ckpt = load_checkpoint(path)
    check_made_for(ckpt, recipe.drafter, target, "init_from",
                   f"start from a {recipe.drafter!r} checkpoint or set drafter={ckpt.family}")
    return ckpt


def init_from_gone(recipe, resume: Path | None) -> bool:
    """A resumed init_from run whose init_from checkpoint is gone by now (moved, pruned, on another machine). Its
    own checkpoint holds every weight the run started from (grown, then trained) and its draft vocabulary, and the
    resume restores them: it takes init_from's place (families.train) rather than the resume being refused."""
    return resume is not None and recipe.init_from is not None and \
        not (Path(recipe.init_from) / "drafter.json").is_file()


def load_resumed_weights(drafter, ckpt, init_from: str, say) -> None:
    """init_from_gone: the drafter takes the resumed checkpoint's weights, which must be every one it has (the resume
    then restores them with the trainer state); the recipe's other checks are check_resume's, already passed."""
    own, theirs = drafter.state_dict(), ckpt.state_dict
    lacking = [key for key, value in own.items() if key not in theirs or theirs[key].shape != value.shape]
    if lacking:
        raise RecipeError(f"init_from={init_from} is gone and resume_from={ckpt.path} lacks weights of the drafter "
                          f"this recipe builds ({', '.join(lacking[:4])}{', ...' if len(lacking) > 4 else ''}); put "
                          "init_from's checkpoint back, or resume with the recipe that checkpoint was trained with")
    drafter.load_state_dict({key: theirs[key] for key in own}, strict=True)
    say(f"init_from={init_from} is gone: the drafter's weights and draft vocabulary are those of {ckpt.path}, "
        "which holds every one")


def initial_vocab(ckpt):
    """The draft vocabulary of init_from's checkpoint: a run started from its weights keeps its vocabulary (the
    LM head's rows are its ids), whatever draft_vocab_size / draft_vocab_coverage would count on the new data."""
    return DraftVocab.from_state_dict(ckpt.state_dict, source=str(ckpt.path))


def load_initial_weights(drafter, ckpt, say, grow_vocab: bool = False, grow_layers: bool = False) -> None:
    """init_from: the freshly built `drafter` takes the checkpoint's weights. Its architecture comes from the
    recipe, so every config field must equal the checkpoint's (a field the checkpoint predates: its default), but
    draft_vocab_size under grow_vocab and num_hidden_layers under grow_layers; the refusal names each one."""
    built = json.loads(json.dumps(asdict(drafter.config)))  # tuples -> lists, as drafter.json stores them
    defaults = {f.name: field_default(f) for f in dataclasses.fields(drafter.config)}
    saved = {**{k: v for k, v in defaults.items() if k in built}, **ckpt.config}
    free = ({"draft_vocab_size"} if grow_vocab else set()) | ({"num_hidden_layers"} if grow_layers else set())
    wrong = [f"{key}: recipe builds {built.get(key)!r}, checkpoint has {saved.get(key)!r}"
             for key in sorted((set(built) | set(saved)) - free) if built.get(key) != saved.get(key)]
    if wrong:
        raise RecipeError(f"init_from={ckpt.path}: this recipe builds another drafter than the checkpoint holds:\n  "
                          + "\n  ".join(wrong) + "\nset the recipe's fields that build these (layers, norms, sizes) "
                          "to the checkpoint's values (its drafter.json, extra.recipe)")
    state = dict(ckpt.state_dict)
    said = ""
    if grow_layers:
        state |= added_layers(drafter, ckpt, saved["num_hidden_layers"])
        said += f"; its {saved['num_hidden_layers']} decoder layer(s) carry over, the " \
            f"{drafter.config.num_hidden_layers - saved['num_hidden_layers']} added start as the identity"
    if grow_vocab:
        state = widened_state(ckpt, drafter, state)
        said += f"; its {ckpt.state_dict['d2t'].numel()} draft ids' head rows sit in a vocabulary of " \
            f"{state['d2t'].numel()}, the new ids' rows start at zero"
    drafter.load_state_dict(state, strict=True)
    say(f"init_from: the drafter starts from {ckpt.path} (step {ckpt.extra.get('step', '?')} of its run){said}; "
        "optimizer, schedule and step start fresh")


def added_layers(drafter, ckpt, had: int) -> dict:
    """grow_layers: the tensors of the EAGLE-3 drafter's layers had .. n-1 (drafters.eagle3: layers.1 ..; layer 0 is
    midlayer), each started as the identity (Eagle3DeeperLayer.start_as_identity), so stacked on the checkpoint's
    layers they pass its last layer's output through unchanged."""
    have = drafter.config.num_hidden_layers
    if have <= had:
        raise RecipeError(f"init_from={ckpt.path}: eagle3.grow_layers: the checkpoint already has {had} decoder "
                          f"layer(s) and eagle3.num_layers={have}; set eagle3.num_layers above {had}, or drop "
                          "eagle3.grow_layers")
    state = {}
    for i in range(had, have):
        layer = drafter.layers[str(i)]
        layer.start_as_identity()
        state |= {f"layers.{i}.{name}": tensor for name, tensor in layer.state_dict().items()}
    return state


def widened_state(ckpt, drafter, theirs_state: dict | None = None) -> dict:
    """grow_vocab: init_from's weights for a drafter whose draft vocabulary holds the checkpoint's ids and more
    (drafters.training.eagle3.choose_draft_vocab's keep). A tensor with one row per draft id (the LM head,
    (Vd_old, h)) becomes (Vd_new, h): the checkpoint's row of target id t moves to t's row in the new vocabulary,
    the rows of new ids are zero. So a new id's logit starts at 0 and the grown drafter drafts what the checkpoint
    drafted wherever its best logit is above 0; the target LM head's rows instead (a fresh run's start) outscore
    the trained rows, whose hidden space has drifted from the target's (a SmolLM2-135M drafter's first-draft
    training accuracy: 0.02 over the first 10 steps, against 0.72 at its own vocabulary). d2t / t2d are the new
    vocabulary's; every other tensor is the checkpoint's (theirs_state: the checkpoint's as grow_layers extended it),
    of the same shape."""
    theirs_state = ckpt.state_dict if theirs_state is None else theirs_state
    own = drafter.state_dict()
    old, new = initial_vocab(ckpt), DraftVocab.from_state_dict(own, source="the grown drafter")
    rows, inside = new.to_draft(old.used.to(new.t2d.device))  # (Vd_old,) new draft row of each old id
    if not bool(inside.all()):
        raise RecipeError(f"init_from={ckpt.path}: grow_vocab built a vocabulary without all of the checkpoint's ids")
    state = {}
    for key, mine in own.items():
        theirs = theirs_state.get(key)
        if key in ("d2t", "t2d"):
            state[key] = mine
        elif theirs is None:
            raise RecipeError(f"init_from={ckpt.path}: the checkpoint has no {key!r} tensor")
        elif theirs.shape == mine.shape:
            state[key] = theirs
        elif theirs.shape[1:] == mine.shape[1:] and (theirs.shape[0], mine.shape[0]) == (old.size, new.size):
            state[key] = torch.zeros_like(mine)
            state[key][rows.to(mine.device)] = theirs.to(mine.dtype)
        else:
            raise RecipeError(f"init_from={ckpt.path}: {key} is {tuple(theirs.shape)} in the checkpoint and "
                              f"{tuple(mine.shape)} in the grown drafter, not one row per draft id")
    return state


def load_run_state(accelerator, path: Path, total_steps: int) -> tuple[int, Position, int]:
    """Restores what save_run_checkpoint saved into the prepared objects -> (step, position, tokens)."""
    meta = json.loads((path / TRAINER_DIR / POSITION_FILE).read_text())
    if meta["step"] > total_steps:  # else the final checkpoint would carry its weights under step total_steps
        raise RecipeError(f"resume_from={path}: the checkpoint is at step {meta['step']}, past this run's last step "
                          f"{total_steps} (max_steps / epochs); raise max_steps or resume an earlier checkpoint")
    if meta["step"] == total_steps and path.name == "checkpoint-final":  # resumed, it would only be saved again
        raise Finished(f"resume_from={path}: the run finished at step {total_steps}, this run's last step "
                          "(max_steps / epochs), so there is nothing to continue; raise max_steps to train it further")
    if meta["num_processes"] != accelerator.num_processes:
        raise RecipeError(f"resume_from={path}: saved by {meta['num_processes']} processes, resumed with "
                          f"{accelerator.num_processes}; the data position and RNG states need the same count")
    accelerator.load_state(str(path / TRAINER_DIR))
    return meta["step"], Position(meta["passes"], meta["micro"]), meta["tokens"]
