"""eval/confidence.py: the target's probability of its own argmax, by answer position, over trained tokens only."""

import json

import pytest
import torch

from conftest import load_script  # tests/ is on sys.path under pytest
from drafters.targets import load_target

confidence = load_script("eval/confidence.py")


def test_positions_bands_and_probabilities_are_the_targets(tmp_path):
    answer = "abcdefghij" * 4  # 40 byte tokens: 32 in the first range, 8 in the second
    rows = [{"conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": answer}]}]
    data = tmp_path / "answers.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = confidence.main(["--target", "tiny-random-llama", "--data", str(data), "--json", str(tmp_path / "c.json")])
    table = result["table"]
    assert table["1-32"]["tokens"] == 32 and table["33-64"]["tokens"] == 41 - 32  # the 40 bytes and <|im_end|>
    assert set(table) == {"1-32", "33-64", "all"} and table["all"]["tokens"] == 41
    assert json.loads((tmp_path / "c.json").read_text())["table"] == table
    # the mean p is the target's own: recomputed from one forward over the rendered row
    target = load_target("tiny-random-llama")
    ids = target.tokenizer.apply_chat_template(rows[0]["conversations"], tokenize=True, return_dict=True)["input_ids"]
    with torch.no_grad():
        p = target.model(torch.tensor([ids])).logits[0].softmax(-1).max(-1).values
    start = len(target.tokenizer.apply_chat_template(rows[0]["conversations"][:1], tokenize=True,
                                                     add_generation_prompt=True, return_dict=True)["input_ids"])
    answer_p = p[start - 1:start - 1 + 41]
    assert table["all"]["mean_p"] == pytest.approx(float(answer_p.mean()), rel=1e-5)
    assert sum(table["all"]["share"]) == pytest.approx(1.0)
    assert table["all"]["share"][2] == pytest.approx(float((answer_p >= 0.9).float().mean()))


def test_a_file_without_usable_rows_is_one_sentence(tmp_path):
    data = tmp_path / "empty.jsonl"
    data.write_text(json.dumps({"conversations": [{"role": "user", "content": "q"}]}) + "\n")
    with pytest.raises(SystemExit, match=r"(?s)^confidence: no usable rows.*empty\.jsonl:1: roles are \[user\]"):
        confidence.main(["--target", "tiny-random-llama", "--data", str(data)])


def test_text_rows_count_positions_from_their_first_token(tmp_path):
    data = tmp_path / "text.jsonl"  # fmt=text: every token trained, the first predicted by nothing
    data.write_text(json.dumps({"text": "x" * 33}) + "\n")
    table = confidence.main(["--target", "tiny-random-llama", "--data", str(data)])["table"]
    assert table["1-32"]["tokens"] == 31 and table["33-64"]["tokens"] == 1  # tokens 1..32 at positions 1..32
