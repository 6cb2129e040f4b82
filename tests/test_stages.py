"""A recipe's `stages:` (drafters.training.stages): equal to the stages run by hand with init_from, resumable as a
whole, and refusing a stage's unknown key or missing input before any stage trains."""

import json
import shlex
import signal
from pathlib import Path

import pytest
import torch
import yaml

from conftest import load_script  # tests/ is on sys.path under pytest
from drafters.checkpoint import load_checkpoint
from drafters.errors import Stopped
from drafters.training import loop  # fit calls loop.train_loop: patched there
from drafters.training.families import load_recipe
from drafters.training.recipe import RecipeError

eagle = load_script("train/eagle.py")
features = load_script("train/features.py")
RECIPE = "recipes/eagle3_tiny.yaml"  # 6 steps, save at 4, eval at 3
DATA = "tests/data/tiny_conversations.jsonl"
SECOND = ["data.limit=16", "optim.lr=5.0e-4", "optim.schedule=constant", "optim.warmup_steps=0", "max_steps=4"]


def staged_recipe(tmp: Path, store: Path, **second) -> Path:
    """The tiny recipe with two stages: 4 steps as the recipe says, then 4 from a store of the first 16 rows at
    another lr and schedule."""
    raw = yaml.safe_load(Path(RECIPE).read_text())
    raw["stages"] = [{"name": "first", "max_steps": 4},
                     {"name": "second", "data": {"limit": 16}, "features": {"dir": str(store)},
                      "optim": {"lr": 5.0e-4, "schedule": "constant", "warmup_steps": 0}, "max_steps": 4, **second}]
    path = tmp / "staged.yaml"
    path.write_text("# python train/train.py staged.yaml\n" + yaml.safe_dump(raw, sort_keys=False))
    return path


def weights(checkpoint):
    return load_checkpoint(checkpoint).state_dict


def same(a, b) -> bool:
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    directory = tmp_path_factory.mktemp("store") / "first16"
    features.main([RECIPE, "data.limit=16", f"features.dir={directory}"])
    return directory


@pytest.fixture(scope="module")
def staged(tmp_path_factory, store):
    tmp = tmp_path_factory.mktemp("staged")
    recipe, out = staged_recipe(tmp, store), tmp / "run"
    eagle.main([str(recipe), f"output_dir={out}"])
    return recipe, out


def test_two_stages_equal_the_two_runs_by_hand_with_init_from(staged, store, tmp_path, capsys):
    recipe, out = staged
    first, second = tmp_path / "first", tmp_path / "second"
    eagle.main([RECIPE, f"output_dir={first}", "max_steps=4"])
    eagle.main([RECIPE, f"output_dir={second}", f"init_from={first / 'checkpoint-final'}", f"features.dir={store}",
                *SECOND])
    assert same(out / "stage-1-first" / "checkpoint-final", first / "checkpoint-final")
    assert same(out / "stage-2-second" / "checkpoint-final", second / "checkpoint-final")
    final = out / "checkpoint-final"
    assert final.is_symlink() and final.resolve() == (out / "stage-2-second" / "checkpoint-final").resolve()
    assert same(final, second / "checkpoint-final")
    # the same command again: both stages finished, nothing trains, the link stays
    capsys.readouterr()
    assert eagle.main([str(recipe), f"output_dir={out}"]) is None
    said = capsys.readouterr().out
    assert "stage 1 (first): finished" in said and "stage 2 (second): finished" in said
    assert same(final, second / "checkpoint-final")


def test_an_interrupted_stage_resumes_to_the_uninterrupted_result(staged, store, tmp_path, monkeypatch, capsys):
    recipe, whole = staged
    out, inner = tmp_path / "run", loop.train_loop

    def interrupt_stage_2_at_step_2(run, *args, **kwargs):
        periodic = run.periodic

        def then_interrupt(step, total, position):
            periodic(step, total, position)
            if step == 2 and run.output_dir.name == "stage-2-second":
                signal.raise_signal(signal.SIGINT)  # Ctrl-C

        run.periodic = then_interrupt
        return inner(run, *args, **kwargs)

    monkeypatch.setattr(loop, "train_loop", interrupt_stage_2_at_step_2)
    with pytest.raises(Stopped, match=r"stage 2 \(second\): interrupted: saved the state after step 2 .*run the "
                                      r"same command again"):
        eagle.main([str(recipe), f"output_dir={out}"])
    assert not (out / "checkpoint-final").exists() and (out / "stage-2-second" / "checkpoint-2").is_dir()
    monkeypatch.setattr(loop, "train_loop", inner)
    capsys.readouterr()
    eagle.main([str(recipe), f"output_dir={out}"])
    said = capsys.readouterr().out
    assert "stage 1 (first): finished" in said and "resumed from" in said and "at step 2" in said
    assert same(out / "checkpoint-final", whole / "checkpoint-final")


@pytest.mark.parametrize("second, message", [
    ({"optim": {"lrr": 1.0}}, r"stage 2 \(second\): unknown key 'optim.lrr' \(did you mean 'optim.lr'\?\)"),
    ({"epoch": 2}, r"stage 2 \(second\): unknown key 'epoch' \(did you mean 'epochs'\?\)"),
    ({"init_from": "x"}, r"stage 2 \(second\) sets init_from, which the stages set themselves"),
    ({"optim": {"lr": "fast"}}, r"stage 2 \(second\): .*optim.lr"),
])
def test_a_stages_bad_key_is_refused_naming_the_stage(tmp_path, store, second, message):
    recipe = staged_recipe(tmp_path, store, **second)
    with pytest.raises(RecipeError, match=message):
        load_recipe([str(recipe)])
    with pytest.raises(RecipeError, match=message):
        eagle.main([str(recipe), f"output_dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run" / "stage-1-first").exists()


def test_a_stage_without_its_store_is_refused_with_the_command_that_makes_it(tmp_path):
    recipe, out, missing = staged_recipe(tmp_path, tmp_path / "none"), tmp_path / "run", tmp_path / "none"
    with pytest.raises(RecipeError, match=r"^stage 2 \(second\) reads features.dir=\S+none, which holds no feature "
                                          r"store yet; make it first with: python train/features.py ") as refused:
        eagle.main([str(recipe), f"output_dir={out}"])
    assert not (out / "stage-1-first").exists()  # refused before the first stage trained
    command = shlex.split(str(refused.value).split("make it first with: ")[1])
    features.main(command[2:])  # the command it gives makes the store
    assert (missing / "index.json").is_file()
    assert load_recipe(command[2:]).features.dir == str(missing)


def test_a_stage_with_features_make_makes_its_store_and_trains_as_from_a_store_made_first(staged, tmp_path, capsys):
    # features.make: the one command makes the missing store when stage 2's turn comes, then trains from it: the
    # drafter equals the fixture's, whose store train/features.py made beforehand
    recipe_with_store, whole = staged
    made = tmp_path / "made"
    recipe = staged_recipe(tmp_path, made, features={"dir": str(made), "make": True})
    out = tmp_path / "run"
    eagle.main([str(recipe), f"output_dir={out}"])
    assert "features.make: making the store in" in capsys.readouterr().out
    assert json.loads((made / "index.json").read_text())["complete"]
    assert same(out / "checkpoint-final", whole / "checkpoint-final")
    capsys.readouterr()
    assert eagle.main([str(recipe), f"output_dir={out}"]) is None  # finished: neither the store nor a stage again
    assert "making the store" not in capsys.readouterr().out
    # features.make changes no training: the stages stay finished once it is dropped (the store is there now)
    assert eagle.main([str(staged_recipe(tmp_path, made)), f"output_dir={out}"]) is None


DAMAGED_INDEX = [(b'{"complete": tr', r"not valid JSON"), (b"\xff\xfe{}", r"not valid JSON"),
                 (b"null", r"holds a JSON NoneType, not a store's index"), (b"[1]", r"holds a JSON list")]


@pytest.mark.parametrize("make", [False, True])
@pytest.mark.parametrize("damaged, why", DAMAGED_INDEX)
def test_a_stage_whose_store_index_is_damaged_is_refused_naming_it_before_any_stage_trains(tmp_path, make,
                                                                                            damaged, why):
    # one reader (features.read_index) for the store, the stages' check and features.make: a damaged index is
    # named, never taken for a missing store that features.make would write over, nor a traceback
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "index.json").write_bytes(damaged)
    recipe = staged_recipe(tmp_path, broken, features={"dir": str(broken), "make": make})
    remake = r"run this command again" if make else r"make it with: python train/features.py "
    with pytest.raises(RecipeError, match=rf"^stage 2 \(second\) reads features.dir=\S+broken: \S+index.json: {why}"
                                          rf".*delete \S+broken and recompute the features; then {remake}"):
        eagle.main([str(recipe), f"output_dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run" / "stage-1-first").exists()
    assert (broken / "index.json").read_bytes() == damaged


@pytest.mark.parametrize("damaged, why", DAMAGED_INDEX)
def test_features_make_over_a_damaged_index_is_refused_before_the_target_loads(tmp_path, damaged, why):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "index.json").write_bytes(damaged)
    with pytest.raises(RecipeError, match=rf"^\S+index.json: {why}"):
        eagle.main([RECIPE, "max_steps=1", f"features.dir={broken}", "features.make=true",
                    f"output_dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run").exists() and sorted(p.name for p in broken.iterdir()) == ["index.json"]


def test_features_make_with_split_target_is_refused_naming_features_make(tmp_path):
    with pytest.raises(RecipeError, match=r"^eagle3: features.make: split_target=true is for online training; .*set "
                                          r"split_target=false"):
        eagle.main([RECIPE, "max_steps=1", "split_target=true", f"features.dir={tmp_path / 'made'}",
                    "features.make=true", f"output_dir={tmp_path / 'run'}"])
    assert not (tmp_path / "made").exists()  # refused before the target loads or a shard is written


def test_a_stage_whose_store_was_made_from_another_data_file_is_refused(tmp_path, store):
    other = tmp_path / "other.jsonl"
    other.write_text("".join(Path(DATA).read_text().splitlines(keepends=True)[1:]))  # another file: a row fewer
    recipe = staged_recipe(tmp_path, store, data={"path": str(other), "limit": 16})
    with pytest.raises(RecipeError, match=r"^stage 2 \(second\) reads features.dir=\S+, a store made from another "
                                          r"data file than its data.path=\S+other.jsonl; update it with: python "
                                          r"train/features.py .* features.update=true"):
        eagle.main([str(recipe), f"output_dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run" / "stage-1-first").exists()


def test_an_earlier_plain_runs_checkpoint_final_is_not_replaced_by_the_stages_link(tmp_path, store):
    out = tmp_path / "run"
    (out / "checkpoint-final").mkdir(parents=True)
    with pytest.raises(RecipeError, match=r"holds an earlier run's checkpoint-final.*choose another output_dir"):
        eagle.main([str(staged_recipe(tmp_path, store)), f"output_dir={out}"])


def test_a_stage_whose_data_file_is_not_there_is_refused_before_any_stage_trains(tmp_path, store):
    recipe = staged_recipe(tmp_path, store, data={"path": str(tmp_path / "later.jsonl")})
    with pytest.raises(RecipeError, match=r"^stage 2 \(second\) reads data.path=\S+later.jsonl, which does not exist "
                                          r"yet; make it first"):
        eagle.main([str(recipe), f"output_dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run" / "stage-1-first").exists()


def test_the_recipes_measure_decodes_the_final_drafter_once_and_says_where_its_export_is(staged, tmp_path, capsys):
    # the staged run again with a `measure:` section: every stage is finished, so nothing trains; the final drafter
    # (the link to stage 2's) is decoded as the section says, and its result kept: a third run decodes nothing
    import json

    from drafters.decode.evaluate import Options, measure

    recipe, out = staged
    bench = tmp_path / "prompts.jsonl"
    bench.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("abc abc abc abc", "hello hello", "x y")))
    section = f'measure={{"bench": "{bench}", "limit": 2, "max_new_tokens": 8, "tree": "chain:2"}}'
    capsys.readouterr()
    eagle.main([str(recipe), f"output_dir={out}", section])
    said = capsys.readouterr().out
    report = out / "measure-prompts.json"
    result = json.loads(report.read_text())
    assert result["limit"] == 2 and result["max_new_tokens"] == 8 and result["tree"] == "chain:2"
    assert result["proposer_sha256"] == measure(Options(target=result["target"], proposer=str(out / "stage-2-second" / "checkpoint-final"),
                                                        bench=str(bench), tree="chain:2", limit=2, max_new_tokens=8,
                                                        no_baseline=True))["proposer_sha256"]  # stage 2's drafter
    depths = " ".join(f"{a:.3f}" for a in result["per_depth_acceptance"])
    assert f"greedy: tau {result['tau']:.3f}, acceptance by depth [{depths}]" in said
    # no GGUF for the tiny target (no build, or llama.cpp's converter does not know its tokenizer): one line, and
    # the run still ends normally
    assert "measure: no llama.cpp export: " in said and "Traceback" not in said
    stamp = report.stat().st_mtime_ns
    eagle.main([str(recipe), f"output_dir={out}", section])
    assert report.stat().st_mtime_ns == stamp and "measure: decoding" not in capsys.readouterr().out


def test_a_finished_plain_run_run_again_measures_instead_of_refusing(tmp_path, capsys):
    # without stages: the run's own checkpoint-final is at the last step, so resume_from=latest has nothing to train;
    # with a `measure:` section that is what the command is run again for (a measure that stopped, or was added)
    bench = tmp_path / "prompts.jsonl"
    bench.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("abc abc abc abc", "hello hello")))
    section = f'measure={{"bench": "{bench}", "limit": 2, "max_new_tokens": 8, "tree": "chain:2", "llama_cpp": false}}'
    out = tmp_path / "run"
    eagle.main([RECIPE, f"output_dir={out}", "max_steps=2"])
    with pytest.raises(RecipeError, match="nothing to continue"):  # without a measure the refusal stands
        eagle.main([RECIPE, f"output_dir={out}", "max_steps=2", "resume_from=latest"])
    capsys.readouterr()
    assert eagle.main([RECIPE, f"output_dir={out}", "max_steps=2", "resume_from=latest", section]) is None
    said = capsys.readouterr().out
    assert "finished training at this recipe's last step; measuring" in said
    assert json.loads((out / "measure-prompts.json").read_text())["limit"] == 2


def test_a_bad_measure_section_is_refused_before_anything_trains(tmp_path):
    with pytest.raises(RecipeError, match=r"measure.limit=0 must be >= 1 or null"):
        eagle.main([RECIPE, f"output_dir={tmp_path / 'run'}", 'measure={"limit": 0}'])
    assert not (tmp_path / "run").exists()
