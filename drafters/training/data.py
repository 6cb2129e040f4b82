"""Dataset rows -> conversations -> token ids with an assistant-only loss mask, and batching.

Knows nothing about targets, drafters or training: it needs a tokenizer and its chat template,
nothing else. It never hard-codes a template's separators: the assistant span of each turn is
found by rendering the conversation prefix with and without the generation prompt, and tokens
are selected by their character offsets in the full rendering.

Rows come from a local JSON (a list of rows) / JSONL file, a folder written by `datasets`
`save_to_disk`, or a Hugging Face dataset name (`datasets.load_dataset(name, split=...)`).
Row formats (`fmt="auto"` detects per row):

    sharegpt  {"conversations": [{"from": "system" | "human" | "gpt", "value": str}, ...]}
    openai    {"messages" | "conversations": [{"role": "system" | "user" | "assistant",
                                              "content": str}, ...]}
    text      {"text": str}        plain text for base models: loss on every token
    prompt    {"prompt": str}      a single user turn (for train/regenerate.py; no assistant turn)

Assistant turns may carry reasoning (`reasoning_content`, or a leading <think> block): it is trained as the model
emits it, or dropped with data.reasoning=answer_only (with_reasoning). A template that rewrites earlier turns
(thinking models drop their think blocks) is trained one assistant turn per example, each in the context the model
saw when it wrote it (conversation_tokens).

Bad rows are skipped and counted in a `SkipReport` (reason, file:row, field); problems with the
whole input (missing file, no chat template, nothing left) raise `DataError` saying what to do.
"""

import json
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator

import jinja2
import torch

from drafters.errors import UserError
from drafters.training import contamination

FORMATS = ("auto", "sharegpt", "openai", "text", "prompt")
ROLES = {
    "sharegpt": {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                 "assistant": "assistant", "chatgpt": "assistant"},
    "openai": {"system": "system", "user": "user", "assistant": "assistant", "tool": "tool"},
}
TURN_KEYS = {"sharegpt": ("from", "value"), "openai": ("role", "content")}
LOCAL_SUFFIXES = (".json", ".jsonl")
GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


class DataError(UserError):
    """The whole input is unusable; the message says what to do."""


class RowError(ValueError):
    """One row is unusable: it is skipped and counted under `reason`."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class NotPrefixStable(RowError):
    """The chat template renders an assistant turn differently once later turns follow it (it rewrites history)."""

    def __init__(self, detail: str):
        super().__init__("chat template cannot place an assistant turn", detail)


@dataclass
class Conversation:
    messages: list[dict[str, str]]  # [{"role": "system" | "user" | "assistant", "content": str}]
    text: str | None                # plain-text rows only (then messages is empty)
    source: str                     # file or dataset name
    row: int                        # 1-based: line number (JSONL) or row index (JSON list, dataset)
    id: str                         # the row's "id" field, else "<file name>:<row>"
    tag: str | None = None          # the row's own "source" field (e.g. "gsm8k-train"), if any


@dataclass
class Example:
    input_ids: list[int]
    loss_mask: list[int]  # loss_mask[t] = 1 iff token t is a target the drafter learns to predict
    row: int
    source: str
    # 0: the whole conversation; i > 0: assistant turn i (its index in the messages) alone, in the context the model
    # saw when it wrote it, for templates that rewrite earlier turns (conversation_tokens)
    turn: int = 0

    @property
    def key(self) -> tuple[int, int]:  # unique per example of one data file
        return self.row, self.turn


@dataclass
class Tokens:
    input_ids: list[int]
    loss_mask: list[int]
    num_truncated: int = 0  # tokens cut off the end to fit max_length


@dataclass
class SkipReport:
    source: str
    rows_read: int = 0
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)            # reason -> rows
    examples: dict[str, list[str]] = field(default_factory=dict)  # reason -> ["file:row: detail"]
    truncated: int = 0                                            # rows kept but cut to max_length
    max_examples: int = 3
    contamination: str | None = None                              # drafters.training.contamination's line
    reasoning_turns: int = 0                                      # assistant turns that carry reasoning
    reasoning: str = "train"                                      # what was done with it (Data.reasoning)
    per_turn_rows: int = 0                                        # rows trained one assistant turn per example

    def skip(self, reason: str, where: str, detail: str) -> None:
        self.skipped[reason] += 1
        shown = self.examples.setdefault(reason, [])
        if len(shown) < self.max_examples:
            shown.append(f"{where}: {detail}")

    def summary(self) -> str:
        lines = [f"{self.source}: read {self.rows_read} rows, kept {self.kept}, "
                 f"skipped {sum(self.skipped.values())}, truncated {self.truncated}"]
        for reason, count in self.skipped.most_common():
            lines.append(f"  skipped {count} x {reason}, e.g.")
            lines.extend(f"    {example}" for example in self.examples[reason])
        if self.reasoning_turns:
            done = ("trained as the model emits it (a think block before the answer)" if self.reasoning == "train"
                    else "dropped: the answer alone is trained (data.reasoning=answer_only)")
            lines.append(f"  {self.reasoning_turns} assistant turns carry reasoning: {done}")
        if self.per_turn_rows:
            lines.append(f"  {self.per_turn_rows} rows trained one assistant turn per example: the chat template "
                         "rewrites earlier turns, so each turn is trained in the context the model saw when it wrote it")
        if self.contamination:
            lines.append(f"  warning: {self.source} {self.contamination}")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Reading rows


def load_conversations(path_or_name: str, *, split: str = "train", fmt: str = "auto",
                       limit: int | None = None, require_assistant: bool = True
                       ) -> tuple[list[Conversation], SkipReport]:
    """Parse rows into conversations; stop after `limit` kept ones.

    require_assistant=False keeps prompt-only conversations (for regeneration).
    """
    if fmt not in FORMATS:
        raise DataError(f"unknown data format fmt={fmt!r}; choose one of {', '.join(FORMATS)}")
    source = str(path_or_name)
    report = SkipReport(source)
    conversations = []
    for row_number, row in _read_rows(source, split):
        if limit is not None and len(conversations) >= limit:
            break
        report.rows_read += 1
        try:
            conversation = parse_row(row, fmt, source=source, row=row_number)
            if require_assistant and conversation.text is None:
                _check_has_assistant(conversation.messages)
        except RowError as err:
            report.skip(err.reason, f"{source}:{row_number}", err.detail)
            continue
        conversations.append(conversation)
    report.kept = len(conversations)
    if not conversations:
        raise DataError(f"no usable rows left (fmt={fmt}):\n{report.summary()}")
    report.contamination = contamination.describe(contamination.find(
        (c.id, [m["content"] for m in c.messages if m["role"] == "user" and isinstance(m["content"], str)])
        for c in conversations))
    return conversations, report


def _read_rows(source: str, split: str) -> Iterator[tuple[int, Any]]:
    if os.path.isfile(source):
        yield from _file_rows(source)
    elif os.path.isdir(source):
        yield from enumerate(_load_from_disk(source, split), 1)
    elif source.endswith(LOCAL_SUFFIXES) or source.startswith((".", "/", "~")):
        raise DataError(f"data file not found: {source} (working directory {os.getcwd()}); "
                        "check the path, or give a Hugging Face dataset name instead")
    else:
        yield from enumerate(_load_hub_dataset(source, split), 1)


def _file_rows(path: str) -> Iterator[tuple[int, Any]]:
    if not path.endswith(LOCAL_SUFFIXES):
        raise DataError(f"{path}: unsupported file type; give a .json (list of rows) or .jsonl "
                        "file, a `datasets` save_to_disk folder, or a Hugging Face dataset name")
    # surrogateescape: a byte that is not UTF-8 becomes one stand-in character, so only its row is
    # skipped (below) instead of the whole read failing
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        head = f.read(4096).lstrip()
        f.seek(0)
        if head.startswith("["):  # one JSON list of rows; anything else is read as JSON lines
            try:
                rows = json.load(f)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}: not valid JSON ({err}); fix the file, or write one "
                                "JSON object per line (.jsonl) so bad rows can be skipped") from err
            for number, row in enumerate(rows, 1):
                yield number, _not_utf8(json.dumps(row, ensure_ascii=False)) or row
            return
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield line_number, _not_utf8(line) or json.loads(line)
            except json.JSONDecodeError as err:
                detail = f"{err.msg} at column {err.colno}"
                yield line_number, RowError("malformed JSON line", detail)


NOT_UTF8 = re.compile("[\udc80-\udcff]")  # surrogateescape's stand-ins for undecodable bytes


def _not_utf8(text: str) -> RowError | None:
    found = NOT_UTF8.search(text)
    if found is None:
        return None
    return RowError("not UTF-8", f"byte 0x{ord(found[0]) - 0xdc00:02x} at character {found.start() + 1}; "
                    "re-encode the file as UTF-8")


def _load_from_disk(path: str, split: str):
    import datasets

    try:
        dataset = datasets.load_from_disk(path)
    except (OSError, ValueError, KeyError) as err:  # not written by save_to_disk, or damaged since
        raise DataError(f"{path} is a folder but not a readable `datasets` save_to_disk folder "
                        f"({type(err).__name__}: {err}); "
                        "data.path takes a .json (list of rows) or .jsonl file, a save_to_disk folder "
                        "(state.json / dataset_dict.json inside) or a Hugging Face dataset name") from None
    if isinstance(dataset, datasets.DatasetDict):
        if split not in dataset:
            raise DataError(f"{path} has splits {sorted(dataset)}, not {split!r}; set split=...")
        dataset = dataset[split]
    return dataset


def _load_hub_dataset(name: str, split: str):
    import datasets

    try:
        return datasets.load_dataset(name, split=split)
    except datasets.exceptions.DatasetNotFoundError as err:
        raise DataError(f"{name!r} is neither a local file or folder nor a loadable Hugging Face "
                        f"dataset ({err}); check the path or the dataset name") from err


# ---------------------------------------------------------------------------------------------
# Parsing one row


def parse_row(data: Any, fmt: str, *, source: str, row: int) -> Conversation:
    """Raises RowError naming the field when the row is unusable."""
    if isinstance(data, RowError):  # a malformed JSON line, found while reading
        raise data
    if not isinstance(data, dict):
        raise RowError("row is not a JSON object", f"got {type(data).__name__}")
    fmt = detect_format(data) if fmt == "auto" else fmt
    row_id = str(data["id"]) if data.get("id") is not None else f"{os.path.basename(source)}:{row}"
    tag = data.get("source") if isinstance(data.get("source"), str) else None
    text, messages = None, []
    if fmt == "text":
        text = _string_field(data, "text")
    elif fmt == "prompt":
        messages = [{"role": "user", "content": _string_field(data, "prompt")}]
    else:
        messages = _parse_turns(data, fmt)
    return Conversation(messages, text, source, row, row_id, tag)


def detect_format(row: dict) -> str:
    for key in ("conversations", "messages"):
        turns = row.get(key)
        if isinstance(turns, list) and turns and isinstance(turns[0], dict):
            return "sharegpt" if "from" in turns[0] else "openai"
    for key in ("text", "prompt"):
        if key in row:
            return key
    raise RowError("unrecognised row format", f"keys {sorted(row)}; expected 'conversations', "
                   "'messages', 'text' or 'prompt' (or set fmt=...)")


def _parse_turns(row: dict, fmt: str) -> list[dict[str, str]]:
    key = "messages" if fmt == "openai" and "messages" in row else "conversations"
    turns = row.get(key)
    if not isinstance(turns, list) or not turns:
        raise RowError("missing turns",
                       f"field '{key}' is missing, empty or not a list (fmt={fmt})")
    role_key, content_key = TURN_KEYS[fmt]
    roles = ROLES[fmt]
    messages = []
    for i, turn in enumerate(turns):
        where = f"{key}[{i}]"
        if not isinstance(turn, dict):
            raise RowError("turn is not a JSON object", f"{where} is {type(turn).__name__}")
        role = turn.get(role_key)
        if role not in roles:
            raise RowError("unknown role", f"{where}.{role_key} = {role!r}; expected one of "
                           f"{', '.join(roles)} (fmt={fmt})")
        tool_calls = turn.get("tool_calls") if roles[role] == "assistant" else None
        if (content_key not in turn or turn[content_key] is None) and not tool_calls:
            raise RowError("missing content", f"{where}.{content_key} is missing")
        content = _text_content(turn.get(content_key) or "", f"{where}.{content_key}")
        message = {"role": roles[role], "content": content}
        if tool_calls:
            message["tool_calls"] = _tool_calls(tool_calls, f"{where}.tool_calls")
        if roles[role] == "tool":  # a tool's result: rendered by the template's tool support, never trained
            message.update({k: turn[k] for k in ("tool_call_id", "name") if isinstance(turn.get(k), str)})
        reasoning = turn.get("reasoning_content", turn.get("reasoning"))  # OpenAI-compatible servers' names
        if reasoning is not None and roles[role] == "assistant":
            if not isinstance(reasoning, str):
                raise RowError("non-string reasoning", f"{where}.reasoning_content is {type(reasoning).__name__}, "
                               "not a string")
            message["reasoning_content"] = reasoning
        messages.append(message)
    return messages


def _text_content(content, where: str) -> str:
    # a string, or OpenAI content parts: text parts joined in order; any other part (an image) is not trainable text
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RowError("non-string content", f"{where} is {type(content).__name__}, not a string or content parts")
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RowError("non-text content part", f"{where}[{j}] is {kind!r}; drafters train on text parts "
                           "({'type': 'text', 'text': ...}) only")
    return "".join(part["text"] for part in content)


def _tool_calls(calls, where: str) -> list[dict]:
    # OpenAI tool calls: [{"type": "function", "function": {"name": str, "arguments": str or object}}, ...]
    if not isinstance(calls, list):
        raise RowError("bad tool calls", f"{where} is {type(calls).__name__}, not a list")
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)):
            raise RowError("bad tool calls", f"{where}[{j}] has no function.name (OpenAI format: "
                           "{'type': 'function', 'function': {'name': ..., 'arguments': ...}})")
    return calls


def _check_tool_support(tokenizer, messages: list[dict]) -> None:
    # a template without tool-call support would render tool calls as nothing (or fail): a counted skip instead
    uses_tools = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if uses_tools and "tool_calls" not in (tokenizer.chat_template or ""):
        raise RowError("tool calls but the chat template renders none",
                       f"the chat template of {tokenizer.name_or_path!r} has no tool-call support (no tool_calls in "
                       "it), so these turns cannot be rendered as the model sees them")


def _string_field(row: dict, key: str) -> str:
    if key not in row or row[key] is None:
        raise RowError("missing content", f"field '{key}' is missing")
    if not isinstance(row[key], str):
        raise RowError("non-string content",
                       f"field '{key}' is {type(row[key]).__name__}, not a string")
    return row[key]


def _check_has_assistant(messages: list[dict[str, str]]) -> None:
    if not any(m["role"] == "assistant" for m in messages):
        roles = ", ".join(m["role"] for m in messages)
        raise RowError("no assistant turn", f"roles are [{roles}]; training needs an answer to "
                       "learn from (regenerate answers with train/regenerate.py)")


# ---------------------------------------------------------------------------------------------
# Tokenising: assistant-only loss mask from the chat template's character offsets


REASONING = ("train", "answer_only")
THINK_BLOCK = re.compile(r"^\s*<think>.*?</think>\s*", re.S)  # a reasoning block written into the content


def think_text(block: re.Match) -> str:
    # a THINK_BLOCK match -> the reasoning inside it, without its tags
    return block.group(0).strip().removeprefix("<think>").removesuffix("</think>")


def with_reasoning(tokenizer, messages: list[dict], mode: str = "train") -> tuple[list[dict], int]:
    """-> (the messages as the template renders them, assistant turns that carry reasoning).

    An assistant turn's reasoning (its `reasoning_content`, or a leading <think>...</think> block in its content) is
    trained as the model emits it (mode "train"): a template that renders `reasoning_content` (Qwen3, DeepSeek-R1
    style) gets it in that field; any other template gets it in the content as a think block before the answer,
    where such models write it. Mode "answer_only" drops it, and the answer alone is trained."""
    renders_field = "reasoning_content" in (tokenizer.chat_template or "")
    out, carried = [], 0
    for message in messages:
        block = THINK_BLOCK.match(message["content"]) if message["role"] == "assistant" else None
        reasoning = message.get("reasoning_content")
        if reasoning is None and block is None:
            out.append(message)
            continue
        carried += 1
        answer = message["content"][block.end():] if block else message["content"]
        if reasoning is None:  # the block's text, without its tags
            reasoning = think_text(block)
        rest = {k: v for k, v in message.items() if k not in ("content", "reasoning_content")}  # tool calls
        if mode == "answer_only":
            out.append({**rest, "content": answer})
        elif renders_field:
            out.append({**rest, "content": answer, "reasoning_content": reasoning.strip("\n")})
        elif message.get("reasoning_content") is None:  # the content is the model's text, its think block included
            out.append({**rest, "content": message["content"]})
        else:
            out.append({**rest, "content": f"<think>\n{reasoning.strip()}\n</think>\n\n{answer}"})
    return out, carried


def conversation_tokens(tokenizer, messages: list[dict], *, max_length: int | None = None,
                        template_kwargs: dict | None = None) -> list[tuple[int, Tokens]]:
    """-> [(turn, Tokens)]: [(0, the whole conversation)] where the template renders every assistant turn the same
    with and without the turns after it (tokenize_conversation). Otherwise each assistant turn i is its own example,
    trained in the context the serving engine renders for it, with only turn i trained:
    - a template that rewrites earlier turns (Qwen3 drops their think blocks) shows the model, when it writes turn i,
      a history unlike the final rendering: messages[:i+1] rendered as the engine renders it for that turn;
    - a template whose generation prompt writes text its rendered answers lack (DeepSeek-R1's `<think>\n`, the empty
      think block or thought channel of a non-thinking mode): the generation prompt, then what the model writes
      after it (forced_turn_tokens).
    A turn neither can place raises NotPrefixStable: the row is skipped and counted. `template_kwargs` go to the
    template as the engine's chat_template_kwargs do (e.g. {"enable_thinking": true})."""
    try:
        return [(0, tokenize_conversation(tokenizer, messages, max_length=max_length,
                                          template_kwargs=template_kwargs))]
    except NotPrefixStable:
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        return [(i, _turn_tokens(tokenizer, messages[:i + 1], max_length, template_kwargs)) for i in turns]


def _turn_tokens(tokenizer, messages, max_length, template_kwargs) -> Tokens:
    try:
        return tokenize_conversation(tokenizer, messages, max_length=max_length, last_only=True,
                                     template_kwargs=template_kwargs)
    except NotPrefixStable as unplaced:
        return forced_turn_tokens(tokenizer, messages, max_length=max_length, template_kwargs=template_kwargs,
                                  unplaced=unplaced)


def forced_turn_tokens(tokenizer, messages: list[dict], *, max_length: int | None = None,
                       template_kwargs: dict | None = None, unplaced: NotPrefixStable | None = None) -> Tokens:
    """The last assistant turn of `messages` for a template whose generation prompt P ends in text (F) that its
    rendering of the answer lacks: history + P, then what the model writes after P, trained up to the end of turn.
    The rendered answer A is the turn's rendering after the part it shares with P (the role header). If F opens a
    think block (DeepSeek-R1: `<think>\n`), the model writes its reasoning and closes the block first:
    `{reasoning}\n</think>\n\n` + A. Otherwise F closed or skipped the thinking (a non-thinking mode), the model
    writes A; a turn that carries reasoning then cannot be trained as written: RowError saying what to set."""
    *history, last = messages
    block = THINK_BLOCK.match(last["content"])
    reasoning = last.get("reasoning_content")
    if reasoning is None and block is not None:
        reasoning = think_text(block)
    answer = last["content"][block.end():] if block else last["content"]
    prompt = render(tokenizer, history, add_generation_prompt=True, template_kwargs=template_kwargs)
    answered = [*history, {**{k: v for k, v in last.items() if k not in ("content", "reasoning_content")},
                           "content": answer}]
    header = os.path.commonprefix([prompt, render(tokenizer, answered, template_kwargs=template_kwargs)])
    turn = _kept_turn(tokenizer, answered, template_kwargs, len(header))
    forced, written = prompt[len(header):], turn[len(header):]
    leads_to_answer = answer.strip() and written.lstrip().startswith(answer.strip()[:20])
    reasoned = bool(reasoning and reasoning.strip())
    if not forced and leads_to_answer and reasoned:
        # the generation prompt already holds the closed, empty think block (Qwen3 with enable_thinking false): the
        # answer has its place, the reasoning has none
        raise _skips_reasoning(prompt[prompt.rfind("<think>"):] if "<think>" in prompt else prompt[-30:])
    if not forced or not leads_to_answer:
        raise unplaced or NotPrefixStable(f"the chat template of {tokenizer.name_or_path!r} renders the answer "
                                          "somewhere its generation prompt does not lead to")
    if forced.count("<think>") > forced.count("</think>"):  # the prompt opened a think block: reasoning, then close
        written = f"{(reasoning or '').strip()}\n</think>\n\n{written.lstrip()}"
    elif reasoned:
        raise _skips_reasoning(forced)
    text = prompt + written
    end = _end_of_turn(text, len(prompt), end_of_turn_tokens(tokenizer))
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    loss_mask = [int(start < end and stop > len(prompt)) for start, stop in encoding["offset_mapping"]]
    return _truncate(encoding["input_ids"], loss_mask, max_length)


def _skips_reasoning(prompt_end: str) -> RowError:
    return RowError("chat template's generation prompt skips the reasoning",
                    f"its generation prompt ends in {prompt_end!r}, so the model answers without thinking and this "
                    "turn's reasoning cannot be trained as it was written; set the template's thinking switch "
                    "(data.chat_template_kwargs, e.g. {enable_thinking: true}), or data.reasoning=answer_only")


def tokenize_conversation(tokenizer, messages: list[dict[str, str]], *, max_length: int | None = None,
                          last_only: bool = False, template_kwargs: dict | None = None) -> Tokens:
    """Token ids of the rendered conversation; the mask covers each assistant turn's content and
    its end-of-turn token (only the last assistant turn's with last_only), nothing of the prompt, the role headers or
    the default system prompt.
    """
    if tokenizer.chat_template is None:
        raise DataError(f"tokenizer {tokenizer.name_or_path!r} has no chat template, so chat "
                        "conversations cannot be rendered: use a plain-text dataset ({'text': ...} "
                        "rows, fmt=text), or give the target a chat template (python train/chat_target.py TARGET DIR) "
                        "and name DIR as the target")
    _check_has_assistant(messages)
    _check_tool_support(tokenizer, messages)
    if messages[0]["role"] == "assistant":
        raise RowError("conversation starts with an assistant turn",
                       "no prompt precedes the first assistant turn")
    try:
        full, spans = assistant_spans(tokenizer, messages, last_only=last_only, template_kwargs=template_kwargs)
    except NotPrefixStable:
        if last_only or not GENERATION_TAG.search(tokenizer.chat_template):
            raise
        # not prefix-stable, but the template marks {% generation %} blocks: its own assistant mask
        return _truncate(*_generation_mask(tokenizer, messages, template_kwargs), max_length)
    encoding = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    loss_mask = [int(any(start < end_ and end > start_ for start_, end_ in spans))
                 for start, end in encoding["offset_mapping"]]
    return _truncate(encoding["input_ids"], loss_mask, max_length)


def tokenize_text(tokenizer, text: str, *, max_length: int | None = None) -> Tokens:
    input_ids = tokenizer(text)["input_ids"]  # with the tokenizer's own bos, as in pretraining
    return _truncate(input_ids, [1] * len(input_ids), max_length)


def assistant_spans(tokenizer, messages, last_only: bool = False, template_kwargs: dict | None = None
                    ) -> tuple[str, list[tuple[int, int]]]:
    """The full rendering and the [start, end) character span of every assistant turn (the last one only with
    last_only).

    Turn i spans from the end of the rendering of messages[:i] with the generation prompt (P) to the end-of-turn
    token inside the rendering of messages[:i+1] (S), cut where the conversation would go on (_kept_turn: text a
    template appends after the last message only, such as Phi-3's eos after <|end|>, is never generated): the
    template's trailing newline is not trained, the end-of-turn token is. Raises NotPrefixStable when P is not a
    prefix of S, or S not a prefix of the full rendering.
    """
    full = render(tokenizer, messages, template_kwargs=template_kwargs)
    end_tokens = end_of_turn_tokens(tokenizer)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or (last_only and i != len(messages) - 1):
            continue
        prompt = render(tokenizer, messages[:i], add_generation_prompt=True, template_kwargs=template_kwargs)
        turn = _kept_turn(tokenizer, messages[: i + 1], template_kwargs, len(prompt))
        if not (turn.startswith(prompt) and full.startswith(turn)):
            raise NotPrefixStable(_prefix_problem(tokenizer, i, prompt, turn, full))
        end = _end_of_turn(turn, len(prompt), end_tokens)
        reasoning = _reasoning_of(message)
        if reasoning and reasoning not in turn[len(prompt):end]:
            raise RowError("chat template drops the reasoning",
                           f"assistant turn {i} carries reasoning that the chat template of "
                           f"{tokenizer.name_or_path!r} does not render in that turn, so it cannot be trained as the "
                           "model wrote it; set data.reasoning=answer_only to train the answers alone")
        spans.append((len(prompt), end))
    return full, spans


def _reasoning_of(message: dict) -> str | None:
    # the reasoning an assistant turn carries (with_reasoning's output: the field, or a leading think block)
    if message.get("reasoning_content"):
        return message["reasoning_content"].strip() or None
    block = THINK_BLOCK.match(message.get("content") or "") if message["role"] == "assistant" else None
    return (think_text(block).strip() or None) if block else None


def _kept_turn(tokenizer, messages, template_kwargs, start: int) -> str:
    # The rendering of messages (ending in an assistant turn whose text starts at `start`) as far as it stays when a
    # user turn follows, if the turn's end-of-turn token is in that part: what the template writes only after the
    # conversation's last message is not part of the turn.
    turn = render(tokenizer, messages, template_kwargs=template_kwargs)
    try:
        going_on = render(tokenizer, [*messages, {"role": "user", "content": "..."}], template_kwargs=template_kwargs)
    except RowError:
        return turn
    kept = os.path.commonprefix([turn, going_on])
    return kept if any(token in kept[start:] for token in end_of_turn_tokens(tokenizer)) else turn


def render(tokenizer, messages, add_generation_prompt: bool = False, template_kwargs: dict | None = None) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **(template_kwargs or {}))
    except jinja2.TemplateError as err:  # e.g. raise_exception("roles must alternate")
        raise RowError("chat template rejected the conversation", str(err)) from err
    except (TypeError, ValueError, KeyError, AttributeError) as err:  # the template's own code failed on this row
        raise RowError("chat template failed on the conversation", f"{type(err).__name__}: {err}") from err


def end_of_turn_tokens(tokenizer) -> list[str]:
    # eos plus every special added token (<|im_end|>, <|eot_id|>, <end_of_turn>, </s>, ...)
    specials = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
    return [tokenizer.eos_token, *specials] if tokenizer.eos_token else specials


def _end_of_turn(turn: str, start: int, end_tokens: list[str]) -> int:
    # End right after the last special token of the turn; without one, keep the whole turn.
    end = -1
    for token in end_tokens:
        found = turn.rfind(token, start)
        if found >= 0:
            end = max(end, found + len(token))
    return end if end >= 0 else len(turn)


def _prefix_problem(tokenizer, i: int, prompt: str, turn: str, full: str) -> str:
    if turn.startswith(prompt):
        other, what = full, "all messages"
    else:
        other, what = turn, f"messages[:{i + 1}]"
    common = len(os.path.commonprefix([prompt, other]))
    return (f"chat template of {tokenizer.name_or_path!r} is not prefix-stable: the rendering of "
            f"messages[:{i}] with add_generation_prompt=True is not a prefix of the rendering of "
            f"{what} (they differ at character {common}: {prompt[common:common + 40]!r} vs "
            f"{other[common:common + 40]!r}), so assistant turn {i} cannot be located. A template "
            "whose generation prompt differs from how it renders an answer needs {% generation %} "
            "blocks around assistant content; add them, or train on a plain-text dataset (fmt=text)")


def _generation_mask(tokenizer, messages, template_kwargs: dict | None = None) -> tuple[list[int], list[int]]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True, **(template_kwargs or {}))
    return list(out["input_ids"]), list(out["assistant_masks"])


def _truncate(input_ids: list[int], loss_mask: list[int], max_length: int | None) -> Tokens:
    if max_length is None or len(input_ids) <= max_length:
        return Tokens(list(input_ids), list(loss_mask))
    return Tokens(list(input_ids[:max_length]), list(loss_mask[:max_length]),
                  len(input_ids) - max_length)


# ---------------------------------------------------------------------------------------------
# Examples and batches


def build_examples(tokenizer, path_or_name: str, *, max_length: int, fmt: str = "auto",
                   split: str = "train", limit: int | None = None, reasoning: str = "train",
                   template_kwargs: dict | None = None) -> tuple[list[Example], SkipReport]:
    """Examples of every usable row (one per row, or one per assistant turn: conversation_tokens), and the report
    of what was read, skipped, truncated and done with reasoning (`reasoning`: with_reasoning's mode)."""
    if reasoning not in REASONING:
        raise DataError(f"data.reasoning={reasoning!r}: choose one of {', '.join(REASONING)}")
    conversations, report = load_conversations(path_or_name, split=split, fmt=fmt, limit=limit)
    report.reasoning = reasoning
    examples = []
    for conversation in conversations:
        where = f"{conversation.source}:{conversation.row}"
        try:
            if conversation.text is not None:
                turns = [(0, tokenize_text(tokenizer, conversation.text, max_length=max_length))]
            else:
                messages, carried = with_reasoning(tokenizer, conversation.messages, reasoning)
                turns = conversation_tokens(tokenizer, messages, max_length=max_length,
                                            template_kwargs=template_kwargs)
                report.reasoning_turns += carried
        except RowError as err:
            report.skip(err.reason, where, err.detail)
            continue
        kept = [(turn, tokens) for turn, tokens in turns if any(tokens.loss_mask)]
        if not kept:
            length = len(turns[0][1].input_ids) + turns[0][1].num_truncated
            report.skip("no trainable token within max_length", where,
                        f"{length} tokens, max_length={max_length}")
            continue
        report.truncated += any(tokens.num_truncated > 0 for _, tokens in kept)
        report.per_turn_rows += turns[0][0] != 0
        examples.extend(Example(tokens.input_ids, tokens.loss_mask, conversation.row, conversation.source, turn)
                        for turn, tokens in kept)
    report.kept = len({e.row for e in examples})
    if not examples:
        raise DataError(f"no usable examples left (max_length={max_length}):\n{report.summary()}")
    return examples, report


def choose_mask_token(rows, vocab_size: int, requested: int | None, key: str) -> int:
    """The mask token of the families that draft from masked slots (DFlash, DSpark, P-EAGLE): `requested` (the
    recipe's `key`), or the lowest id no training row contains, so the frozen embedding the drafter learns to read
    as "unknown" never stands for a real token of its data."""
    if requested is not None:
        if requested >= vocab_size:
            raise ValueError(f"{key}={requested} is not a token id of the target (vocab {vocab_size})")
        return requested
    seen = torch.zeros(vocab_size, dtype=torch.bool)
    for e in rows:
        seen[torch.as_tensor(e.input_ids, dtype=torch.long)] = True
    unseen = (~seen).nonzero()
    if not len(unseen):
        raise ValueError(f"{key}: every one of the target's {vocab_size} ids occurs in the training rows; set {key} "
                         "to a rare id explicitly")
    return int(unseen[0])


def repeat_mask(input_ids: list[int], loss_mask: list[int], n: int) -> list[int]:
    """loss_mask with the learnt tokens that repeat the example's own answers dropped: token t (loss_mask[t] = 1,
    t >= n-1) is dropped when the n tokens ending at it, ids[t-n+1 : t+1], already ended at an earlier learnt
    token s < t of the same example (any of its answers; a span copied from the prompt is kept). A small target
    loops in long answers (a third of the tokens it answers with past 128 continue an earlier span); these
    tokens teach the drafter to copy, which prompt lookup does without training."""
    seen, kept = set(), list(loss_mask)
    for t in range(n - 1, len(input_ids)):
        if not loss_mask[t]:
            continue
        span = tuple(input_ids[t - n + 1:t + 1])
        if span in seen:
            kept[t] = 0
        seen.add(span)
    return kept


def collate(examples: list[Example], pad_id: int, drop_repeats: int | None = None, multiple: int = 1,
            cap: int | None = None) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example: input_ids, attention_mask, loss_mask, each (B, T) long; drop_repeats=n
    drops repeated n-token spans from loss_mask (repeat_mask: training batches of data.drop_repeats). multiple=m
    pads T further, up to the next multiple of m but not past max(longest, cap) (data.pad_multiple, data.max_length):
    the longest example's length stays attention_mask.sum(1).max()."""
    longest = max(len(example.input_ids) for example in examples)
    length = max(longest, min(-(-longest // multiple) * multiple, cap if cap is not None else longest * multiple))
    batch = {name: torch.zeros(len(examples), length, dtype=torch.long)
             for name in ("input_ids", "attention_mask", "loss_mask")}
    batch["input_ids"].fill_(pad_id)
    for b, example in enumerate(examples):
        t = len(example.input_ids)
        batch["input_ids"][b, :t] = torch.tensor(example.input_ids)
        batch["attention_mask"][b, :t] = 1
        loss_mask = example.loss_mask if drop_repeats is None else \
            repeat_mask(example.input_ids, example.loss_mask, drop_repeats)
        batch["loss_mask"][b, :t] = torch.tensor(loss_mask)
    return batch
