"""SpecForge 0.2.0 as a peer trainer for eval/peers.py: install it in its own venv, convert our feature store to
its offline EAGLE-3 format, give its training command line, and name the directory our reader loads.

It never imports SpecForge (which pins torch 2.11, transformers 5.8.1 and sglang): everything SpecForge runs, runs
in its venv by subprocess. It knows nothing about measuring, decoding or the other peers.

SpecForge's offline EAGLE-3 format (specforge/runtime/data_plane/offline_reader.py, algorithms/eagle3/data.py): a
directory tree of `.ckpt` files (torch.save dicts, read in sorted path order), one per example:
    input_ids         (T,)        int64   token ids
    loss_mask         (T,)        int64   1 = token t is a token to learn (ours: loss_mask, bool)
    hidden_state      (1, T, h)   bf16    final-normed last hidden state (ours: label_hidden); its TargetHead
                                          applies the LM head only, so it must be normed already
    aux_hidden_state  (1, T, 3h)  bf16    cat of the 3 aux layers (ours: features, the same fusion order)
Its training-time test (TargetHead.preprocess + OnlineEagle3Model.forward): step i at position t reads
aux_hidden_state[t], input_ids[t+1+i] and is labelled by head(hidden_state[t+1+i]): our alignment
(docs/conventions.md). It counts that label iff loss_mask[t+i] (and the target's argmax is in the draft vocab),
where ours counts it iff token t+2+i is learnt: SpecForge's mask lags ours by 2 positions (it drops the first two
learnt tokens of each span and adds the two after it); its normalizer also zeroes loss_mask[T-1].
`convert(..., labels_as_ours=True)` writes loss_mask[t] = ours[t+2] so that it counts exactly our labels; its
offline draft vocabulary is then counted over the shifted mask too, so pair it with `write_vocab_mapping`.

The tied head: SpecForge's TargetHead finds `lm_head_key` through a `*.index.json` weight map; a single-file Hugging
Face save has no index and a tied target no `lm_head.weight`. `prepare_target` makes a view of the target directory
(symlinks + an index) and the command reads the head from `model.embed_tokens.weight`.
"""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors import safe_open

from drafters.draft_vocab import build_draft_vocab
from drafters.files import move_dir_into_place, write_text_atomic
from drafters.peers import PeerError
from drafters.training.features import FeatureStore, FeatureStoreError, stored_examples

NAME = "specforge"
VERSION = "0.2.0"
PATCHES: list[tuple[str, str]] = [
    ("specforge-0.2.0-cpu-loss.patch",
     "core/loss.py imports Triton at import time and runs its loss as a Triton kernel; CPU torch ships no Triton: "
     "without it, the same loss (its own torch reference, uncompiled) in plain torch"),
]
PATCH_DIR = Path(__file__).resolve().parent / "patches"
TORCH = "torch==2.13.0"  # the local CPU build; any other version pulls CUDA wheels
# what the offline EAGLE-3 training path imports, found by running it (datasets: for the vocab mapping); the wheel
# also lists sglang, wandb, tensorboard, yunchang, openai-harmony, requests: the online / tracking / sequence-parallel
# paths, never imported offline
DEPENDENCIES = ("transformers==5.8.1", "accelerate", "datasets", "pydantic", "pyyaml", "safetensors", "huggingface-hub",
                "numpy", "psutil", "tqdm")

# SpecForge's own values for what `kind: defaults` leaves to it (specforge/config/schema.py TrainingConfig /
# ModelConfig / DataConfig, algorithms/eagle3/providers.py, training/strategies/base.py, optimizer.py)
DEFAULTS = {
    "training.learning_rate": 1e-4,
    "training.lr_scheduler": "cosine",
    "training.warmup_ratio": 0.015,
    "training.max_grad_norm": 0.5,
    "training.ttt_length": 7,
    "training.batch_size": 1,
    "training.accumulation_steps": 1,
    "training.attention_backend": "flex_attention",
    "training.fsdp_sharding": "SHARD_GRAD_OP",
    "model.torch_dtype": "bfloat16",
    "draft num_hidden_layers": 1,  # fixed for EAGLE-3 (providers.py fixed_override_values)
    "draft_vocab_size": 32000,  # TargetDerivedDraftDefaults
    "TTT step weight": 0.8,  # Eagle3TrainStrategy ploss_decay, not configurable
    "optimizer": "AdamW over fp32 masters, weight_decay 0.0, betas (0.9, 0.999)",
    "data.dataloader_num_workers": 4,  # EAGLE-3's default_dataloader_num_workers
    "training.seed": 42,
    "data.max_length": 2048,
}
# what SpecForge needs to train on a CPU, passed in both kinds when this machine has no GPU
CPU_NEEDS = {"attention_backend": "sdpa",  # flex_attention, its default, has no backward on CPU
             "fsdp_sharding": "NO_SHARD"}  # FSDP refuses a CPU; NO_SHARD is DDP, over gloo on a CPU
VENV = ".venv-specforge"  # under the repository root, gitignored
RUN_ID = "specforge"
HIDDEN = "hidden_state"  # SpecForge's names
AUX = "aux_hidden_state"


# ---- install ---------------------------------------------------------------------------------------------------


def install(root: Path, venv: Path | None = None) -> Path:
    """Idempotent: create/reuse the venv (default root/.venv-specforge), torch first, SpecForge without its
    dependencies (they pin torch 2.11 and sglang), the imported ones under a torch pin, then the patches once.
    Returns the venv's python."""
    venv = Path(venv) if venv is not None else Path(root) / VENV
    python = venv / "bin" / "python"
    if not python.exists():
        _run([sys.executable, "-m", "venv", str(venv)], "creating the venv")
    missing = _missing(python)
    if missing:
        pin = venv / "torch-pin.txt"
        pin.write_text(TORCH + "\n")
        _run([str(python), "-m", "pip", "install", "--quiet", TORCH], f"installing {TORCH}")
        _run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", f"{NAME}=={VERSION}"],
             f"installing {NAME}=={VERSION}")
        _run([str(python), "-m", "pip", "install", "--quiet", "-c", str(pin), *DEPENDENCIES],
             "installing SpecForge's offline-training dependencies")
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     "finding site-packages").strip())
    for name, _ in PATCHES:
        apply_patch(PATCH_DIR / name, site)
    _run([str(python), "-c", "import specforge.cli, specforge.algorithms.eagle3.model"], "importing SpecForge")
    return python


def _missing(python: Path) -> list[str]:
    """The packages (torch, SpecForge, DEPENDENCIES) the venv lacks or holds in another pinned version."""
    wanted = dict(spec.partition("==")[::2] for spec in (TORCH, f"{NAME}=={VERSION}", *DEPENDENCIES))  # name: pin
    probe = ("import importlib.metadata as m, json\n"
             "def v(n):\n    try: return m.version(n)\n    except m.PackageNotFoundError: return None\n"
             f"print(json.dumps({{n: v(n) for n in {sorted(wanted)!r}}}))")
    found = json.loads(_run([str(python), "-c", probe], "listing installed packages"))
    return [n for n, v in found.items() if v is None or (wanted[n] and v.split("+")[0] != wanted[n])]


def apply_patch(patch_file: Path, site: Path) -> bool:
    """Apply once: a patch that reverses cleanly is applied already. -> whether it was applied now."""
    if not patch_file.is_file():
        raise PeerError(f"patch file {patch_file} is missing")
    # -f: never ask, and take the patch as given (without it, --batch applies a "reversed" patch forward)
    base = ["patch", "-p1", "-f", "-d", str(site), "-i", str(patch_file)]
    if subprocess.run([*base, "--dry-run", "-R"], capture_output=True).returncode == 0:
        return False
    if subprocess.run([*base, "--dry-run"], capture_output=True).returncode != 0:
        raise PeerError(f"{patch_file.name} does not apply to {site} (another {NAME} version installed?)")
    _run([*base, "--no-backup-if-mismatch"], f"applying {patch_file.name}")
    return True


def _run(argv: list[str], what: str, env: dict | None = None) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise PeerError(f"{NAME}: {what} failed (exit {done.returncode}): {tail[0]}")
    return done.stdout


# ---- convert: our feature store -> SpecForge's offline .ckpt files ---------------------------------------------


def convert(store: Path, out: Path, rows: list[int] | None = None, *, labels_as_ours: bool = False) -> dict:
    """One `data_NNNNNN.ckpt` per stored example (store order) whose data row is in `rows` (None: all), written
    into a temporary directory renamed to `out`; a rerun with the same store, rows and mask keeps `out`.
    -> {"rows", "tokens", "supervised"}: examples, tokens, and the positions SpecForge's TTT step 0 counts
    (its loss mask after it zeroes the last position) before the draft-vocab mask."""
    store, out = Path(store), Path(out)
    try:
        opened = FeatureStore.open(store)
    except FeatureStoreError as err:
        raise PeerError(f"{NAME}: cannot convert {store}: {err}") from None
    if opened.index["family"] != "eagle3":
        raise PeerError(f"{store} holds {opened.index['family']} features; {NAME} trains EAGLE-3 from eagle3 ones")
    manifest = {"format": "specforge-offline-eagle3", "store": str(store.resolve()),
                "shards": {name: entry["sha256"] for name, entry in opened.shards},
                "rows": None if rows is None else sorted(set(rows)), "labels_as_ours": labels_as_ours}
    done = _read_manifest(out)
    if done is not None and all(done.get(k) == v for k, v in manifest.items()):
        return done["counts"]
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    counts = _write_examples(store, opened, tmp, None if rows is None else set(rows), labels_as_ours)
    if counts["rows"] == 0:
        shutil.rmtree(tmp)
        raise PeerError(f"{store}: none of the rows {sorted(set(rows))[:8]} is stored")
    write_text_atomic(tmp / "manifest.json", json.dumps({**manifest, "counts": counts}, indent=2) + "\n")
    move_dir_into_place(tmp, out, str(os.getpid()))
    return counts


def _write_examples(store: Path, opened: FeatureStore, out: Path, rows: set[int] | None, labels_as_ours: bool) -> dict:
    n = tokens = supervised = 0
    for name, _ in opened.shards:
        with safe_open(store / name, framework="pt") as shard:
            for (row, _turn), ids, mask, (a, b) in stored_examples(store / name):
                if rows is not None and row not in rows:
                    continue
                example = specforge_example(ids, mask, shard.get_slice("label_hidden")[a:b],
                                            shard.get_slice("features")[a:b], labels_as_ours=labels_as_ours)
                torch.save(example, out / f"data_{n:06d}.ckpt")
                n, tokens = n + 1, tokens + len(ids)
                supervised += int(example["loss_mask"][:-1].sum())
    return {"rows": n, "tokens": tokens, "supervised": supervised}


def specforge_example(ids: list[int], mask: list[int], label_hidden: torch.Tensor, features: torch.Tensor, *,
                      labels_as_ours: bool = False) -> dict:
    """One example as SpecForge's offline capture saves it. label_hidden (T, h), features (T, 3h)."""
    loss_mask = torch.tensor(mask, dtype=torch.int64)  # (T,)
    if labels_as_ours:  # SpecForge counts loss_mask[t] for the label of token t+2: give it ours[t+2]
        loss_mask = torch.cat([loss_mask[2:], loss_mask.new_zeros(min(2, len(mask)))])
    return {"input_ids": torch.tensor(ids, dtype=torch.int64),  # (T,)
            "loss_mask": loss_mask,
            # clone, not contiguous: a slice of the shard shares its storage, and torch.save writes a tensor's whole
            # storage, so every file would hold the whole shard (150 rows of SmolLM2: 25 GB instead of 172 MB)
            HIDDEN: label_hidden.unsqueeze(0).clone(),  # (1, T, h)
            AUX: features.unsqueeze(0).clone()}  # (1, T, 3h)


def _read_manifest(out: Path) -> dict | None:
    path = out / "manifest.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except json.JSONDecodeError:
        return None


def write_vocab_mapping(store: Path, path: Path, size: int, rows: list[int] | None = None) -> Path:
    """Our draft vocabulary (drafters.draft_vocab: the `size` most frequent learnt tokens of the chosen rows) as
    SpecForge's vocab-mapping file ({"d2t", "t2d"}, the same convention); pass it as settings["vocab_mapping"]."""
    opened = FeatureStore.open(store)
    keep = None if rows is None else set(rows)
    examples = [(ids, mask) for name, _ in opened.shards for (row, _), ids, mask, _ in stored_examples(store / name)
                if keep is None or row in keep]
    vocab = build_draft_vocab(examples, opened.index["target"]["vocab_size"], size=size)
    path = Path(path)
    if path.is_file():  # SpecForge resumes only when the file its checkpoint names is untouched (its stat is recorded)
        before = torch.load(path, weights_only=True)
        if before["d2t"].equal(vocab.d2t) and before["t2d"].equal(vocab.t2d):
            return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save({"d2t": vocab.d2t, "t2d": vocab.t2d}, tmp)
    os.replace(tmp, path)
    return path


# ---- command ---------------------------------------------------------------------------------------------------


def prepare_target(target_dir: Path, view: Path) -> str:
    """A view of the Hugging Face target directory SpecForge can read: symlinks to its files plus, for a
    single-file save, a `model.safetensors.index.json`. -> the key its TargetHead reads the LM head from."""
    target_dir, view = Path(target_dir).resolve(), Path(view)
    view.mkdir(parents=True, exist_ok=True)
    for item in target_dir.iterdir():
        link = view / item.name
        if not link.is_symlink():
            link.symlink_to(item)
    weights = target_dir / "model.safetensors"
    index = view / "model.safetensors.index.json"
    if weights.is_file() and not list(target_dir.glob("*.index.json")):
        with safe_open(weights, framework="pt") as f:
            keys = list(f.keys())
        write_text_atomic(index, json.dumps({"metadata": {}, "weight_map": dict.fromkeys(keys, weights.name)}) + "\n")
    weight_map = json.loads(next(view.glob("*.index.json")).read_text())["weight_map"]
    if "lm_head.weight" in weight_map:
        return "lm_head.weight"
    if "model.embed_tokens.weight" in weight_map:  # tied head: the embedding is the head
        return "model.embed_tokens.weight"
    raise PeerError(f"{target_dir}: neither lm_head.weight nor model.embed_tokens.weight in its weights")


def command(python: Path, data: Path, target_dir: Path, out: Path, settings: dict) -> tuple[list[str], dict]:
    """`specforge train --config out/run.yaml`, after writing the run config, the target view and the draft config
    into `out`. Under "matched" every setting is passed; under "defaults" only data, target, output, epochs, seed,
    threads (and no loader worker processes), max length, the aux layers of the data and, without a GPU, CPU_NEEDS."""
    python, data, out = Path(python), Path(data).resolve(), Path(out).resolve()
    on_cpu = not torch.cuda.is_available()  # this machine's: the peer's venv runs here too
    out.mkdir(parents=True, exist_ok=True)
    lm_head_key = prepare_target(target_dir, out / "target")
    store_layers = _aux_layers(data)
    config = {
        "run_id": RUN_ID,
        "output_dir": str(out / "train"),
        "model": {"target_model_path": str(out / "target"), "lm_head_key": lm_head_key,
                  "draft_model_config": str(out / "draft_config.json")},
        "data": {"hidden_states_path": str(data), "cache_dir": str(out / "cache"), "dataloader_num_workers": 0,
                 **({"max_length": settings["max_length"]} if settings.get("max_length") else {})},
        "training": {"num_epochs": settings["epochs"], "seed": settings["seed"], **(CPU_NEEDS if on_cpu else {})},
    }
    if settings.get("save_fraction"):  # a checkpoint every fraction of the run, all kept: the curve's points and
        steps = _steps(data, settings)  # what an interrupted run resumes from
        config["training"].update(save_interval=max(1, round(steps * settings["save_fraction"])), max_checkpoints=0)
    if checkpoints(out):
        config["training"]["resume_from"] = str(out / "train")  # its newest complete checkpoint
    draft = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [layer - 1 for layer in store_layers]}}
    if settings["kind"] == "matched":
        config["training"].update(_matched(settings, data))
        config["model"]["torch_dtype"] = settings["dtype"]
        draft["draft_vocab_size"] = settings["draft_vocab"]
        if settings.get("vocab_mapping"):
            config["model"]["vocab_mapping_path"] = str(Path(settings["vocab_mapping"]).resolve())
    elif settings["kind"] != "defaults":
        raise PeerError(f"settings kind {settings['kind']!r}: matched or defaults")
    write_text_atomic(out / "run.yaml", json.dumps(config, indent=2) + "\n")  # JSON is YAML
    write_draft_config(python, out / "run.yaml", out / "draft_config.json", draft)
    write_text_atomic(out / "peer.json", json.dumps({"peer": NAME, "version": VERSION, "python": str(python),
                                                     "kind": settings["kind"], "steps": _steps(data, settings)}) + "\n")
    threads = str(settings["threads"])
    env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false",
           **({"SPECFORGE_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": ""} if on_cpu else {})}
    return [str(python), "-m", "specforge.cli", "train", "--config", str(out / "run.yaml")], env


def _matched(settings: dict, data: Path) -> dict:
    if settings["num_layers"] != 1:
        raise PeerError(f"{NAME} {VERSION} trains 1-layer EAGLE-3 drafters only (num_layers={settings['num_layers']})")
    if not math.isclose(settings["step_weight"], 0.8):
        raise PeerError(f"{NAME} {VERSION} fixes the TTT step weight at 0.8 (step_weight={settings['step_weight']})")
    if settings["schedule"] not in ("cosine", "constant"):
        raise PeerError(f"{NAME} {VERSION} schedules cosine or constant, not {settings['schedule']!r}")
    # SpecForge warms up int(warmup_ratio * total_steps) steps (training/schedule.py): the ratio that lands on
    # warmup_steps exactly
    steps = _steps(data, settings)
    warmup = settings["warmup_steps"]
    return {"learning_rate": settings["lr"], "lr_scheduler": settings["schedule"],
            "warmup_ratio": min(1.0, (warmup + 0.5) / steps) if warmup else 0.0,
            "ttt_length": settings["ttt_steps"], "batch_size": settings["batch_size"]}


def _steps(data: Path, settings: dict) -> int:
    """SpecForge's total_steps = examples // batch_size * epochs (training/schedule.py)."""
    batch = settings["batch_size"] if settings["kind"] == "matched" else DEFAULTS["training.batch_size"]
    return len(list(Path(data).rglob("*.ckpt"))) // batch * settings["epochs"]


def checkpoints(out: Path) -> list[tuple[int, Path]]:
    """The complete training checkpoints under out/train (RUN_ID-stepN/ holding its state file), by step."""
    found = []
    for path in (Path(out) / "train").glob(f"{RUN_ID}-step*"):
        step = path.name.removeprefix(f"{RUN_ID}-step")
        if step.isdigit() and not path.is_symlink() and (path / "training_state.pt").is_file():
            found.append((int(step), path))
    return sorted(found)


def saved(out: Path) -> list[tuple[float, Path]]:
    """(fraction of the run, checkpoint) for every checkpoint kept so far: exported(out, checkpoint) decodes one."""
    steps = json.loads((Path(out) / "peer.json").read_text())["steps"]
    return [(step / steps, path) for step, path in checkpoints(out)]


def _aux_layers(data: Path) -> list[int]:
    """The store's aux layers (HF hidden_states indices) as recorded by convert's manifest."""
    manifest = _read_manifest(data)
    if manifest is None:
        raise PeerError(f"{data}: no manifest.json; write it with convert(store, {data})")
    index = json.loads((Path(manifest["store"]) / "index.json").read_text())
    return list(index["layer_spec"]["layers"])


DRAFT_CONFIG = """
import json, sys
from specforge.application import resolve_run
from specforge.config import load_config
from specforge.training.model_loading import draft_config_dict
config, path, update = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
cfg = load_config(config, ["model.draft_model_config="])
run = resolve_run(cfg)
draft = draft_config_dict(run.config, provider=run.algorithm.providers.model.draft_config)
draft.update(update)
with open(path + ".tmp", "w") as f:
    json.dump(draft, f, indent=2)
"""


def write_draft_config(python: Path, run_config: Path, path: Path, update: dict) -> None:
    """The draft config SpecForge derives from the target (its own code, in its venv), with `update` on top."""
    _run([str(python), "-c", DRAFT_CONFIG, str(run_config), str(path), json.dumps(update)],
         "deriving the draft config", env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    os.replace(f"{path}.tmp", path)


# ---- the output --------------------------------------------------------------------------------------------------


def exported(out: Path, checkpoint: Path | None = None) -> tuple[Path, str]:
    """SpecForge's run directory holds training checkpoints (train/specforge-stepN/training_state.pt); its own
    `specforge export --to sglang` turns the last one (or `checkpoint`, one of them) into the serving layout
    (config.json + model.safetensors: midlayer.* / fc / norm / lm_head, d2t, t2d), done here once.
    -> (out/export or out/export-stepN, "sglang")."""
    out = Path(out).resolve()
    export = out / ("export" if checkpoint is None else f"export-{Path(checkpoint).name.removeprefix(RUN_ID + '-')}")
    if (export / "config.json").is_file() and (export / "model.safetensors").is_file():
        return export, "sglang"
    peer = json.loads((out / "peer.json").read_text()) if (out / "peer.json").is_file() else None
    if peer is None or not (out / "train").is_dir():
        raise PeerError(f"{out}: no {NAME} training run here (run command() and its training first)")
    tmp = out / f".export.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    _run([peer["python"], "-m", "specforge.cli", "export", "--to", "sglang", "--checkpoint",
          str(out / "train" if checkpoint is None else checkpoint),
          "--draft-config", str(out / "draft_config.json"), "--output-dir", str(tmp)],
         "exporting the checkpoint", env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    move_dir_into_place(tmp, export, str(os.getpid()))
    return export, "sglang"



if __name__ == "__main__":  # python -m drafters.peers.specforge: make the venv the `peers` tests use
    print(install(Path(__file__).resolve().parents[2]))
