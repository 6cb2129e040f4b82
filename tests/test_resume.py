"""Checkpoints resume exactly: SIGKILL, Ctrl-C, NaN, changed recipes, wrong checkpoints (train/eagle.py)."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import load_script  # tests/ is on sys.path under pytest
from drafters.errors import Stopped  # noqa: E402
from drafters.training import loop  # noqa: E402  (fit calls loop.train_loop: patched there)
from drafters.checkpoint import load_checkpoint
from drafters.draft_vocab import DraftVocab
from drafters.training.batches import lr_factor
from drafters.training.families import load_recipe
from drafters.training.recipe import RecipeError
from drafters.training.loop import NonFiniteLoss
from drafters.training.resume import earlier_run_files

eagle = load_script("train/eagle.py")
RECIPE = "recipes/eagle3_tiny.yaml"  # 6 steps, eval at 3 and 6
ROOT = Path(__file__).resolve().parents[1]


def train(out, *overrides):
    return eagle.main([RECIPE, f"output_dir={out}", "save_every=2", *overrides])


def weights(run_dir, name="checkpoint-final"):
    return load_checkpoint(Path(run_dir) / name).state_dict


def losses(run_dir):
    return [json.loads(line)["loss"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("whole")
    train(out)
    return out


def assert_same_run(a, b):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "weights differ from the uninterrupted run"
    assert losses(a) == losses(b)


@pytest.mark.slow
def test_sigkilled_run_resumes_to_bitwise_the_same_weights(uninterrupted, tmp_path):
    out = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    killed = subprocess.run([sys.executable, str(ROOT / "tests/helpers/kill_after_step.py"), "5", RECIPE,
                             f"output_dir={out}", "save_every=2"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr[-2000:]  # really killed, after checkpoint-4
    assert not (out / "checkpoint-final").exists() and (out / "checkpoint-4").is_dir()
    assert max(json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()) >= 4
    summary = train(out, "resume_from=latest")
    assert summary.steps == 6
    assert_same_run(uninterrupted, out)


def test_ctrl_c_saves_a_checkpoint_that_resumes_exactly(uninterrupted, tmp_path, monkeypatch):
    out, inner = tmp_path / "interrupted", loop.train_loop

    def interrupt_at_3(run, *args, **kwargs):
        periodic = run.periodic

        def then_interrupt(step, total, position):
            periodic(step, total, position)
            if step == 3:
                signal.raise_signal(signal.SIGINT)  # Ctrl-C

        run.periodic = then_interrupt
        return inner(run, *args, **kwargs)

    monkeypatch.setattr(loop, "train_loop", interrupt_at_3)
    with pytest.raises(Stopped, match=r"interrupted: saved the state after step 3 .*checkpoint-3"):
        train(out)
    monkeypatch.setattr(loop, "train_loop", inner)
    train(out, f"resume_from={out / 'checkpoint-3'}")
    assert_same_run(uninterrupted, out)


def test_non_finite_loss_stops_with_the_step_rows_and_last_good_checkpoint(tmp_path, monkeypatch):
    from drafters.training.loop import FeatureRun

    micro_step = FeatureRun.micro_step
    calls = {"n": 0}

    def poisoned(self, batch, acc):
        acc = micro_step(self, batch, acc)
        calls["n"] += 1
        if calls["n"] == 7:  # grad_accum 2: the 7th micro-batch ends step 4
            acc.loss = acc.loss * float("nan")
        return acc

    monkeypatch.setattr(FeatureRun, "micro_step", poisoned)
    with pytest.raises(NonFiniteLoss) as error:
        train(tmp_path / "nan")
    message = str(error.value)
    assert "step 4" in message and "tiny_conversations.jsonl:" in message
    assert f"last good checkpoint is {tmp_path / 'nan' / 'checkpoint-2'}" in message
    assert torch.isfinite(weights(tmp_path / "nan", "checkpoint-2")["fc.weight"]).all()


def test_changed_recipe_is_refused_with_a_diff_unless_allowed(uninterrupted, tmp_path):
    out = tmp_path / "changed"
    train(out, "max_steps=4")
    with pytest.raises(RecipeError, match=r"recipe changed[\s\S]*optim.lr: 0.001 -> 0.002[\s\S]*allow_recipe_changes"):
        train(out, "resume_from=latest", "optim.lr=2e-3")
    summary = train(out, "resume_from=latest", "optim.lr=2e-3", "allow_recipe_changes=true")
    assert summary.steps == 6  # max_steps may change freely


def test_a_checkpoint_that_saved_eagle3s_options_at_the_top_level_resumes(tmp_path):
    # an earlier release saved EAGLE-3's options at the recipe's top level; resume_from compares them where they sit
    # now (under eagle3:), so the same recipe resumes and a changed option is named once
    out = tmp_path / "old"
    train(out, "max_steps=4")
    for checkpoint in out.glob("checkpoint-*"):
        meta = json.loads((checkpoint / "drafter.json").read_text())
        recipe = meta["extra"]["recipe"]
        meta["extra"]["recipe"] = {**{k: v for k, v in recipe.items() if k != "eagle3"}, **recipe["eagle3"]}
        (checkpoint / "drafter.json").write_text(json.dumps(meta))
    with pytest.raises(RecipeError, match=r"recipe changed since that checkpoint:\n  eagle3.step_weight: 0.8 -> 0.5\n"):
        train(out, "resume_from=latest", "eagle3.step_weight=0.5")
    assert train(out, "resume_from=latest").steps == 6


def test_resume_ignores_fields_added_since_at_their_default_and_sections_the_run_does_not_read():
    # a checkpoint written before tv_weight and features.dir existed resumes under the newer code as long as they
    # keep the defaults (which reproduce the old behaviour); fields the run's schema lacks (an older version's one
    # schema of five families saved every family's sections) are not read and not compared; everything else is
    from drafters.training.resume import recipe_diff
    from drafters.training.dflash import DFlashRecipe
    from drafters.training.eagle3 import Eagle3Recipe
    from drafters.training.recipe import to_dict

    current = to_dict(Eagle3Recipe(target="tiny-random-llama", data={"path": "d.jsonl"}))
    old = json.loads(json.dumps(current))
    del old["eagle3"]["tv_weight"]
    old["eagle1"] = {"feature": "pre_norm"}  # another family's section, as an older version saved it
    assert recipe_diff(old, current, schema=Eagle3Recipe) == []
    # without the schema, both differences are reported
    assert len(recipe_diff(old, current)) == 2
    # an added field away from its default changes what is trained: reported, here and nested
    assert recipe_diff(old, {**current, "eagle3": {**current["eagle3"], "tv_weight": 1.0}}, schema=Eagle3Recipe) == [
        "eagle3.tv_weight: '<absent>' -> 1.0"]
    del old["features"]["dir"]
    assert recipe_diff(old, {**current, "features": {**current["features"], "dir": "f"}}, schema=Eagle3Recipe) == [
        "features.dir: '<absent>' -> 'f'"]
    # a DFlash checkpoint of the older schema held EAGLE-3's fields too: the DFlash run compares its own only
    dflash = to_dict(DFlashRecipe(target="t", data={"path": "d"}))
    saved = {**dflash, "ttt_steps": 3, "tv_weight": 0.5, "dflash": {**dflash["dflash"]}}
    assert recipe_diff(saved, dflash, schema=DFlashRecipe) == []
    saved["dflash"]["block_size"] = 4
    assert recipe_diff(saved, dflash, schema=DFlashRecipe) == ["dflash.block_size: 4 -> 8"]


def test_resume_from_another_family_or_target_is_refused(uninterrupted, tmp_path):
    with pytest.raises(RecipeError, match="model_type"):
        train(tmp_path / "g", f"resume_from={uninterrupted / 'checkpoint-4'}", "target=tiny-random-gemma3")
    other = tmp_path / "other" / "checkpoint-4"
    other.parent.mkdir()
    os.system(f"cp -r {uninterrupted / 'checkpoint-4'} {other}")
    meta = json.loads((other / "drafter.json").read_text())
    (other / "drafter.json").write_text(json.dumps({**meta, "family": "medusa"}))
    with pytest.raises(RecipeError, match="a 'medusa' checkpoint, but this recipe trains 'eagle3'"):
        train(tmp_path / "f", f"resume_from={other}")
    bare = tmp_path / "exported"  # a checkpoint without the trainer state, as an export or an older checkpoint-final
    shutil.copytree(uninterrupted / "checkpoint-final", bare, ignore=shutil.ignore_patterns("trainer"))
    with pytest.raises(RecipeError, match="not a resumable checkpoint"):
        train(tmp_path / "h", f"resume_from={bare}")


def test_extending_a_finished_run_continues_from_its_final_state(tmp_path, capsys):
    # resume_from=latest max_steps=6 on a run finished at step 4 (checkpoint-2, checkpoint-final) goes on at step 5:
    # resuming checkpoint-2, the newest numbered one, redid steps 3 and 4 and replaced the finished checkpoint-final
    out, older = tmp_path / "run", tmp_path / "older"
    train(out, "max_steps=4")
    before = losses(out)
    # an older version's checkpoint-final holds no trainer state: refused, and left as it is
    shutil.copytree(out, older)
    shutil.rmtree(older / "checkpoint-final" / "trainer", ignore_errors=True)
    final = (older / "checkpoint-final" / "model.safetensors").read_bytes()
    with pytest.raises(RecipeError, match=r"resume_from=latest: .*checkpoint-final \(step 4\) holds no trainer state "
                                          r".*resuming checkpoint-2 would train steps 3-4 again and replace it; "
                                          r"start a new run from its weights \(init_from="):
        train(older, "resume_from=latest", "max_steps=6")
    assert (older / "checkpoint-final" / "model.safetensors").read_bytes() == final
    assert losses(older) == before
    capsys.readouterr()
    summary = train(out, "resume_from=latest", "max_steps=6")
    assert f"resumed from {out / 'checkpoint-final'} at step 4" in capsys.readouterr().out
    assert summary.steps == 6 and load_checkpoint(out / "checkpoint-final").extra["step"] == 6
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6] and losses(out)[:4] == before
    # step 5 takes its lr from the 6-step schedule, not from the finished 4-step one (whose cosine had reached 0)
    optim = load_recipe([RECIPE]).optim
    assert rows[4]["lr"] == pytest.approx(optim.lr * lr_factor(optim, 6, 4)) and lr_factor(optim, 4, 4) == 0
    # nothing left to train: said, not a second evaluation and save of the same weights
    with pytest.raises(RecipeError, match=r"the run finished at step 6, this run.s last step .*nothing to continue"):
        train(out, "resume_from=latest", "max_steps=6")


def test_resuming_an_init_from_run_needs_no_init_from_checkpoint(uninterrupted, tmp_path, capsys):
    # The run's checkpoints hold every weight it started from (here grown to 96 draft ids) and its vocabulary: its
    # init_from checkpoint, gone since, is not needed to resume it. Every other check still applies
    start, out = tmp_path / "start", tmp_path / "from"
    shutil.copytree(uninterrupted / "checkpoint-4", start)
    recipe = [f"init_from={start}", "grow_vocab=true", "draft_vocab_size=96"]
    train(out, *recipe)
    whole = weights(out)
    shutil.rmtree(start)
    resume = f"resume_from={out / 'checkpoint-4'}"
    with pytest.raises(RecipeError, match=r"recipe changed[\s\S]*optim.lr: 0.001 -> 0.002"):
        train(out, *recipe, resume, "optim.lr=2e-3")
    capsys.readouterr()
    summary = train(out, *recipe, resume)
    said = f"init_from={start} is gone: the drafter's weights and draft vocabulary are those of {out / 'checkpoint-4'}"
    assert said in capsys.readouterr().out
    assert summary.steps == 6
    resumed = weights(out)
    assert resumed["d2t"].numel() == 96 and all(torch.equal(whole[k], resumed[k]) for k in whole)


def test_keep_last_prunes_old_step_checkpoints(tmp_path):
    train(tmp_path / "k", "save_every=1", "keep_last=2")
    assert sorted(p.name for p in (tmp_path / "k").glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-5",
                                                                            "checkpoint-final"]


def test_init_from_starts_a_new_run_from_a_checkpoints_weights_and_vocabulary(uninterrupted, tmp_path):
    # lr 1e-30 (the recipe refuses 0): every update is below a float32 weight's last bit, so the run ends exactly
    # where it started and its final weights are what it started from. The recipe asks for
    # another vocabulary size; a run from a checkpoint keeps the checkpoint's vocabulary (its LM head's ids)
    start = uninterrupted / "checkpoint-4"
    summary = train(tmp_path / "from", f"init_from={start}", "optim.lr=1e-30", "max_steps=2", "draft_vocab_size=32")
    assert summary.steps == 2  # a fresh run: its own step count and schedule, not the checkpoint's step 4
    started, ended = load_checkpoint(start).state_dict, weights(tmp_path / "from")
    assert started.keys() == ended.keys()
    assert all(torch.equal(started[k], ended[k]) for k in started)
    # without init_from the same recipe starts from a random drafter (another vocabulary size, other weights)
    train(tmp_path / "fresh", "optim.lr=1e-30", "max_steps=2", "draft_vocab_size=32")
    assert weights(tmp_path / "fresh")["d2t"].numel() == 32 != started["d2t"].numel()


def test_grow_vocab_widens_a_checkpoints_draft_vocabulary_keeping_its_rows(uninterrupted, tmp_path):
    # The tiny recipe's 64 draft ids grow to 96: every checkpoint id keeps its LM-head row (at its new position),
    # the 32 new ids' rows start at zero, every other tensor is the checkpoint's. lr 1e-30: the final weights are
    # the starting ones (see above)
    start = uninterrupted / "checkpoint-4"
    summary = train(tmp_path / "grown", f"init_from={start}", "grow_vocab=true", "draft_vocab_size=96",
                    "optim.lr=1e-30", "max_steps=2")
    assert summary.steps == 2
    old, grown = load_checkpoint(start).state_dict, weights(tmp_path / "grown")
    old_vocab, new_vocab = DraftVocab.from_state_dict(old), DraftVocab.from_state_dict(grown)
    assert (old_vocab.size, new_vocab.size) == (64, 96)
    assert bool(new_vocab.t2d[old_vocab.used].all())  # a superset
    rows, _ = new_vocab.to_draft(old_vocab.used)
    assert torch.equal(grown["lm_head.weight"][rows], old["lm_head.weight"])
    added = ~old_vocab.t2d[new_vocab.used]  # (96,) rows of ids the checkpoint did not hold
    assert int(added.sum()) == 32
    assert float(grown["lm_head.weight"][added].abs().max()) < 1e-20  # lr 1e-30 does move a zero, by ~1e-30
    assert all(torch.equal(grown[k], old[k]) for k in old if k not in ("lm_head.weight", "d2t", "t2d"))


def test_grow_vocab_refuses_what_cannot_grow(uninterrupted, tmp_path):
    start = uninterrupted / "checkpoint-final"
    with pytest.raises(RecipeError, match="grow_vocab=true widens the draft vocabulary of init_from's checkpoint: "
                                          "set init_from"):
        train(tmp_path / "a", "grow_vocab=true")
    with pytest.raises(RecipeError, match="grow_vocab: draft_vocab_size=64 makes a vocabulary of 64 ids on this "
                                          "data, but init_from's already holds 64: set draft_vocab_size above 64"):
        train(tmp_path / "b", f"init_from={start}", "grow_vocab=true")
    assert not any(earlier_run_files(tmp_path / name) for name in "ab")


def draft_logits(path, seed=0):
    """The checkpoint's drafter on fixed random fused features and ids: prefill, then one step on its own output."""
    from drafters.eagle3 import Eagle3Config, Eagle3Drafter
    from drafters.layers import DraftKVCache

    ckpt = load_checkpoint(path)
    config = Eagle3Config(**ckpt.config)
    drafter = Eagle3Drafter(config)
    drafter.load_state_dict(ckpt.state_dict)
    gen = torch.Generator().manual_seed(seed)
    embed = torch.nn.Embedding.from_pretrained(torch.randn(config.vocab_size, config.hidden_size, generator=gen))
    features = torch.randn(1, 9, len(config.aux_layers) * config.hidden_size, generator=gen)
    ids = torch.randint(0, config.vocab_size, (1, 10), generator=gen)
    cache = DraftKVCache()
    with torch.no_grad():
        hidden, first = drafter.prefill(features, ids[:, :9], embed, cache)
        _, second = drafter.step(hidden[:, -1:], ids[:, 9:], embed, cache)
    return config.num_hidden_layers, torch.cat([first[0], second[0]])


def test_grow_layers_stacks_identity_layers_on_a_checkpoint(uninterrupted, tmp_path):
    # A checkpoint written before num_hidden_layers existed (its drafter.json lacks the key: one layer) grows to
    # three layers: its tensors carry over, the two added layers start as the identity, so the grown drafter drafts
    # the checkpoint's logits exactly. lr 1e-30: the final weights are the starting ones
    start = tmp_path / "one-layer"
    os.system(f"cp -r {uninterrupted / 'checkpoint-4'} {start}")
    meta = json.loads((start / "drafter.json").read_text())
    del meta["config"]["num_hidden_layers"]
    (start / "drafter.json").write_text(json.dumps(meta))
    summary = train(tmp_path / "deep", f"init_from={start}", "eagle3.grow_layers=true", "eagle3.num_layers=3",
                    "optim.lr=1e-30", "max_steps=2")
    assert summary.steps == 2
    old, deep = load_checkpoint(start).state_dict, weights(tmp_path / "deep")
    assert all(torch.equal(deep[k], old[k]) for k in old)
    added = sorted(set(deep) - set(old))
    assert {k.split(".")[1] for k in added} == {"1", "2"} and len(added) == 2 * 9  # 9 tensors a layer
    assert all(float(deep[f"layers.{i}.{name}"].abs().max()) < 1e-20
               for i in (1, 2) for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"))
    (n_old, before), (n_deep, after) = draft_logits(start), draft_logits(tmp_path / "deep" / "checkpoint-final")
    assert (n_old, n_deep) == (1, 3)
    torch.testing.assert_close(after, before, atol=1e-6, rtol=0)


def test_grow_layers_refuses_what_cannot_grow(uninterrupted, tmp_path):
    start = uninterrupted / "checkpoint-final"
    with pytest.raises(RecipeError, match="eagle3.grow_layers=true stacks layers on init_from's checkpoint: set init_"):
        train(tmp_path / "a", "eagle3.grow_layers=true", "eagle3.num_layers=2")
    with pytest.raises(RecipeError, match=r"eagle3.grow_layers: the checkpoint already has 1 decoder layer\(s\) and "
                                          "eagle3.num_layers=1; set eagle3.num_layers above 1"):
        train(tmp_path / "b", f"init_from={start}", "eagle3.grow_layers=true")
    with pytest.raises(RecipeError, match="num_hidden_layers: recipe builds 2, checkpoint has 1"):
        train(tmp_path / "c", f"init_from={start}", "eagle3.num_layers=2")
    with pytest.raises(RecipeError, match="eagle3.num_layers=0 must be >= 1"):
        train(tmp_path / "d", "eagle3.num_layers=0")
    assert not any(earlier_run_files(tmp_path / name) for name in "abcd")


def test_init_from_what_cannot_start_this_run_is_refused_before_any_work(uninterrupted, tmp_path):
    start = uninterrupted / "checkpoint-final"
    with pytest.raises(RecipeError, match=r"init_from=.*nowhere: not a drafter checkpoint directory"):
        train(tmp_path / "a", f"init_from={tmp_path / 'nowhere'}")
    with pytest.raises(RecipeError, match=r"(?s)builds another drafter.*norm_before_fc: recipe builds True, "
                                          "checkpoint has False"):
        train(tmp_path / "b", f"init_from={start}", "norm_before_fc=true")
    with pytest.raises(RecipeError, match="init_from: .*model_type"):
        train(tmp_path / "c", f"init_from={start}", "target=tiny-random-gemma3")
    other = tmp_path / "medusa-like"
    os.system(f"cp -r {start} {other}")
    meta = json.loads((other / "drafter.json").read_text())
    (other / "drafter.json").write_text(json.dumps({**meta, "family": "medusa"}))
    with pytest.raises(RecipeError, match="a 'medusa' checkpoint, but this recipe trains 'eagle3'"):
        train(tmp_path / "d", f"init_from={other}")
    assert not any(earlier_run_files(tmp_path / name) for name in "abcd")  # no checkpoint, metrics or eval rows
