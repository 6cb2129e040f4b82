"""eval/peers.py, the side-by-side harness, on the tiny target with our own trainer (the peers' own runs need their
venvs: tests/test_peer_<peer>.py). What it must get right whatever the trainers: one capture that every run trains
on, measurement from outside the process (its descendants included), a row with a reason for a trainer that
fails while the others still report, and a rerun that resumes instead of redoing."""

import json
import sys
import types

import pytest
import torch
from safetensors.torch import load_file

from conftest import load_script

PEERS = load_script("eval/peers.py")

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
    rows = PEERS.main(tiny_args(out, bench, "--trainers", "drafters-offline", "drafters-online",
                                "--feature-dtype", "float32"))
    return out, rows


def test_offline_and_online_train_the_same_drafter_from_the_one_capture(ours):
    out, rows = ours
    assert [r["trainer"] for r in rows] == ["drafters-offline", "drafters-online"]
    assert all("error" not in r for r in rows), rows
    # float32 storage: the offline run reads what the online run computes, so the drafters are the same up to the
    # rounding of a differently padded batch (tests/test_features_offline.py: losses equal to 1e-6)
    offline, online = (load_file(f"{r['drafter']}/model.safetensors") for r in rows)
    assert offline.keys() == online.keys()
    for name in offline:
        torch.testing.assert_close(offline[name], online[name], rtol=1e-5, atol=1e-7, msg=name)
    assert rows[0]["tau"] == rows[1]["tau"] >= 1.0
    report = json.loads((out / "peers.json").read_text())
    index = json.loads((out / "store" / "index.json").read_text())
    assert report["tokens"] == index["tokens"] and report["rows"] == index["rows"] == 8


def test_each_run_is_measured_from_outside(ours):
    _, rows = ours
    for r in rows:
        assert r["returncode"] == 0 and r["cpu_s"] == pytest.approx(r["user_s"] + r["system_s"])
        assert 0 < r["cpu_s"] and 0 < r["wall_s"] and r["max_rss_bytes"] > 100 * 2**20  # torch alone is > 100 MB


def test_a_rerun_resumes_and_a_changed_rerun_is_refused(ours, bench):
    out, rows = ours
    stamps = {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("*.json")}
    again = PEERS.main(tiny_args(out, bench, "--trainers", "drafters-offline", "drafters-online",
                                 "--feature-dtype", "float32"))
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
