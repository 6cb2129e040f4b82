"""A target without its decoder layers (load_target(decoder=False)): what training from a feature store loads. The
outer tensors equal the whole model's, the layers are never read from disk, and a run from a store trains as it does
online."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from drafters.checkpoint import target_info
from drafters.targets import TargetError, load_target
from drafters.tiny import build_tiny_target
from conftest import load_script  # tests/ is on sys.path under pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "tiny_conversations.jsonl"
EAGLE3 = str(ROOT / "recipes" / "eagle3_tiny.yaml")
OUTER = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


def saved_target(directory: Path, untied_head_seed=None) -> Path:
    model, tokenizer = build_tiny_target(untied_head_seed=untied_head_seed)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("untied", [None, 3], ids=["tied", "untied"])
def test_the_outer_tensors_equal_the_whole_models_and_nothing_else_is_held(tmp_path, untied):
    directory = saved_target(tmp_path, untied)
    whole, light = load_target(str(directory)), load_target(str(directory), decoder=False)
    held = dict(light.model.named_parameters(remove_duplicate=False))
    assert set(held) == set(OUTER)  # the head is a parameter of its own or the embedding itself
    for name, weight in held.items():
        assert torch.equal(weight, whole.model.get_parameter(name)), name
    assert (light.lm_head.weight is light.embed_tokens.weight) == (untied is None)
    assert not light.has_decoder and whole.has_decoder and light.num_layers == whole.num_layers == 8
    assert target_info(light) == target_info(whole)  # its weights fingerprint reads the layers' files
    hidden = torch.randn(3, 64)
    assert torch.equal(light.lm_head(light.final_norm(hidden)), whole.lm_head(whole.final_norm(hidden)))
    with pytest.raises(TargetError, match="was loaded without its decoder layers .* it has no forward"):
        light.features(torch.tensor([[1, 2, 3]]), layers=[2])


def test_the_decoder_layers_are_never_read(tmp_path):
    # every layer tensor of the file replaced by one of the wrong shape: the whole model cannot load from it, the
    # outer parts load as they were
    directory = saved_target(tmp_path, untied_head_seed=3)
    tensors = load_file(directory / "model.safetensors")
    save_file({k: v if k in OUTER else torch.zeros(1) for k, v in tensors.items()}, directory / "model.safetensors",
              metadata={"format": "pt"})
    light = load_target(str(directory), decoder=False)
    assert torch.equal(light.lm_head.weight, tensors["lm_head.weight"])
    assert torch.equal(light.embed_tokens.weight, tensors["model.embed_tokens.weight"])
    with pytest.raises(Exception, match="size|shape"):
        load_target(str(directory))


def test_weights_named_otherwise_load_whole_and_drop_the_layers(tmp_path):
    # the base model's checkpoint (no "model." prefix, tied head): transformers maps its names, the tensor-by-tensor
    # reader does not find them, so the fallback loads the whole model and drops its layers
    model, tokenizer = build_tiny_target()
    model.model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    light, whole = load_target(str(tmp_path), decoder=False), load_target(str(tmp_path))
    assert not light.has_decoder and torch.equal(light.lm_head.weight, model.lm_head.weight)
    assert torch.equal(whole.lm_head.weight, model.lm_head.weight)
    assert target_info(light) == target_info(whole)  # the layers' fingerprint samples kept when they were dropped


def test_a_run_from_a_store_loads_no_decoder_layer_and_trains_as_online(tmp_path, capsys):
    directory = saved_target(tmp_path / "target", untied_head_seed=3)
    features, eagle = load_script("train/features.py"), load_script("train/eagle.py")
    common = [EAGLE3, f"target={directory}", f"data.path={DATA}", "max_steps=3", "eval_every=3"]
    features.main([*common, f"features.dir={tmp_path / 'store'}", "features.dtype=float32"])
    online = eagle.main([*common, f"output_dir={tmp_path / 'online'}"])
    capsys.readouterr()
    offline = eagle.main([*common, f"output_dir={tmp_path / 'offline'}", f"features.dir={tmp_path / 'store'}",
                          "features.dtype=float32"])
    assert "its 8 decoder layers are not loaded: the features come from the store" in capsys.readouterr().out
    assert offline.losses == pytest.approx(online.losses, rel=1e-5)
    assert offline.eval["step_acc"] == pytest.approx(online.eval["step_acc"])
    # the checkpoint records the same target (its fingerprint reads the layers' samples from their files)
    stored = [json.loads((tmp_path / run / "checkpoint-final" / "drafter.json").read_text())["target"]
              for run in ("online", "offline")]
    assert stored[0] == stored[1]
