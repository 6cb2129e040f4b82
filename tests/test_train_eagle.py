"""train/eagle.py on the tiny recipe: golden losses, frozen target, checkpoint round trip, metrics,
recipe validation."""

import json
import math
from pathlib import Path

import pytest
import torch

from drafters.checkpoint import load_checkpoint
from drafters.eagle3 import Eagle3Config, Eagle3Drafter
from drafters.layers import DraftKVCache
from drafters.training.recipe import RecipeError
from drafters.tiny import build_tiny_target
from conftest import train_tiny  # tests/ is on sys.path under pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "eagle3_tiny.yaml")
DATA = ROOT / "tests" / "data" / "tiny_conversations.jsonl"
TTT_STEPS, STEPS = 3, 6

# Recorded once from the tiny recipe as it is (6 steps of batch 2 x grad_accum 2, ttt_steps 3, draft
# vocab 64, lr 1e-3 with 2 warmup steps then cosine, seed 0) with one CPU thread:
#   OMP_NUM_THREADS=1 python train/eagle.py recipes/eagle3_tiny.yaml output_dir=/tmp/e3tiny
#   -> the "loss" column of /tmp/e3tiny/metrics.jsonl (torch 2.13.0 CPU, transformers 5.23.0).
# Changing the recipe, the data, the batching, the drafter's initialisation or its loss changes it.
GOLDEN_LOSSES = [2.451293468475342, 3.0046067237854004, 3.2992544174194336,
                 2.8779683113098145, 3.002206325531006, 3.0612661838531494]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return train_tiny(tmp_path_factory, RECIPE, f"data.path={DATA}")


def test_reproduces_golden_losses(run):
    summary, output_dir = run
    assert summary.steps == STEPS
    assert summary.losses == pytest.approx(GOLDEN_LOSSES, rel=1e-4)
    written = [row["loss"] for row in read_jsonl(output_dir / "metrics.jsonl")]
    assert written == summary.losses


def test_padding_to_a_multiple_changes_no_loss_and_no_weight(trainer, run, tmp_path):
    # data.pad_multiple pads every training batch past its longest row (to 32, 64, 96 or 128 tokens here): the
    # padding is never scored and the positions normalisation counts the unpadded length, so the run is the same
    summary, output_dir = run
    padded = trainer.main([RECIPE, f"data.path={DATA}", f"output_dir={tmp_path}", "data.pad_multiple=32"])
    assert padded.losses == pytest.approx(summary.losses, rel=1e-5)
    trained, reference = (load_checkpoint(d / "checkpoint-final", family="eagle3").state_dict
                          for d in (tmp_path, output_dir))
    for name, tensor in reference.items():
        torch.testing.assert_close(trained[name], tensor, rtol=1e-4, atol=1e-6, msg=name)


def test_target_weights_unchanged(run):
    summary, _ = run
    fresh, _ = build_tiny_target("tiny-random-llama")
    trained_with = summary.target.model.state_dict()
    assert trained_with.keys() == fresh.state_dict().keys()
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(trained_with[name], tensor), name
    assert not any(p.requires_grad for p in summary.target.model.parameters())


def test_checkpoint_rebuilds_the_trained_drafter(run):
    summary, output_dir = run
    checkpoint = load_checkpoint(output_dir / "checkpoint-final", family="eagle3")
    state = checkpoint.state_dict
    assert {"d2t", "t2d", "fc.weight", "lm_head.weight"} <= state.keys()
    assert not [k for k in state if "embed" in k], "the target's embedding must not be saved"
    assert state["d2t"].dtype == torch.int64 and state["d2t"].numel() == 64
    assert state["t2d"].dtype == torch.bool and int(state["t2d"].sum()) == 64
    assert checkpoint.config["aux_layers"] == [2, 4, 5]
    assert checkpoint.extra["step"] == STEPS and checkpoint.extra["tokens"] == summary.tokens > 0
    assert checkpoint.extra["recipe"]["eagle3"]["ttt_steps"] == TTT_STEPS
    assert checkpoint.target["name"] == "tiny-random-llama"
    assert load_checkpoint(output_dir / "checkpoint-4").extra["step"] == 4  # save_every: 4

    rebuilt = Eagle3Drafter(Eagle3Config(**checkpoint.config))
    rebuilt.load_state_dict(state)
    trained = summary.drafter
    assert not torch.equal(trained.fc.weight, Eagle3Drafter(trained.config).fc.weight)
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(1, 12, 3 * 64, generator=generator)  # (B, T, 3h)
    input_ids = torch.randint(3, 259, (1, 12), generator=generator)
    embed = summary.target.embed_tokens
    with torch.no_grad():
        _, want = trained.prefill(features, input_ids, embed, DraftKVCache())
        _, got = rebuilt.prefill(features, input_ids, embed, DraftKVCache())
    assert torch.equal(got, want)
    assert torch.equal(rebuilt.topk_tokens(got)[1], trained.topk_tokens(want)[1])


def test_a_frozen_head_keeps_the_targets_rows_and_trains_the_rest(trainer, run, tmp_path):
    # eagle3.freeze_head: speculators' head (the target's rows of the draft vocabulary, never updated); the same first
    # forward as the trained-head run, and no optimizer state for the head
    summary, output_dir = run
    frozen = trainer.main([RECIPE, f"data.path={DATA}", f"output_dir={tmp_path}", "eagle3.freeze_head=true"])
    ours, trained = (load_checkpoint(d / "checkpoint-final", family="eagle3").state_dict for d in (tmp_path, output_dir))
    rows = frozen.target.lm_head.weight.float()[frozen.drafter.draft_vocab.used]
    assert torch.equal(ours["lm_head.weight"], rows)
    assert not torch.equal(trained["lm_head.weight"], rows)  # the check can fail: a trained head moves
    assert frozen.losses[0] == pytest.approx(summary.losses[0], rel=1e-6)
    assert frozen.losses[1:] != pytest.approx(summary.losses[1:], rel=1e-6)
    assert not torch.equal(ours["fc.weight"], trained["fc.weight"])  # trained, along another path
    moments = [torch.load(d / "checkpoint-final" / "trainer" / "optimizer.bin", weights_only=False)["state"]
               for d in (tmp_path, output_dir)]
    assert len(moments[0]) == len(moments[1]) - 1


def test_metrics_have_one_row_per_step(run):
    _, output_dir = run
    rows = read_jsonl(output_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    for row in rows:
        assert len(row["step_loss"]) == len(row["step_acc"]) == TTT_STEPS and row["step_loss_is"] == "per TTT step"
        assert all(0 <= a <= 1 for a in row["step_acc"])
        weighted = sum(0.8 ** i * loss for i, loss in enumerate(row["step_loss"]))
        assert row["loss"] == pytest.approx(weighted, rel=1e-5)
        assert row["tokens"] > 0 and row["tokens_per_s"] > 0 and math.isfinite(row["grad_norm"])
    # warmup 2 steps to lr 1e-3, then cosine over the remaining 4
    assert [row["lr"] for row in rows[:3]] == pytest.approx([5e-4, 1e-3, 1e-3])
    assert rows[-1]["lr"] == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * 3 / 4)))


def test_held_out_evaluation(run):
    summary, output_dir = run
    results = read_jsonl(output_dir / "eval.jsonl")
    assert [r["step"] for r in results] == [3, STEPS]  # eval_every: 3, and at the end
    final = summary.eval
    assert final == results[-1] and final["supervised"] > 0
    accuracy = final["step_acc"]
    assert len(accuracy) == TTT_STEPS
    assert final["tau_pred"] == pytest.approx(1 + sum(math.prod(accuracy[:k]) for k in range(1, TTT_STEPS + 1)))


def test_held_out_depth_is_set_apart_from_the_training_depth(trainer, run, tmp_path):
    """eagle3.eval_ttt_steps=5 scores a drafter trained at eagle3.ttt_steps=2 on 5 chain steps; training does not read
    it, so its first 2 steps' accuracies equal the default (2-step) evaluation's of the same run."""
    common = [RECIPE, f"data.path={DATA}", "max_steps=2", "eagle3.ttt_steps=2"]
    deep = trainer.main([*common, "eagle3.eval_ttt_steps=5", f"output_dir={tmp_path / 'deep'}"]).eval
    shallow = trainer.main([*common, f"output_dir={tmp_path / 'shallow'}"]).eval
    assert len(deep["step_acc"]) == 5 and len(shallow["step_acc"]) == 2
    assert deep["step_acc"][:2] == shallow["step_acc"]
    assert deep["tau_pred"] == pytest.approx(1 + sum(math.prod(deep["step_acc"][:k]) for k in range(1, 6)))


@pytest.mark.parametrize("override, error, message", [
    ("unknown_key=1", RecipeError, "unknown key 'unknown_key'"),
    ("optim.lrr=0.1", RecipeError, "did you mean 'lr'"),
    ("features.dir=somewhere", RecipeError, "features.dir=somewhere: no index.json; write the features first"),
    ("eagle3.ttt_steps=0", RecipeError, "eagle3.ttt_steps=0 must be >= 1"),
    ("draft_vocab_size=0", RecipeError, "draft_vocab_size=0 must be >= 1"),
    ("data.pad_multiple=0", RecipeError, r"data.pad_multiple=0 must be >= 1 \(1 = pad to the longest row only\)"),
    ("draft_vocab_size=-5", RecipeError, "draft_vocab_size=-5 must be >= 1"),
    ("epochs=null", RecipeError, "set epochs or max_steps"),
    ("eagle3.eval_ttt_steps=0", RecipeError, "eagle3.eval_ttt_steps=0 must be >= 1 or null"),
    ("eagle3.init_layer=8", RecipeError, r"init_layer=8 is not a decoder layer of .* \(8 layers: 0 \.\. 7, or -1"),
])
def test_bad_recipe_values_fail_clearly(trainer, tmp_path, override, error, message):
    overrides = [f"output_dir={tmp_path}", override]
    if override == "epochs=null":
        overrides.append("max_steps=null")
    with pytest.raises(error, match=message):
        trainer.main([RECIPE, *overrides])


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_norm_options_train_save_reload_and_export_where_an_engine_reads_them(trainer, tmp_path):
    from drafters.export.common import ExportError
    from drafters.export.dispatch import export_checkpoint
    from drafters.checkpoint import load_checkpoint
    from drafters.registry import load_drafter

    out = tmp_path / "run"
    trainer.main([RECIPE, f"data.path={DATA}", "max_steps=1", "norm_before_fc=true", "norm_before_residual=true",
                f"output_dir={out}"])
    drafter = load_drafter(load_checkpoint(out / "checkpoint-final"))
    assert drafter.config.norm_before_fc and drafter.config.norm_before_residual and not drafter.config.fc_norm
    assert drafter.input_norm.weight.shape == (3 * drafter.config.hidden_size,)
    with pytest.raises(ExportError, match="trained with norm_before_fc, norm_before_residual: the sglang layout"):
        export_checkpoint(out / "checkpoint-final", "sglang", tmp_path / "sglang")
    config = json.loads((export_checkpoint(out / "checkpoint-final", "vllm", tmp_path / "vllm").path
                         / "config.json").read_text())
    assert config["norm_before_fc"] and config["norm_before_residual"] and not config["fc_norm"]
    with pytest.raises(RecipeError, match="norm_before_fc and fc_norm are both set"):
        trainer.main([RECIPE, "norm_before_fc=true", "fc_norm=true", f"output_dir={tmp_path / 'x'}"])


def test_train_rows_keeps_a_subset_of_the_split_and_the_same_held_out_rows(trainer, tmp_path):
    from dataclasses import replace

    from drafters.targets import load_target
    from drafters.training.batches import load_examples
    from drafters.training.families import load_recipe

    recipe = load_recipe([RECIPE, f"data.path={DATA}"])
    target = load_target(recipe.target)
    train, held_out = load_examples(recipe, target, say=lambda line: None)
    part_train, part_held_out = load_examples(replace(recipe, data=replace(recipe.data, train_rows=5)), target,
                                              say=lambda line: None)
    rows = lambda examples: [e.row for e in examples]  # noqa: E731
    assert rows(part_held_out) == rows(held_out) and len(part_train) == 5 < len(train)
    assert set(rows(part_train)) <= set(rows(train))
    with pytest.raises(RecipeError, match="data.train_rows=0 must be >= 1"):
        trainer.main([RECIPE, f"data.path={DATA}", "data.train_rows=0", f"output_dir={tmp_path / 'x'}"])


def test_max_length_above_the_targets_context_is_cut_to_it_and_said(trainer):
    from drafters.targets import load_target
    from drafters.training.batches import load_examples
    from drafters.training.families import load_recipe

    recipe = load_recipe([RECIPE, f"data.path={DATA}", "data.max_length=3000"])
    target = load_target(recipe.target)
    target.model.config.max_position_embeddings = 48  # shorter than most rows
    said = []
    train, held_out = load_examples(recipe, target, say=said.append)
    lengths = [len(e.input_ids) for e in train + held_out]
    assert max(lengths) == 48 and any(n < 48 for n in lengths)
    assert said[0] == ("data.max_length=3000 is above tiny-random-llama's context of 48 positions: rows are cut to "
                       "48 tokens (set data.max_length=48 or less to have the recipe say so)")


# ---- features.source: text (a pretraining pass over raw text; the target never runs) ----------------------------


def test_text_inputs_are_the_embedding_in_every_aux_slot_and_the_next_token_as_label(tiny_llama):
    from drafters.training.eagle3 import text_inputs

    model, _ = tiny_llama
    embed = model.get_input_embeddings()
    ids = torch.tensor([[5, 9, 2, 7], [3, 3, 8, 1]])
    features, labels = text_inputs(embed, 3, model.config.vocab_size, {"input_ids": ids}, dtype=torch.float32)
    h = model.config.hidden_size
    assert features.shape == (2, 4, 3 * h)
    for slot in range(3):  # HF hidden_states[0] = the embedding output, in each aux slot
        torch.testing.assert_close(features[..., slot * h:(slot + 1) * h], embed(ids), rtol=0, atol=0)
    rows = labels[torch.ones(2, 4, dtype=torch.bool)]  # (8, V): every row's label logits
    assert rows.shape == (8, model.config.vocab_size)
    assert rows.argmax(-1).view(2, 4)[:, :3].tolist() == ids[:, 1:].tolist()  # row t -> token t+1
    assert torch.equal(torch.softmax(rows, -1), torch.nn.functional.one_hot(rows.argmax(-1),
                                                                             model.config.vocab_size).float())


def test_a_text_pass_is_cross_entropy_on_the_next_token_over_the_draft_vocabulary(tiny_llama):
    # TTT step 0 on text inputs: the loss at position t is -log q(x_{t+2}) over the draft vocabulary (x_{t+2}: the
    # row t+1 label), counted where loss_mask[t+2] = 1 and x_{t+2} is in the vocabulary, averaged over B x T
    from drafters.draft_vocab import build_draft_vocab
    from drafters.training.eagle3 import TTTOptions, text_inputs, ttt_loss
    from drafters.training.loop import FeatureBatch

    model, _ = tiny_llama
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 40, (2, 12), generator=g)
    loss_mask = torch.ones_like(ids)
    loss_mask[:, :3] = 0
    config = Eagle3Config.from_target_config(model.config, 24)
    vocab = build_draft_vocab([(ids[:, :6], loss_mask[:, :6])], config.vocab_size, 24)  # not every id is in it
    torch.manual_seed(0)
    drafter = Eagle3Drafter(config, vocab)
    embed = model.get_input_embeddings()
    features, labels = text_inputs(embed, len(config.aux_layers), model.config.vocab_size, {"input_ids": ids},
                                   dtype=torch.float32)
    with torch.no_grad():
        out = ttt_loss(drafter, FeatureBatch(features, ids, labels, loss_mask, embed), TTTOptions(steps=2),
                       return_logits=True)
    log_q = torch.log_softmax(out.step_logits[0], -1)  # (B, T-1, Vd)
    total, counted = 0.0, 0
    for b in range(2):
        for t in range(10):  # the label x_{t+2} exists for t <= T-3
            token = int(ids[b, t + 2])
            if loss_mask[b, t + 2] and bool(vocab.t2d[token]):
                draft_id, _ = vocab.to_draft(torch.tensor([token]))
                total -= float(log_q[b, t, int(draft_id)])
                counted += 1
    assert 0 < counted < 20  # some labels fall outside the 24-id vocabulary and are not scored
    assert int(out.step_counts[0]) == counted
    torch.testing.assert_close(out.step_losses[0], torch.tensor(total / ids.numel()), rtol=1e-5, atol=1e-6)


def test_a_text_run_never_runs_the_target(trainer, tmp_path, monkeypatch):
    from drafters.targets import Target

    def forbidden(*args, **kwargs):
        raise AssertionError("the target ran a forward in a features.source=text run")

    monkeypatch.setattr(Target, "features", forbidden)
    summary = trainer.main([RECIPE, f"data.path={DATA}", f"output_dir={tmp_path}", "features.source=text"])
    assert summary.steps == STEPS and (tmp_path / "checkpoint-final").is_dir()
    with pytest.raises(AssertionError, match="the target ran a forward"):  # the check can fail: a target run does
        trainer.main([RECIPE, f"data.path={DATA}", f"output_dir={tmp_path / 'target'}"])


@pytest.mark.parametrize("override, message", [
    (["features.dir=outputs/features/x"], "features.source=text reads no store"),
    (["recipes/dflash_tiny.yaml"], "features.source=text pretrains EAGLE-3 only; drafter=dflash"),
])
def test_a_text_pass_that_cannot_run_is_refused(trainer, tmp_path, override, message):
    recipe = override[0] if override[0].endswith(".yaml") else RECIPE
    extra = [o for o in override if not o.endswith(".yaml")]
    with pytest.raises(RecipeError, match=message):
        trainer.main([str(ROOT / recipe) if recipe != RECIPE else recipe, f"data.path={DATA}",
                      f"output_dir={tmp_path}", "features.source=text", *extra])
