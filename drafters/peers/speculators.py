"""speculators 0.9.0 (vLLM's EAGLE-3 trainer) as a peer of eval/peers.py (drafters/peers/__init__.py): install it in
its own virtual environment, convert our feature store to its offline format, say how to launch its trainer and where
its drafter lands.

Runs in OUR venv and never imports speculators: its venv (.ci/consumers-venv: it pins transformers <= 5.19, we need
>= 5.20) is driven by subprocess, and the two sides exchange files. Knows nothing about measuring or evaluating.

speculators' offline format (what vLLM's hidden-state capture writes and `speculators.train.data.ArrowDataset` reads),
one directory DATA:
    DATA/data-*.arrow, state.json, dataset_info.json   a `datasets` save_to_disk, torch format, row i =
        input_ids (T,) int64 | loss_mask (T,) int64 | seq_len int
    DATA/hidden_states/hs_{i}.safetensors              row i's capture:
        hidden_states (T, 4, h)  the 3 aux layers (vLLM ids = HF hidden_states indices, low to high), then the
                                 LAST decoder layer's output BEFORE the final norm (vLLM captures layer id L:
                                 hidden + residual); the trainer applies the verifier's final norm and LM head
        token_ids (T,) int64     must equal the row's input_ids
    DATA/token_freq.pt                                 {target id: count} of the supervised tokens, from which the
                                                        trainer builds d2t-N.npy / t2d-N.npy when asked for N ids
convert adds one row after those it was asked for, a copy of the last: speculators needs a validation split (its
train_data_ratio must be below 1, default 0.9: a tenth of the rows never trained on), and command() makes that copy
the whole split, so speculators trains on every converted row, as the other trainers do.
Alignment (speculators.models.eagle3.data.shift_batch, metrics.align_for_step): row t of TTT step i reads fused
feature t and token t+1+i at RoPE position t+1+i and is scored against the target's row t+1+i: ours
(docs/conventions.md) with every position one higher, which RoPE does not see. The loss mask differs by one:
speculators counts that label iff loss_mask[t+1+i] (the token the step READS), ours iff token t+2+i (the token it
PREDICTS) is to learn; its own preprocessing sets loss_mask[s] = 1 on assistant tokens, so it never learns a turn's
first token and learns the one after its last. `convert` writes loss_mask[s] = ours[s+1] (0 at the end), so both
trainers score exactly the same labels. What stays different: it softmaxes the target over the draft vocabulary
without masking rows whose target argmax is outside it; it divides each step's loss by its counted labels (ours by
B x T); it packs rows into total_seq_len tokens per step (no row batch size); its LM head is frozen.

The last hidden state: our store keeps the final-NORMED one (label_hidden = norm(x) = w * x / rms(x)); speculators
wants x and norms it itself. convert writes x' = label_hidden / w (see `unnorm` where w = 0): its rms is 1 up to eps,
so the trainer's norm(x') = w * x' / sqrt(mean(x'^2) + eps) is label_hidden to within eps / 2 relative (then the
bf16 rounding of x', as the store rounds label_hidden).
"""

import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from drafters.files import move_dir_into_place, write_text_atomic
from drafters.peers import PeerError
from drafters.targets import load_target
from drafters.training.features import FeatureStore, stored_examples

NAME = "speculators"
VERSION = "0.9.0"
TORCH = "2.13.0"  # the local CPU build: any other version pulls CUDA wheels
PATCH_DIR = Path(__file__).resolve().parent / "patches"
PATCHES: list[tuple[str, str]] = [
    ("speculators-0.9.0-cpu-device.patch",
     "its Trainer falls back to 'cuda' without an accelerator, moves model and batches to the integer local_rank "
     "(cuda:0) and calls torch.accelerator.synchronize() unguarded: on a CPU-only torch all three fail"),
    ("speculators-0.9.0-cpu-resume.patch",
     "resuming an interrupted run loads its checkpoint onto get_current_device(), 'cuda:0' without an accelerator"),
]
FORMAT = "speculators-0.9.0-offline/1"  # convert.json's format: what this module writes
MANIFEST = "convert.json"

# speculators 0.9.0's own defaults for `--speculator-type eagle3` (speculators/train/config/schema.py and
# TrainConfig._resolve_derived_defaults; trainer.py, optimizers.py for what has no flag). Under settings "defaults"
# command() passes none of these but those marked CPU (what a CPU-only torch needs) and the data's own layer ids.
DEFAULTS = {
    "num_layers": 1, "draft_arch": "llama", "norm_before_fc": True, "norm_output": True, "norm_before_residual": True,
    "fc_norm": False, "sliding_window": 2048, "full_attention_indices": [],  # every draft layer sliding
    "draft_vocab_size": None,  # the target's whole vocabulary (no d2t / t2d) unless asked for N ids
    "ttt_steps": 3, "ttt_step_loss_decay": 1.0, "loss_fn": "kl_div", "optimizer": "muon", "lr": 1e-3,
    "muon_lr": 1e-3, "weight_decay": 0.01, "muon_weight_decay": 0.1, "muon_momentum": 0.95,
    "adamw_betas": (0.9, 0.999),  # torch's default, no flag
    "max_grad_norm": 1.0,  # hard-coded in Trainer.train_epoch
    "scheduler_type": "linear", "scheduler_warmup": "1% of the steps", "epochs": 20, "seed": 42,
    "total_seq_len": 8192,  # tokens packed per step (several rows)
    "train_data_ratio": 0.9,  # the last 10% of rows are validation, never trained on; here: convert's extra copy
    "hidden_states_dtype": "bfloat16",  # autocast; master weights fp32
    "lm_head": "frozen (the target's rows)", "embed_requires_grad": False,
    "draft_attn_impl": "simple_flex_attention",  # CPU: sdpa
    "loss_implementation": "fused",  # Triton; CPU: eager
    "num_workers": 12,  # spawned dataloader processes; CPU (threads = 1): 0
    "on_missing": "generate",  # asks a vLLM server for absent hidden states; offline: raise
    "target_layer_ids": None,  # = [2, L//2, L-3]; passed here: the store's layers
}


# ---- install -----------------------------------------------------------------------------------------

def install(root: Path, venv: Path | None = None) -> Path:
    """Idempotent: create / reuse the peer's venv (default root/.venv-speculators, the consumers' venv that
    .ci/consumers-venv builds: torch 2.13.0 first, speculators pinned), apply PATCHES once. -> its python."""
    root = Path(root)
    venv = Path(venv) if venv is not None else root / ".venv-speculators"
    python = venv / "bin" / "python"
    site = _site_packages(python)
    if site is None:
        _run(["bash", str(root / ".ci" / "consumers-venv"), str(venv)], "bash .ci/consumers-venv")
        site = _site_packages(python)
        if site is None:
            raise PeerError(f"{venv}: .ci/consumers-venv finished but speculators {VERSION} with torch {TORCH} is not "
                            "installed there")
    for name, _ in PATCHES:
        apply_patch(PATCH_DIR / name, site)
    return python


def _site_packages(python: Path) -> Path | None:
    """Where speculators VERSION is installed beside torch TORCH (metadata only: importing them takes seconds)."""
    if not python.is_file():
        return None
    probe = subprocess.run([str(python), "-c", "import importlib.metadata as m; d = m.distribution('speculators'); "
                            "print(d.version, m.version('torch'), d.locate_file(''))"], capture_output=True, text=True)
    found = probe.stdout.split()
    if probe.returncode != 0 or found[:1] != [VERSION] or not found[1].startswith(TORCH):
        return None
    return Path(found[2])


def apply_patch(patch: Path, site: Path) -> bool:
    """patch -p1 in site-packages unless already applied (its reverse applies cleanly). -> True if applied now."""
    def patch_cmd(*flags):
        return subprocess.run(["patch", "-p1", "--forward", "--silent", *flags, "-i", str(patch)], cwd=site,
                              capture_output=True, text=True)

    if patch_cmd("--dry-run", "-R").returncode == 0:
        return False
    if patch_cmd("--dry-run").returncode != 0 or patch_cmd().returncode != 0:
        raise PeerError(f"{patch.name} does not apply to {site} (another speculators than {VERSION}?)")
    return True


def _run(cmd: list[str], what: str) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise PeerError(f"{what} failed (exit {done.returncode}): {(done.stderr or done.stdout).strip()[-400:]}")
    return done.stdout


# ---- convert -----------------------------------------------------------------------------------------

def convert(store: Path, out: Path, rows: list[int] | None = None, *, target=None, labels_as_ours: bool = True) -> dict:
    """Our EAGLE-3 feature store -> speculators' offline format in `out` (module docstring). rows: the data rows to
    take (the store's `rows` field; every turn of a row), None = all, written in store order. target: the loaded
    drafters Target the store was computed from, for its final norm's weight (default: loaded by the store's target
    name). labels_as_ours: the loss mask shifted so that speculators scores exactly our labels (speculators_mask);
    False: our mask as it is, which speculators reads by its own convention, as its own capture of the same data
    would be read. Redoing it with the same store and rows returns the recorded counts; written into a temporary directory
    renamed into place. -> {"rows", "tokens", "supervised" (labels of TTT step 0, ours = speculators')}."""
    store, out = Path(store), Path(out)
    opened = FeatureStore.open(store)
    index = opened.index
    if index.get("family") != "eagle3" or "label_hidden" not in index.get("layer_spec", {}):
        raise PeerError(f"{store}: a {index.get('family')} store; speculators trains EAGLE-3 from fused aux layers and "
                        "the last hidden state (train/features.py with an eagle3 recipe)")
    source = {"format": FORMAT, "store": str(store.resolve()),
              "shards": {name: entry.get("sha256") for name, entry in opened.shards},
              "requested_rows": None if rows is None else sorted(set(rows)), "labels_as_ours": labels_as_ours}
    done = _recorded(out, source)
    if done is not None:
        return done
    weight = final_norm_weight(index, target)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        counts = _write(opened, tmp, source["requested_rows"], weight, labels_as_ours)
        (tmp / MANIFEST).write_text(json.dumps({**source, **counts, "layers": index["layer_spec"]["layers"]},
                                               indent=2) + "\n")
        move_dir_into_place(tmp, out, str(os.getpid()))  # out, if there, is an earlier convert's (_recorded)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return counts


def _recorded(out: Path, source: dict) -> dict | None:
    manifest = out / MANIFEST
    if not manifest.is_file():
        if out.exists():
            raise PeerError(f"{out} exists and was not written by convert (no {MANIFEST}): choose another directory")
        return None
    recorded = json.loads(manifest.read_text())
    if {k: recorded.get(k) for k in source} != source:
        return None
    return {k: recorded[k] for k in ("rows", "tokens", "supervised")}


def final_norm_weight(index: dict, target=None) -> torch.Tensor:
    """(h,) float32: the target's final RMSNorm weight w, checked to compute w * x / rms(x) (Llama's; a Gemma-style
    (1 + w) norm would make speculators' own norm wrong, and the division below too)."""
    if target is None:
        target = load_target(index["target"]["name"], dtype="float32")  # the weight's values whatever the run's dtype
    norm = target.final_norm
    weight = norm.weight.detach().float().cpu()
    x = torch.randn(3, weight.numel(), generator=torch.Generator().manual_seed(0))
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
    with torch.no_grad():
        want = norm(x.to(norm.weight.device, norm.weight.dtype)).float().cpu()
    if not torch.allclose(want, weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps), rtol=1e-2, atol=1e-2):
        raise PeerError(f"the target's final norm ({type(norm).__name__}) is not weight * x / rms(x): speculators' "
                        "verifier norm would compute other labels")
    return weight


def unnorm(label_hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(T, h) final-normed w * x / rms(x) -> x / rms(x), in label_hidden's dtype: what speculators' verifier norm
    turns back into label_hidden (its mean square is 1, up to eps). Where w = 0 the label is 0 whatever x was: those
    entries are filled so that the mean square is 1 again."""
    zero = weight == 0
    x = label_hidden.float() / torch.where(zero, 1.0, weight)  # (T, h)
    if zero.any():
        missing = (x.shape[-1] - x.masked_fill(zero, 0.0).pow(2).sum(-1, keepdim=True)).clamp(min=0)  # (T, 1)
        x = torch.where(zero, (missing / zero.sum()).sqrt(), x)
    return x.to(label_hidden.dtype)


def speculators_mask(loss_mask: torch.Tensor) -> torch.Tensor:
    """(T,) ours, 1 = token s is to learn -> speculators', which scores the label read at s: mask[s] = ours[s+1]."""
    mask = loss_mask.long()
    return torch.cat([mask[1:], mask.new_zeros(1)])


def _write(opened, out: Path, rows: list[int] | None, weight: torch.Tensor, labels_as_ours: bool = True) -> dict:
    from datasets import Dataset  # on use: importing it takes seconds

    wanted = None if rows is None else set(rows)
    columns = {"input_ids": [], "loss_mask": [], "seq_len": []}
    freq: dict[int, int] = {}
    tokens = supervised = 0
    (out / "hidden_states").mkdir(parents=True)
    for name, _ in opened.shards:
        with safe_open(opened.directory / name, framework="pt") as shard:
            for (row, _turn), ids, mask, (a, b) in stored_examples(opened.directory / name):
                if wanted is not None and row not in wanted:
                    continue
                ids, mask = torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)
                features = shard.get_slice("features")[a:b]  # (T, 3h)
                last = unnorm(shard.get_slice("label_hidden")[a:b], weight)  # (T, h)
                hidden = torch.cat([features.view(b - a, -1, last.shape[-1]), last[:, None]], 1)  # (T, 4, h)
                i = len(columns["seq_len"])
                save_file({"hidden_states": hidden.contiguous(), "token_ids": ids},
                          out / "hidden_states" / f"hs_{i}.safetensors")
                columns["input_ids"].append(ids)
                columns["loss_mask"].append(speculators_mask(mask) if labels_as_ours else mask)
                columns["seq_len"].append(b - a)
                for token, count in zip(*ids[mask.bool()].unique(return_counts=True)):
                    freq[int(token)] = freq.get(int(token), 0) + int(count)
                tokens += b - a
                supervised += int(mask[2:].sum())  # step 0 scores the labels of tokens 2 .. T-1
    if wanted is not None and not columns["seq_len"]:
        raise PeerError(f"{opened.directory}: none of the {len(wanted)} requested rows is in the store")
    rows_written = len(columns["seq_len"])
    # speculators insists on a validation split (train_data_ratio < 1): a copy of the last row, after the rows it
    # trains on (command() sets the ratio), so it trains on every converted row
    shutil.copy(out / "hidden_states" / f"hs_{rows_written - 1}.safetensors",
                out / "hidden_states" / f"hs_{rows_written}.safetensors")
    for values in columns.values():
        values.append(values[-1])
    data = Dataset.from_dict({k: [v.tolist() if torch.is_tensor(v) else v for v in vs] for k, vs in columns.items()})
    data.set_format("torch")
    data.save_to_disk(str(out / "dataset"))
    for path in (out / "dataset").iterdir():  # ArrowDataset loads DATA itself, beside hidden_states/
        path.rename(out / path.name)
    (out / "dataset").rmdir()
    torch.save(freq, out / "token_freq.pt")
    return {"rows": rows_written, "tokens": tokens, "supervised": supervised}


# ---- command ---------------------------------------------------------------------------------------

def command(python: Path, data: Path, target_dir: Path, out: Path, settings: dict) -> tuple[list[str], dict]:
    """speculators' training command line (`python -m speculators.train`, what `speculators train` runs) and its
    environment. settings["kind"] "matched": our settings mapped to its flags; "defaults": only the data, target,
    output, epochs, seed, threads, max_length (-> --total-seq-len; None keeps its 8192-token packing) and what a CPU
    needs (DEFAULTS marks which). Both: the store's aux layers (the data holds those), no vLLM server
    (--on-missing raise), no dataloader processes, and every converted row trained (the validation split is the
    copy convert appends)."""
    data, out = Path(data), Path(out)
    manifest = json.loads((data / MANIFEST).read_text())
    threads = int(settings.get("threads", 1))
    argv = [str(python), "-m", "speculators.train", "--speculator-type", "eagle3",
            "--verifier-name-or-path", str(target_dir), "--data-path", str(data), "--save-path", str(out),
            "--log-dir", str(out / "logs"), "--epochs", str(settings["epochs"]), "--seed", str(settings["seed"]),
            "--target-layer-ids", *[str(i) for i in manifest["layers"]], "--on-missing", "raise",
            "--num-workers", "0", "--draft-attn-impl", "sdpa", "--loss-implementation", "eager",
            # rows + 1 rows: the split index int((rows + 1) * ratio) = rows leaves convert's copy to validation
            "--train-data-ratio", repr((manifest["rows"] + 0.5) / (manifest["rows"] + 1))]
    if settings.get("max_length") is not None:
        argv += ["--total-seq-len", str(settings["max_length"])]
    if settings.get("save_fraction"):  # mid-epoch saves (each overwrites out/<epoch>/; snapshot() keeps them) that
        argv += ["--checkpoint-freq", repr(settings["save_fraction"])]  # an interrupted run also resumes from
    if settings["kind"] == "matched":
        argv += _matched(settings)
    elif settings["kind"] != "defaults":
        raise PeerError(f"settings kind {settings['kind']!r}: matched or defaults")
    env = {name: str(threads) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    env |= {"CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false"}
    return argv, env


def _matched(s: dict) -> list[str]:
    # ours, flag by flag; what speculators cannot match is in the module docstring and DEFAULTS
    schedule = {"cosine": "cosine", "linear": "linear", "constant": "none"}.get(s["schedule"])
    if schedule is None:
        raise PeerError(f"schedule {s['schedule']!r}: speculators has linear, cosine and none")
    return ["--num-layers", str(s["num_layers"]), "--full-attention-indices", *map(str, range(s["num_layers"])),
            "--no-norm-before-fc", "--no-norm-output", "--no-norm-before-residual",
            "--ttt-steps", str(s["ttt_steps"]), "--ttt-step-loss-decay", str(s["step_weight"]),
            "--loss-fn", "ce",  # soft CE against the target renormalised over the draft vocabulary, as ours
            "--draft-vocab-size", str(s["draft_vocab"]), "--optimizer", s.get("optimizer", "adamw"),
            "--lr", str(s["lr"]), "--weight-decay", str(s.get("weight_decay", 0.0)),
            "--scheduler-type", schedule, "--scheduler-warmup-steps", str(s["warmup_steps"]),
            "--hidden-states-dtype", s["dtype"]]


# ---- output ------------------------------------------------------------------------------------------

def exported(out: Path) -> tuple[Path, str]:
    """The drafter speculators saved last (out/<epoch>/: config.json + model.safetensors, its vLLM layout) and the
    format our reader loads it with."""
    saved = Path(out).iterdir() if Path(out).is_dir() else ()
    epochs = sorted((int(p.name), p) for p in saved if p.name.isdigit() and (p / "config.json").is_file())
    if not epochs:
        raise PeerError(f"{out}: no saved epoch (out/<epoch>/config.json): did the training finish?")
    return epochs[-1][1], "vllm"


# ---- the curve: speculators' mid-epoch saves overwrite out/<epoch>/, so each is copied as it appears ---------------

SAVED_LINK = re.compile(r"^epoch(\d+)_step(\d+)$")  # the link it points at out/<epoch>/ after a mid-epoch save


def snapshot(out: Path, curve: Path, save_fraction: float) -> None:
    """Copy the drafter of the newest mid-epoch save (config.json + model.safetensors, the vLLM layout; not the
    optimizer) to curve/step-N, once. Called every few seconds while the run goes: a save overwrites the last one
    minutes later, and a copy that a new save overlapped (the link moved, or the weights changed under it) is
    dropped and taken again at the next call."""
    out, curve = Path(out), Path(curve)
    links = [(int(m[2]), path) for path in (out.iterdir() if out.is_dir() else ())
             if path.is_symlink() and (m := SAVED_LINK.match(path.name))]
    if not links:
        return
    step, link = max(links)
    observed = curve / "observed.json"
    record = json.loads(observed.read_text()) if observed.is_file() else {"save_fraction": save_fraction, "steps": []}
    if step not in record["steps"]:
        record["steps"] = sorted(record["steps"] + [step])
        curve.mkdir(parents=True, exist_ok=True)
        write_text_atomic(observed, json.dumps(record) + "\n")
    dest = curve / f"step-{step}"
    if dest.is_dir():
        return
    source = link.resolve()
    weights = source / "model.safetensors"
    try:
        before = weights.stat().st_mtime_ns
        tmp = curve / f".step-{step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for name in ("config.json", "model.safetensors"):
            shutil.copy2(source / name, tmp / name)
        if weights.stat().st_mtime_ns != before or not link.is_symlink():
            shutil.rmtree(tmp)
            return
        tmp.rename(dest)
    except OSError:
        shutil.rmtree(curve / f".step-{step}.tmp", ignore_errors=True)


def saved(out: Path) -> list[tuple[float, Path]]:
    """(fraction of the run, drafter) for every save snapshot() copied, and the final one (1.0). Saves land at
    multiples of interval = round(steps x save_fraction), so step N is N / interval x save_fraction of the run;
    the interval is the gcd of the steps seen."""
    curve = Path(out) / "curve"
    found = []
    observed = curve / "observed.json"
    if observed.is_file():
        record = json.loads(observed.read_text())
        interval = math.gcd(*record["steps"])
        found = sorted((step / interval * record["save_fraction"], curve / f"step-{step}") for step in record["steps"]
                       if (curve / f"step-{step}" / "model.safetensors").is_file())
    try:
        found.append((1.0, exported(out)[0]))
    except PeerError:
        pass
    return found
