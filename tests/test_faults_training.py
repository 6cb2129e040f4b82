"""Faults of a training run end cleanly (issue 13): a signal is honoured at a step boundary and resumes
bitwise, a run never silently replaces another, damaged or mismatched checkpoints are named, and
recipe mistakes are refused with a message (train/eagle.py, train/heads.py)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import load_script  # tests/ is on sys.path under pytest
from drafters.errors import Stopped  # noqa: E402
from drafters.training import loop  # noqa: E402
from drafters.training.resume import DiskFull  # noqa: E402  (fit calls loop.train_loop: patched there)
from drafters.checkpoint import load_checkpoint
from drafters.training.recipe import RecipeError

eagle, heads = load_script("train/eagle.py"), load_script("train/heads.py")
ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {"recipes/eagle3_tiny.yaml": eagle, "recipes/medusa_tiny.yaml": heads}  # 6 steps, grad_accum 2


def train(recipe, out, *overrides):
    return SCRIPTS[recipe].main([recipe, f"output_dir={out}", "eval_every=0", *overrides])


def assert_same_weights(a, b):
    wa, wb = (load_checkpoint(Path(d) / "checkpoint-final").state_dict for d in (a, b))
    assert wa.keys() == wb.keys()
    assert [k for k in wa if not torch.equal(wa[k], wb[k])] == [], "weights differ from the uninterrupted run"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    runs = {}
    for recipe in SCRIPTS:
        runs[recipe] = tmp_path_factory.mktemp("whole")
        train(recipe, runs[recipe])
    return runs


# ---- 1. an interrupt takes effect between optimizer steps, whatever phase of a step it hits ---------

STOP_STEP = 3  # the interrupt arrives while step 3 runs: step 3 finishes, is saved, and the run stops


def interrupt_during(phase: str, script, monkeypatch):
    """A train_loop that sends this process SIGINT once, in `phase` of optimizer step STOP_STEP."""
    inner = loop.train_loop

    def train_loop(run, optimizer, scheduler, *args, **kwargs):
        state = {"micro": 0, "sent": False}

        def send(now: bool) -> None:
            if now and not state["sent"]:
                state["sent"] = True
                signal.raise_signal(signal.SIGINT)

        micro_step, periodic, scheduler_step = run.micro_step, run.periodic, type(scheduler).step
        step_of_micro = lambda: state["micro"] // run.recipe.grad_accum + 1  # noqa: E731 (1-based step)

        def micro(batch, acc):
            first = state["micro"] % run.recipe.grad_accum == 0
            send(step_of_micro() == STOP_STEP and phase == ("first_micro" if first else "last_micro"))
            state["micro"] += 1
            return micro_step(batch, acc)

        run.micro_step = micro
        optimizer.optimizer.register_step_pre_hook(
            lambda *_: send(phase == "optimizer_pre" and step_of_micro() - 1 == STOP_STEP))
        optimizer.optimizer.register_step_post_hook(
            lambda *_: send(phase == "optimizer_post" and step_of_micro() - 1 == STOP_STEP))

        def scheduler_then_signal(self, *a, **k):
            scheduler_step(self, *a, **k)
            send(phase == "scheduler" and step_of_micro() - 1 == STOP_STEP)

        # on the class: an instance attribute would land in the scheduler's saved state
        monkeypatch.setattr(type(scheduler), "step", scheduler_then_signal)

        def periodic_then_signal(step, total, position):
            periodic(step, total, position)
            send(phase == "periodic" and step == STOP_STEP)

        run.periodic = periodic_then_signal
        return inner(run, optimizer, scheduler, *args, **kwargs)

    return train_loop


@pytest.mark.parametrize("recipe, phase", [
    *(("recipes/eagle3_tiny.yaml", p) for p in
      ("first_micro", "last_micro", "optimizer_pre", "optimizer_post", "scheduler", "periodic")),
    ("recipes/medusa_tiny.yaml", "optimizer_post"), ("recipes/medusa_tiny.yaml", "first_micro"),
])
def test_interrupt_in_any_phase_saves_the_finished_step_and_resumes_bitwise(uninterrupted, tmp_path, monkeypatch,
                                                                              recipe, phase):
    script, out = SCRIPTS[recipe], tmp_path / "run"
    inner = loop.train_loop
    monkeypatch.setattr(loop, "train_loop", interrupt_during(phase, script, monkeypatch))
    with pytest.raises(Stopped) as stopped:
        train(recipe, out)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the previous handlers are back
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    monkeypatch.setattr(loop, "train_loop", inner)
    train(recipe, out, "resume_from=latest")
    assert_same_weights(uninterrupted[recipe], out)
    # the step that was running when the signal came finished, and the checkpoint says so
    path = out / f"checkpoint-{STOP_STEP}"
    assert str(stopped.value) == (f"interrupted: saved the state after step {STOP_STEP} to {path}; continue with "
                                  f"resume_from={path} (or resume_from=latest)")
    assert load_checkpoint(path).extra["step"] == STOP_STEP


# ---- 2. SIGTERM (schedulers, `kill`) saves like Ctrl-C --------------------------------------------

LONG = ["max_steps=60", "log_every=1", "save_every=0"]  # about 5 s: time to signal it mid-run


def test_an_ignored_signal_stays_ignored_during_the_loop():
    # a launcher that ignores SIGINT (`cmd &` in a shell script, nohup) keeps it ignored: no stop, no save
    from drafters.training.loop import StopRequests

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with StopRequests() as stop:
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == stop.record  # SIGTERM is still honoured
        signal.raise_signal(signal.SIGINT)
        assert stop.signal is None
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_that_resumes_bitwise(tmp_path):
    whole, out = tmp_path / "whole", tmp_path / "terminated"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "train/eagle.py", "recipes/eagle3_tiny.yaml", f"output_dir={out}", "eval_every=0", *LONG]
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + 120
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 2) and process.poll() is None:
        assert time.monotonic() < deadline, "the run never logged a step"
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130 and "stopped: interrupted: saved the state after step" in stderr, stderr[-2000:]
    assert not (out / "checkpoint-final").exists()
    assert 2 <= max(json.loads(row)["step"] for row in metrics.read_text().splitlines()) < 60
    train("recipes/eagle3_tiny.yaml", out, *LONG, "resume_from=latest")
    train("recipes/eagle3_tiny.yaml", whole, *LONG)
    assert_same_weights(whole, out)


# ---- 3. a new run never silently replaces an earlier one ------------------------------------------


@pytest.mark.slow
def test_a_second_run_into_a_running_runs_directory_is_refused_and_a_killed_runs_lock_is_not(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "train/eagle.py", "recipes/eagle3_tiny.yaml", f"output_dir={out}", "eval_every=0",
               "max_steps=5000", "log_every=1", "save_every=2"]  # minutes: it is killed long before its end
    first = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics, deadline = out / "metrics.jsonl", time.monotonic() + 120
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 2) and first.poll() is None:
            assert time.monotonic() < deadline, "the run never logged a step"
            time.sleep(0.02)
        # without the lock this one would remove the running run's files and train into them with another lr
        second = subprocess.run(command + ["optim.lr=9e-3", "overwrite_output_dir=true"], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr[-2000:]
        assert f"error: output_dir={out} is in use by another run (PID {first.pid}" in second.stderr
        assert first.poll() is None and metrics.is_file()
        first.send_signal(signal.SIGKILL)  # killed: its lock goes with it, the file stays
        first.wait(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    assert (out / ".run.lock").read_text().strip() == str(first.pid)
    last = max(int(p.name.removeprefix("checkpoint-")) for p in out.glob("checkpoint-[0-9]*"))
    train("recipes/eagle3_tiny.yaml", out, "resume_from=latest", f"max_steps={last + 2}", "log_every=1", "save_every=2")
    assert (out / "checkpoint-final").is_dir()


def test_a_new_run_into_an_earlier_runs_directory_is_refused_unless_asked(uninterrupted, tmp_path):
    out = tmp_path / "run"
    train("recipes/eagle3_tiny.yaml", out, "max_steps=4", "save_every=2")
    (out / "notes.txt").write_text("mine")  # not the trainer's: never removed
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.name != ".run.lock"}
    with pytest.raises(RecipeError, match=rf"output_dir={out} holds an earlier run \(checkpoint-2, checkpoint-final, "
                                        r"eval.jsonl, metrics.jsonl\).*resume_from=latest.*overwrite_output_dir=true"):
        train("recipes/eagle3_tiny.yaml", out)
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.name != ".run.lock"} == before  # untouched
    train("recipes/eagle3_tiny.yaml", out, "overwrite_output_dir=true")  # removes checkpoint-2: latest is this run's
    assert sorted(p.name for p in out.iterdir()) == [".run.lock", "checkpoint-4", "checkpoint-final", "eval.jsonl",
                                                     "metrics.jsonl", "notes.txt"]
    assert_same_weights(uninterrupted["recipes/eagle3_tiny.yaml"], out)
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 6


def test_resume_latest_of_a_finished_run_without_step_checkpoints_is_refused(tmp_path):
    out = tmp_path / "run"
    train("recipes/eagle3_tiny.yaml", out, "max_steps=2", "save_every=0")
    with pytest.raises(RecipeError, match=r"checkpoint-final: the run finished at step 2, this run's last step "
                                          r"\(max_steps / epochs\), so there is nothing to continue; raise max_steps"):
        train("recipes/eagle3_tiny.yaml", out, "max_steps=2", "save_every=0", "resume_from=latest")
    # its checkpoint-final resumes: a finished run with no checkpoint-<step> at all is continued
    assert train("recipes/eagle3_tiny.yaml", out, "max_steps=3", "save_every=0", "resume_from=latest").steps == 3
    assert [json.loads(row)["step"] for row in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    with pytest.raises(RecipeError, match="set only one of them"):
        train("recipes/eagle3_tiny.yaml", out, "resume_from=latest", "overwrite_output_dir=true")


# ---- 4. resuming a checkpoint past max_steps is refused -------------------------------------------


def test_resuming_a_checkpoint_past_max_steps_is_refused(uninterrupted, tmp_path):
    checkpoint = uninterrupted["recipes/medusa_tiny.yaml"] / "checkpoint-4"
    with pytest.raises(RecipeError, match=rf"resume_from={checkpoint}: the checkpoint is at step 4, past this "
                                          r"run's last step 2 \(max_steps / epochs\); raise max_steps or resume"):
        train("recipes/medusa_tiny.yaml", tmp_path / "run", f"resume_from={checkpoint}", "max_steps=2",
              "trust_checkpoint=true")
    assert not (tmp_path / "run" / "checkpoint-final").exists()


def test_resuming_a_checkpoint_from_outside_output_dir_asks_for_trust(uninterrupted, tmp_path):
    # resuming unpickles the trainer state; a crafted file ran its payload (issue 38, fault 3): a checkpoint from
    # another directory is refused, before anything is loaded from it, unless trust_checkpoint=true says so
    checkpoint = uninterrupted["recipes/medusa_tiny.yaml"] / "checkpoint-4"
    with pytest.raises(RecipeError, match=rf"resume_from={checkpoint} is outside output_dir=.*run: resuming "
                                          r"unpickles its trainer state .* trust_checkpoint=true"):
        train("recipes/medusa_tiny.yaml", tmp_path / "run", f"resume_from={checkpoint}")
    assert not (tmp_path / "run" / "checkpoint-final").exists()
    summary = train("recipes/medusa_tiny.yaml", tmp_path / "run", f"resume_from={checkpoint}", "trust_checkpoint=true")
    assert summary.steps == 6  # the recipe's max_steps, continued from step 4


# ---- 5. resume notices a changed data file --------------------------------------------------------


def test_resume_with_a_changed_data_file_is_refused_unless_allowed(tmp_path):
    data, out = tmp_path / "data.jsonl", tmp_path / "run"
    original = (ROOT / "tests/data/tiny_conversations.jsonl").read_text()
    data.write_text(original)
    train("recipes/eagle3_tiny.yaml", out, f"data.path={data}", "max_steps=4", "save_every=2")
    data.write_text(original.replace("2+2 is 4.", "2+2 is four."))
    with pytest.raises(RecipeError, match=rf"data.path={data} changed since that checkpoint.*held-out set.*"
                                          "allow_recipe_changes=true"):
        train("recipes/eagle3_tiny.yaml", out, f"data.path={data}", "resume_from=latest")
    allowed = tmp_path / "allowed"
    shutil.copytree(out, allowed)
    assert train("recipes/eagle3_tiny.yaml", allowed, f"data.path={data}", "resume_from=latest",
                 "allow_recipe_changes=true").steps == 6
    # checkpoints of older versions recorded no hash: nothing to compare, resumed as before
    meta_path = out / "checkpoint-final" / "drafter.json"  # the newest resumable one (step 4)
    meta = json.loads(meta_path.read_text())
    del meta["extra"]["data_sha256"]
    meta_path.write_text(json.dumps(meta))
    assert train("recipes/eagle3_tiny.yaml", out, f"data.path={data}", "resume_from=latest").steps == 6
    assert load_checkpoint(out / "checkpoint-final").extra["data_sha256"] is not None


# ---- 6. values the trainer would quietly change or that export will refuse are said at the start ----


def test_a_draft_vocab_larger_than_the_targets_is_said(tmp_path, capsys):
    summary = train("recipes/eagle3_tiny.yaml", tmp_path / "run", "draft_vocab_size=300", "max_steps=1")
    assert "draft_vocab_size=300 is larger than the target's vocabulary (259): using 259" in capsys.readouterr().out
    assert summary.drafter.config.draft_vocab_size == 259


def test_an_eagle3_layer_list_export_will_refuse_is_warned_at_the_start(capsys):
    from drafters.training.eagle3 import warn_about_layers
    from drafters.training.families import load_recipe

    for layers, warned in (("[2, 5]", True), ("[2, 4, 5]", False), ("null", False)):
        warn_about_layers(load_recipe(["recipes/eagle3_tiny.yaml", f"layers={layers}"]))
        out = capsys.readouterr().out
        assert ("layers=[2, 5] are 2 aux layers: training works, but export to sglang / vllm will refuse the "
                "drafter (both engines build fc for exactly 3)" in out) == warned, out


# ---- 7. messages, not tracebacks ------------------------------------------------------------------


@pytest.mark.parametrize("script, recipe", [("train/eagle.py", "recipes/eagle3_tiny.yaml"),
                                            ("train/heads.py", "recipes/medusa_tiny.yaml"),
                                            ("train/features.py", "recipes/eagle1_tiny.yaml"),
                                            ("train/regenerate.py", "recipes/tiny_regenerate.yaml")])
@pytest.mark.slow
def test_a_recipe_error_prints_only_its_message(script, recipe):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, script, recipe, "bogus_key=1"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.splitlines()[-1].startswith("error: override 'bogus_key=1' (command line): unknown key 'bogus_key'")


@pytest.mark.parametrize("override, message", [
    ("data.path={junk}", "error: {junk} is a folder but not a readable `datasets` save_to_disk folder"),
    ("target=no-such-target-dir/", "error: "),
])
@pytest.mark.slow
def test_a_data_or_target_error_prints_only_its_message(tmp_path, override, message):
    # every UserError (recipe, data, target, checkpoint), not only RecipeError, ends without a traceback
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "x.bin").write_text("not a dataset")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "train/eagle.py", "recipes/eagle3_tiny.yaml", override.format(junk=junk),
                           f"output_dir={tmp_path / 'run'}"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.splitlines()[-1].startswith(message.format(junk=junk)), done.stderr[-1000:]


def truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def test_a_truncated_checkpoint_is_named_and_latest_falls_back_to_the_previous_one(uninterrupted, tmp_path,
                                                                                    capsys):
    from drafters.checkpoint import CheckpointError

    out = tmp_path / "run"
    train("recipes/eagle3_tiny.yaml", out, "save_every=2")
    truncate(out / "checkpoint-4" / "trainer" / "optimizer.bin")
    truncate(out / "checkpoint-final" / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"{out / 'checkpoint-final' / 'model.safetensors'}: cannot be read"):
        load_checkpoint(out / "checkpoint-final")
    with pytest.raises(RecipeError, match=rf"resume_from={out / 'checkpoint-4'}: the checkpoint is incomplete: "
                                          rf"{out / 'checkpoint-4' / 'trainer' / 'optimizer.bin'}: truncated"):
        train("recipes/eagle3_tiny.yaml", out, "save_every=2", f"resume_from={out / 'checkpoint-4'}")
    capsys.readouterr()
    train("recipes/eagle3_tiny.yaml", out, "save_every=2", "resume_from=latest")
    assert f"resume_from=latest: skipping {out / 'checkpoint-4'}, it is incomplete" in capsys.readouterr().out
    assert_same_weights(uninterrupted["recipes/eagle3_tiny.yaml"], out)


def enospc_oserror():
    import errno

    return OSError(errno.ENOSPC, "No space left on device")


def enospc_safetensors():  # what safetensors raised on a really full tmpfs (the hand-run fault matrix)
    from safetensors import SafetensorError

    return SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


@pytest.mark.parametrize("full", [enospc_oserror, enospc_safetensors])
def test_a_full_disk_while_saving_says_what_to_do_and_keeps_the_earlier_checkpoints(tmp_path, monkeypatch, full):
    from drafters import checkpoint

    out, save_file = tmp_path / "run", checkpoint.save_file
    saves = {"n": 0}

    def full_at_the_second_save(*args, **kwargs):
        saves["n"] += 1
        if saves["n"] == 2:
            raise full()
        return save_file(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_file", full_at_the_second_save)
    with pytest.raises(DiskFull) as stopped:
        train("recipes/eagle3_tiny.yaml", out, "save_every=2")
    assert str(stopped.value) == (f"no space left on device while writing checkpoint-4 to {out}; nothing was "
                                  f"half-written; free space and resume from {out / 'checkpoint-2'} "
                                  "(resume_from=latest)")
    assert sorted(p.name for p in out.iterdir()) == [".run.lock", "checkpoint-2", "eval.jsonl", "metrics.jsonl"]


@pytest.fixture
def small_disk(tmp_path):
    """a 300 KB tmpfs (skipped where mounting needs a root this process is not)"""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    yield disk
    subprocess.run(["umount", str(disk)], capture_output=True)


@pytest.mark.slow
def test_a_full_disk_while_writing_features_says_what_to_do_and_the_rerun_continues(small_disk, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "train/features.py", "recipes/eagle3_tiny.yaml", f"features.dir={small_disk / 'f'}",
               "features.shard_rows=2"]  # ~75 KB a shard: the 5th does not fit
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"no space left on device while writing shard-00004.safetensors to {small_disk / 'f'}; the store is " \
           "consistent (4 of 10 shards complete, nothing half-written): free space and run the same command again " \
           "to continue. This store will need about 0.7 MiB in all" in done.stderr, done.stderr[-3000:]
    assert sorted(p.name for p in (small_disk / "f").iterdir()) == [
        "index.json", "shard-00000.safetensors", "shard-00001.safetensors", "shard-00002.safetensors",
        "shard-00003.safetensors"]
    moved = tmp_path / "f"  # "free space": the same store on a larger disk
    shutil.copytree(small_disk / "f", moved)
    done = subprocess.run(command[:3] + [f"features.dir={moved}", "features.shard_rows=2"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("already complete, skipped") == 4 and "10 shards" in done.stdout


@pytest.mark.slow
def test_a_really_full_disk_while_saving_says_what_to_do(small_disk):
    # the first checkpoint's safetensors fit, torch.save of the optimizer state does not (it used to end in
    # "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos", a traceback)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "train/eagle.py", "recipes/eagle3_tiny.yaml", f"output_dir={small_disk / 'run'}",
                           "eval_every=0", "save_every=2"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"no space left on device while writing checkpoint-2 to {small_disk / 'run'}; nothing was half-written; " \
           "free space and run again (no checkpoint was saved yet)" in done.stderr, done.stderr[-3000:]
    assert not any(p.name.startswith("checkpoint") for p in (small_disk / "run").iterdir())  # no partial checkpoint


# ---- 8. small traps --------------------------------------------------------------------------------


def test_yaml_booleans_read_as_the_literal_word_the_user_wrote(tmp_path):
    import dataclasses
    from typing import Literal

    from drafters.training.families import load_recipe
    from drafters.training.recipe import load_dataclass

    @dataclasses.dataclass
    class Schema:
        precision: Literal["no", "bf16", "fp16"] = "bf16"
        switch: Literal["on", "off", "auto"] = "auto"
        mode: Literal["online", "offline"] = "online"

    path = tmp_path / "r.yaml"
    path.write_text("precision: no\nswitch: off\n")
    assert load_dataclass(path, schema=Schema) == Schema(precision="no", switch="off")
    assert load_dataclass(path, ["precision=no", "switch=on"], schema=Schema) == Schema(precision="no", switch="on")
    with pytest.raises(RecipeError, match=r"override 'mode=yes' \(command line\): True is not one of 'online', 'offline'"):
        load_dataclass(path, ["mode=yes"], schema=Schema)  # no word of this Literal: still refused
    recipe = load_recipe(["recipes/eagle3_tiny.yaml", "mixed_precision=no"])
    assert recipe.mixed_precision == "no"


@pytest.mark.skipif(torch.accelerator.is_available(), reason="fp16 autocast is real on a GPU")
def test_fp16_on_a_cpu_is_refused_instead_of_training_in_fp32(tmp_path):
    with pytest.raises(RecipeError, match=r"mixed_precision=fp16 needs a GPU.*use mixed_precision=bf16"):
        train("recipes/eagle3_tiny.yaml", tmp_path / "run", "mixed_precision=fp16")
