"""Offline target features: run the frozen target once over a recipe's examples, keep what a drafter
family trains on in safetensors shards, and stream them back during training (EAGLE-3 and EAGLE-1).

    python train/features.py recipes/eagle3_tiny.yaml features.dir=outputs/features/eagle3_tiny
    python train/eagle.py recipes/eagle3_tiny.yaml features.dir=outputs/features/eagle3_tiny

A features directory holds
    index.json                header (format, family, layer spec, storage dtype, target info + dtype,
                              data fingerprint) + the finished shards, row / token counts, bytes
    shard-00000.safetensors   examples [k * shard_rows, (k+1) * shard_rows) of ALL usable examples, in
                              data order (the train / held-out split happens at training time):
        features   (N, F)  storage dtype   the feature the family reads. EAGLE-1: F = h, the last hidden
                                           state, pre-norm or normed as eagle1.feature says. EAGLE-3: F = n*h,
                                           the fused aux layers cat(hidden_states[l] for l in layers)
        label_hidden (N, h) storage dtype  EAGLE-3 only: hidden_states[L], the final-normed last hidden state
        input_ids  (N,)    int32           loss_mask (N,) bool
        offsets    (R+1,)  int64           example r = tokens offsets[r]:offsets[r+1] of the shard
        rows       (R,)    int64           the example's row in the data file (how training finds it)
No logits are stored (V x 2 bytes per token, 98 kB for SmolLM2 against 1.2 kB of bf16 feature): the soft-CE
target, the target's distribution at t+1, is recomputed through the frozen head (final norm if pre-norm,
LM head, softcap) from the stored feature_{t+1} (EAGLE-1) or label_hidden_{t+1} (EAGLE-3, at supervised
rows only: drafters.losses.LabelLogits), which is what the target itself computes. EAGLE-3 trains online
through the same LabelLogits, so with float32 storage online and offline losses are bit-identical.

Writing is resumable: each shard goes to a temporary file renamed into place, index.json (rewritten
atomically after each shard) lists the finished ones, and a rerun skips them. With N processes (`accelerate
launch` / torchrun), process r computes shards k = r, r + N, ... and lists them in its own index-rank<r>.json; at
the end process 0 merges those lists into index.json and removes them (a rerun after a crash merges them first).
Every shard holds the same rows and is computed the same way whatever N is, so the store is the 1-process one.
A shard's features depend on its rows' tokens alone, so when the data file grows or changes, features.update=true keeps
every shard that still holds exactly the rows the new data puts there and computes the rest: the updated store is the
one a fresh run writes, shard for shard (appended rows recompute only the last partial shard). Reading refuses features
written for other data (sha256 of the data file's bytes + the data fields that shape the rows), another
target, storage layout or family, and checks every example's tokens and loss mask against the stored ones.
Knows nothing about drafters or training loops; `header` comes from the caller (train/features.py).
"""

import json
import math
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from drafters.checkpoint import target_info
from drafters.dtypes import DTYPES
from drafters.eagle3 import fuse_features
from drafters.files import atomic_path, data_sha256, disk_full, file_sha256, write_text_atomic
from drafters.training.batches import LengthBuckets, num_tokens, padding
from drafters.training.data import Example, collate
from drafters.training.recipe import RecipeError

FORMAT = "drafters-features/1"
INDEX = "index.json"
RANK_INDEX = "index-rank{rank}.json"  # the shards one of several writing processes finished
# shape the stored rows; eval_*, seed split them
DATA_FIELDS = ("fmt", "split", "max_length", "limit", "reasoning", "chat_template_kwargs")
# data fields added since stores were first written: theirs held this value
DATA_ADDED = {"reasoning": "train", "chat_template_kwargs": None}
TARGET_FIELDS = ("name", "model_type", "num_layers", "hidden_size", "vocab_size", "max_position_embeddings",
                 "dtype")
STORED_VALUES = ("features", "label_hidden")  # per-token tensors a shard may hold, besides tokens and masks
class FeatureStoreError(RecipeError):
    pass


# ---- the header: what the features were computed from -------------------------------------------


def features_header(recipe, target, family) -> dict:
    """What the stored tensors depend on, from a feature-level family's recipe, the loaded target and the family being
    trained (drafters.training.families.TrainingFamily: its store_layout and layer_spec)."""
    if not family.offline:
        raise FeatureStoreError(f"offline features (features.dir) are not implemented for drafter={family.name}; "
                                f"unset features.dir to train {family.name} online")
    data = asdict(recipe.data)
    return {
        "format": FORMAT,
        "family": family.store_layout,  # whose layout: dflash reads eagle3's
        "layer_spec": family.layer_spec(recipe, target),
        "dtype": recipe.features.dtype,
        "shard_rows": recipe.features.shard_rows,
        "target": {**target_info(target), "dtype": str(target.dtype).removeprefix("torch.")},
        "data": {"sha256": data_sha256(recipe.data.path), **{k: data[k] for k in DATA_FIELDS},
                 "recipe_section": data},
    }


def header_mismatch(stored: dict, current: dict) -> tuple[str, object, object] | None:
    """-> (field, stored value, current value) of the first difference that changes the stored tensors."""
    checks = [("family", stored.get("family"), current["family"]),
              ("layer_spec.features", stored.get("layer_spec", {}).get("features"),
               current["layer_spec"]["features"]),
              ("dtype", stored.get("dtype"), current["dtype"])]  # bf16 features are not float32 ones
    checks += [(f"target.{k}", stored.get("target", {}).get(k), current["target"][k]) for k in TARGET_FIELDS]
    checks += [(f"data.{k}", stored.get("data", {}).get(k, DATA_ADDED.get(k)), current["data"][k])
               for k in ("sha256", *DATA_FIELDS)]
    return next(((name, a, b) for name, a, b in checks if a != b), None)


# ---- writing -----------------------------------------------------------------------------------------


class Processes:
    """The processes writing one store: this one's rank, how many, and a barrier (no-op for one process)."""

    def __init__(self, rank: int = 0, world: int = 1, barrier=lambda: None):
        self.rank, self.world, self.barrier = rank, world, barrier


def write_features(directory, target, examples: list[Example], header: dict, *, batch_size: int = 8,
                   say=print, processes: Processes | None = None, update: bool = False) -> dict:
    """Runs the target over `examples` (all usable examples, data order) and writes the missing shards, this
    process's share of them when `processes` are several (every process calls this with the same arguments).
    `update`: the directory may hold a store of other data; its shards that hold exactly the rows `examples` put
    there are kept (`_updatable_index`). -> the final index (also in directory/index.json)."""
    directory = Path(directory)
    processes = processes or Processes()
    rank, world = processes.rank, processes.world
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
    processes.barrier()
    header = {**header, "rows": len(examples), "tokens": sum(map(num_tokens, examples))}
    index = _resumable_index(directory, header, examples, update, say if rank == 0 else lambda line: None)
    processes.barrier()  # every process has read the lists before any process adds to them
    dtype, per_shard = DTYPES[header["dtype"]], header["shard_rows"]
    spec = header["layer_spec"]
    num_shards = math.ceil(len(examples) / per_shard)
    mine = range(rank, num_shards, world)
    if world > 1:
        say = partial(_ranked, say, rank)
    mine_tokens = sum(num_tokens(e) for k in mine for e in examples[k * per_shard:(k + 1) * per_shard])
    start = time.perf_counter()
    bar = tqdm(total=mine_tokens, unit="tok", unit_scale=True, desc="features", dynamic_ncols=True,
               disable=rank != 0)
    own = {}  # this process's finished shards (index-rank<r>.json when several processes write)
    for k in mine:
        name = f"shard-{k:05d}.safetensors"
        done = index["shards"].get(name)
        if done is not None:
            problem = shard_problem(directory, name, done)
            if problem is None:
                say(f"features: {name} already complete, skipped")
                bar.update(done["tokens"])
                continue
            say(f"features: {name} {problem}: computing it again")
            del index["shards"][name]
        rows = examples[k * per_shard:(k + 1) * per_shard]
        tensors = shard_tensors(target, rows, spec, dtype, batch_size, bar)
        try:
            with atomic_path(directory / name) as tmp:  # a shard file is complete or absent
                save_file(tensors, tmp, metadata={"format": FORMAT})
            index["shards"][name] = own[name] = {
                "first_row": k * per_shard, "rows": len(rows), "tokens": tensors["input_ids"].numel(),
                "bytes": (directory / name).stat().st_size, "sha256": file_sha256(directory / name)}
            if world == 1:
                _write_index(directory, index)
            else:  # index.json is process 0's to write; each process lists its own shards
                write_text_atomic(directory / RANK_INDEX.format(rank=rank), json.dumps({"shards": own}, indent=2))
        except Exception as err:  # noqa: BLE001 - re-raised unless it is a full disk
            if not disk_full(err):
                raise
            raise FeatureStoreError(
                f"no space left on device while writing {name} to {directory}; the store is consistent "
                f"({k} of {num_shards} shards complete, nothing half-written): free space and run the same command "
                "again to continue. This store will need about "
                f"{header['tokens'] * token_bytes(header) / 2**20:.1f} MiB in all") from None
        say(f"features: {name} written ({len(rows)} examples, {index['shards'][name]['tokens']} tokens, "
            f"{time.perf_counter() - start:.1f}s so far)")
    bar.close()
    processes.barrier()  # every shard is written
    if rank == 0:
        index = _merge_rank_indexes(directory, index)
        missing = [f"shard-{k:05d}.safetensors" for k in range(num_shards)
                   if f"shard-{k:05d}.safetensors" not in index["shards"]]
        if missing:  # a process ended without writing its share: never mark such a store complete
            raise FeatureStoreError(f"{directory}: {len(missing)} shards were not written ({', '.join(missing[:3])}"
                                    f"{', ...' if len(missing) > 3 else ''}); run the same command again to write them")
        index["complete"] = True
        index["bytes"] = sum(s["bytes"] for s in index["shards"].values())
        for path in directory.glob("shard-*.safetensors"):  # left by an update to fewer rows
            if path.name not in index["shards"]:
                path.unlink()
        index["bytes_per_token"] = index["bytes"] / max(index["tokens"], 1)
        _write_index(directory, index)
        for path in directory.glob(RANK_INDEX.format(rank="*")):
            path.unlink()
        say(storage_report(index))
    processes.barrier()  # index.json is final
    return index if rank == 0 else read_index(directory)


def _ranked(say, rank: int, line: str) -> None:
    say(f"[process {rank}] {line}")


def _merge_rank_indexes(directory: Path, index: dict) -> dict:
    """index plus the shards listed in index-rank<r>.json files (left by several processes, finished or
    interrupted), each kept only if its file is what the list says."""
    shards = dict(index["shards"])
    for path in sorted(directory.glob(RANK_INDEX.format(rank="*"))):
        try:
            listed = json.loads(path.read_text())["shards"]
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a list cut short: its shards are computed again
        for name, entry in listed.items():
            if shard_problem(directory, name, entry) is None:
                shards[name] = entry
    return {**index, "shards": shards}


def target_values(target, input_ids: Tensor, attention_mask: Tensor, spec: dict) -> dict[str, Tensor]:
    """One target forward -> the tensors a features directory stores, each (B, T, F)."""
    feature = spec["features"]
    if feature.startswith("fused:"):  # EAGLE-3
        out = target.features(input_ids, attention_mask, layers=spec["layers"], logits=False)
        return {"features": fuse_features(out.hidden_states, spec["layers"]), "label_hidden": out.last_hidden}
    out = target.features(input_ids, attention_mask, pre_norm_last=feature == "pre_norm", logits=False)
    return {"features": out.pre_norm_last if feature == "pre_norm" else out.last_hidden}  # EAGLE-1


def shard_tensors(target, rows: list[Example], spec: dict, dtype: torch.dtype, batch_size: int, bar=None) -> dict:
    """The target's features at every token of `rows` (one target forward per length-sorted batch)."""
    per_row: dict[str, list] = {}
    order = sorted(range(len(rows)), key=lambda i: num_tokens(rows[i]))
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        batch = {k: v.to(target.device) for k, v in collate([rows[i] for i in chunk], 0).items()}
        for name, values in target_values(target, batch["input_ids"], batch["attention_mask"], spec).items():
            stored = per_row.setdefault(name, [None] * len(rows))
            for b, i in enumerate(chunk):
                stored[i] = values[b, :num_tokens(rows[i])].to("cpu", dtype)  # (T_i, F), padding dropped
        if bar is not None:
            bar.update(sum(num_tokens(rows[i]) for i in chunk))
    lengths = torch.tensor([num_tokens(e) for e in rows])
    return {
        **{name: torch.cat(values).contiguous() for name, values in per_row.items()},  # (N, F) each
        "input_ids": torch.tensor([t for e in rows for t in e.input_ids], dtype=torch.int32),  # (N,)
        "loss_mask": torch.tensor([m for e in rows for m in e.loss_mask], dtype=torch.bool),  # (N,)
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),  # (R+1,)
        "rows": torch.tensor([e.row for e in rows], dtype=torch.long),  # (R,)
        "turns": torch.tensor([e.turn for e in rows], dtype=torch.long),  # (R,) drafters.training.data.Example.turn
    }


def shard_problem(directory: Path, name: str, entry: dict, checksum: bool = True) -> str | None:
    """What is wrong with a shard the index lists as written: missing, another size (truncated), or other bytes
    than were written (its sha256; stores written before the checksum was recorded are checked by size).
    checksum=False checks presence and size only: enough for a count in a message, without reading every byte."""
    path = directory / name
    if not path.is_file():
        return "is missing"
    size = path.stat().st_size
    if size != entry["bytes"]:
        return f"has {size} bytes, {entry['bytes']} were written (truncated or replaced)"
    if checksum and "sha256" in entry and file_sha256(path) != entry["sha256"]:
        return "has other bytes than were written (its sha256 differs from the index's)"
    return None


def _resumable_index(directory: Path, header: dict, examples: list[Example], update: bool, say) -> dict:
    index = read_index(directory)
    if index is None:
        return _merge_rank_indexes(directory, {**header, "complete": False, "shards": {}})
    differs = [k for k in ("format", "dtype", "shard_rows", "rows", "tokens") if index.get(k) != header[k]]
    mismatch = header_mismatch(index, header)
    same_but_data = {**header, "data": {**header["data"], "sha256": index.get("data", {}).get("sha256")}}
    if mismatch is not None and header_mismatch(index, same_but_data) is None and not set(differs) - {"rows", "tokens"}:
        return _updatable_index(directory, _merge_rank_indexes(directory, index), header, examples, update, say)
    if differs or mismatch:
        name, old, new = mismatch or (differs[0], index.get(differs[0]), header[differs[0]])
        raise FeatureStoreError(f"{directory / INDEX}: these features were written by another recipe ({name}: "
                                f"{old!r} there, {new!r} now); delete {directory} or choose another features.dir")
    return _merge_rank_indexes(directory, {**index, **header, "complete": False})


def _updatable_index(directory: Path, index: dict, header: dict, examples: list[Example], update: bool, say) -> dict:
    """The store was written for another data file, and only the data differs (same target, layers, dtype, data
    fields, shard_rows). Shard k holds examples[k * shard_rows:(k + 1) * shard_rows] of whatever data it was written
    for, computed from their tokens alone, so a shard whose rows, turns, tokens and loss masks equal what `examples`
    puts at its place holds exactly the features a fresh store would: it is kept (appended rows keep every full
    shard). With update=False nothing is touched and the refusal says how many shards would be kept (by size and
    tokens). The checksums are read once, by write_features, which computes a kept shard with other bytes again."""
    per_shard = header["shard_rows"]
    kept = {name: entry for name, entry in index["shards"].items()
            if shard_problem(directory, name, entry, checksum=False) is None
            and _holds(directory / name, examples[entry["first_row"]:entry["first_row"] + per_shard])}
    total = math.ceil(len(examples) / per_shard)
    if not update:
        raise FeatureStoreError(
            f"{directory / INDEX}: these features were written for another data file (data.sha256 "
            f"{index['data']['sha256'][:12]}... there, {header['data']['sha256'][:12]}... now: "
            f"{index['rows']} examples there, {len(examples)} now). If the data grew or changed, rerun with "
            f"features.update=true: {len(kept)} "
            f"of the {total} shards it needs hold the same rows and would be kept, the rest computed; or choose "
            "another features.dir")
    say(f"features: updating {directory} for other data: {len(kept)} of {total} shards hold the same rows and are "
        f"kept, {total - len(kept)} to compute")
    return {**index, **header, "complete": False, "shards": kept}


def _holds(path: Path, rows: list[Example]) -> bool:
    """Whether a shard file holds exactly `rows`: the same data rows and turns, tokens and loss masks, in order.
    A file that cannot be read as a shard (damaged) does not."""
    try:
        stored = [(key, ids, mask) for key, ids, mask, _ in stored_examples(path)]
    except (SafetensorError, OSError, RuntimeError, ValueError):
        return False
    return stored == [(e.key, list(e.input_ids), list(e.loss_mask)) for e in rows]


def stored_examples(path: Path) -> list[tuple[tuple[int, int], list[int], list[int], tuple[int, int]]]:
    """A shard's examples in order: ((data row, turn), input_ids, loss_mask, (start, end)), where [start, end) is
    the example's span of the shard's (N, ...) token tensors: offsets[r], offsets[r + 1]. Stores written before
    per-turn examples hold one example per data row and no "turns": turn 0."""
    with safe_open(path, framework="pt") as f:
        ids, masks = f.get_tensor("input_ids").tolist(), f.get_tensor("loss_mask").int().tolist()
        offsets, rows = f.get_tensor("offsets").tolist(), f.get_tensor("rows").tolist()
        turns = f.get_tensor("turns").tolist() if "turns" in f.keys() else [0] * len(rows)
    return [((row, turn), ids[a:b], masks[a:b], (a, b)) for row, turn, a, b in zip(rows, turns, offsets, offsets[1:])]


def read_index(directory: Path) -> dict | None:
    """directory's index.json, None where there is none; one that cannot be read, is not JSON or is not a JSON
    object is refused naming the file (the store, the stages' input check and features.make all read it here)."""
    path = directory / INDEX
    if not path.is_file():
        return None
    try:
        index = json.loads(path.read_text())
    except OSError as err:
        raise FeatureStoreError(f"{path}: cannot be read ({err.strerror}); check its permissions") from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        raise FeatureStoreError(f"{path}: not valid JSON ({err}); delete {directory} and recompute the "
                                "features") from None
    if not isinstance(index, dict):
        raise FeatureStoreError(f"{path}: holds a JSON {type(index).__name__}, not a store's index; delete "
                                f"{directory} and recompute the features")
    return index


def _write_index(directory: Path, index: dict) -> None:
    write_text_atomic(directory / INDEX, json.dumps(index, indent=2) + "\n")


def feature_width(index: dict) -> int:
    # values stored per token: the features (one hidden state per layer read) and the label hidden state if any
    h, spec = index["target"]["hidden_size"], index["layer_spec"]
    return h * len(spec.get("layers", [None])) + (h if "label_hidden" in spec else 0)


def token_bytes(index: dict) -> int:
    # per token in a shard, headers and offsets aside: the features, input_ids (4) and loss_mask (1)
    return feature_width(index) * DTYPES[index["dtype"]].itemsize + 5


def storage_report(index: dict) -> str:
    itemsize, width = DTYPES[index["dtype"]].itemsize, feature_width(index)
    logits = index["target"]["vocab_size"] * 2
    return (f"features: {index['rows']} examples, {index['tokens']} tokens in {len(index['shards'])} shards, "
            f"{index['bytes']} bytes = {index['bytes_per_token']:.1f} bytes per token (features {width} x {itemsize} "
            f"= {width * itemsize}, input_ids 4, loss_mask 1, plus offsets and headers); storing the full-vocab "
            f"logits would add {logits} bytes per token in 16 bits: they are recomputed from the features instead")


# ---- reading -----------------------------------------------------------------------------------------


class FeatureStore:
    """A complete features directory, opened for training. Tokens, masks and offsets of every shard are
    read at `locate` (5 bytes per token); features are sliced out of the memory-mapped shard per example."""

    def __init__(self, directory: Path, index: dict):
        self.directory, self.index = directory, index
        self.shards = sorted(index["shards"].items(), key=lambda item: item[1]["first_row"])
        self._handles: dict[str, object] = {}
        self._where: list[tuple[str, int, int]] = []  # stored example -> (shard file, token start, end)

    @classmethod
    def open(cls, directory) -> "FeatureStore":
        directory = Path(directory)
        index = read_index(directory)
        if index is None:
            raise FeatureStoreError(f"features.dir={directory}: no {INDEX}; write the features first with "
                                    f"python train/features.py RECIPE features.dir={directory} (same recipe)")
        if index.get("format") != FORMAT:
            raise FeatureStoreError(f"{directory / INDEX}: format {index.get('format')!r}, this version reads "
                                    f"{FORMAT!r}; recompute the features with train/features.py")
        if not index.get("complete"):
            raise FeatureStoreError(f"{directory / INDEX}: only {len(index.get('shards', {}))} shards are written; "
                                    "finish them: rerun python train/features.py with the same recipe (it resumes)")
        damaged = [(name, problem) for name, entry in sorted(index["shards"].items())
                   if (problem := shard_problem(directory, name, entry)) is not None]
        if damaged:
            listed = "; ".join(f"{name} {problem}" for name, problem in damaged[:4])
            listed += "; ..." if len(damaged) > 4 else ""
            raise FeatureStoreError(f"features.dir={directory}: {len(damaged)} of {len(index['shards'])} shards are "
                                    f"damaged ({listed}). Repair: rerun python train/features.py with the same recipe "
                                    "and features.dir; it checks every shard and computes only the damaged ones again")
        return cls(directory, index)

    def check(self, recipe, target, family) -> None:
        mismatch = header_mismatch(self.index, features_header(recipe, target, family))
        if mismatch is not None:
            name, stored, current = mismatch
            grown = (f" (if the data grew or changed, the same command with features.dir={self.directory} "
                     "features.update=true keeps the shards whose rows are unchanged and computes the rest)"
                     if name == "data.sha256" else "")
            raise FeatureStoreError(
                f"{self.directory / INDEX}: {name} is {stored!r} in the stored features but {current!r} in this run, "
                f"so they were computed for {_what(name)}. Recompute them: python train/features.py RECIPE "
                f"features.dir=NEW_DIR with this run's recipe and overrides{grown}, or point features.dir at matching "
                "ones")

    def summary(self) -> str:
        i = self.index
        return (f"features: offline from {self.directory}: {i['rows']} examples, {i['tokens']} tokens, "
                f"{i['layer_spec']['features']} features in {i['dtype']}, {i['bytes_per_token']:.1f} bytes per token")

    def locate(self, examples: list[Example]) -> list[int]:
        """-> the stored index of each example (by its data row), after checking its tokens and loss mask."""
        if not self._where:
            self._load_tokens()
        wrong = []
        for e in examples:
            stored = self._by_key.get(e.key)
            if stored is None or self._ids[stored] != e.input_ids or self._masks[stored] != e.loss_mask:
                wrong.append(e)
        if wrong:
            e = wrong[0]
            raise FeatureStoreError(f"{self.directory}: {len(wrong)} examples are not stored as this run tokenizes "
                                    f"them (first: {e.source}:{e.row}); the data, tokenizer or chat template changed "
                                    "since train/features.py ran: recompute the features into a new features.dir")
        return [self._by_key[e.key] for e in examples]

    def _load_tokens(self) -> None:
        self._by_key, self._ids, self._masks = {}, [], []
        for name, _ in self.shards:
            for key, ids, mask, span in stored_examples(self.directory / name):
                self._by_key[key] = len(self._where)
                self._where.append((name, *span))
                self._ids.append(ids)
                self._masks.append(mask)

    def features(self, stored: int) -> dict[str, Tensor]:
        """{"features": (T, F), and for EAGLE-3 "label_hidden": (T, h)} in the storage dtype, for the
        stored example `stored` (from `locate`)."""
        name, a, b = self._where[stored]
        if name not in self._handles:
            self._handles[name] = safe_open(self.directory / name, framework="pt")  # memory-mapped
        handle = self._handles[name]
        return {key: handle.get_slice(key)[a:b] for key in STORED_VALUES if key in handle.keys()}


def _what(field: str) -> str:
    if field.startswith("data."):
        return "other data (data file bytes or the data fields that shape the examples)"
    if field.startswith("target."):
        return "another target (or target dtype)"
    return {"family": "another drafter family", "dtype": "another features.dtype (a store keeps one precision)",
            "layer_spec.features": "other target layers (EAGLE-3 / DFlash: layers; EAGLE-1: eagle1.feature)"}[field]


# ---- batches for training ------------------------------------------------------------------------------


class OfflineRows(Dataset):
    """examples[i] with its stored values: (Example, {"features": (T_i, F), ...})."""

    def __init__(self, examples: list[Example], store: FeatureStore):
        self.examples, self.store, self.stored = examples, store, store.locate(examples)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int):
        return self.examples[i], self.store.features(self.stored[i])


def collate_offline(items, pad_id: int, **padding) -> dict[str, Tensor]:
    """drafters.training.data.collate (its keywords: drafters.training.batches.padding) plus each stored value
    (B, T, F), zero on padding, in the storage dtype."""
    batch = collate([example for example, _ in items], pad_id, **padding)
    for key, first in items[0][1].items():
        padded = first.new_zeros(len(items), batch["input_ids"].shape[1], first.shape[-1])
        for b, (_, values) in enumerate(items):
            padded[b, :values[key].shape[0]] = values[key]
        batch[key] = padded
    return batch


def offline_loader(recipe, store: FeatureStore, rows: list[Example], pad: int) -> DataLoader:
    """The same batches as drafters.training.batches.train_loader (same LengthBuckets), with stored features."""
    sampler = LengthBuckets([num_tokens(e) for e in rows], recipe.batch_size, recipe.seed)
    return DataLoader(OfflineRows(rows, store), batch_sampler=sampler,
                      collate_fn=partial(collate_offline, pad_id=pad, **padding(recipe.data)))


def offline_batches(store: FeatureStore, batches: list[list[Example]], pad: int) -> list[dict]:
    rows = OfflineRows([e for batch in batches for e in batch], store)
    out, start = [], 0
    for batch in batches:
        out.append(collate_offline([rows[i] for i in range(start, start + len(batch))], pad))
        start += len(batch)
    return out
