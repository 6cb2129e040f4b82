"""Re-answer the user turns of a dataset with the target, so drafters learn the target's own replies.

    python train/regenerate.py recipes/regenerate_smollm2.yaml [key=value ...]

Keeps each conversation's system and user turns and generates every assistant turn with the
target, in order (the 2nd user turn is asked after the target's own 1st answer), batched with
left padding. Writes one JSON line per conversation, {"id", "source", "conversations": [{"role",
"content"}, ...]}, appended and flushed as soon as the conversation is done. Resumable: ids
already in the output are skipped on restart (rows without an "id" field are identified by file
name and row number), and a last line cut short by a crash is dropped.
Knows nothing about drafters or training.
"""

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from tqdm import tqdm

from drafters.dtypes import DtypeName
from drafters.training.data import DataError, RowError, load_conversations, render
from drafters.training.recipe import RecipeError, load_recipe, run_main
from drafters.targets import load_target


@dataclass
class Recipe:
    target: str  # short name, model directory, .gguf file or hub id (drafters.targets)
    data: str  # JSON / JSONL file, save_to_disk folder or dataset name (drafters.training.data)
    output: str  # JSONL, appended to: re-running resumes
    fmt: Literal["auto", "sharegpt", "openai", "prompt"] = "auto"  # see drafters.training.data
    split: str = "train"
    limit: int | None = None  # the first N input conversations (done or not)
    batch_size: int = 16
    max_new_tokens: int = 256
    max_prompt_length: int = 2048  # tokens; a longer prompt ends its conversation there
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    dtype: Literal["auto", DtypeName] = "float32"  # auto: bf16 only where native (drafters.dtypes)
    threads: int = 0  # torch CPU threads; 0 = torch's default


@dataclass
class Stats:
    written: int = 0
    tokens: int = 0  # generated, end-of-turn token included, padding not
    seconds: float = 0.0  # inside generate
    cut: int = 0  # answers that hit max_new_tokens
    resumed: int = 0  # input conversations already in the output
    skipped: Counter = field(default_factory=Counter)

    def tokens_per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def main(argv: list[str]) -> Stats:
    if not argv:
        raise SystemExit("usage: python train/regenerate.py RECIPE.yaml [key=value ...]")
    recipe = load_recipe(argv[0], argv[1:], schema=Recipe)
    check(recipe)
    if recipe.threads:
        torch.set_num_threads(recipe.threads)
    torch.manual_seed(recipe.seed)

    target = load_target(recipe.target, dtype=recipe.dtype)
    if target.tokenizer.chat_template is None:
        raise DataError(f"target {target.name} has no chat template: regeneration answers chat "
                        "turns, so use an instruct target (base models train on fmt=text data)")
    conversations, report = load_conversations(recipe.data, split=recipe.split, fmt=recipe.fmt,
                                               limit=recipe.limit, require_assistant=False)
    print(report.summary())
    output = Path(recipe.output)
    done = read_done_ids(output)
    todo, stats = select_todo(conversations, done)
    eos_ids = sorted(target.eos_token_ids)

    output.parent.mkdir(parents=True, exist_ok=True)
    with open(output, "a", encoding="utf-8") as out, tqdm(total=len(todo), unit="conv") as bar:
        for start in range(0, len(todo), recipe.batch_size):
            batch = todo[start : start + recipe.batch_size]
            for row in regenerate_batch(target, batch, recipe, eos_ids, stats):
                out.write(json.dumps(row, ensure_ascii=False) + "\n")  # one write per row
                out.flush()
                stats.written += 1
            bar.update(len(batch))
            bar.set_postfix_str(f"{stats.tokens_per_second():.1f} generated tok/s")

    skipped = ", ".join(f"{n} {reason}" for reason, n in stats.skipped.items()) or "none"
    print(f"regenerate: wrote {stats.written} rows to {output} ({stats.resumed} were already there); "
          f"skipped: {skipped}; {stats.cut} answers cut at max_new_tokens={recipe.max_new_tokens}; "
          f"{stats.tokens} tokens in {stats.seconds:.1f} s = {stats.tokens_per_second():.1f} tok/s")
    return stats


def check(recipe: Recipe) -> None:
    problems = [f"{name}={getattr(recipe, name)} must be >= 1"
                for name in ("batch_size", "max_new_tokens", "max_prompt_length")
                if getattr(recipe, name) < 1]
    if recipe.temperature < 0:
        problems.append(f"temperature={recipe.temperature} must be >= 0 (0 = greedy)")
    if not 0 < recipe.top_p <= 1:
        problems.append(f"top_p={recipe.top_p} must be in (0, 1]")
    if problems:
        raise RecipeError("; ".join(problems))


def read_done_ids(path: Path) -> set[str]:
    """Ids of the rows already written; a last line cut short by a crash is removed from the file."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    complete = data.rfind(b"\n") + 1  # a row and its newline are one write: a row without one is cut
    if complete < len(data):
        print(f"{path}: dropping a truncated last line ({len(data) - complete} bytes) from a previous run")
        with open(path, "r+b") as f:
            f.truncate(complete)
    ids = set()
    for line_number, line in enumerate(data[:complete].decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            ids.add(str(json.loads(line)["id"]))
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise DataError(f"{path}:{line_number}: not a row written by regenerate ({err!r}); "
                            "fix or remove that line, or choose another output file") from err
    return ids


def select_todo(conversations, done: set[str]):
    stats, todo, seen = Stats(), [], set()
    for conversation in conversations:
        if conversation.id in done:
            stats.resumed += 1
            continue
        if conversation.id in seen:
            stats.skipped["duplicate id"] += 1
            continue
        seen.add(conversation.id)
        if not any(m["role"] == "user" for m in conversation.messages):
            stats.skipped["no user turn"] += 1
            continue
        todo.append(conversation)
    return todo, stats


def regenerate_batch(target, conversations, recipe: Recipe, eos_ids: list[int], stats: Stats):
    # Round k asks the k-th user turn of every conversation that has one, after its own answers.
    queues = [[m for m in c.messages if m["role"] != "assistant"] for c in conversations]
    histories = [[] for _ in conversations]
    while True:
        asking, prompts = [], []
        for i, queue in enumerate(queues):
            turns = next_user_turn(queue)
            if not turns:
                continue
            prompt = prompt_ids(target.tokenizer, histories[i] + turns, stats)  # None: counted
            if prompt is not None and len(prompt) > recipe.max_prompt_length:
                stats.skipped["prompt longer than max_prompt_length (conversation ends before it)"] += 1
                prompt = None
            if prompt is None:
                queue.clear()  # the conversation ends with its last answered turn, if any
                continue
            histories[i].extend(turns)
            asking.append(i)
            prompts.append(prompt)
        if not asking:
            break
        for i, answer in zip(asking, generate(target, prompts, recipe, eos_ids, stats)):
            histories[i].append({"role": "assistant", "content": answer})
    return [{"id": c.id, "source": c.tag or c.source, "conversations": history}
            for c, history in zip(conversations, histories) if history]


def next_user_turn(queue: list[dict]) -> list[dict]:
    # Pops any system turns plus the next user turn; [] once no user turn is left.
    for k, message in enumerate(queue):
        if message["role"] == "user":
            turns = queue[: k + 1]
            del queue[: k + 1]
            return turns
    queue.clear()
    return []


def prompt_ids(tokenizer, messages: list[dict], stats: Stats) -> list[int] | None:
    try:
        text = render(tokenizer, messages, add_generation_prompt=True)
    except RowError as err:
        stats.skipped[err.reason] += 1
        return None
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def generate(target, prompts: list[list[int]], recipe: Recipe, eos_ids: list[int], stats: Stats):
    tokenizer = target.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    T = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)  # (B, T) left-padded
    attention_mask = torch.zeros_like(input_ids)
    for b, prompt in enumerate(prompts):
        input_ids[b, T - len(prompt) :] = torch.tensor(prompt)
        attention_mask[b, T - len(prompt) :] = 1
    if recipe.temperature > 0:  # top_k=0: only temperature and top_p shape the distribution
        sampling = dict(do_sample=True, temperature=recipe.temperature, top_p=recipe.top_p, top_k=0)
    else:
        sampling = dict(do_sample=False)
    start = time.perf_counter()
    out = target.model.generate(
        input_ids=input_ids.to(target.device), attention_mask=attention_mask.to(target.device),
        max_new_tokens=recipe.max_new_tokens, eos_token_id=eos_ids, pad_token_id=pad_id, **sampling,
    )  # (B, T + new)
    stats.seconds += time.perf_counter() - start
    answers = []
    for new in out[:, T:].tolist():
        end = next((t for t, token in enumerate(new) if token in eos_ids), None)
        stats.tokens += len(new) if end is None else end + 1
        stats.cut += end is None
        answers.append(tokenizer.decode(new[:end], skip_special_tokens=True))
    return answers


if __name__ == "__main__":
    run_main(main)
