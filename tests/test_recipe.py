import dataclasses
import os
from typing import Literal

import pytest

from drafters.training.recipe import RecipeError, load_dataclass


@dataclasses.dataclass
class Optim:
    lr: float = 1e-4
    betas: tuple[float, ...] = (0.9, 0.95)


@dataclasses.dataclass
class Schema:
    target: str
    layers: list[int] | None = None
    mode: Literal["online", "offline"] = "online"
    steps: int = 10
    optim: Optim = dataclasses.field(default_factory=Optim)


def write(tmp_path, text):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return path


def test_nested_values_overrides_and_coercion(tmp_path):
    path = write(tmp_path, "# python train/x.py r.yaml\ntarget: tiny-random-llama\noptim:\n  lr: 3e-4\n")
    recipe = load_dataclass(path, ["steps=5", "optim.betas=[0.8, 0.9]", "layers=[2, 4, 5]"], schema=Schema)
    assert recipe == Schema(target="tiny-random-llama", layers=[2, 4, 5], steps=5, optim=Optim(3e-4, (0.8, 0.9)))
    assert isinstance(recipe.optim.lr, float)


def test_unknown_key_lists_valid_keys_and_suggests(tmp_path):
    path = write(tmp_path, "target: t\nstpes: 3\n")
    with pytest.raises(RecipeError, match=r"unknown key 'stpes' \(did you mean 'steps'\?\); valid keys: layers, mode, optim, steps, target"):
        load_dataclass(path, schema=Schema)


def test_a_mistake_in_an_override_is_the_command_lines_not_the_files(tmp_path):
    path = write(tmp_path, "target: t\n")
    with pytest.raises(RecipeError, match=r"^override 'optim.rl=1' \(command line\): unknown key 'rl' \(did you mean "
                                          r"'lr'\?\); valid keys of optim: betas, lr$"):
        load_dataclass(path, ["optim.rl=1"], schema=Schema)
    with pytest.raises(RecipeError, match=r"^override 'stpes=3' \(command line\): unknown key 'stpes' \(did you mean "
                                          r"'steps'\?\)"):
        load_dataclass(path, ["stpes=3"], schema=Schema)
    with pytest.raises(RecipeError, match=r"^override 'steps=three' \(command line\): expected int, got 'three'"):
        load_dataclass(path, ["steps=three"], schema=Schema)
    with pytest.raises(RecipeError, match=r"^override 'target.x=1' \(command line\): target is a value, not a section"):
        load_dataclass(path, ["target.x=1"], schema=Schema)


@pytest.mark.parametrize(
    "text, overrides, message",
    [
        ("steps: 3\n", [], "required key 'target' is missing"),
        ("target: t\nsteps: three\n", [], r"r.yaml:steps: expected int, got 'three'"),
        ("target: t\nsteps: true\n", [], r"expected int, got True"),
        ("target: t\nmode: offlien\n", [], r"'offlien' is not one of 'online', 'offline'"),
        ("target: t\noptim: 3\n", [], r"r.yaml:optim: expected a section"),
        ("target: t\n", ["steps"], r"must look like key=value"),
        ("- a\n- b\n", [], r"must be a mapping"),
        ("target: [unclosed\n", [], r"not valid YAML"),
    ],
)
def test_bad_recipes_fail_with_the_key(tmp_path, text, overrides, message):
    with pytest.raises(RecipeError, match=message):
        load_dataclass(write(tmp_path, text), overrides, schema=Schema)


def test_a_key_given_twice_is_refused_with_both_lines(tmp_path):
    path = write(tmp_path, "target: t\nsteps: 3\noptim:\n  lr: 1e-3\nsteps: 5\n")
    with pytest.raises(RecipeError, match=r"r.yaml: key 'steps' is given twice, on line 2 and line 5; keep one"):
        load_dataclass(path, schema=Schema)
    nested = write(tmp_path, "target: t\noptim:\n  lr: 1e-3\n  lr: 2e-3\n")
    with pytest.raises(RecipeError, match=r"key 'lr' is given twice, on line 3 and line 4"):
        load_dataclass(nested, schema=Schema)
    assert load_dataclass(write(tmp_path, "target: t\nsteps: 3\n"), ["steps=5"], schema=Schema).steps == 5


def test_missing_file(tmp_path):
    with pytest.raises(RecipeError, match="not found"):
        load_dataclass(tmp_path / "nope.yaml", schema=Schema)


def test_ctrl_c_at_start_up_is_a_sentence_not_a_traceback(capsys):
    from drafters.training.recipe import run_main

    def main(argv):  # as if Ctrl-C arrived while the target loads, before the loop's handler exists
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as stopped:
        run_main(main)
    assert stopped.value.code == 130 and stopped.value.__context__ is None or stopped.value.__suppress_context__
    assert "interrupted (Ctrl-C); what was saved before is intact" in capsys.readouterr().err


LAUNCHED = """
import atexit, sys
from drafters.errors import UserError
from drafters.training.recipe import run_main
atexit.register(lambda: print("finalized", file=sys.stderr))  # runs only if the interpreter finalizes
def main(argv):
    print("saved", end="")  # unflushed: exit must flush it
    if argv:
        raise UserError("bad row 3")
run_main(main)
"""


@pytest.mark.parametrize("world_size", ["1", "2"])
@pytest.mark.parametrize("fail", [False, True])
def test_a_launched_process_exits_with_its_code_and_output_but_without_finalization(world_size, fail):
    # one process of a multi-process launch skips finalization, where gloo's threads can abort it after a
    # complete run; a single process finalizes as usual. Either way: the same exit code and output.
    import subprocess
    import sys

    from conftest import ROOT

    env = {**os.environ, "WORLD_SIZE": world_size}
    done = subprocess.run([sys.executable, "-c", LAUNCHED, *(["x"] if fail else [])], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=120)
    assert done.returncode == (2 if fail else 0)
    assert done.stdout == "saved"
    assert ("error: bad row 3" in done.stderr) == fail
    assert ("finalized" in done.stderr) == (world_size == "1")


def float_fields(schema, prefix=""):
    """Dotted keys of every float field (optional ones included) of a recipe schema, sections walked."""
    import typing

    hints = typing.get_type_hints(schema)
    for field in dataclasses.fields(schema):
        hint = hints[field.name]
        if typing.get_origin(hint) in (list, tuple):
            continue  # lists of floats: their items go through the same coercion
        options = typing.get_args(hint) or (hint,)
        section = next((o for o in options if dataclasses.is_dataclass(o)), None)
        if section is not None:
            yield from float_fields(section, f"{prefix}{field.name}.")
        elif float in options:
            yield f"{prefix}{field.name}"


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "nan", "inf"])
def test_non_finite_numbers_are_refused_with_the_key(tmp_path, value):
    # optim.lr=.nan used to pass and end in a torch traceback (issue 38); 'nan' / 'inf' are YAML strings float() reads
    path = write(tmp_path, "target: t\n")
    with pytest.raises(RecipeError, match=r"override 'optim.lr=.*' \(command line\): -?(nan|inf) is not a finite"):
        load_dataclass(path, [f"optim.lr={value}"], schema=Schema)


def test_every_float_field_of_every_training_schema_refuses_nan():
    from drafters.training.families import TRAINING_FAMILIES, load_recipe
    from conftest import ROOT

    checked = 0
    for name, family in TRAINING_FAMILIES.items():
        recipe = ROOT / "recipes" / f"{name}_tiny.yaml"
        for key in float_fields(family.recipe):
            with pytest.raises(RecipeError, match="is not a finite number"):
                load_recipe([str(recipe), f"{key}=.nan"])
            checked += 1
    assert checked > 20  # the walk found the schemas' float fields (lr, step_weight, dflash.gamma, ...)
