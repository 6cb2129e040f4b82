"""Every recipe in the repository loads with the schema of the script its first line launches."""

import re
from pathlib import Path

import pytest

from drafters.training.families import load_recipe
from drafters.training.recipe import RecipeError, load_dataclass
from conftest import load_script  # tests/ is on sys.path under pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
LAUNCH = re.compile(r"^# (?:accelerate launch(?: --\S+(?: \S+)?)*|python) ((?:train|eval)/\w+\.py) (recipes/\S+\.yaml)")


TRAINERS = ("train/train.py", "train/eagle.py", "train/heads.py", "train/features.py")  # families.load_recipe


def load_with_script(path: Path, script: str):
    if script in TRAINERS:  # the recipe's `drafter` picks the schema
        return load_recipe([str(path)])
    return load_dataclass(path, schema=load_script(script).Recipe)


def test_there_are_recipes():
    assert RECIPES, "recipes/ holds no YAML recipe"


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_loads_with_its_scripts_schema(path):
    first_line = path.read_text().splitlines()[0]
    match = LAUNCH.match(first_line)
    assert match, f"{path.name}: first line must be the launch command, e.g. '# python train/x.py recipes/{path.name}'"
    script, named = match.groups()
    assert named == f"recipes/{path.name}", f"{path.name}: its launch command names {named}"
    load_with_script(path, script)


@pytest.mark.parametrize("path", sorted((ROOT / "recipes" / "accelerate").glob("*.yaml")), ids=lambda p: p.name)
def test_accelerate_configs_load_with_accelerate(path):
    # accelerate's own reader: an unknown key or a bad enum value fails here, not on a GPU cluster
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(path))
    assert config.distributed_type.value in ("MULTI_GPU", "DEEPSPEED", "FSDP")
    assert path.read_text().startswith("# ") and "accelerate launch --config_file recipes/accelerate/" in \
        path.read_text().splitlines()[0]


# The shared sections (data, optim, batching, steps, checkpoints, logging) are checked in one place
# (TrainRecipe.problems), so every training script refuses the same bad values before loading a target.
SCRIPTS = [("train/eagle.py", "recipes/eagle3_tiny.yaml"), ("train/eagle.py", "recipes/eagle1_tiny.yaml"),
           ("train/heads.py", "recipes/medusa_tiny.yaml"), ("train/heads.py", "recipes/blockwise_tiny.yaml"),
           ("train/features.py", "recipes/eagle3_tiny.yaml")]


@pytest.mark.parametrize("script, recipe", SCRIPTS, ids=lambda v: v.split("/")[-1])
@pytest.mark.parametrize("override, message", [
    ("optim.clip_value=-1", "optim.clip_value=-1.0 must be > 0 or null"),  # would clamp every gradient to -1
    ("keep_last=-1", "keep_last=-1 must be >= 0"),
    ("data.limit=0", "data.limit=0 must be >= 1 or null"),
    ("optim.betas=[0.9]", "optim.betas=[0.9] must be two numbers"),
    ("grad_accum=0", "grad_accum=0 must be >= 1"),
])
def test_every_training_script_refuses_the_same_shared_fields(script, recipe, override, message):
    with pytest.raises(RecipeError, match=re.escape(message)):
        load_script(script).main([recipe, override])


def test_all_problems_are_named_at_once():
    with pytest.raises(RecipeError) as err:
        load_script("train/heads.py").main(["recipes/medusa_tiny.yaml", "num_heads=0", "optim.lr=0", "threads=-1"])
    assert all(f in str(err.value) for f in ("num_heads=0", "optim.lr=0", "threads=-1")), err.value


@pytest.mark.parametrize("recipe, override, message", [
    ("recipes/eagle3_tiny.yaml", "tv_weight=-0.5", "tv_weight=-0.5 must be >= 0"),
    # a family that does not read the field refuses it rather than training without it
    ("recipes/eagle1_tiny.yaml", "tv_weight=1", "tv_weight=1 is read by drafter: eagle3, eagle4 only, not eagle1"),
    ("recipes/dflash_tiny.yaml", "tv_weight=1", "tv_weight=1 is read by drafter: eagle3, eagle4 only, not dflash"),
    ("recipes/dflash_tiny.yaml", "init_layer=-1", "init_layer=-1 is read by drafter: eagle3, eagle4 only, not dflash"),
    ("recipes/dflash_tiny.yaml", "divergence=lk", "divergence=lk is read by drafter: eagle3, eagle4 only, not dflash"),
    ("recipes/eagle3_tiny.yaml", "divergence=l2", "divergence='l2' is not a loss EAGLE-3 trains with: use one of kl, "
     "reverse_kl, jsd, lk, argmax"),
    ("recipes/eagle1_tiny.yaml", "eval_ttt_steps=3", "eval_ttt_steps=3 is read by drafter: eagle3, eagle4 only, not eagle1"),
    ("recipes/medusa_tiny.yaml", "blockwise.loss=sample_one",
     "blockwise.loss=sample_one is read by drafter: blockwise only, not medusa"),
    ("recipes/dflash_tiny.yaml", "eagle3.tv_weight=1", "eagle3.tv_weight=1 is read by drafter: eagle3, eagle4 only, not "
     "dflash"),
    ("recipes/eagle3_tiny.yaml", "drafter=eagel3", "drafter='eagel3' is not a family this trainer trains; choose one "
     "of eagle3, dflash, dspark, dflash2, peagle, eagle4, eagle1, medusa, blockwise, mtp (did you mean 'eagle3'?)"),
])
def test_another_familys_field_is_refused_where_it_would_be_ignored(recipe, override, message):
    with pytest.raises(RecipeError, match=re.escape(message)):
        load_script("train/train.py").main([recipe, override])


def test_another_familys_field_at_its_default_is_accepted():
    # a DFlash recipe copied from an EAGLE-3 one keeps eagle3: {ttt_steps: 7} (EAGLE-3's default) and norm_before_fc:
    # false: neither changes anything, so the recipe loads; ttt_steps: 3 (here in the old top-level spelling) would be
    # training a setting DFlash never reads
    recipe = load_recipe(["recipes/dflash_tiny.yaml", "eagle3.ttt_steps=7", "norm_before_fc=false"])
    assert recipe.drafter == "dflash" and not hasattr(recipe, "eagle3")
    with pytest.raises(RecipeError, match="ttt_steps=3 is read by drafter: eagle3, eagle4 only, not dflash"):
        load_recipe(["recipes/dflash_tiny.yaml", "ttt_steps=3"])


@pytest.mark.parametrize("script", ["train/eagle.py", "train/heads.py"])
def test_the_aliases_train_any_family_the_recipe_names(script, tmp_path):
    # train/heads.py given an EAGLE-3 recipe trains EAGLE-3 (the scripts once refused each other's families)
    assert load_recipe(["recipes/eagle3_tiny.yaml"], default="medusa").drafter == "eagle3"
    assert load_recipe(["recipes/medusa_tiny.yaml"]).drafter == "medusa"
    summary = load_script(script).main(["recipes/blockwise_tiny.yaml" if script.endswith("eagle.py") else
                                        "recipes/eagle3_tiny.yaml", "max_steps=1", "eval_every=0",
                                        f"output_dir={tmp_path}", "data.eval_rows=0"])
    assert summary.checkpoint.is_dir()


# EAGLE-3's options sit under `eagle3:`, as every family's under its own section. An earlier release read them at the
# top level: this one still does (moving them there, with one deprecation line), the next will refuse them.
def old_shape(path: Path, tmp_path: Path) -> Path:
    """The recipe as an earlier release wrote it: its eagle3: section's keys at the top level."""
    import yaml

    raw = yaml.safe_load(path.read_text())
    old = tmp_path / f"old_{path.name}"
    old.write_text(yaml.safe_dump({**{k: v for k, v in raw.items() if k != "eagle3"}, **raw["eagle3"]},
                                  sort_keys=False))
    return old


@pytest.mark.parametrize("name", ["eagle3_smollm2.yaml", "eagle3_tiny.yaml"])
def test_the_old_top_level_eagle3_keys_load_to_the_same_recipe_and_say_so_in_one_line(name, tmp_path, capsys):
    import yaml

    new = ROOT / "recipes" / name
    old = old_shape(new, tmp_path)
    assert load_recipe([str(new)]) == load_recipe([str(old)])
    moved = list(yaml.safe_load(new.read_text())["eagle3"])  # in the order the old file holds them
    assert capsys.readouterr().err.splitlines() == [  # the old file's line; the new shape says nothing
        f"warning: {old}: {', '.join(moved)} at the top level are deprecated: move them under `eagle3:` (on the "
        "command line: eagle3.ttt_steps=...); this release still reads the top level, the next will refuse it"]
    # an old key=value on the command line says its line and lands where its new spelling does
    assert load_recipe([str(new), "eagle3.divergence=lk"]) == load_recipe([str(new), "divergence=lk"])
    assert capsys.readouterr().err.splitlines() == [
        f"warning: {new}: divergence at the top level is deprecated: move it under `eagle3:` (on the command line: "
        "eagle3.divergence=...); this release still reads the top level, the next will refuse it"]
    # the command line still wins over the file, whichever spelling each uses
    assert load_recipe([str(old), "eagle3.ttt_steps=5"]).eagle3.ttt_steps == 5


def test_an_eagle3_key_at_the_top_level_and_under_eagle3_is_refused_in_one_sentence(tmp_path):
    both = tmp_path / "both.yaml"
    both.write_text((ROOT / "recipes" / "eagle3_tiny.yaml").read_text() + "ttt_steps: 4\n")
    with pytest.raises(RecipeError) as err:
        load_recipe([str(both)])
    assert str(err.value) == (f"{both}: ttt_steps is given both at the top level and under eagle3:, keep the one under "
                              "eagle3: (the top level is where an earlier release read it)")


# What a recipe reads must be in a fresh clone, or be written by a command the repository names: another recipe's
# `output:` (its launch line is that command), or the run's own outputs/. A user-data path (eagle3_llama8b's
# data/regenerated.jsonl) must say in the recipe's comments how to make it.
def read_paths(raw: dict) -> list[str]:
    data = raw.get("data")
    paths = [data.get("path")] if isinstance(data, dict) else [data]
    features = raw.get("features")
    if isinstance(features, dict):
        paths.append(features.get("dir"))
    return [p for p in paths + [raw.get("resume_from")] if isinstance(p, str) and ("/" in p or "." in p)]


def produced_by() -> dict[str, str]:
    import yaml

    made = {}
    for path in RECIPES:
        output = yaml.safe_load(path.read_text()).get("output")
        if isinstance(output, str):
            made[output] = path.read_text().splitlines()[0][2:]
    return made


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_path_a_recipe_reads_exists_or_is_made_by_a_named_command(path):
    import yaml

    text = path.read_text()
    made = produced_by()
    for read in read_paths(yaml.safe_load(text)):
        assert not Path(read).is_absolute() and not read.startswith(".."), \
            f"{path.name}: {read} lies outside the repository; a fresh clone does not have it"
        if (ROOT / read).exists() or read in made:
            continue
        if read.startswith("outputs/"):  # written by a step the recipe's comments name
            assert "python train/" in text or "quickstart" in text, f"{path.name}: nothing says what writes {read}"
            continue
        assert "train/regenerate.py" in text, f"{path.name}: {read} is neither in the repository nor made by a command"


def test_the_shipped_smollm2_data_is_what_its_recipe_writes():
    # the SmolLM2 training recipes read the file recipes/regenerate_smollm2.yaml appends to, so re-running that
    # command grows the data the recipes train on
    made = produced_by()
    import yaml

    for path in RECIPES:
        if path.name.endswith("_smollm2.yaml") and not path.name.startswith("regenerate"):
            read = yaml.safe_load(path.read_text())["data"]["path"]
            assert made.get(read) == "python train/regenerate.py recipes/regenerate_smollm2.yaml", (path.name, read)
            assert (ROOT / read).stat().st_size > 0


def test_the_shipped_smollm2_data_answers_the_shipped_prompts_and_no_evaluation_prompt():
    # recipes/data/smollm2_general.jsonl grows by regeneration across sessions, from prompt files added to
    # recipes/prompts/general.jsonl: every row must answer a prompt of that file, word for word, once; the prompts
    # must carry unique ids in order, each in one of MT-bench's eight categories; and neither file may hold an
    # MT-bench or HumanEval prompt (exact or a shared word 8-gram), or the shipped drafters are measured on their
    # own training prompts
    import json

    from drafters.training.contamination import eval_prompts, find

    prompts = [json.loads(line) for line in (ROOT / "recipes/prompts/general.jsonl").read_text().splitlines()]
    ids = [p["id"] for p in prompts]
    assert ids == [f"g{i:04d}" for i in range(1, len(ids) + 1)]
    assert {p["category"] for p in prompts} == {"writing", "roleplay", "reasoning", "math", "coding", "extraction",
                                                "stem", "humanities"}
    assert len({p["prompt"] for p in prompts}) == len(prompts), "a prompt is repeated"
    by_id = {p["id"]: p["prompt"] for p in prompts}

    rows = [json.loads(line) for line in (ROOT / "recipes/data/smollm2_general.jsonl").read_text().splitlines()]
    assert len({r["id"] for r in rows}) == len(rows), "a prompt is answered twice"
    for row in rows:
        user, assistant = row["conversations"]
        assert user["role"] == "user" and assistant["role"] == "assistant" and assistant["content"], row["id"]
        assert row["id"] in by_id, f"{row['id']}: answers a prompt recipes/prompts/general.jsonl does not hold"
        assert user["content"] == by_id[row["id"]], f"{row['id']}: the answered prompt is not the shipped one"

    benches = eval_prompts()
    assert not benches.missing, f"install the evaluation benches (bash .ci/setup): {benches.missing}"
    assert find((p["id"], [p["prompt"]]) for p in prompts) == []

