"""The SpecForge 0.2.0 adapter of eval/peers.py (drafters/peers/specforge.py): its offline files hold our store's
tokens, masks and hidden states bit for bit, the mask shift makes SpecForge count exactly our EAGLE-3 labels, the
target view and the run config say what they should; and, with SpecForge's venv, a few training steps whose export
our reader loads.

The venv is never made here (CI does not download or build the peers):
    python -m drafters.peers.specforge       # installs .venv-specforge (torch 2.13 CPU, SpecForge --no-deps)
    pytest -m peers tests/test_peer_specforge.py
Without it the `peers` test skips. DRAFTERS_SPECFORGE_VENV points at another location.
"""

import json
import os
from pathlib import Path

import pytest
import torch

import drafters.peers.specforge as peer
from conftest import PEER_SETTINGS as SETTINGS, stored
from drafters.draft_vocab import build_draft_vocab
from drafters.layers import ttt_label_mask

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("DRAFTERS_SPECFORGE_VENV", ROOT / peer.VENV))


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    from drafters.targets import load_target

    target, directory = load_target("tiny-random-llama"), tmp_path_factory.mktemp("target")
    target.model.save_pretrained(directory)
    target.tokenizer.save_pretrained(directory)
    return directory


def written(out):
    return [torch.load(path, weights_only=True) for path in sorted(Path(out).rglob("*.ckpt"))]


def test_the_offline_files_hold_the_store_bit_for_bit(store, tmp_path):
    counts = peer.convert(store, tmp_path / "data")
    examples, files = stored(store), written(tmp_path / "data")
    assert len(files) == len(examples) == counts["rows"] == 20
    assert counts["tokens"] == sum(len(ids) for _, ids, *_ in examples)
    for (_, ids, mask, label, features), f in zip(examples, files):
        assert sorted(f) == ["aux_hidden_state", "hidden_state", "input_ids", "loss_mask"]
        assert f["input_ids"].dtype == f["loss_mask"].dtype == torch.int64
        assert f["input_ids"].tolist() == ids and f["loss_mask"].tolist() == mask
        assert f["hidden_state"].shape == (1, len(ids), 64) and f["aux_hidden_state"].shape == (1, len(ids), 3 * 64)
        assert f["hidden_state"].dtype == label.dtype and torch.equal(f["hidden_state"][0], label)
        assert torch.equal(f["aux_hidden_state"][0], features)
    # SpecForge zeroes each example's last loss-mask entry: the positions its step 0 counts
    assert counts["supervised"] == sum(sum(mask[:-1]) for _, _, mask, *_ in examples)
    # each file holds its own example, not the storage of the whole shard it was sliced from
    for (_, ids, *_), path in zip(examples, sorted((tmp_path / "data").glob("*.ckpt"))):
        assert path.stat().st_size < 2 * len(ids) * 4 * 64 * 4 + 4096, path


def test_rows_pick_examples_by_data_row_and_a_rerun_keeps_the_files(store, tmp_path):
    out = tmp_path / "data"
    counts = peer.convert(store, out, rows=[3, 1])
    assert [f["input_ids"].tolist() for f in written(out)] == [ids for row, ids, *_ in stored(store) if row in (1, 3)]
    first = sorted(path.stat().st_mtime_ns for path in out.glob("*.ckpt"))
    assert peer.convert(store, out, rows=[1, 3]) == counts
    assert sorted(path.stat().st_mtime_ns for path in out.glob("*.ckpt")) == first
    assert peer.convert(store, out)["rows"] == 20  # other rows: written anew
    with pytest.raises(peer.PeerError, match="none of the rows"):
        peer.convert(store, tmp_path / "none", rows=[999])


def specforge_counts(written_mask: torch.Tensor, step: int) -> torch.Tensor:
    """SpecForge's rule (algorithms/eagle3/data.py, TargetHead.preprocess, OnlineEagle3Model.forward): the mask's
    last entry zeroed, then step i counts position t iff mask[t+i]; over our positions t = 0 .. T-2-i."""
    mask = written_mask.clone()
    mask[:, -1] = 0
    return mask[:, step:][:, :mask.shape[1] - 1 - step]


def test_shifted_masks_make_specforge_count_exactly_our_labels(store, tmp_path):
    peer.convert(store, tmp_path / "as_is")
    peer.convert(store, tmp_path / "ours", labels_as_ours=True)
    lagging = 0
    for (_, _, mask, *_), as_is, ours in zip(stored(store), written(tmp_path / "as_is"), written(tmp_path / "ours")):
        mask = torch.tensor([mask])
        for step in range(3):
            want = ttt_label_mask(mask, step)
            assert torch.equal(specforge_counts(ours["loss_mask"][None], step), want)
            lagging += not torch.equal(specforge_counts(as_is["loss_mask"][None], step), want)
    assert lagging > 0  # the control: the store's mask as is counts other labels (SpecForge's lag of two)


def test_our_draft_vocabulary_is_written_as_specforges_vocab_mapping(store, tmp_path):
    mapping = torch.load(peer.write_vocab_mapping(store, tmp_path / "vocab.pt", 16), weights_only=True)
    ours = build_draft_vocab([(ids, mask) for _, ids, mask, *_ in stored(store)], 259, size=16)
    assert sorted(mapping) == ["d2t", "t2d"] and mapping["d2t"].dtype == torch.int64
    assert torch.equal(mapping["d2t"], ours.d2t) and torch.equal(mapping["t2d"], ours.t2d)


def test_the_target_view_reads_a_tied_head_from_the_embedding(target_dir, tmp_path):
    assert not (target_dir / "model.safetensors.index.json").exists()
    key = peer.prepare_target(target_dir, tmp_path / "view")
    index = json.loads((tmp_path / "view" / "model.safetensors.index.json").read_text())
    assert key == "model.embed_tokens.weight" and index["weight_map"][key] == "model.safetensors"
    assert (tmp_path / "view" / "config.json").resolve() == (target_dir / "config.json").resolve()
    assert not (target_dir / "model.safetensors.index.json").exists()  # the driver's directory is left as it was


@pytest.fixture
def no_venv(monkeypatch):
    written_updates = []
    monkeypatch.setattr(peer, "write_draft_config", lambda python, run, path, update: written_updates.append(update))
    return written_updates


def test_matched_passes_every_setting_and_defaults_only_the_fixed_ones(store, target_dir, tmp_path, no_venv):
    peer.convert(store, tmp_path / "data")
    argv, env = peer.command(Path("python"), tmp_path / "data", target_dir, tmp_path / "matched", SETTINGS)
    assert argv[-3:] == ["train", "--config", str(tmp_path / "matched" / "run.yaml")] and env["OMP_NUM_THREADS"] == "1"
    matched = json.loads((tmp_path / "matched" / "run.yaml").read_text())
    assert matched["training"] == {"num_epochs": 1, "seed": 0, "attention_backend": "sdpa", "fsdp_sharding": "NO_SHARD",
                                   "learning_rate": 1e-3, "lr_scheduler": "cosine", "warmup_ratio": 0.0,
                                   "ttt_length": 3, "batch_size": 1}
    assert matched["model"]["lm_head_key"] == "model.embed_tokens.weight"
    assert no_venv[0] == {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}, "draft_vocab_size": 64}

    peer.command(Path("python"), tmp_path / "data", target_dir, tmp_path / "defaults", {**SETTINGS, "kind": "defaults"})
    defaults = json.loads((tmp_path / "defaults" / "run.yaml").read_text())
    assert defaults["training"] == {"num_epochs": 1, "seed": 0,  # and what a CPU needs:
                                    "attention_backend": "sdpa", "fsdp_sharding": "NO_SHARD"}
    assert "torch_dtype" not in defaults["model"] and no_venv[1] == {"eagle_config": no_venv[0]["eagle_config"]}


@pytest.mark.parametrize("change, message", [({"num_layers": 2}, "1-layer"), ({"step_weight": 0.7}, "0.8"),
                                             ({"schedule": "linear"}, "cosine or constant")])
def test_settings_specforge_cannot_run_are_refused(store, target_dir, tmp_path, no_venv, change, message):
    peer.convert(store, tmp_path / "data")
    with pytest.raises(peer.PeerError, match=message):
        peer.command(Path("python"), tmp_path / "data", target_dir, tmp_path / "run", {**SETTINGS, **change})


def test_warmup_steps_become_the_ratio_that_gives_them(store, target_dir, tmp_path, no_venv):
    peer.convert(store, tmp_path / "data")
    peer.command(Path("python"), tmp_path / "data", target_dir, tmp_path / "run", {**SETTINGS, "warmup_steps": 3})
    ratio = json.loads((tmp_path / "run" / "run.yaml").read_text())["training"]["warmup_ratio"]
    assert int(ratio * 20) == 3  # SpecForge warms up int(warmup_ratio * total_steps), 20 steps here


@pytest.mark.peers
@pytest.mark.skipif(not (VENV / "bin" / "python").is_file(),
                    reason=f"no SpecForge venv at {VENV}: create it with `python -m drafters.peers.specforge`")
def test_specforge_trains_on_the_converted_store_and_our_reader_loads_its_export(store, target_dir, tmp_path):
    import subprocess

    from drafters.export.eagle3_reader import read_eagle3_export

    python = peer.install(ROOT, VENV)  # applies the patches if a fresh venv lacks them; installs nothing present
    peer.convert(store, tmp_path / "data")
    argv, env = peer.command(python, tmp_path / "data", target_dir, tmp_path / "run", SETTINGS)
    done = subprocess.run([*argv, "training.max_steps=3"], env={**os.environ, **env}, cwd=tmp_path / "run",
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "run" / "train" / "specforge-step3" / "training_state.pt").is_file()
    path, fmt = peer.exported(tmp_path / "run")
    config, state, written_ids, _ = read_eagle3_export(path, fmt, engine_defaults=False)
    assert (fmt, written_ids, config.aux_layers) == ("sglang", [1, 3, 4], [2, 4, 5])
    assert (config.draft_vocab_size, config.hidden_size, config.num_hidden_layers) == (64, 64, 1)
    assert state["lm_head.weight"].shape == (64, 64) and int(state["t2d"].sum()) == 64
