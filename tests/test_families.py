"""Every layer's family table names the same families, and each training entry is complete: a family that is
registered in one layer and missing in another fails here by name, not later on a user's recipe."""

import ast
import typing
from pathlib import Path

import pytest

from drafters.decode.proposers.loading import FAMILY_PROPOSERS
from drafters.export.dispatch import EXPORTERS
from drafters.registry import FAMILIES
from drafters.training.families import TRAINING_FAMILIES

ROOT = Path(__file__).resolve().parents[1]


TABLES = {"drafters.training.families.TRAINING_FAMILIES": TRAINING_FAMILIES,
          "drafters.decode.proposers.loading.FAMILY_PROPOSERS": FAMILY_PROPOSERS,
          "drafters.export.dispatch.EXPORTERS": {family for family, _ in EXPORTERS},
          "drafters.registry.FAMILIES": FAMILIES}


@pytest.mark.parametrize("name", sorted(TABLES))
def test_every_layer_knows_every_family(name):
    table = TABLES[name]
    assert set(table) == set(FAMILIES), f"{name}: missing {set(FAMILIES) - set(table)}, extra {set(table) - set(FAMILIES)}"


def test_the_readmes_adding_a_family_list_is_these_tables():
    # README "Adding a family": the list a contributor follows names exactly the tables checked above
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- family tables -->")[1].split("<!-- end family tables -->")[0]
    listed = set()
    for line in block.strip().splitlines():
        path, names = line.removeprefix("- `").split("` ", 1)
        module = path.removesuffix(".py").replace("/", ".")
        listed |= {f"{module}.{n}" for n in names.split(":")[0].replace("`", "").replace(" and ", " ").split()}
    assert listed == set(TABLES)


@pytest.mark.parametrize("family", sorted(TRAINING_FAMILIES))
def test_each_training_entry_is_complete(family):
    entry = TRAINING_FAMILIES[family]
    assert entry.name == family
    # its schema trains it and no other family: the `drafter` it accepts is exactly its name
    assert typing.get_args(typing.get_type_hints(entry.recipe)["drafter"]) == (family,)
    assert entry.loss_parts and callable(entry.build) and callable(entry.recipe.problems)
    if entry.offline:  # an offline family reads a layout and says how to feed and evaluate itself
        assert entry.store_layout in TRAINING_FAMILIES and entry.inputs and entry.evaluate and entry.describe


def family_checks(paths) -> list[str]:
    """Every comparison of something with a family name literal (`recipe.drafter == "eagle3"`) in `paths`."""
    def family(node) -> bool:
        return isinstance(node, ast.Constant) and node.value in FAMILIES

    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Compare):
                continue
            for op, left, right in zip(node.ops, [node.left, *node.comparators], node.comparators):
                equal = isinstance(op, (ast.Eq, ast.NotEq)) and (family(left) or family(right))
                listed = isinstance(op, (ast.In, ast.NotIn)) and isinstance(right, (ast.Tuple, ast.List, ast.Set)) \
                    and any(family(e) for e in right.elts)  # `x in ("eagle3", "dflash")`; a section name `in` is not
                if equal or listed:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_training_has_no_family_branches_outside_the_table():
    """The trainers ask their family's TrainingFamily entry, never `if recipe.drafter == ...`: a new family is an
    entry, not an edit of every place that branches."""
    paths = [*ROOT.joinpath("drafters", "training").glob("*.py"), *ROOT.joinpath("train").glob("*.py")]
    assert family_checks(paths) == [], "family checks outside drafters.training.families"
