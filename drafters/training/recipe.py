"""YAML recipes with dotted `key=value` overrides, validated against a dataclass schema.

An entry script declares its recipe as a (possibly nested) dataclass; `load_dataclass` reads the YAML
file, applies command-line overrides, and builds the dataclass, failing on any unknown key (with
the list of valid keys and the closest match), any missing required key, and any value of the
wrong type. A training recipe is read by drafters.training.families.load_recipe instead, the one
`load_recipe` (its `drafter` picks the schema). This module knows nothing about targets, drafters or training.
"""

import dataclasses
import difflib
import logging
import math
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any, Sequence, TypeVar

import yaml

from drafters.allocator import keep_freed_memory
from drafters.errors import UserError

T = TypeVar("T")


class RecipeError(UserError):
    pass


def run_main(main) -> None:
    """An entry script's `if __name__ == "__main__":` - main(sys.argv[1:]), where a UserError (a wrong
    recipe, data file, target or checkpoint, and what to do about it) prints `error: <message>` and exits
    2 (drafters.errors: a run stopped by a signal prints `stopped: ...` and exits 130), without a traceback;
    Ctrl-C outside the training loop (which saves and stops on its own) exits 130 with a sentence. Large freed
    blocks stay in the process (drafters.allocator: no mmap / munmap per step; DRAFTERS_MALLOC=system opts out)."""
    keep_freed_memory()
    code = 0
    try:
        main(sys.argv[1:])
    except UserError as error:
        print(f"{error.label}: {error}", file=sys.stderr)
        code = error.exit_code
    except KeyboardInterrupt:  # before the loop's own handler is in place (start-up: loading the target, the data)
        print("\ninterrupted (Ctrl-C); what was saved before is intact: run the same command to start again (a "
              "training run with resume_from=latest continues from its last checkpoint)", file=sys.stderr)
        code = 130
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        exit_launched_process(code)
    if code:
        raise SystemExit(code) from None


def exit_launched_process(code: int) -> None:
    """Exit one process of a multi-process launch with `code`, skipping the interpreter's finalization. The
    distributed state outlives destroy_process_group: DTensor's sharding caches keep FSDP2's device mesh, and so
    the gloo backend and its threads, alive to the end; a backend thread that releases a tensor while the
    interpreter is being torn down cannot take the GIL and aborts the process ("terminate called without an
    active exception", exit -6) after a complete, saved run. Everything this project writes is closed by then
    (checkpoints, metrics, wandb's finish); what is left is to flush the standard streams and logging."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def load_dataclass(path: str | Path, overrides: Sequence[str] = (), *, schema: type[T]) -> T:
    for override in overrides:
        check_override_key(schema, override)
    return build_overridden(schema, read_recipe(path, overrides), path, overrides)


def build_overridden(schema: type[T], raw: dict, path, overrides: Sequence[str]) -> T:
    """build(), where a mistake in a key=value override is said to be the command line's, not the file's
    (check_override_key has checked the override keys)."""
    try:
        return build(schema, raw, where=str(path))
    except RecipeError as err:
        for override in overrides:
            prefix = f"{path}:" + override.partition("=")[0].strip().replace(".", ":")
            if str(err).startswith(prefix):  # the offending value came from this override
                raise RecipeError(f"override {override!r} (command line){str(err)[len(prefix):]}") from None
        raise


def check_override_key(schema: type, override: str) -> None:
    """An override's dotted key must name a field of the schema (a typo is the command line's, not the file's)."""
    key = override.partition("=")[0].strip()
    node = schema
    for depth, part in enumerate(key.split(".")):
        fields = {f.name: f for f in dataclasses.fields(node)} if dataclasses.is_dataclass(node) else None
        if fields is None:
            raise RecipeError(f"override {override!r} (command line): {'.'.join(key.split('.')[:depth])} is a value, "
                              "not a section")
        if part not in fields:
            close = difflib.get_close_matches(part, fields, n=1, cutoff=0.5)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise RecipeError(f"override {override!r} (command line): unknown key {part!r}{hint}; valid keys"
                              + (f" of {'.'.join(key.split('.')[:depth])}" if depth else "")
                              + f": {', '.join(sorted(fields))}")
        hint_type = typing.get_type_hints(node)[part]
        node = next((a for a in (hint_type, *typing.get_args(hint_type)) if dataclasses.is_dataclass(a)), hint_type)


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load that refuses a key given twice in one mapping (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise RecipeError(f"{self.name}: key {key!r} is given twice, on line {seen[key] + 1} and line "
                                  f"{key_node.start_mark.line + 1}; keep one (or override it as {key}=VALUE)")
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def read_recipe(path: str | Path, overrides: Sequence[str] = ()) -> dict:
    """The recipe file with the overrides applied, as plain YAML data (not yet checked against a schema)."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file {path} not found")
    try:
        with path.open() as file:  # the loader's name is the path its messages give
            raw = yaml.load(file, Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as err:
        raise RecipeError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: a recipe must be a mapping of keys to values, got {type(raw).__name__}")
    for override in overrides:
        apply_override(raw, override)
    return raw


def apply_override(raw: dict, override: str) -> None:
    # "train.lr=3e-4" -> raw["train"]["lr"] = 3e-4; the value is parsed as YAML ("[2, 4]", "null").
    key, sep, value = override.partition("=")
    if not sep or not key:
        raise RecipeError(f"override {override!r} must look like key=value (dotted keys for sections: train.lr=1e-4)")
    *sections, leaf = key.strip().split(".")
    node = raw
    for section in sections:
        node = node.setdefault(section, {})
        if not isinstance(node, dict):
            raise RecipeError(f"override {override!r}: {section!r} is a value, not a section")
    try:
        node[leaf] = yaml.safe_load(value)
    except yaml.YAMLError as err:
        raise RecipeError(f"override {override!r}: value is not valid YAML: {err}") from None


def build(schema: type[T], raw: dict, where: str) -> T:
    fields = {f.name: f for f in dataclasses.fields(schema)}
    hints = typing.get_type_hints(schema)
    unknown = [key for key in raw if key not in fields]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(str(key), fields, n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise RecipeError(
            f"{where}: unknown key {key!r}{hint}; valid keys: {', '.join(sorted(fields))}"
        )
    values = {}
    for name, field in fields.items():
        key = f"{where}:{name}"
        if name in raw:
            values[name] = coerce(hints[name], raw[name], key)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            if dataclasses.is_dataclass(hints[name]):
                values[name] = build(hints[name], {}, key)
            else:
                raise RecipeError(f"{where}: required key {name!r} is missing")
    return schema(**values)


YAML_BOOL_WORDS = {True: ("yes", "on", "true", "y"), False: ("no", "off", "false", "n")}


def coerce(annotation: Any, value: Any, key: str) -> Any:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            raise RecipeError(f"{key}: expected a section (mapping), got {value!r}")
        return build(annotation, value, key)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return coerce(option, value, key)
            except RecipeError as err:
                errors.append(str(err))
        if len(errors) == 1:  # one option besides None (float | None): its own reason says more
            raise RecipeError(errors[0])
        raise RecipeError(f"{key}: {value!r} fits none of {annotation}")
    if origin is typing.Literal:
        if isinstance(value, bool):  # YAML 1.1 reads unquoted no / off / yes / on as booleans
            words = [a for a in args if isinstance(a, str) and a.lower() in YAML_BOOL_WORDS[value]]
            if len(words) == 1:  # mixed_precision: no -> "no"
                return words[0]
        if value not in args:
            raise RecipeError(f"{key}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise RecipeError(f"{key}: expected a list, got {value!r}")
        item = args[0] if args else Any
        return origin(coerce(item, v, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise RecipeError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if annotation is Any:
        return value
    if annotation is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return finite(float(value), key)
    if annotation is float and isinstance(value, str):
        try:  # YAML 1.1 reads "3e-4" as a string; accept it as the float the user meant
            number = float(value)
        except ValueError:
            number = None
        if number is not None:
            return finite(number, key)
    if annotation is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, annotation) or (annotation is int and isinstance(value, bool)):
        raise RecipeError(f"{key}: expected {annotation.__name__}, got {value!r} ({type(value).__name__})")
    return value


def finite(value: float, key: str) -> float:
    # YAML reads .nan / .inf (and float() "nan", "inf") as floats: no recipe number means that
    if not math.isfinite(value):
        raise RecipeError(f"{key}: {value!r} is not a finite number; give a number such as 1e-4")
    return value


def to_dict(recipe: Any) -> dict:
    """The recipe as plain data (for checkpoints, metrics files and resume checks)."""
    return dataclasses.asdict(recipe)
