"""The memory check before the first step (drafters/training/memory.py): a step estimated larger than the free
memory is refused in one sentence naming the estimate and what to lower, before anything trains; the estimate's
terms grow as its docstring says."""

from pathlib import Path
from types import SimpleNamespace

import pytest

import drafters.training.memory as memory
from drafters.training.families import load_recipe, train
from drafters.training.recipe import RecipeError

ROOT = Path(__file__).resolve().parents[1]


def recipe(family, tmp_path, *overrides):
    return load_recipe([str(ROOT / "recipes" / f"{family}_tiny.yaml"), "max_steps=2", "eval_every=0",
                        "data.eval_rows=2", f"output_dir={tmp_path / family}", "threads=1", *overrides])


@pytest.mark.parametrize("family, knob", [("eagle3", "ttt_steps ("), ("dflash", "dflash.anchors (")])
def test_a_step_that_cannot_fit_is_refused_before_it_runs(family, knob, tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda device: 2**20)  # 1 MB free
    with pytest.raises(RecipeError) as refused:
        train(recipe(family, tmp_path))
    said = str(refused.value)
    assert said.startswith("recipe: one training step needs about ") and "more than the 1 MB free on cpu" in said
    assert "data.max_length" in said and "batch_size" in said and knob in said and "check_memory=false" in said
    assert not list((tmp_path / family).glob("checkpoint-*"))  # nothing trained, nothing saved


def test_check_memory_false_trains_anyway(tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda device: 2**20)
    assert train(recipe("eagle3", tmp_path, "check_memory=false")).steps == 2


def test_the_estimate_grows_as_its_terms_say():
    # labels and activations linear in the tokens B T, head gradients and activations linear in the TTT depth,
    # labels and head gradients linear in the draft vocabulary; the online target's hidden states on top
    import torch

    def estimate(seq=512, batch=2, steps=3, vocab=1000, online=False):
        recipe = SimpleNamespace(batch_size=batch, data=SimpleNamespace(max_length=seq), ttt_steps=steps)
        drafter = SimpleNamespace(config=SimpleNamespace(draft_vocab_size=vocab, hidden_size=64),
                                  parameters=lambda: [torch.zeros(100, requires_grad=True)])
        target = SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: SimpleNamespace(
            hidden_size=32, num_hidden_layers=3)), dtype=torch.bfloat16)
        return memory.estimate_step(memory.ttt_shape(recipe, drafter), recipe, target, drafter, online=online).parts

    base = estimate()
    assert base == {"labels": 2 * 512 * 1000 * 4, "head grads": 3 * 1000 * 64 * 4, "optimizer": 100 * 12,
                    "activations": 3 * 2 * 512 * 64 * memory.ACT_BYTES,
                    "transients": 16 * 256 * 1000 + 8 * 2**24, "logits": 0}
    longer, deeper, wider = estimate(seq=1024), estimate(steps=6), estimate(vocab=2000)
    assert longer["labels"] == 2 * base["labels"] and longer["activations"] == 2 * base["activations"]
    assert longer["head grads"] == base["head grads"]
    assert deeper["head grads"] == 2 * base["head grads"] and deeper["activations"] == 2 * base["activations"]
    assert wider["labels"] == 2 * base["labels"] and wider["activations"] == base["activations"]
    assert estimate(online=True)["target"] == 2 * 512 * 32 * 4 * 2
