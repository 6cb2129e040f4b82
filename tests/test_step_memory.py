"""The memory check before the first step (drafters/training/memory.py): a step estimated larger than the free
memory is refused in one sentence naming the estimate and what to lower, before anything trains; the estimate's
terms grow as its docstring says."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import drafters.training.memory as memory
from drafters.training.families import load_recipe, train
from drafters.training.recipe import RecipeError

ROOT = Path(__file__).resolve().parents[1]


def recipe(family, tmp_path, *overrides):
    return load_recipe([str(ROOT / "recipes" / f"{family}_tiny.yaml"), "max_steps=2", "eval_every=0",
                        "data.eval_rows=2", f"output_dir={tmp_path / family}", "threads=1", *overrides])


@pytest.mark.parametrize("family, knob", [("eagle3", "eagle3.ttt_steps ("), ("dflash", "dflash.anchors (")])
def test_a_step_that_cannot_fit_is_refused_before_it_runs(family, knob, tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda device: 2**20)  # 1 MB free
    with pytest.raises(RecipeError) as refused:
        train(recipe(family, tmp_path))
    said = str(refused.value)
    assert said.startswith("recipe: one training step needs about ") and "more than the 1 MB free on cpu" in said
    assert "data.max_length" in said and "batch_size" in said and knob in said and "check_memory=false" in said
    assert ("set eagle3.vocab_memory=recompute" in said) == (family == "eagle3")  # flat in the vocabulary
    assert not list((tmp_path / family).glob("checkpoint-*"))  # nothing trained, nothing saved


def test_check_memory_false_trains_anyway(tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda device: 2**20)
    assert train(recipe("eagle3", tmp_path, "check_memory=false")).steps == 2


def test_the_estimate_grows_as_its_terms_say():
    # labels and activations linear in the tokens B T, head gradients and activations linear in the TTT depth,
    # labels and head gradients linear in the draft vocabulary; the online target's hidden states on top
    import torch

    def estimate(seq=512, batch=2, steps=3, vocab=1000, online=False, vocab_memory="table", layers=1, frozen=False):
        recipe = SimpleNamespace(batch_size=batch, data=SimpleNamespace(max_length=seq),
                                 eagle3=SimpleNamespace(ttt_steps=steps, vocab_memory=vocab_memory))
        drafter = SimpleNamespace(config=SimpleNamespace(draft_vocab_size=vocab, hidden_size=64,
                                                         num_hidden_layers=layers),
                                  parameters=lambda: [torch.zeros(100, requires_grad=True)],
                                  lm_head=SimpleNamespace(weight=SimpleNamespace(requires_grad=not frozen)))
        target = SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: SimpleNamespace(
            hidden_size=32, num_hidden_layers=3)), dtype=torch.bfloat16, vocab_size=3000)
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
    stacked = estimate(layers=3)  # each TTT step runs every decoder layer; one LM head a step whatever the depth
    assert stacked["activations"] == 3 * base["activations"] and stacked["head grads"] == base["head grads"]
    assert estimate(online=True)["target"] == 2 * 512 * 32 * 4 * 2
    assert estimate(frozen=True)["head grads"] == 0  # eagle3.freeze_head: the fused loss keeps no dL/dW


def test_recomputed_labels_take_the_vocabulary_out_of_the_estimate():
    # vocab_memory=recompute: the labels are the target's (B T, h_t) float32 hidden rows and one head gradient is
    # held at a time; the only term left in Vd is the constant-size chunk (transients), none grows with T x Vd
    import torch

    def parts(vocab, seq=512, vocab_memory="recompute"):
        recipe = SimpleNamespace(batch_size=2, data=SimpleNamespace(max_length=seq),
                                 eagle3=SimpleNamespace(ttt_steps=7, vocab_memory=vocab_memory))
        drafter = SimpleNamespace(config=SimpleNamespace(draft_vocab_size=vocab, hidden_size=64, num_hidden_layers=1),
                                  parameters=lambda: [], lm_head=SimpleNamespace(weight=SimpleNamespace(requires_grad=True)))
        target = SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: SimpleNamespace(
            hidden_size=32, num_hidden_layers=3)), dtype=torch.bfloat16, vocab_size=3000)
        shape = memory.ttt_shape(recipe, drafter)
        return memory.estimate_step(shape, recipe, target, drafter, online=False), shape

    small, shape = parts(1000)
    assert small.parts["labels"] == 2 * 512 * 32 * 4 and small.parts["head grads"] == 1000 * 64 * 4
    assert parts(2000)[0].parts["labels"] == small.parts["labels"]
    assert parts(1000, seq=1024)[0].parts["labels"] == 2 * small.parts["labels"]
    assert small.parts["transients"] == 16 * 256 * 1000 + 8 * 2**24 + 12 * 256 * 3000
    assert shape.switches == ()
    table, table_shape = parts(1000, vocab_memory="table")
    assert table.parts["labels"] == 2 * 512 * 1000 * 4 and table.parts["head grads"] == 7 * 1000 * 64 * 4
    assert any("vocab_memory=recompute" in switch for switch in table_shape.switches)


def test_a_run_with_recomputed_labels_trains_as_the_table_run(tmp_path):
    # vocab_memory=recompute changes what the step keeps, not what it computes: two steps of the tiny EAGLE-3
    # recipe give the same weights (the label head's matmul over other rows: float32 tolerance)
    from safetensors.torch import load_file

    runs = [train(recipe("eagle3", tmp_path / mode, f"eagle3.vocab_memory={mode}")) for mode in ("table", "recompute")]
    assert runs[0].steps == runs[1].steps == 2
    weights = [load_file(next((tmp_path / mode / "eagle3").glob("checkpoint-final/*.safetensors")))
               for mode in ("table", "recompute")]
    assert weights[0].keys() == weights[1].keys()
    for name in weights[0]:
        torch.testing.assert_close(weights[1][name], weights[0][name], rtol=1e-5, atol=1e-6)


def test_an_unknown_vocab_memory_is_refused_in_one_sentence(tmp_path):
    with pytest.raises(RecipeError, match="vocab_memory"):
        load_recipe([str(ROOT / "recipes" / "eagle3_tiny.yaml"), "eagle3.vocab_memory=lazy", f"output_dir={tmp_path}"])


def test_dpace_weighting_counts_the_block_logits_it_keeps():
    # D-PACE weighs each slot by the draft's own probabilities: the block loss keeps every slot's (rows, Vd) logits,
    # which the fused decay loss never materialises
    def shape(weighting, fused=True):
        recipe = SimpleNamespace(batch_size=2, data=SimpleNamespace(max_length=512),
                                 dflash=SimpleNamespace(block_size=4, anchors=8, weighting=weighting))
        drafter = SimpleNamespace(config=SimpleNamespace(num_hidden_layers=1), fused_loss=fused)
        return memory.block_shape(recipe, drafter)

    assert shape("decay").logit_rows == 0 and shape("dpace").logit_rows == 2 * 8 * 3 == shape("decay", False).logit_rows
