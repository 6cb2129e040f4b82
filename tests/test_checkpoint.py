import errno
import json

import pytest
import torch

from drafters import checkpoint as ckpt
from drafters.checkpoint import CheckpointError, check_target, load_checkpoint, save_checkpoint, target_info
from drafters.targets import load_target


def save(path, value=1.0, **kw):
    args = dict(family="eagle3", config={"hidden_size": 64}, target={"name": "t"},
                state_dict={"fc.weight": torch.full((2, 3), value), "d2t": torch.arange(4)})
    return save_checkpoint(path, **{**args, **kw})


def test_round_trip(tmp_path):
    save(tmp_path / "c", extra={"step": 3})
    loaded = load_checkpoint(tmp_path / "c", family="eagle3")
    assert (loaded.family, loaded.config, loaded.extra) == ("eagle3", {"hidden_size": 64}, {"step": 3})
    assert torch.equal(loaded.state_dict["fc.weight"], torch.ones(2, 3))
    assert loaded.state_dict["d2t"].dtype == torch.int64


def test_failed_write_leaves_previous_checkpoint_intact(tmp_path, monkeypatch):
    save(tmp_path / "c", value=1.0)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt, "save_file", disk_full)
    with pytest.raises(OSError, match="No space"):
        save(tmp_path / "c", value=2.0)
    assert [p.name for p in tmp_path.iterdir()] == ["c"]  # no temporary directory left behind
    assert torch.equal(load_checkpoint(tmp_path / "c").state_dict["fc.weight"], torch.ones(2, 3))


def test_overwrite_replaces(tmp_path):
    save(tmp_path / "c", value=1.0)
    save(tmp_path / "c", value=2.0)
    assert torch.equal(load_checkpoint(tmp_path / "c").state_dict["fc.weight"], torch.full((2, 3), 2.0))
    assert [p.name for p in tmp_path.iterdir()] == ["c"]


def test_bad_checkpoints_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="not a drafters checkpoint"):
        load_checkpoint(tmp_path)
    save(tmp_path / "c")
    with pytest.raises(CheckpointError, match="a 'eagle3' checkpoint, expected 'medusa'"):
        load_checkpoint(tmp_path / "c", family="medusa")
    (tmp_path / "c" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors is missing"):
        load_checkpoint(tmp_path / "c")
    (tmp_path / "c" / "drafter.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_checkpoint(tmp_path / "c")
    (tmp_path / "c" / "drafter.json").write_text(json.dumps({"format": "other/9"}))
    with pytest.raises(CheckpointError, match="this version reads 'drafters/1'"):
        load_checkpoint(tmp_path / "c")


def test_target_mismatch_is_refused(tmp_path):
    llama = load_target("tiny-random-llama")
    save(tmp_path / "c", target=target_info(llama))
    check_target(load_checkpoint(tmp_path / "c"), llama)
    wrong = dict(target_info(llama), hidden_size=576, vocab_size=49152)
    save(tmp_path / "d", target=wrong)
    with pytest.raises(CheckpointError, match=r"hidden_size: checkpoint 576 vs target 64; vocab_size: checkpoint 49152 vs target 259"):
        check_target(load_checkpoint(tmp_path / "d"), llama)


def test_same_shapes_but_another_architecture_is_refused(tmp_path):
    # the tiny Llama and Gemma-3 share layers, hidden size, vocab and context: only model_type tells
    llama, gemma = load_target("tiny-random-llama"), load_target("tiny-random-gemma3")
    save(tmp_path / "c", target=target_info(llama))
    with pytest.raises(CheckpointError, match="model_type: checkpoint llama vs target gemma3"):
        check_target(load_checkpoint(tmp_path / "c"), gemma)


def test_disk_full_in_the_trainer_state_keeps_the_previous_checkpoint(tmp_path):
    save(tmp_path / "c", value=1.0)

    def trainer_state(tmp):
        (tmp / "trainer").mkdir()
        (tmp / "trainer" / "optimizer.bin").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        save(tmp_path / "c", value=2.0, write_more=trainer_state)
    assert torch.equal(load_checkpoint(tmp_path / "c").state_dict["fc.weight"], torch.ones(2, 3))
    assert [p.name for p in tmp_path.iterdir()] == ["c"]  # no temporary directory left


def test_prune_keeps_the_newest_step_checkpoints_only(tmp_path):
    for step in (5, 10, 15, 20):
        save(tmp_path / f"checkpoint-{step}")
    save(tmp_path / "checkpoint-final")
    (tmp_path / "checkpoint-25").mkdir()  # incomplete (no drafter.json): not a checkpoint, left alone
    deleted = ckpt.prune_checkpoints(tmp_path, keep_last=2)
    assert sorted(p.name for p in deleted) == ["checkpoint-10", "checkpoint-5"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-15", "checkpoint-20", "checkpoint-25",
                                                          "checkpoint-final"]
    assert [s for s, _ in ckpt.step_checkpoints(tmp_path)] == [15, 20]
    assert ckpt.prune_checkpoints(tmp_path, keep_last=0) == []
