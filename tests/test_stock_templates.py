"""The trained mask under the chat templates models ship, read from the stock template files llama.cpp keeps in its
source (`models/templates/*.jinja`, in the llama-cpp-python sdist the project builds llama.cpp from), each set on
the tiny tokenizer with that model's end-of-turn and role tokens added as special tokens. For a two-turn
conversation with reasoning and one without, the mask must be exactly what the model writes after its generation
prompt: the reasoning where the template lets the model think, the answer, and the end-of-turn token; never a role
header, a forced prompt, or text the template appends after the last message (Phi-3's eos). A template that
cannot render a turn's reasoning makes the row a counted skip that says what to set."""

import os

import pytest

from drafters.engines import llama_cpp
from drafters.tiny import build_tiny_tokenizer
from drafters.training.data import DataError, build_examples
from test_data import REASONED_CHAT, masked_runs, write_jsonl

TEMPLATES = llama_cpp.build_dir() / "src" / "models" / "templates"
if not TEMPLATES.is_dir() and not os.environ.get("DRAFTERS_REQUIRE_LLAMA_CPP"):
    pytest.skip("no llama.cpp source with its stock templates: bash .ci/llama-cpp", allow_module_level=True)

PLAIN_CHAT = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
              {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}]
R1 = ("<｜end▁of▁sentence｜>", ["<｜User｜>", "<｜Assistant｜>"])
SKIPS_REASONING = "(?s)skipped 1 x chat template's generation prompt skips the reasoning.*enable_thinking"


# template file: (eos, other special tokens, chat_template_kwargs, examples per row (reasoned, plain),
#                 hand-marked trained runs of the reasoned row (or the skip's words), of the plain row)
CASES = {
    # Qwen3: history drops think blocks, so one example per turn; an answer without reasoning gets the empty block
    "Qwen-Qwen3-0.6B": ("<|im_end|>", ["<|im_start|>"], None, (2, 2),
                        ["<think>\nGreet back.\n</think>\n\nHello!<|im_end|>",
                         "<think>\nAdd them.\n</think>\n\n4.<|im_end|>"],
                        ["<think>\n\n</think>\n\nHello!<|im_end|>", "<think>\n\n</think>\n\n4.<|im_end|>"]),
    # Qwen3 without thinking: the generation prompt holds the empty think block, so a reasoned turn is a counted skip
    # that says to switch thinking on (or drop the reasoning), and the answers are trained after the block
    "Qwen-Qwen3-0.6B+no-thinking": ("<|im_end|>", ["<|im_start|>"], {"enable_thinking": False}, (0, 2),
                                    SKIPS_REASONING, ["Hello!<|im_end|>", "4.<|im_end|>"]),
    # Qwen3.5: the generation prompt opens the think block; the model writes from inside it
    "Qwen3.5-4B": ("<|im_end|>", ["<|im_start|>"], None, (2, 2),
                   ["Greet back.\n</think>\n\nHello!<|im_end|>", "Add them.\n</think>\n\n4.<|im_end|>"],
                   ["\n</think>\n\nHello!<|im_end|>", "\n</think>\n\n4.<|im_end|>"]),
    # DeepSeek-R1: the generation prompt is `<｜Assistant｜><think>\n`, history keeps only answers
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": (*R1, None, (2, 2),
                                                 ["Greet back.\n</think>\n\nHello!<｜end▁of▁sentence｜>",
                                                  "Add them.\n</think>\n\n4.<｜end▁of▁sentence｜>"],
                                                 ["\n</think>\n\nHello!<｜end▁of▁sentence｜>",
                                                  "\n</think>\n\n4.<｜end▁of▁sentence｜>"]),
    # the same family with a thinking switch: off by default (the prompt closes the block), on by the kwargs
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": (*R1, None, (0, 2), SKIPS_REASONING,
                                                 ["Hello!<｜end▁of▁sentence｜>", "4.<｜end▁of▁sentence｜>"]),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B+thinking": (*R1, {"enable_thinking": True}, (2, 2),
                                                          ["Greet back.\n</think>\n\nHello!<｜end▁of▁sentence｜>",
                                                           "Add them.\n</think>\n\n4.<｜end▁of▁sentence｜>"],
                                                          ["\n</think>\n\nHello!<｜end▁of▁sentence｜>",
                                                           "\n</think>\n\n4.<｜end▁of▁sentence｜>"]),
    # Phi-3.5: the eos the template appends after the last message is never generated (the model stops at <|end|>)
    "microsoft-Phi-3.5-mini-instruct": ("<|endoftext|>", ["<|end|>", "<|user|>", "<|assistant|>", "<|system|>"], None,
                                        (1, 1), ["<think>\nGreet back.\n</think>\n\nHello!<|end|>",
                                                 "<think>\nAdd them.\n</think>\n\n4.<|end|>"],
                                        ["Hello!<|end|>", "4.<|end|>"]),
    "meta-llama-Llama-3.1-8B-Instruct": ("<|eot_id|>", ["<|start_header_id|>", "<|end_header_id|>"], None, (1, 1),
                                         ["<think>\nGreet back.\n</think>\n\nHello!<|eot_id|>",
                                          "<think>\nAdd them.\n</think>\n\n4.<|eot_id|>"],
                                         ["Hello!<|eot_id|>", "4.<|eot_id|>"]),
    "google-gemma-2-2b-it": ("<end_of_turn>", ["<start_of_turn>"], None, (1, 1),
                             ["<think>\nGreet back.\n</think>\n\nHello!<end_of_turn>",
                              "<think>\nAdd them.\n</think>\n\n4.<end_of_turn>"],
                             ["Hello!<end_of_turn>", "4.<end_of_turn>"]),
    # Gemma-4 without its thinking switch: the prompt writes an empty thought channel, the model answers after it
    "google-gemma-4-31B-it": ("<turn|>", ["<|turn>", "<|channel>", "<channel|>"], None, (0, 2),
                              SKIPS_REASONING, ["Hello!<turn|>", "4.<turn|>"]),
    # Kimi-K2-Thinking renders even the newest turn without its reasoning: a counted skip, never a silent drop
    "Kimi-K2-Thinking": ("<|im_end|>", ["<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"], None,
                         (0, 1), "(?s)skipped 1 x chat template drops the reasoning.*data.reasoning=answer_only",
                         ["<think></think>Hello!<|im_end|>", "<think></think>4.<|im_end|>"]),
    "mistralai-Mistral-Nemo-Instruct-2407": ("</s>", ["[INST]", "[/INST]"], None, (1, 1),
                                             ["<think>\nGreet back.\n</think>\n\nHello!</s>",
                                              "<think>\nAdd them.\n</think>\n\n4.</s>"],
                                             ["Hello!</s>", "4.</s>"]),
    "HuggingFaceTB-SmolLM3-3B": ("<|im_end|>", ["<|im_start|>"], None, (1, 1),
                                 ["<think>\nGreet back.\n</think>\n\nHello!<|im_end|>",
                                  "<think>\nAdd them.\n</think>\n\n4.<|im_end|>"],
                                 ["Hello!<|im_end|>", "4.<|im_end|>"]),
    "ibm-granite-granite-4.0": ("<|end_of_text|>", ["<|start_of_role|>", "<|end_of_role|>"], None, (1, 1),
                                ["<think>\nGreet back.\n</think>\n\nHello!<|end_of_text|>",
                                 "<think>\nAdd them.\n</think>\n\n4.<|end_of_text|>"],
                                ["Hello!<|end_of_text|>", "4.<|end_of_text|>"]),
}


def stock_tokenizer(name: str, eos: str, specials: list[str]):
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_special_tokens({"eos_token": eos, "additional_special_tokens": specials})
    tokenizer.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    return tokenizer


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_mask_is_exactly_what_the_model_writes(case, tmp_path):
    eos, specials, kwargs, counts, reasoned, plain = CASES[case]
    tokenizer = stock_tokenizer(case.split("+")[0], eos, specials)
    for chat, expected, count in ((REASONED_CHAT, reasoned, counts[0]), (PLAIN_CHAT, plain, counts[1])):
        path = write_jsonl(tmp_path / "row.jsonl", [{"messages": chat}])
        if isinstance(expected, str):  # a counted skip that says what to set, never a silent drop
            with pytest.raises(DataError, match=expected):
                build_examples(tokenizer, path, max_length=4096, template_kwargs=kwargs)
            continue
        examples, report = build_examples(tokenizer, path, max_length=4096, template_kwargs=kwargs)
        assert len(examples) == count and report.kept == 1
        assert [run for e in examples for run in masked_runs(tokenizer, e.input_ids, e.loss_mask)] == expected


TOOL_CHAT = [
    {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "name": "weather", "content": "18C, sunny"},
    {"role": "assistant", "content": "It is 18C and sunny."},
]


@pytest.mark.parametrize("case, expected", [
    # Qwen3 writes its call in a tool_call block (after the empty think block of a turn without reasoning); the
    # tool's result is rendered in the context, never trained
    ("Qwen-Qwen3-0.6B", ['<think>\n\n</think>\n\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n'
                         '</tool_call><|im_end|>', "<think>\n\n</think>\n\nIt is 18C and sunny.<|im_end|>"]),
    ("meta-llama-Llama-3.1-8B-Instruct", ['{"name": "weather", "parameters": "{\\"city\\": \\"Paris\\"}"}<|eot_id|>',
                                          "It is 18C and sunny.<|eot_id|>"]),
])
def test_tool_calls_and_content_parts_render_through_the_templates_tool_support(case, expected, tmp_path):
    eos, specials, *_ = CASES[case]
    tokenizer = stock_tokenizer(case, eos, specials)
    examples, report = build_examples(tokenizer, write_jsonl(tmp_path / "tools.jsonl", [{"messages": TOOL_CHAT}]),
                                      max_length=4096)
    assert [run for e in examples for run in masked_runs(tokenizer, e.input_ids, e.loss_mask)] == expected
    assert "Weather in Paris?" in tokenizer.decode(examples[-1].input_ids) and "18C, sunny" in tokenizer.decode(
        examples[-1].input_ids)
