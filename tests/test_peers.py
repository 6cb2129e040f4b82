"""eval/peers.py, the side-by-side harness, on the tiny target with our own trainer (the peers' own runs need their
venvs: tests/test_peer_<peer>.py). What it must get right whatever the trainers: one capture that every run trains
on, measurement from outside the process (its descendants included), a row with a reason for a trainer that
fails while the others still report, and a rerun that resumes instead of redoing."""

import json
import os
import sys
import types

import pytest
import torch
from safetensors.torch import load_file

from conftest import load_script
from drafters.tiny import build_tiny_target

PEERS = load_script("eval/peers.py")
OURS = PEERS.OURS  # offline, online, frozen head

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("abc abc abc abc", "hello hello")))
    return path


def tiny_args(out, bench, *extra):
    return ["--out", str(out), "--target", "tiny-random-llama", "--recipe", "recipes/eagle3_tiny.yaml",
            "--data", "tests/data/tiny_conversations.jsonl", "--rows", "8", "--draft-vocab", "64",
            "--bench", str(bench), "--bench-limit", "2", "--max-new-tokens", "8", *extra]


@pytest.fixture(scope="module")
def ours(tmp_path_factory, bench):
    out = tmp_path_factory.mktemp("peers")
    rows = PEERS.main(tiny_args(out, bench, "--trainers", *OURS, "--feature-dtype", "float32"))
    return out, rows


def test_offline_and_online_train_the_same_drafter_from_the_one_capture(ours):
    out, rows = ours
    assert [r["trainer"] for r in rows] == list(OURS)
    assert all("error" not in r for r in rows), rows
    rows = rows[:2]
    # float32 storage: the offline run reads what the online run computes, so the drafters are the same up to the
    # rounding of a differently padded batch (tests/test_features_offline.py: losses equal to 1e-6)
    offline, online = (load_file(f"{r['drafter']}/model.safetensors") for r in rows)
    assert offline.keys() == online.keys()
    for name in offline:
        torch.testing.assert_close(offline[name], online[name], rtol=1e-5, atol=1e-7, msg=name)
    assert rows[0]["tau"] == rows[1]["tau"] >= 1.0
    # scored on the same held-out rows (after the 8 training rows), by TTT step, the same for the same drafter
    offline_held, online_held = (r["heldout"] for r in rows)
    first = max(PEERS.training_rows(out / "store")[0]) + 1  # the first data row after those trained on
    assert offline_held["rows"] == online_held["rows"] == f"{first}:{first + 64}" and offline_held["supervised"] > 0
    assert len(offline_held["step_acc"]) == 7
    assert offline_held["step_acc"] == pytest.approx(online_held["step_acc"], abs=1e-6)
    report = json.loads((out / "peers.json").read_text())
    index = json.loads((out / "store" / "index.json").read_text())
    assert report["tokens"] == index["tokens"] and report["rows"] == index["rows"] == 8


def test_the_frozen_head_row_trains_all_but_the_targets_head_rows(ours):
    _, rows = ours
    offline, frozen = (load_file(f"{r['drafter']}/model.safetensors") for r in (rows[0], rows[2]))
    target, _ = build_tiny_target("tiny-random-llama")
    used = torch.arange(frozen["d2t"].numel()) + frozen["d2t"]  # EAGLE-3's d2t: target id - draft id
    assert torch.equal(frozen["lm_head.weight"], target.lm_head.weight.float()[used])
    assert not torch.equal(offline["lm_head.weight"], frozen["lm_head.weight"])  # the offline run trains its head
    assert not torch.equal(offline["fc.weight"], frozen["fc.weight"])


def test_each_run_is_measured_from_outside(ours):
    _, rows = ours
    for r in rows:
        assert r["returncode"] == 0 and r["cpu_s"] == pytest.approx(r["user_s"] + r["system_s"])
        assert 0 < r["cpu_s"] and 0 < r["wall_s"] and r["max_rss_bytes"] > 100 * 2**20  # torch alone is > 100 MB


def test_a_rerun_resumes_and_a_changed_rerun_is_refused(ours, bench):
    out, rows = ours
    stamps = {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("*.json")}
    again = PEERS.main(tiny_args(out, bench, "--trainers", *OURS, "--feature-dtype", "float32"))
    assert [r["tau"] for r in again] == [r["tau"] for r in rows]
    assert {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("*.json")} == stamps  # nothing ran again
    with pytest.raises(SystemExit, match=r"--rows 8 \(now 9\).*same options to resume"):
        PEERS.main(tiny_args(out, bench, "--rows", "9", "--feature-dtype", "float32"))


def test_a_peer_that_cannot_install_gets_its_reason_and_the_others_still_report(ours, bench, monkeypatch):
    out, _ = ours
    class PeerError(Exception):
        pass

    def install(root, venv=None):
        raise PeerError("pip could not find speculators==0.9.0 (no network)")

    # the peer's install is the external part stubbed here; the harness around it is what is tested
    monkeypatch.setattr(PEERS, "load_adapter", lambda name: types.SimpleNamespace(install=install))
    rows = PEERS.main(tiny_args(out, bench, "--trainers", "drafters-offline", "speculators",
                                "--feature-dtype", "float32"))
    assert rows[0]["tau"] >= 1.0
    assert rows[1]["error"] == "PeerError: pip could not find speculators==0.9.0 (no network)"
    assert "| speculators | matched | 0 | failed: PeerError: pip could not find" in PEERS.table(rows, 1)


def test_the_measurement_covers_the_processes_a_trainer_starts(tmp_path):
    # a launcher (accelerate, torchrun, a self-launching CLI) whose worker does the work: the worker's CPU time
    # and memory must be counted
    worker = "import time; b = bytearray(300 * 2**20); t = time.process_time(); exec('while time.process_time() - t < 0.5: pass')"
    launcher = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {worker!r}], check=True)"
    measured = PEERS.run_measured([sys.executable, "-c", launcher], tmp_path / "log")
    assert measured.returncode == 0
    assert measured.cpu_s >= 0.45 and measured.max_rss_bytes >= 300 * 2**20
    failed = PEERS.run_measured([sys.executable, "-c", "import sys; print('no data'); sys.exit(3)"], tmp_path / "log2")
    assert failed.returncode == 3 and PEERS.last_lines(failed.log) == "no data"


def test_private_memory_is_sampled_apart_from_a_mapped_files_pages(tmp_path, monkeypatch):
    # a worker that maps and reads a 256 MB file (as our offline trainer maps its feature store) and allocates 128 MB
    # of its own: VmHWM / ru_maxrss count both, the sampled RssAnon peak only the allocation
    monkeypatch.setattr(PEERS, "MEMORY_POLL_S", 0.05)
    data = tmp_path / "store.bin"
    data.write_bytes(b"\1" * (256 * 2**20))
    worker = (f"import mmap, time; f = open({str(data)!r}, 'rb'); m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ); "
              "s = sum(m[i] for i in range(0, len(m), 4096)); b = bytearray(128 * 2**20); b[::4096] = b'x' * len(b[::4096]); "
              "time.sleep(1.0)")
    launcher = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {worker!r}], check=True)"
    measured = PEERS.run_measured([sys.executable, "-c", launcher], tmp_path / "log")
    assert measured.returncode == 0, PEERS.last_lines(measured.log)
    assert measured.max_rss_bytes >= (256 + 128) * 2**20
    assert 128 * 2**20 <= measured.max_anon_bytes < (128 + 100) * 2**20  # the allocation (+ the interpreter)


def test_a_running_attempt_is_sampled_so_a_cut_off_one_still_counts(tmp_path, monkeypatch):
    # a launcher whose worker burns CPU: while it runs, the /proc samples must see the worker's time (a descendant,
    # alive) and, once it exits, keep it (the launcher's cutime); the final record is wait4's
    monkeypatch.setattr(PEERS, "POLL_S", 0.1)
    worker = "import time; t = time.process_time(); exec('while time.process_time() - t < 1.0: pass')"
    launcher = f"import subprocess, sys, time; subprocess.run([sys.executable, '-c', {worker!r}]); time.sleep(0.5)"
    progress, seen = tmp_path / "attempt-00.json", []
    measured = PEERS.run_measured([sys.executable, "-c", launcher], tmp_path / "log", progress=progress,
                                  on_poll=lambda: seen.append(json.loads(progress.read_text())) if progress.exists() else None)
    running = [s for s in seen if not s["complete"]]
    assert running and max(s["user_s"] + s["system_s"] for s in running) >= 0.9  # the worker's second, mid-run
    final = json.loads(progress.read_text())
    assert final["complete"] and final["user_s"] == measured.user_s and measured.cpu_s >= 1.0
    # a second attempt, cut off after its last sample: the run's total adds both, and says one was cut off
    PEERS.write_json(tmp_path / "attempt-01.json", {**running[-1]})
    total = PEERS.attempts_total(tmp_path)
    assert total["attempts"] == 2 and total["complete_attempts"] == 1
    assert total["user_s"] == pytest.approx(measured.user_s + running[-1]["user_s"])
    assert "1 of 2 attempts cut off" in PEERS.cut_off(total)


def test_an_interrupted_run_resumes_to_the_uninterrupted_drafter(ours, bench, tmp_path):
    # the harness and its trainer killed mid-run (a session's hard end), then the same command again: the run
    # continues from its last save, its row counts both attempts, and its drafter is the one an uninterrupted
    # run trains (tests/test_resume.py holds our trainer's resume to bitwise equality)
    import shutil
    import signal
    import subprocess
    import time

    done_out, rows = ours
    out = tmp_path / "peers"
    shutil.copytree(done_out, out, ignore=shutil.ignore_patterns("runs", "peers.json"))
    args = tiny_args(out, bench, "--trainers", "drafters-offline", "--feature-dtype", "float32")
    code = (f"import sys; sys.path.insert(0, 'tests'); from conftest import load_script; p = load_script('eval/peers.py'); "
            f"p.POLL_S = 0.05; p.main({args!r})")
    drafter = out / "runs" / "drafters-offline-matched-s0" / "drafter"
    harness = subprocess.Popen([sys.executable, "-c", code], cwd=PEERS.ROOT, start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not list(drafter.glob("checkpoint-[0-9]*")) and harness.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(harness.pid, signal.SIGKILL)
    harness.wait()
    assert not (drafter / "checkpoint-final").exists(), "the run ended before it could be cut off"
    row, = PEERS.main(args)
    assert row["attempts"] == 2 and row["complete_attempts"] == 1, row
    first = json.loads((drafter.parent / "attempt-00.json").read_text())
    assert row["user_s"] > first["user_s"] > 0
    resumed, whole = (load_file(f"{d}/model.safetensors") for d in (row["drafter"], rows[0]["drafter"]))
    assert resumed.keys() == whole.keys()
    for name in whole:
        torch.testing.assert_close(resumed[name], whole[name], rtol=0, atol=0, msg=name)


def test_the_curve_takes_the_save_nearest_each_point_and_the_final_drafter():
    saved = [(0.24, "a"), (0.26, "b"), (0.5, "c"), (0.71, "d"), (1.0, "final")]
    assert PEERS.curve_points(4, saved) == [(0.24, "a"), (0.5, "c"), (0.71, "d"), (1.0, "final")]
    # a point with no save within half a grid step is left out rather than stood in for by a far one
    assert PEERS.curve_points(4, [(0.5, "c"), (1.0, "final")]) == [(0.5, "c"), (1.0, "final")]
    assert PEERS.curve_points(1, saved) == [(1.0, "final")]


def test_speculators_mid_epoch_saves_are_kept_as_they_overwrite_each_other(tmp_path):
    # speculators 0.9.0 writes every mid-epoch save into out/<epoch>/ and points epoch<e>_step<N> at it, removing
    # the previous link (trainer.py maybe_save_checkpoint); the end of the epoch links epoch<e>_end
    import drafters.peers.speculators as speculators

    out, curve = tmp_path / "out", tmp_path / "out" / "curve"
    (out / "0").mkdir(parents=True)

    def save(step, weights):
        (out / "0" / "config.json").write_text(json.dumps({"step": step}))
        (out / "0" / "model.safetensors").write_bytes(weights)
        for link in out.glob("epoch0_*"):
            link.unlink()
        (out / f"epoch0_step{step}").symlink_to("0")

    for step in (5, 10, 15):  # a fraction of 0.125 of a 40-step run: saves every 5 steps
        save(step, bytes([step]) * 8)
        speculators.snapshot(out, curve, 0.125)
        speculators.snapshot(out, curve, 0.125)  # called again before the next save: nothing new
    save(20, b"late")  # a save the run made after its last poll: never copied, but its step is not invented
    assert sorted(p.name for p in curve.iterdir() if p.is_dir()) == ["step-10", "step-15", "step-5"]
    assert (curve / "step-10" / "model.safetensors").read_bytes() == bytes([10]) * 8
    (out / "epoch0_end").symlink_to("0")
    saved = speculators.saved(out)
    assert [round(f, 3) for f, _ in saved] == [0.125, 0.25, 0.375, 1.0]
    assert saved[1][1] == curve / "step-10" and saved[-1][1] == out / "0"


def test_specforge_checkpoints_are_its_complete_step_directories(tmp_path):
    import drafters.peers.specforge as specforge

    out = tmp_path / "out"
    for step in (40, 80, 120):
        (out / "train" / f"specforge-step{step}").mkdir(parents=True)
    for step in (40, 120):  # step 80 has no state file yet: a save in progress, or one cut off
        (out / "train" / f"specforge-step{step}" / "training_state.pt").write_bytes(b"state")
    (out / "train" / "specforge-latest").symlink_to("specforge-step120")
    (out / "peer.json").write_text(json.dumps({"steps": 160}))
    assert specforge.saved(out) == [(0.25, out / "train" / "specforge-step40"),
                                    (0.75, out / "train" / "specforge-step120")]


def test_a_damaged_capture_index_stops_the_harness_in_one_sentence(tmp_path):
    # the harness reads its capture's index.json through the store's own reader: damaged, it is named before any
    # trainer runs, not taken for a missing capture nor left as a JSONDecodeError
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "index.json").write_text('{"complete": tr')
    with pytest.raises(SystemExit, match=r"^peers: \S+index.json: not valid JSON .*; delete \S+store and recompute "
                                         r"the features, then run this command again"):
        PEERS.capture(None, tmp_path)
    with pytest.raises(SystemExit, match=r"^peers: \S+index.json: not valid JSON"):
        PEERS.training_rows(tmp_path / "store")
