"""Our trainer, speculators' and SpecForge's side by side on the same work: one feature capture, matched settings
and each trainer's own defaults, measured the same way.

    python eval/peers.py --out outputs/peers/smollm2 --rows 150                  # every trainer, matched settings
    python eval/peers.py --out outputs/peers/smollm2 --rows 150 --settings matched defaults --seeds 0 1
    python eval/peers.py --out outputs/peers/smollm2 --report report/peers/smollm2.md   # the table again, no work
    python eval/peers.py --out outputs/peers/smollm2-1m --rows 5120 --settings defaults --seeds 0 1 --curve 4 \
        --trainers drafters-offline speculators specforge        # the 1M-token budget, with its curve

Stages, each resumable (a rerun skips what is finished and retries what failed, so an interrupted run continues
where it stopped):
  target    the target as a Hugging Face directory (`--out`/target), which the peers load.
  capture   ONE feature capture for everyone: train/features.py writes our store (token ids, loss masks, the fused
            aux layers [2, L//2, L-3] and the final-normed last hidden state) over the first --rows usable rows of
            --data; our offline run reads it, each peer gets it converted to its own offline format
            (drafters/peers/<peer>.py `convert`). Every trainer trains on all of its rows: there is no
            held-out split, so none spends CPU time on an evaluation the others skip.
  install   each peer in a virtual environment of its own (`install`: torch 2.13.0 CPU first, the peer pinned,
            the CPU patches of drafters/peers/patches applied once, each named with its reason).
  train     each (trainer, settings, seed) as a subprocess, measured from outside by wait4: user and system CPU
            seconds, wall, peak RSS, minor page faults. Tokens per CPU-second = the training rows' tokens (the same
            number for every trainer) / (user + system), so startup and feature loading count for all alike.
            Every trainer saves 4 x --curve times a run and resumes from its last save: a run cut off (the
            harness killed with it) continues when the command is run again, and its row sums its attempts
            (runs/NAME/attempt-NN.json; a cut-off attempt is counted to its last /proc sample, POLL_S apart).
            speculators' mid-epoch saves overwrite each other, so the harness copies each as it appears.
  evaluate  every trainer's drafter scored on --heldout-rows rows after the training rows (eval/heldout.py: top-1 by
            TTT step, as training's held-out evaluation scores it), and decoded by OUR decoder (eval/tau.py: the peers' output directories load
            through drafters.export.eagle3_reader, ours from its checkpoint), MT-bench, chain of --chain,
            temperature 0: tau and per-depth acceptance; with --curve N, also each run's save nearest to every
            1/N of its tokens (SpecForge's saves are training states: exported first), for the curve of acceptance
            against tokens.

Our rows: drafters-offline (from the store), drafters-online (the target run at every step) and, when named in
--trainers, drafters-frozen-head (offline with eagle3.freeze_head=true: the LM head left at the target's rows, as
speculators leaves it).

Settings:
  matched   EAGLE-3, 1 layer, training-time test 3 steps at weight 0.8^i, draft vocabulary 16,384, AdamW lr 1e-3
            cosine without warm-up, bf16 autocast, batch 1, 1 epoch, max length 512 (MATCHED).
  defaults  what a user of each trainer gets: only the data, target, output, epochs, seed and threads are set,
            and what a CPU run needs (each adapter's DEFAULTS says which values those are). Ours: the recipe
            recipes/eagle3_smollm2.yaml as shipped.

A trainer that fails to install, train or load gets its row with the reason in one sentence; the others still report.
The peers never import drafters (and this script never imports them): files are the interface.
"""

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEERS = ("speculators", "specforge")
# drafters-frozen-head: the offline run with eagle3.freeze_head=true, the LM head speculators trains (none: the
# target's rows of the draft vocabulary): what a trained head buys in acceptance and costs in memory and time
OURS = ("drafters-offline", "drafters-online", "drafters-frozen-head")
TRAINERS = OURS + PEERS
DEFAULT_TRAINERS = ("drafters-offline", "drafters-online", *PEERS)

# The matched settings every trainer is given (the adapters translate them into their own flags).
MATCHED = {"num_layers": 1, "ttt_steps": 3, "step_weight": 0.8, "draft_vocab": 16384, "lr": 1e-3,
           "schedule": "cosine", "warmup_steps": 0, "dtype": "bfloat16", "batch_size": 1, "epochs": 1,
           "max_length": 512}


def our_overrides(kind: str, settings: dict) -> list[str]:
    """Our trainer's recipe overrides for `kind` (the same numbers the adapters receive)."""
    fixed = ["data.eval_rows=0", f"epochs={settings['epochs']}", f"seed={settings['seed']}", f"threads={settings['threads']}",
             f"data.max_length={settings['max_length']}", "max_steps=null"]
    if kind == "defaults":
        return fixed
    return fixed + [
        "eagle3.num_layers=1", f"eagle3.ttt_steps={settings['ttt_steps']}",
        f"eagle3.step_weight={settings['step_weight']}", f"draft_vocab_size={settings['draft_vocab']}",
        "draft_vocab_coverage=null", "optim.name=adamw", f"optim.lr={settings['lr']}",
        f"optim.schedule={settings['schedule']}", f"optim.warmup_steps={settings['warmup_steps']}",
        f"batch_size={settings['batch_size']}", "grad_accum=1"]


@dataclass
class Measured:
    """One subprocess, measured from outside (os.wait4's rusage covers it and every descendant it waited for)."""
    returncode: int
    wall_s: float
    user_s: float
    system_s: float
    max_rss_bytes: int
    minor_faults: int
    log: str
    # the largest RssAnon summed over the process tree, sampled every MEMORY_POLL_S (tree_usage): private memory,
    # without the file pages of a memory-mapped feature store that VmHWM / ru_maxrss count; 0 = never sampled
    max_anon_bytes: int = 0

    @property
    def cpu_s(self) -> float:
        return self.user_s + self.system_s


POLL_S = 15.0  # how often a running trainer's usage is written (what a cut-off attempt loses at most)
MEMORY_POLL_S = 1.0  # how often its private memory (RssAnon) is sampled between those writes


def tree_usage(root: int) -> dict | None:
    """Usage so far of process `root` and its live descendants, from /proc (None once `root` is gone): CPU seconds
    summed over the live processes of utime + cutime (stime + cstime): the c-fields hold every descendant a process
    has reaped, so workers that already exited are counted once; minor faults likewise; the largest VmHWM, the
    peak resident set of the biggest single process, which is what ru_maxrss reports; and anon_bytes, RssAnon summed
    over the live processes now: their private resident memory, which VmHWM overstates by the file pages of what
    they memory-map (our offline trainer's feature store: clean pages the kernel drops under pressure)."""
    parent, stat = {}, {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            text = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        fields = text[text.rfind(")") + 2:].split()  # fields[0] is stat's field 3 (state); comm may hold spaces
        pid = int(entry.name)
        parent[pid], stat[pid] = int(fields[1]), fields
    if root not in stat:
        return None
    tree, frontier = {root}, [root]
    while frontier:
        children = [pid for pid, ppid in parent.items() if ppid in frontier and pid not in tree]
        tree.update(children)
        frontier = children
    tick = os.sysconf("SC_CLK_TCK")
    usage = {"user_s": 0.0, "system_s": 0.0, "minor_faults": 0, "max_rss_bytes": 0, "anon_bytes": 0}
    for pid in tree:
        f = stat[pid]
        usage["minor_faults"] += int(f[7]) + int(f[8])
        usage["user_s"] += (int(f[11]) + int(f[13])) / tick
        usage["system_s"] += (int(f[12]) + int(f[14])) / tick
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    usage["max_rss_bytes"] = max(usage["max_rss_bytes"], int(line.split()[1]) * 1024)
                elif line.startswith("RssAnon:"):
                    usage["anon_bytes"] += int(line.split()[1]) * 1024
        except OSError:
            pass
    return usage


def run_measured(command: list[str], log: Path, env: dict | None = None, cwd: Path = ROOT,
                 progress: Path | None = None, on_poll=None) -> Measured:
    """Run `command`, measured by wait4 when it ends. Meanwhile, every POLL_S seconds, its usage so far is written
    to `progress` (so an attempt cut off with this process, at a session's end, still counts all but its last
    seconds) and `on_poll()` is called (the curve's snapshots)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    done = threading.Event()

    peak_anon = [0]  # the watcher's largest anon_bytes sample, read once the process has ended

    def watch(pid: int) -> None:
        peak, written = 0, time.perf_counter()
        while not done.wait(min(MEMORY_POLL_S, POLL_S)):
            usage = tree_usage(pid)
            if usage is None:
                return
            peak = usage["max_rss_bytes"] = max(peak, usage["max_rss_bytes"])
            peak_anon[0] = max(peak_anon[0], usage.pop("anon_bytes"))
            if time.perf_counter() - written < POLL_S:
                continue
            written = time.perf_counter()
            if progress is not None:
                write_json(progress, {**usage, "max_anon_bytes": peak_anon[0], "wall_s": written - start,
                                      "complete": False})
            if on_poll is not None:
                on_poll()

    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                                   env={**os.environ, **(env or {})})
        if progress is not None:  # at once: an attempt cut off before its first sample still counts as one
            write_json(progress, {"user_s": 0.0, "system_s": 0.0, "minor_faults": 0, "max_rss_bytes": 0,
                                  "max_anon_bytes": 0, "wall_s": 0.0, "complete": False})
        watcher = threading.Thread(target=watch, args=(process.pid,), daemon=True)
        watcher.start()
        try:
            _, status, usage = os.wait4(process.pid, 0)
        except BaseException:
            process.kill()
            process.wait()
            raise
        finally:
            done.set()
            watcher.join()
    process.returncode = os.waitstatus_to_exitcode(status)
    measured = Measured(process.returncode, time.perf_counter() - start, usage.ru_utime, usage.ru_stime,
                        usage.ru_maxrss * 1024, usage.ru_minflt, str(log), peak_anon[0])
    if progress is not None:
        write_json(progress, {**asdict(measured), "complete": True})
    if on_poll is not None:
        on_poll()
    return measured


def attempts_total(directory: Path) -> dict:
    """A run's usage over all its attempts (each resumed from the last one's checkpoint): CPU, wall and faults
    summed, peak memory the largest. An attempt whose harness was cut off mid-run has only its last /proc sample,
    so up to POLL_S seconds of it are missing: `complete_attempts` < `attempts` says so."""
    parts = [json.loads(p.read_text()) for p in sorted(directory.glob("attempt-*.json"))]
    total = {key: sum(p[key] for p in parts) for key in ("wall_s", "user_s", "system_s", "minor_faults")}
    for key in ("max_rss_bytes", "max_anon_bytes"):  # an attempt recorded before anon sampling has none
        total[key] = max((p.get(key, 0) for p in parts), default=0)
    total.update(attempts=len(parts), complete_attempts=sum(p["complete"] for p in parts))
    return total


def last_lines(path: str, n: int = 3) -> str:
    lines = [line.strip() for line in Path(path).read_text(errors="replace").splitlines() if line.strip()]
    return " | ".join(lines[-n:])[-400:]


def load_adapter(name: str):
    """drafters/peers/<name>.py: install, convert, command, exported (drafters/peers/__init__.py)."""
    return importlib.import_module(f"drafters.peers.{name}")


def write_json(path: Path, value) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(value, indent=2) + "\n")
    temporary.replace(path)


# ----------------------------------------------------------------------------------------------- stages

def save_target(name: str, out: Path) -> Path:
    """The target as an HF directory (safetensors + config + tokenizer): what the peers load."""
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    from drafters.files import move_dir_into_place
    from drafters.targets import load_target

    target = load_target(name, dtype="float32")
    partial = out.with_name(out.name + ".partial")
    target.model.save_pretrained(partial)
    target.tokenizer.save_pretrained(partial)
    move_dir_into_place(partial, out, "target")
    return out


def capture(args, out: Path) -> Path:
    """Our features store over the first --rows rows (train/features.py resumes a partial one)."""
    store = out / "store"
    if (store_index(store) or {}).get("complete"):
        return store
    command = [sys.executable, "train/features.py", args.recipe, f"target={args.target}", f"data.path={args.data}",
               f"data.limit={args.rows}", "data.eval_rows=0", f"data.max_length={MATCHED['max_length']}",
               f"features.dir={store}",
               f"features.dtype={args.feature_dtype}", f"threads={args.threads}"]
    measured = run_measured(command, out / "logs" / "capture.log", env=threads_env(args.threads))
    if measured.returncode:
        raise SystemExit(f"peers: the feature capture failed ({last_lines(measured.log)}); see {measured.log}")
    write_json(out / "capture.json", asdict(measured))
    return store


def store_index(store: Path) -> dict | None:
    """The capture's index.json (drafters.training.features.read_index), None before the capture; a damaged one
    stops the harness in one sentence naming it."""
    from drafters.training.features import FeatureStoreError, read_index

    try:
        return read_index(store)
    except FeatureStoreError as err:
        raise SystemExit(f"peers: {err}, then run this command again") from None


def training_rows(store: Path) -> tuple[list[int], int, int]:
    """The rows every trainer trains on: all of the store's (no held-out rows: the comparison's measure of quality
    is the MT-bench evaluation, and no trainer spends CPU time on an evaluation the others skip) -> (data rows,
    tokens, supervised tokens)."""
    from safetensors import safe_open

    index = store_index(store)
    rows, tokens, supervised = [], 0, 0
    for name in sorted(index["shards"]):
        with safe_open(store / name, framework="pt") as f:
            rows += f.get_tensor("rows").tolist()
            tokens += f.get_tensor("input_ids").numel()
            supervised += int(f.get_tensor("loss_mask").sum())
    return sorted(set(rows)), tokens, supervised


def check_same_work(args) -> None:
    """One --out holds one piece of work: a rerun with another target, data or row count would mix stores."""
    work = {"target": args.target, "data": str(args.data), "rows": args.rows, "recipe": args.recipe,
            "feature_dtype": args.feature_dtype}
    path = args.out / "work.json"
    if path.exists():
        before = json.loads(path.read_text())
        changed = [f"--{k} {before[k]} (now {work[k]})" for k in work if before.get(k) != work[k]]
        if changed:
            raise SystemExit(f"peers: {args.out} holds the work of {', '.join(changed)}; pass the same options to "
                             "resume it, or another --out for new work")
    else:
        write_json(path, work)


def threads_env(threads: int) -> dict:
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}


SAVES_PER_POINT = 4  # saves per curve point: an interrupted run resumes from at most 1 / (curve x 4) of it back


def our_steps(recipe: str, kind: str, rows: int, settings: dict) -> int:
    """Optimizer steps of our one-epoch run over `rows` (batches of the recipe's or the matched batch size)."""
    import yaml

    batch = settings["batch_size"] if kind == "matched" else yaml.safe_load(Path(recipe).read_text())["batch_size"]
    return -(-rows // batch)


def our_saved(drafter_dir: Path) -> list[tuple[float, Path]]:
    """(fraction of the run's tokens, checkpoint) for our run's checkpoint-<step> directories and its final one,
    from each checkpoint's trainer/position.json (the tokens it had trained on)."""
    def tokens(path: Path) -> int:
        return json.loads((path / "trainer" / "position.json").read_text())["tokens"]

    final = drafter_dir / "checkpoint-final"
    total = tokens(final)
    points = [(tokens(p) / total, p) for p in drafter_dir.glob("checkpoint-*")
              if p.name.removeprefix("checkpoint-").isdigit() and (p / "trainer" / "position.json").is_file()]
    return sorted(points) + [(1.0, final)]


def train(args, out: Path, store: Path, target_dir: Path, trainer: str, kind: str, seed: int) -> dict:
    """One training run -> its row (measurement, or the reason it has none). Skipped when its result exists; an
    interrupted one resumes from its last save, and its row sums the attempts (attempt-NN.json)."""
    name = f"{trainer}-{kind}-s{seed}"
    run_dir = out / "runs" / name
    result_path = run_dir / "train.json"
    if result_path.exists():
        done = json.loads(result_path.read_text())
        if "error" not in done:  # a failed run is tried again
            return done
    save_fraction = 1 / (args.curve * SAVES_PER_POINT)
    settings = {**MATCHED, "kind": kind, "seed": seed, "threads": args.threads, "draft_vocab": args.draft_vocab,
                "save_fraction": save_fraction}
    row = {"trainer": trainer, "settings": kind, "seed": seed}
    try:
        on_poll = None
        if trainer in OURS:
            steps = our_steps(args.recipe, kind, len(training_rows(store)[0]), settings)
            command = [sys.executable, "train/train.py", args.recipe, f"target={args.target}", f"data.path={args.data}",
                       f"data.limit={args.rows}", f"output_dir={run_dir / 'drafter'}",
                       *our_overrides(kind, settings), f"save_every={max(1, round(steps * save_fraction))}",
                       "keep_last=0", "resume_from=latest"]
            if trainer != "drafters-online":
                command += [f"features.dir={store}", f"features.dtype={args.feature_dtype}"]
            if trainer == "drafters-frozen-head":
                command.append("eagle3.freeze_head=true")
            env, drafter, fmt = threads_env(args.threads), run_dir / "drafter" / "checkpoint-final", "ours"
        else:
            adapter = load_adapter(trainer)
            python = adapter.install(ROOT)
            data = run_dir / "data"
            # matched: each peer scores exactly our labels (its loss-mask convention differs: drafters/peers/*.py);
            # defaults: our mask as it is, read by the peer's own convention, as its own capture would be
            adapter.convert(store, data, rows=training_rows(store)[0], labels_as_ours=kind == "matched")
            if kind == "defaults":
                settings["max_length"] = None  # the peer's own sequence length / packing
            elif hasattr(adapter, "write_vocab_mapping"):  # our draft vocabulary, not one counted on its shifted mask
                settings["vocab_mapping"] = adapter.write_vocab_mapping(store, run_dir / "vocab_mapping.pt",
                                                                        settings["draft_vocab"], training_rows(store)[0])
            command, env = adapter.command(python, data, target_dir, run_dir / "out", settings)
            env = {**threads_env(args.threads), **env}
            drafter, fmt = None, None
            if hasattr(adapter, "snapshot"):  # a peer whose saves overwrite each other: each copied as it appears
                def on_poll():
                    adapter.snapshot(run_dir / "out", run_dir / "out" / "curve", save_fraction)
        attempt = len(list(run_dir.glob("attempt-*.json")))
        measured = run_measured(command, run_dir / f"train-{attempt:02d}.log", env=env,
                                progress=run_dir / f"attempt-{attempt:02d}.json", on_poll=on_poll)
        total = attempts_total(run_dir)
        row.update(total, returncode=measured.returncode, log=measured.log, cpu_s=total["user_s"] + total["system_s"],
                   command=" ".join(map(str, command)), env=env)
        if measured.returncode:
            row["error"] = f"training exited {measured.returncode}: {last_lines(measured.log)}"
        elif drafter is None:
            drafter, fmt = adapter.exported(run_dir / "out")
        if trainer in PEERS and not args.keep_converted and not measured.returncode:
            shutil.rmtree(run_dir / "data", ignore_errors=True)  # a copy of the store as big as it (5.6 GB at 1M tokens)
        row["drafter"], row["format"] = (str(drafter), fmt) if drafter else (None, None)
    except Exception as error:  # a peer that cannot install or convert: its row says why, the others still run
        row["error"] = f"{type(error).__name__}: {error}"[:400]
    write_json(result_path, row)
    return row


def measure(args, drafter: str, path: Path) -> dict:
    """MT-bench tau and per-depth acceptance of one drafter by our decoder, kept in `path` (a rerun reads it)."""
    if not path.exists():
        command = [sys.executable, "eval/tau.py", "--target", args.target, "--proposer", drafter,
                   "--bench", args.bench, "--limit", str(args.bench_limit), "--tree", f"chain:{args.chain}",
                   "--temperature", "0", "--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads),
                   "--no-baseline", "--json", str(path)]
        measured = run_measured(command, path.with_suffix(".log"), env=threads_env(args.threads))
        if measured.returncode or not path.exists():
            raise RuntimeError(f"our decoder could not measure {drafter}: {last_lines(measured.log)}")
    return json.loads(path.read_text())


def held_out(args, out: Path, drafter: str, path: Path) -> dict:
    """Held-out top-1 by TTT step (eval/heldout.py) over the --heldout-rows data rows after the last training row,
    the same rows and the same measure for every trainer's drafter; kept in `path`. A failure is the row's note."""
    if args.heldout_rows < 1:
        return {}
    if not path.exists():
        last = max(training_rows(out / "store")[0])
        command = [sys.executable, "eval/heldout.py", "--target", args.target, "--proposer", drafter,
                   "--data", str(args.data), "--rows", f"{last + 1}:{last + 1 + args.heldout_rows}",
                   "--steps", str(args.heldout_steps), "--threads", str(args.threads), "--json", str(path)]
        measured = run_measured(command, path.with_suffix(".log"), env=threads_env(args.threads))
        if measured.returncode or not path.exists():
            return {"error": f"eval/heldout.py: {last_lines(measured.log, 1)}"}
    result = json.loads(path.read_text())
    return {key: result[key] for key in ("step_acc", "tau_pred", "supervised", "rows")}


def curve_points(curve: int, saved: list[tuple[float, Path]]) -> list[tuple[float, Path]]:
    """Of a run's saves (fraction of the run, drafter; the last one the final drafter, 1.0), the ones nearest to
    1/curve, 2/curve, ... (within half a step of the grid), then the final one."""
    *middle, final = saved
    points = []
    for k in range(1, curve):
        if middle:
            fraction, path = min(middle, key=lambda s: abs(s[0] - k / curve))
            if abs(fraction - k / curve) < 0.5 / curve and (fraction, path) not in points:
                points.append((fraction, path))
    return points + [final]


def evaluate(args, out: Path, row: dict) -> dict:
    """MT-bench tau and per-depth acceptance by our decoder: the final drafter's, and with --curve N each N-th of
    the run's. Skipped where its result exists."""
    if row.get("error") or not row.get("drafter"):
        return row
    run_dir = out / "runs" / f"{row['trainer']}-{row['settings']}-s{row['seed']}"
    try:
        result = measure(args, row["drafter"], run_dir / "bench.json")
        row.update(tau=result["tau"], per_depth_acceptance=result["per_depth_acceptance"],
                   eval_json=str(run_dir / "bench.json"))
        row["heldout"] = held_out(args, out, row["drafter"], run_dir / "heldout.json")
        if args.curve > 1:
            adapter = None if row["trainer"] in OURS else load_adapter(row["trainer"])
            saved = our_saved(run_dir / "drafter") if adapter is None else adapter.saved(run_dir / "out")
            row["curve"] = []
            for fraction, drafter in curve_points(args.curve, saved):
                point = result
                if fraction < 1.0:
                    if row["trainer"] == "specforge":  # its saves are training states: exported first
                        drafter = adapter.exported(run_dir / "out", drafter)[0]
                    point = measure(args, str(drafter), run_dir / f"bench-{round(1000 * fraction):04d}.json")
                row["curve"].append({"fraction": fraction, "tau": point["tau"],
                                     "first_draft": point["per_depth_acceptance"][0]})
    except Exception as error:
        row["error"] = f"{type(error).__name__}: {error}"[:400]
    return row


# ----------------------------------------------------------------------------------------------- report

def table(rows: list[dict], tokens: int) -> str:
    lines = ["| trainer | settings | seed | tokens / CPU-s | wall s | CPU s (sys %) | peak RSS GiB | peak anon GiB "
             "| minor faults | tau | first draft | held-out top-1 by TTT step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['trainer']} | {r['settings']} | {r['seed']} | failed: {r['error']} |||||||||")
            continue
        lines.append(f"| {r['trainer']} | {r['settings']} | {r['seed']} | {tokens / r['cpu_s']:.0f} | "
                     f"{r['wall_s']:.0f} | {r['cpu_s']:.0f} ({100 * r['system_s'] / r['cpu_s']:.0f}%){cut_off(r)} | "
                     f"{r['max_rss_bytes'] / 2**30:.2f} | {r.get('max_anon_bytes', 0) / 2**30:.2f} | "
                     f"{r['minor_faults'] / 1e6:.1f}M | "
                     f"{r['tau']:.3f} | {r['per_depth_acceptance'][0]:.3f} | {held_out_cell(r.get('heldout'))} |")
    return "\n".join(lines)


def held_out_cell(result: dict | None) -> str:
    if not result:
        return "-"
    if "error" in result:
        return f"failed: {result['error']}"
    return " ".join(f"{a:.3f}" for a in result["step_acc"])


def cut_off(row: dict) -> str:
    """A note for a run some of whose attempts were cut off with the harness: their last POLL_S seconds are
    missing from its CPU time."""
    missing = row.get("attempts", 1) - row.get("complete_attempts", 1)
    return f", {missing} of {row['attempts']} attempts cut off" if missing else ""


def curve_table(rows: list[dict], supervised: int) -> str:
    """First-draft acceptance (tau) against the supervised tokens trained on, a column per curve point."""
    rows = [r for r in rows if r.get("curve")]
    if not rows:
        return ""
    fractions = sorted({round(c["fraction"], 2) for r in rows for c in r["curve"]})
    lines = ["| trainer | settings | seed | " + " | ".join(f"{f * supervised:,.0f} tokens" for f in fractions) + " |",
             "|---|---|---|" + "---|" * len(fractions)]
    for r in rows:
        by = {round(c["fraction"], 2): c for c in r["curve"]}
        cells = [f"{by[f]['first_draft']:.3f} ({by[f]['tau']:.3f})" if f in by else "" for f in fractions]
        lines.append(f"| {r['trainer']} | {r['settings']} | {r['seed']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="working directory (resumable)")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--data", default="recipes/data/smollm2_general.jsonl")
    p.add_argument("--recipe", default="recipes/eagle3_smollm2.yaml",
                   help="our trainer's recipe (the defaults row runs it as it is; matched overrides it)")
    p.add_argument("--bench", default="mt_bench", help="what our decoder measures: mt_bench or a JSONL file")
    p.add_argument("--draft-vocab", type=int, default=MATCHED["draft_vocab"])
    p.add_argument("--feature-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="the capture's storage (float32: our offline and online runs train bit for bit alike)")
    p.add_argument("--rows", type=int, default=150, help="train on the first N usable rows of --data")
    p.add_argument("--trainers", nargs="+", default=list(DEFAULT_TRAINERS), choices=TRAINERS,
                   help="drafters-frozen-head (ours offline with the head not trained) runs only when named")
    p.add_argument("--settings", nargs="+", default=["matched"], choices=["matched", "defaults"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--threads", type=int, default=1, help="per trainer; trainers run one after another")
    p.add_argument("--bench-limit", type=int, default=10, help="first N MT-bench questions (both turns)")
    p.add_argument("--chain", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=32, help="per turn")
    p.add_argument("--keep-converted", action="store_true",
                   help="keep each peer run's converted copy of the store (runs/NAME/data; removed once the run "
                        "ends, since a rerun converts again)")
    p.add_argument("--heldout-rows", type=int, default=64,
                   help="held-out top-1 by TTT step (eval/heldout.py) on this many data rows after the training "
                        "rows, for every drafter; 0 = none")
    p.add_argument("--heldout-steps", type=int, default=7, help="TTT steps the held-out accuracy scores")
    p.add_argument("--curve", type=int, default=1,
                   help="also measure each run at 1/N, 2/N, ... of its tokens (its saves then), for the curve of "
                        "acceptance against tokens; 1 = the final drafters only")
    p.add_argument("--report", type=Path, default=None, help="also write the table here (markdown)")
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    check_same_work(args)
    target_dir = save_target(args.target, args.out / "target")
    store = capture(args, args.out)
    rows, tokens, supervised = training_rows(store)
    print(f"peers: {len(rows)} training rows, {tokens} tokens ({supervised} supervised), same for every trainer")
    results = []
    for seed in args.seeds:
        for kind in args.settings:
            for trainer in args.trainers:
                row = evaluate(args, args.out, train(args, args.out, store, target_dir, trainer, kind, seed))
                results.append(row)
                print(table([row], tokens).splitlines()[-1], flush=True)
    text = (f"{len(rows)} training rows of {args.data}, {tokens} tokens ({supervised} supervised); {args.bench}, "
            f"first {args.bench_limit} questions, all turns, {args.max_new_tokens} tokens a turn, chain of {args.chain}, "
            f"temperature 0; {args.threads} thread(s) per trainer.\n\n{table(results, tokens)}\n")
    if args.curve > 1:
        text += ("\nFirst-draft acceptance (tau) against the supervised tokens trained on (each run's save nearest "
                 f"to every 1/{args.curve} of it):\n\n{curve_table(results, supervised)}\n")
    write_json(args.out / "peers.json", {"rows": len(rows), "tokens": tokens, "supervised": supervised,
                                          "results": results})
    print(text)
    if args.report:
        from drafters.files import write_text_atomic
        write_text_atomic(args.report, text)
    return results


if __name__ == "__main__":
    main()
