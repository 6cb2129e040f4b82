"""eval/heldout.py: held-out accuracy by TTT step of any EAGLE-3 drafter, measured as training's own held-out
evaluation measures it, so that drafters of different trainers are compared on the same rows."""

import json

import pytest
import torch

from conftest import load_script

HELDOUT = load_script("eval/heldout.py")
TRAIN = load_script("train/train.py")
RECIPE, DATA = "recipes/eagle3_tiny.yaml", "tests/data/tiny_conversations.jsonl"


def held_out_rows(eval_rows: int, seed: int = 0) -> list[int]:
    # the training split's own rule (drafters.training.batches.load_examples): a permutation of the usable rows
    from drafters.targets import load_target
    from drafters.training.data import build_examples

    examples, _ = build_examples(load_target("tiny-random-llama").tokenizer, DATA, max_length=512)
    rows = list(dict.fromkeys(e.row for e in examples))
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(rows[i] for i in order[:eval_rows])


def test_a_trained_drafter_scores_what_its_own_held_out_evaluation_scored(tmp_path):
    out = tmp_path / "run"
    TRAIN.main([RECIPE, f"output_dir={out}", "max_steps=6", "eval_every=0", "data.eval_rows=6",
                "eagle3.eval_ttt_steps=4"])
    trained = json.loads((out / "eval.jsonl").read_text().splitlines()[-1])
    rows = ",".join(map(str, held_out_rows(6)))
    result = HELDOUT.main(["--target", "tiny-random-llama", "--proposer", str(out / "checkpoint-final"),
                           "--data", DATA, "--rows", rows, "--steps", "4", "--dtype", "float32",
                           "--json", str(tmp_path / "heldout.json")])
    assert result["supervised"] == trained["supervised"]
    torch.testing.assert_close(torch.tensor(result["step_acc"]), torch.tensor(trained["step_acc"]), rtol=0, atol=1e-6)
    assert result["tau_pred"] == pytest.approx(trained["tau_pred"], abs=1e-6)
    assert json.loads((tmp_path / "heldout.json").read_text())["step_acc"] == result["step_acc"]


@pytest.mark.parametrize("rows, message", [("7:3", "want A:B with 0 <= A < B"), ("a,b", "or a list I,J,K"),
                                           ("9000:9010", "no usable row of"),
                                           ("0:4", "neither drafter.json .* nor config.json")])
def test_bad_rows_get_one_sentence(rows, message, tmp_path):
    with pytest.raises(SystemExit, match=message):
        HELDOUT.main(["--target", "tiny-random-llama", "--proposer", str(tmp_path), "--data", DATA, "--rows", rows])
