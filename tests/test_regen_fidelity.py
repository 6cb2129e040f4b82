"""eval/regen_fidelity.py: where two regenerations of the same prompts part, and how close to a tie that is in the
target (the tiny random Llama: its greedy reply against the same reply with one token swapped for the runner-up)."""

import json

import pytest
import torch

from conftest import load_script  # tests/ is on sys.path under pytest
from drafters.targets import load_target
from drafters.training.data import render

fidelity = load_script("eval/regen_fidelity.py")


def greedy(target, messages, new=12):
    ids = target.tokenizer(render(target.tokenizer, messages, add_generation_prompt=True),
                           add_special_tokens=False)["input_ids"]
    out = target.model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(ids):].tolist()
    return ids, out


def write(path, rows):
    path.write_text("".join(json.dumps({"id": i, "conversations": c}) + "\n" for i, c in rows.items()))


def test_identical_replies_count_and_a_swapped_token_is_found_with_its_rank(tmp_path):
    target = load_target("tiny-random-llama")
    tok = target.tokenizer
    rows, other = {}, {}
    for i, question in enumerate(["What is 2+2?", "Name a colour.", "Say hi."]):
        user = [{"role": "user", "content": question}]
        prompt, reply = greedy(target, user)
        rows[f"r{i}"] = user + [{"role": "assistant", "content": tok.decode(reply)}]
        other[f"r{i}"] = rows[f"r{i}"]
    # r1 in the other file: the target's runner-up at token 4, then the same tokens as before
    user = rows["r1"][:1]
    prompt, reply = greedy(target, user)
    logits = target.model(torch.tensor([prompt + reply[:4]])).logits[0, -1]
    runner_up = int(logits.topk(2).indices[1])
    swapped = reply[:4] + [runner_up] + reply[5:]
    if tok(tok.decode(swapped), add_special_tokens=False)["input_ids"] != swapped or \
            tok(tok.decode(reply), add_special_tokens=False)["input_ids"] != reply:
        pytest.skip("the tiny tokenizer does not round-trip these ids")
    other["r1"] = user + [{"role": "assistant", "content": tok.decode(swapped)}]
    write(tmp_path / "a.jsonl", rows)
    write(tmp_path / "b.jsonl", other)

    result = fidelity.compare(target, fidelity.read(tmp_path / "a.jsonl"), fidelity.read(tmp_path / "b.jsonl"), tie=0.01)
    assert result["compared"] == 3 and result["identical"] == 2
    (part,) = result["partings"]
    assert part["id"] == "r1" and part["turn"] == 1 and part["at"] == 4 and part["ranks"] == [0, 1]
    top2 = logits.topk(2).values
    assert part["relative_gap"] == pytest.approx(float((top2[0] - top2[1]) / top2[0].abs()), rel=1e-4)


def test_a_file_that_is_not_a_regeneration_is_named(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"id": "a", "conversations": []}\n{"oops"\n')
    with pytest.raises(ValueError, match=r"x.jsonl:2: not a row written by train/regenerate.py"):
        fidelity.read(tmp_path / "x.jsonl")
