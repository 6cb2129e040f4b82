"""train/quickstart.py's own step: the training file it writes from the regenerated answers and the shipped ones."""

import json

import pytest

from conftest import load_script

QUICKSTART = load_script("train/quickstart.py")


def rows(path):
    return [json.loads(line)["id"] for line in path.read_text().splitlines()]


def test_the_mix_holds_every_regenerated_answer_and_shipped_ones_spread_over_their_file(tmp_path):
    regenerated, shipped, out = tmp_path / "regen.jsonl", tmp_path / "shipped.jsonl", tmp_path / "train.jsonl"
    regenerated.write_text("".join(json.dumps({"id": f"r{i}"}) + "\n" for i in range(3)))
    # the shipped file is ordered by when prompts were answered, a few categories at a time: its head is one
    # category, so the mix must reach its end
    shipped.write_text("".join(json.dumps({"id": f"s{i}"}) + "\n" for i in range(10)) + "\n")
    QUICKSTART.mix(regenerated, shipped, 4, out)
    assert rows(out) == ["r0", "r1", "r2", "s0", "s2", "s5", "s7"]
    QUICKSTART.mix(regenerated, shipped, 0, out)  # rewritten whole: no rows of the earlier mix stay
    assert rows(out) == ["r0", "r1", "r2"]
    QUICKSTART.mix(regenerated, shipped, 10, out)
    assert rows(out)[3:] == [f"s{i}" for i in range(10)]
    with pytest.raises(SystemExit, match=r"--shipped-rows 11: .*shipped.jsonl holds 10 rows; pass at most that"):
        QUICKSTART.mix(regenerated, shipped, 11, out)
    assert rows(out)[3:] == [f"s{i}" for i in range(10)]  # a refused mix leaves the last one as it was

