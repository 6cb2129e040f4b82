import pytest
import torch

from drafters.draft_vocab import DraftVocab, DraftVocabError, build_draft_vocab, count_tokens


def test_counts_only_loss_masked_tokens():
    examples = [([5, 6, 7, 7], [0, 1, 1, 1]), (torch.tensor([5, 5, 9]), torch.tensor([1, 1, 0]))]
    counts = count_tokens(examples, 10)
    assert counts.tolist() == [0, 0, 0, 0, 0, 2, 1, 2, 0, 0]


def test_top_n_ties_by_lower_id_sorted_ascending():
    counts = torch.tensor([0, 3, 5, 3, 0, 3, 9, 0])
    vocab = build_draft_vocab(counts, 8, size=4)
    # 6 (9), 2 (5), then the three ids with count 3 -> the lower two: 1, 3
    assert vocab.used.tolist() == [1, 2, 3, 6]
    assert vocab.d2t.dtype == torch.int64 and vocab.t2d.dtype == torch.bool
    assert vocab.d2t.tolist() == [1, 1, 1, 3]  # used[i] - i


def test_a_kept_vocabulary_stays_whole_and_the_rest_are_the_most_frequent():
    counts = torch.tensor([0, 3, 5, 3, 0, 3, 9, 0])
    kept = DraftVocab.from_used(torch.tensor([0, 7]), 8)  # ids never counted: kept anyway (grow_vocab)
    # 0 and 7 first, then 6 (9) and 2 (5), then the lowest of the three ids with count 3: 1
    assert build_draft_vocab(counts, 8, size=5, keep=kept).used.tolist() == [0, 1, 2, 6, 7]
    with pytest.raises(DraftVocabError, match="draft vocab of 1 ids cannot hold the 2 ids it must keep"):
        build_draft_vocab(counts, 8, size=1, keep=kept)


def test_fills_with_lowest_unseen_ids_to_exact_size():
    vocab = build_draft_vocab([([7, 7, 4], [1, 1, 1])], 10, size=5)
    assert vocab.size == 5 and int(vocab.t2d.sum()) == 5
    assert vocab.used.tolist() == [0, 1, 2, 4, 7]


def test_size_capped_at_target_vocab():
    vocab = build_draft_vocab(torch.arange(6), 6, size=32000)
    assert vocab.size == 6 and vocab.d2t.tolist() == [0] * 6


def test_round_trip_and_out_of_vocab():
    torch.manual_seed(0)
    ids = torch.randint(0, 300, (4, 50))
    vocab = build_draft_vocab([(row, torch.ones_like(row)) for row in ids], 300, size=64)
    assert vocab.size == 64 and int(vocab.t2d.sum()) == 64
    assert bool((vocab.used[1:] > vocab.used[:-1]).all())
    draft_ids = torch.arange(64)
    target_ids = vocab.to_target(draft_ids)
    assert torch.equal(target_ids, vocab.used) and bool(vocab.t2d[target_ids].all())
    back, in_vocab = vocab.to_draft(target_ids)
    assert torch.equal(back, draft_ids) and bool(in_vocab.all())
    outside = (~vocab.t2d).nonzero().squeeze(-1)
    _, in_vocab = vocab.to_draft(outside)
    assert not bool(in_vocab.any())


def test_state_dict_round_trip_and_validation():
    vocab = DraftVocab.from_used(torch.tensor([3, 0, 8]), 10)
    loaded = DraftVocab.from_state_dict(vocab.state_dict(), draft_vocab_size=3, target_vocab_size=10)
    assert torch.equal(loaded.d2t, vocab.d2t) and torch.equal(loaded.t2d, vocab.t2d)
    with pytest.raises(DraftVocabError, match="draft_vocab_size"):
        DraftVocab.from_state_dict(vocab.state_dict(), draft_vocab_size=4)
    with pytest.raises(DraftVocabError, match="target vocab"):
        DraftVocab.from_state_dict(vocab.state_dict(), target_vocab_size=11)
    with pytest.raises(DraftVocabError, match="t2d"):
        DraftVocab.from_state_dict({"d2t": vocab.d2t})
    wrong_t2d = vocab.t2d.clone()
    wrong_t2d[3], wrong_t2d[4] = False, True  # same count, different ids
    with pytest.raises(DraftVocabError, match="disagree"):
        DraftVocab.from_state_dict({"d2t": vocab.d2t, "t2d": wrong_t2d})
    with pytest.raises(DraftVocabError, match="marks"):
        DraftVocab.from_state_dict({"d2t": vocab.d2t, "t2d": torch.ones(10, dtype=torch.bool)})
    with pytest.raises(DraftVocabError, match="ascending"):
        DraftVocab.from_state_dict({"d2t": torch.tensor([3, -3, 6]), "t2d": vocab.t2d})


def test_bad_examples_fail_loudly():
    with pytest.raises(DraftVocabError, match="example 1: token id outside"):
        count_tokens([([1, 2], [1, 1]), ([1, 12], [1, 1])], 10)
    with pytest.raises(DraftVocabError, match="example 0: input_ids has 2"):
        count_tokens([([1, 2], [1, 1, 1])], 10)


def test_coverage_and_the_size_that_reaches_it():
    from drafters.draft_vocab import coverage, size_for_coverage

    counts = torch.tensor([0, 50, 0, 30, 10, 5, 5, 0])  # 100 supervised tokens over 5 distinct ids
    assert [coverage(counts, build_draft_vocab(counts, 8, n)) for n in (1, 2, 3, 5, 8)] == [0.5, 0.8, 0.9, 1.0, 1.0]
    assert coverage(counts, DraftVocab.from_used(torch.tensor([0, 2, 4]), 8)) == 0.1  # any ids: only id 4 is counted
    assert [size_for_coverage(counts, f) for f in (0.5, 0.51, 0.8, 0.9, 0.91, 1.0)] == [1, 2, 2, 3, 4, 5]
    assert coverage(torch.zeros(4, dtype=torch.long), DraftVocab.from_used(torch.tensor([0, 1]), 4)) == 0.0
    with pytest.raises(DraftVocabError, match=r"coverage 0 must be in \(0, 1\]"):
        size_for_coverage(counts, 0)


def test_training_sizes_the_draft_vocab_by_coverage_and_reports_it(tmp_path, capsys):
    from conftest import load_script

    eagle = load_script("train/eagle.py")
    summary = eagle.main(["recipes/eagle3_tiny.yaml", "draft_vocab_coverage=0.9", "max_steps=1", "eval_every=0",
                          "save_every=0", f"output_dir={tmp_path}"])
    out = capsys.readouterr().out
    size = summary.drafter.config.draft_vocab_size
    line = next(line for line in out.splitlines() if "supervised training tokens" in line)
    assert f"draft vocab {size} of 259 ids covers " in line and "draft_vocab_coverage=0.9" in line
    covered = float(line.split("covers ")[1].split("%")[0]) / 100
    assert covered >= 0.9 and 1 <= size < 259
    with pytest.raises(Exception, match=r"draft_vocab_coverage=1.5 must be in \(0, 1\]"):
        eagle.main(["recipes/eagle3_tiny.yaml", "draft_vocab_coverage=1.5", f"output_dir={tmp_path / 'x'}"])
