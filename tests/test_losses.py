"""drafters.losses: the fused LM-head soft cross-entropy equals the unfused one (loss, accuracy, gradients),
chunked or not, in float32 and under bf16 autocast; LabelLogits equals indexing the full logits."""

import pytest
import torch

from drafters.losses import LabelLogits, linear_soft_cross_entropy, soft_cross_entropy


def inputs(rows=37, hidden=16, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g, requires_grad=True)
    weight = torch.randn(vocab, hidden, generator=g, requires_grad=True)
    target_p = torch.softmax(3 * torch.randn(rows, vocab, generator=g), -1)
    argmax_draft = torch.randint(vocab, (rows,), generator=g)
    argmax_draft[:5] = (x[:5] @ weight.T).argmax(-1)  # some hits, so accuracy is not trivially 0
    return x, weight, target_p, argmax_draft


def unfused(x, weight, target_p, argmax_draft, num_positions=None, tv_weight=0.0):
    ones = torch.ones(len(x), dtype=torch.bool)
    return soft_cross_entropy(x @ weight.T, target_p, ones, argmax_draft, ones, num_positions=num_positions,
                              tv_weight=tv_weight)


@pytest.mark.parametrize("chunk", [1, 8, 1000])
@pytest.mark.parametrize("num_positions", [None, 100])
@pytest.mark.parametrize("tv_weight", [0.0, 1.5])
def test_fused_equals_unfused_in_float32(chunk, num_positions, tv_weight):
    # the fused backward is hand-written (q - p, plus the TV term through the softmax Jacobian); the
    # unfused path is differentiated by autograd
    x, weight, target_p, argmax_draft = inputs()
    expected = unfused(x, weight, target_p, argmax_draft, num_positions, tv_weight)
    expected[0].backward()
    grads = x.grad.clone(), weight.grad.clone()
    x.grad = weight.grad = None
    got = linear_soft_cross_entropy(x, weight, target_p, argmax_draft, num_positions=num_positions, chunk=chunk,
                                    tv_weight=tv_weight)
    (2.5 * got[0]).backward()  # an incoming gradient other than 1 scales both gradients
    torch.testing.assert_close(got[0], expected[0], rtol=1e-6, atol=1e-6)
    assert got[1] == expected[1] and got[1] > 0 and got[2] == expected[2] == len(x)
    torch.testing.assert_close(x.grad, 2.5 * grads[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad, 2.5 * grads[1], rtol=1e-5, atol=1e-6)


def test_fused_under_bf16_autocast_matches_the_autocast_linear():
    x, weight, target_p, argmax_draft = inputs(rows=64, hidden=32, vocab=80)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = unfused(x, weight, target_p, argmax_draft)  # the bf16 matmul nn.Linear would do
        expected[0].backward()
        grads = x.grad.clone(), weight.grad.clone()
        x.grad = weight.grad = None
        got = linear_soft_cross_entropy(x, weight, target_p, argmax_draft, chunk=16)
        got[0].backward()
    assert x.grad.dtype == weight.grad.dtype == torch.float32
    torch.testing.assert_close(got[0], expected[0], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(x.grad, grads[0], rtol=3e-2, atol=1e-3)
    torch.testing.assert_close(weight.grad, grads[1], rtol=3e-2, atol=1e-3)


def test_the_tv_term_is_one_minus_the_acceptance_probability():
    # speculative sampling accepts a token drafted from q with probability sum_d min(p_d, q_d)
    x, weight, target_p, argmax_draft = inputs()
    q = torch.softmax(x @ weight.T, -1)
    acceptance = torch.minimum(q, target_p).sum(-1)  # (M,)
    with torch.no_grad():
        plain, with_tv = (unfused(x, weight, target_p, argmax_draft, tv_weight=w)[0] for w in (0.0, 2.0))
    torch.testing.assert_close(with_tv - plain, 2.0 * (1 - acceptance).mean(), rtol=1e-5, atol=1e-6)
    assert 0 < (1 - acceptance).mean() < 1


def test_no_rows_gives_zero_loss_and_zero_gradients():
    x, weight, target_p, argmax_draft = inputs(rows=0)
    loss, accuracy, count = linear_soft_cross_entropy(x, weight, target_p, argmax_draft, num_positions=10)
    loss.backward()
    assert loss == 0 and accuracy == 0 and count == 0 and torch.equal(weight.grad, torch.zeros_like(weight))


def test_head_rows_equals_indexing_the_full_logits():
    g = torch.Generator().manual_seed(1)
    hidden, head = torch.randn(2, 5, 8, generator=g), torch.nn.Linear(8, 11, bias=False)
    mask = torch.tensor([[1, 0, 1, 1, 0], [0, 0, 1, 0, 1]], dtype=torch.bool)
    torch.testing.assert_close(LabelLogits(hidden, head)[mask], head(hidden)[mask])


def test_the_fused_head_is_a_linear_layer_and_its_loss_is_the_fused_loss():
    # called with x alone it is the bias-free nn.Linear it replaces; with targets, the fused loss of its own weight
    from drafters.losses import FusedLinearHead, linear_soft_cross_entropy

    torch.manual_seed(0)
    head = FusedLinearHead(8, 12)
    x, target_p = torch.randn(5, 8), torch.softmax(torch.randn(5, 12), -1)
    argmax = target_p.argmax(-1)
    torch.testing.assert_close(head(x), x @ head.weight.T, rtol=0, atol=0)
    assert list(head.state_dict()) == ["weight"]
    got = head(x, target_p, argmax, num_positions=7)
    want = linear_soft_cross_entropy(x, head.weight, target_p, argmax, num_positions=7)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    got[0].backward()
    grad = head.weight.grad.clone()
    head.weight.grad = None
    soft = -(target_p * torch.log_softmax(x @ head.weight.T, -1)).sum() / 7
    soft.backward()
    torch.testing.assert_close(grad, head.weight.grad)


@pytest.mark.parametrize("rows", [1, 3, 7])
def test_the_label_side_in_chunks_equals_it_whole(rows, monkeypatch):
    # supervised_targets computes the target's logits a chunk of rows at a time (peak (rows, V), not (N, V)); the
    # soft labels, the in-vocabulary test and the draft argmax must be those of the whole (N, V) tensor
    from types import SimpleNamespace

    import drafters.losses as losses

    torch.manual_seed(0)
    V, h, draft = 50, 8, 20
    head = torch.nn.Linear(h, V, bias=False)
    hidden = torch.randn(2, 9, h)
    loss_mask = (torch.rand(2, 9) > 0.3).long()
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.randperm(V)[:draft]] = True
    drafter = SimpleNamespace(t2d=t2d, config=SimpleNamespace(draft_vocab_size=draft))
    whole = losses.supervised_targets(drafter, head(hidden), loss_mask)  # a plain (B, T, V) tensor, no chunks
    monkeypatch.setattr(losses, "LABEL_CHUNK_ROWS", rows)
    for labels in (LabelLogits(hidden, head), head(hidden)):
        chunked = losses.supervised_targets(drafter, labels, loss_mask)
        assert torch.equal(chunked[0], whole[0])  # rows
        # target_p: the head's matmul over fewer rows rounds differently in the last bit (1e-8), nothing more
        torch.testing.assert_close(chunked[1][0], whole[1][0], rtol=1e-6, atol=1e-7)
        assert torch.equal(chunked[1][1], whole[1][1])  # argmax_draft
    assert len(list(losses.label_chunks(LabelLogits(hidden, head), loss_mask.bool()))) == -(-int(loss_mask.sum()) // rows)


def test_a_label_chunk_holds_the_same_number_of_logits_whatever_the_vocabulary(monkeypatch):
    # rows per chunk = LABEL_CHUNK_ELEMENTS // V: the label side's transient (rows, V) does not grow with V
    import drafters.losses as losses

    monkeypatch.setattr(losses, "LABEL_CHUNK_ELEMENTS", 200)
    hidden, mask = torch.randn(1, 30, 4), torch.ones(1, 30, dtype=torch.bool)
    for vocab, rows in ((50, 4), (100, 2), (400, 1)):
        head = torch.nn.Linear(4, vocab, bias=False)
        for labels in (LabelLogits(hidden, head), head(hidden)):
            sizes = [len(chunk) for chunk in losses.label_chunks(labels, mask)]
            assert sizes[:-1] == [rows] * (len(sizes) - 1) and sum(sizes) == 30


# ---- the divergences a drafter can train with (recipe field `divergence`) --------------------------------


def test_each_divergence_is_its_formula_by_hand():
    # p = (0.5, 0.3, 0.2), q = (0.2, 0.3, 0.5): A = sum min = 0.2 + 0.3 + 0.2 = 0.7, m = (0.35, 0.3, 0.35)
    import math

    from drafters.losses import divergence_rows
    p, q = torch.tensor([[0.5, 0.3, 0.2]]), torch.tensor([[0.2, 0.3, 0.5]])
    log = math.log
    expected = {
        "kl": -(0.5 * log(0.2) + 0.3 * log(0.3) + 0.2 * log(0.5)),
        "reverse_kl": 0.2 * log(0.2 / 0.5) + 0.3 * log(1.0) + 0.5 * log(0.5 / 0.2),
        "jsd": 0.5 * (0.5 * log(0.5 / 0.35) + 0.2 * log(0.2 / 0.35)) + 0.5 * (0.2 * log(0.2 / 0.35)
                                                                          + 0.5 * log(0.5 / 0.35)),
        "lk": -log(0.7),
        "argmax": -log(0.2),  # the target's argmax is token 0, which q gives 0.2
    }
    for name, value in expected.items():
        got = divergence_rows(q.log(), p, name)
        torch.testing.assert_close(got, torch.tensor([value]), rtol=1e-6, atol=1e-7, msg=name)
    with pytest.raises(ValueError, match="divergence='l2': use one of kl, reverse_kl"):
        divergence_rows(q.log(), p, "l2")


@pytest.mark.parametrize("divergence", ["kl", "reverse_kl", "jsd", "lk", "argmax"])
@pytest.mark.parametrize("tv_weight", [0.0, 0.7])
def test_each_divergence_fused_equals_autograd(divergence, tv_weight):
    # the fused head differentiates by hand (drafters.losses.divergence_grad); autograd of the unfused rows is the
    # reference, for the loss, both gradients and the accuracy
    x, weight, target_p, argmax_draft = inputs(seed=3)
    ones = torch.ones(len(x), dtype=torch.bool)
    expected = soft_cross_entropy(x @ weight.T, target_p, ones, argmax_draft, ones, tv_weight=tv_weight,
                                  divergence=divergence)
    expected[0].backward()
    grads = x.grad.clone(), weight.grad.clone()
    x.grad = weight.grad = None
    got = linear_soft_cross_entropy(x, weight, target_p, argmax_draft, chunk=8, tv_weight=tv_weight,
                                    divergence=divergence)
    got[0].backward()
    torch.testing.assert_close(got[0], expected[0], rtol=1e-6, atol=1e-6)
    assert got[1] == expected[1]
    torch.testing.assert_close(x.grad, grads[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad, grads[1], rtol=1e-5, atol=1e-6)
    assert grads[0].abs().sum() > 0  # a loss that moves the drafter


def test_the_divergences_differ_and_vanish_where_the_draft_is_the_target():
    from drafters.losses import DIVERGENCES, divergence_rows
    p = torch.softmax(torch.randn(4, 9, generator=torch.Generator().manual_seed(1)), -1)
    q = torch.softmax(torch.randn(4, 9, generator=torch.Generator().manual_seed(2)), -1)
    values = {name: divergence_rows(q.log(), p, name) for name in DIVERGENCES}
    assert len({round(v.sum().item(), 5) for v in values.values()}) == len(DIVERGENCES)
    for name in ("reverse_kl", "jsd", "lk"):  # zero at q = p; kl's minimum there is H(p), argmax's -log p_a
        torch.testing.assert_close(divergence_rows(p.log(), p, name), torch.zeros(4), atol=1e-6, rtol=0)
    torch.testing.assert_close(divergence_rows(p.log(), p, "kl"), -(p * p.log()).sum(-1))


@pytest.mark.parametrize("divergence, tv_weight", [("kl", 0.0), ("lk", 0.5)])
def test_the_fused_loss_reads_rows_of_the_label_table_as_it_reads_their_copy(divergence, tv_weight):
    # target_rows: each step scores rows of the whole (N, Vd) table, gathered a chunk at a time; the loss, the
    # argmax and both gradients equal those of the step's own (M, Vd) copy
    torch.manual_seed(0)
    table = torch.softmax(torch.randn(40, 30), -1)  # (N, Vd)
    rows = torch.randint(0, 40, (25,))  # (M,) with repeats, out of order
    argmax = table.argmax(-1)
    results = []
    for kwargs in ({"target_p": table[rows]}, {"target_p": table, "target_rows": rows}):
        x = torch.randn(25, 8, generator=torch.Generator().manual_seed(1)).requires_grad_()
        weight = torch.randn(30, 8, generator=torch.Generator().manual_seed(2)).requires_grad_()
        loss, accuracy, _ = linear_soft_cross_entropy(x, weight, argmax_draft=argmax[rows], chunk=7,
                                                      divergence=divergence, tv_weight=tv_weight, **kwargs)
        loss.backward()
        results.append((loss.detach(), accuracy, x.grad, weight.grad))
    for copied, indexed in zip(*results):
        torch.testing.assert_close(indexed, copied, rtol=0, atol=0)


# ---- the label side of Medusa / Blockwise (distillation, held-out) and EAGLE-1: rows, never (B, T, V) ----------


class CountingHead:
    """A frozen head x (N, h) -> x W^T (N, V) that records how many rows each call computed."""

    def __init__(self, weight: torch.Tensor):
        self.weight, self.rows = weight, []

    out_features = property(lambda self: self.weight.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.rows.append(x.shape[0])
        return x @ self.weight.T


def gradients(module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in module.parameters() if p.grad is not None]


@pytest.mark.parametrize("family", ["medusa", "blockwise"])
def test_heads_distill_from_label_rows_as_from_the_whole_logits(family):
    from drafters.blockwise import BlockwiseConfig, BlockwiseHeads
    from drafters.heads import HeadRows, heads_loss
    from drafters.medusa import MedusaConfig, MedusaHeads

    B, T, D, V, K = 3, 11, 16, 45, 3
    gen = torch.Generator().manual_seed(4)
    torch.manual_seed(0)
    heads = (MedusaHeads(MedusaConfig(hidden_size=D, vocab_size=V, num_heads=K, num_layers=1)) if family == "medusa"
             else BlockwiseHeads(BlockwiseConfig(hidden_size=D, vocab_size=V, num_heads=K)))
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.3, generator=gen)
    x, lm_head = torch.randn(B, T, D, generator=gen), torch.randn(V, D, generator=gen)
    ids, loss_mask = torch.randint(0, V, (B, T), generator=gen), (torch.rand(B, T, generator=gen) > 0.3).long()
    teacher_hidden, head = torch.randn(B, T, D, generator=gen), CountingHead(torch.randn(V, D, generator=gen))
    weights = {k: 0.8 ** k for k in range(K)}
    results = []
    for teacher in (head(teacher_hidden.reshape(B * T, D)).reshape(B, T, V), LabelLogits(teacher_hidden, head)):
        heads.zero_grad()
        out = heads_loss(heads, x, ids, loss_mask, lm_head, weights=weights, teacher_logits=teacher)
        out.loss.backward()
        results.append((out.loss.detach(), out.correct, gradients(heads)))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-6, atol=1e-7)
    assert torch.equal(results[1][1], results[0][1]) and results[0][0] > 0
    for a, b in zip(results[0][2], results[1][2], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    # the whole-tensor pass computed B * T rows once; the label rows, one head's rows per call
    rows = HeadRows.of(loss_mask, K)
    assert head.rows[0] == B * T and head.rows[1:] == [len(rows.batch)] * K and len(rows.batch) < B * T


def test_eagle1_scores_label_rows_as_the_whole_logits():
    from drafters.eagle1 import Eagle1Config, Eagle1Drafter
    from drafters.training.eagle1 import chain_loss
    from drafters.training.loop import FeatureBatch
    from transformers import LlamaConfig

    B, T, D, V = 2, 12, 64, 259
    gen = torch.Generator().manual_seed(5)
    config = Eagle1Config.from_target_config(LlamaConfig(hidden_size=D, intermediate_size=128, num_attention_heads=4,
                                                         num_key_value_heads=2, head_dim=16, vocab_size=V))
    torch.manual_seed(0)
    head = CountingHead(torch.randn(V, D, generator=gen))
    drafter = Eagle1Drafter(config).attach_head(head)
    embed = torch.nn.Embedding(V, D)
    features, ids = torch.randn(B, T, D, generator=gen), torch.randint(0, V, (B, T), generator=gen)
    loss_mask = (torch.rand(B, T, generator=gen) > 0.25).long()
    results = []
    for labels in (head(features.reshape(B * T, D)).reshape(B, T, V), LabelLogits(features, head)):
        drafter.zero_grad()
        head.rows.clear()
        out = chain_loss(drafter, FeatureBatch(features, ids, labels, loss_mask, embed), steps=3)
        out.loss.backward()
        results.append((out.loss.detach(), out.step_accuracies, out.step_counts, gradients(drafter),
                        [r for r in head.rows]))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-6, atol=1e-7)
    assert torch.equal(results[1][1], results[0][1]) and torch.equal(results[1][2], results[0][2])
    for a, b in zip(results[0][3], results[1][3], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    # each step's label rows are its counted positions: the drafter's own (M, V) projection is the same size
    counts = results[0][2].tolist()
    assert results[1][4][1::2] == counts and max(results[1][4]) < B * T


@pytest.mark.parametrize("family", ["medusa", "blockwise", "eagle1"])
def test_projections_onto_the_vocabulary_in_row_chunks_equal_one_pass(family, monkeypatch):
    # Medusa's and Blockwise's heads and EAGLE-1's frozen head project their M rows onto V a chunk of rows at a
    # time, recomputed in backward (in_row_chunks): loss, accuracies and gradients equal one pass over all M rows,
    # and no head call sees more than a chunk's rows (the label head is called again in backward: recomputed)
    from transformers import LlamaConfig

    import drafters.losses as losses
    from drafters.blockwise import BlockwiseConfig, BlockwiseHeads
    from drafters.eagle1 import Eagle1Config, Eagle1Drafter
    from drafters.heads import heads_loss
    from drafters.medusa import MedusaConfig, MedusaHeads
    from drafters.training.eagle1 import chain_loss
    from drafters.training.loop import FeatureBatch

    B, T, D, V, K = 2, 13, 16, 45, 3
    gen = torch.Generator().manual_seed(6)
    torch.manual_seed(0)
    head = CountingHead(torch.randn(V, D, generator=gen))
    hidden, ids = torch.randn(B, T, D, generator=gen), torch.randint(0, V, (B, T), generator=gen)
    loss_mask = (torch.rand(B, T, generator=gen) > 0.2).long()
    if family == "eagle1":
        config = Eagle1Config.from_target_config(LlamaConfig(hidden_size=D, intermediate_size=32, num_attention_heads=2,
                                                             num_key_value_heads=1, head_dim=8, vocab_size=V))
        drafter, embed = Eagle1Drafter(config).attach_head(head), torch.nn.Embedding(V, D)

        def run():
            out = chain_loss(drafter, FeatureBatch(hidden, ids, LabelLogits(hidden, head), loss_mask, embed), steps=2)
            return out.loss, out.step_accuracies
    else:
        drafter = (MedusaHeads(MedusaConfig(hidden_size=D, vocab_size=V, num_heads=K, num_layers=1))
                   if family == "medusa" else BlockwiseHeads(BlockwiseConfig(hidden_size=D, vocab_size=V, num_heads=K)))
        lm_head, weights = torch.randn(V, D, generator=gen), {k: 0.8 ** k for k in range(K)}

        def run():
            out = heads_loss(drafter, hidden, ids, loss_mask, lm_head, weights=weights,
                             teacher_logits=LabelLogits(hidden, head))
            return out.loss, torch.stack([out.correct, out.correct_top5])
    results = []
    for rows in (None, 4):
        monkeypatch.setattr(losses, "LOGIT_CHUNK_ROWS", rows)
        monkeypatch.setattr(losses, "LABEL_CHUNK_ELEMENTS", 10**9)  # None: every row in one chunk
        drafter.zero_grad()
        head.rows.clear()
        loss, metrics = run()
        forward_calls = len(head.rows)
        loss.backward()
        results.append((loss.detach(), metrics, gradients(drafter), head.rows[:], forward_calls))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-6, atol=1e-7)
    assert torch.equal(results[1][1], results[0][1]) and results[0][0] > 0
    for whole, chunked in zip(results[0][2], results[1][2], strict=True):
        torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-7)
    assert max(results[0][3]) > 4 and max(results[1][3]) <= 4  # one pass saw more rows than a chunk
    assert len(results[1][3]) > results[1][4]  # backward called the head again: the chunks were recomputed


# ---- vocab_memory=recompute: the same loss with nothing kept that grows with the draft vocabulary ---------------


@pytest.mark.parametrize("divergence, tv_weight", [("kl", 0.0), ("jsd", 0.5)])
@pytest.mark.parametrize("frozen_head", [False, True])
def test_recomputing_in_backward_gives_the_fused_loss_and_gradients_bit_for_bit(divergence, tv_weight, frozen_head):
    # the two schedules of LinearSoftCrossEntropy run the same chunk arithmetic, once in forward (kept) or again in
    # backward (recompute): loss, argmax and both gradients equal at tolerance 0, a frozen head (DFlash) included
    table = torch.softmax(torch.randn(40, 30, generator=torch.Generator().manual_seed(0)), -1)  # (N, Vd)
    rows = torch.randint(0, 40, (25,), generator=torch.Generator().manual_seed(4))
    results = []
    for recompute in (False, True):
        x = torch.randn(25, 8, generator=torch.Generator().manual_seed(1)).requires_grad_()
        weight = torch.randn(30, 8, generator=torch.Generator().manual_seed(2)).requires_grad_(not frozen_head)
        loss, accuracy, _ = linear_soft_cross_entropy(x, weight, table, table.argmax(-1)[rows], chunk=7,
                                                      divergence=divergence, tv_weight=tv_weight, target_rows=rows,
                                                      recompute=recompute)
        (3 * loss).backward()  # an upstream gradient that is not 1
        results.append((loss.detach(), accuracy, x.grad, weight.grad))
    for kept, recomputed in zip(*results):
        if kept is None:
            assert recomputed is None and frozen_head
            continue
        torch.testing.assert_close(recomputed, kept, rtol=0, atol=0)
    assert results[0][2].abs().sum() > 0


def test_recomputed_labels_are_rows_of_the_label_table():
    # RecomputedLabels[n] is computed from the n-th needed hidden row when read; it equals row n of the table
    # supervised_targets fills, and the rows index and argmax_draft are unchanged
    from types import SimpleNamespace

    import drafters.losses as losses

    torch.manual_seed(0)
    V, h, draft = 50, 8, 20
    head = torch.nn.Linear(h, V, bias=False)
    hidden, loss_mask = torch.randn(2, 9, h), (torch.rand(2, 9) > 0.3).long()
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.randperm(V)[:draft]] = True
    drafter = SimpleNamespace(t2d=t2d, config=SimpleNamespace(draft_vocab_size=draft))
    rows, (table, argmax) = losses.supervised_targets(drafter, LabelLogits(hidden, head), loss_mask)
    rows_r, (labels, argmax_r) = losses.supervised_targets(drafter, LabelLogits(hidden, head), loss_mask,
                                                           recompute=True)
    assert isinstance(labels, losses.RecomputedLabels) and labels.hidden.shape == (len(table), h)  # (N, h) kept
    assert torch.equal(rows_r, rows) and torch.equal(argmax_r, argmax)
    index = torch.tensor([3, 0, 3, len(table) - 1])
    torch.testing.assert_close(labels[index], table[index], rtol=1e-6, atol=1e-7)  # the head over other rows


@pytest.mark.parametrize("divergence", ["kl", "lk"])
def test_ttt_loss_with_recomputed_labels_equals_the_label_table(divergence):
    # the whole EAGLE-3 objective (7 TTT steps) under vocab_memory=recompute: loss, per-step accuracies and every
    # drafter gradient equal the table schedule's (the label head's matmul over other rows: float32 tolerance)
    from drafters.draft_vocab import build_draft_vocab
    from drafters.eagle3 import Eagle3Config, Eagle3Drafter
    from drafters.training.eagle3 import TTTOptions, ttt_loss
    from drafters.training.loop import FeatureBatch

    torch.manual_seed(0)
    V, h, draft = 64, 32, 24
    config = Eagle3Config(hidden_size=h, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, vocab_size=V, draft_vocab_size=draft, max_position_embeddings=64,
                          aux_layers=[1, 2, 3])
    counts = torch.arange(V, 0, -1).float()
    drafter = Eagle3Drafter(config, build_draft_vocab(counts, V, draft))
    embed, head = torch.nn.Embedding(V, h), torch.nn.Linear(h, V, bias=False)
    features, ids = torch.randn(2, 12, 3 * h), torch.randint(0, V, (2, 12))
    hidden, loss_mask = torch.randn(2, 12, h), torch.ones(2, 12, dtype=torch.long)
    loss_mask[1, :4] = 0
    runs = []
    for recompute in (False, True):
        drafter.zero_grad()
        out = ttt_loss(drafter, FeatureBatch(features, ids, LabelLogits(hidden, head), loss_mask, embed),
                       TTTOptions(steps=7, divergence=divergence, recompute=recompute))
        out.loss.backward()
        runs.append((out.loss.detach(), out.step_accuracies, gradients(drafter)))
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=1e-6, atol=1e-7)
    assert torch.equal(runs[1][1], runs[0][1])
    for recomputed, kept in zip(runs[1][2], runs[0][2], strict=True):
        torch.testing.assert_close(recomputed, kept, rtol=1e-5, atol=1e-7)


def test_a_fused_loss_chunk_holds_the_same_number_of_logits_whatever_the_vocabulary():
    # the fused head's (c, Vd) float32 transients are LOSS_CHUNK_ELEMENTS large at any Vd past 32k (fewer rows per
    # chunk as Vd grows), so they do not grow with the vocabulary; a narrow head keeps LOSS_CHUNK_MAX_ROWS rows
    from drafters.losses import LOSS_CHUNK_ELEMENTS, LOSS_CHUNK_MAX_ROWS, loss_chunk_rows

    assert [loss_chunk_rows(v) for v in (1000, 32000, 128000, 256000)] == [LOSS_CHUNK_MAX_ROWS, 256, 65, 32]
    for vocab in (32768, 131072, 262144):
        assert loss_chunk_rows(vocab) * vocab <= LOSS_CHUNK_ELEMENTS
    assert loss_chunk_rows(10**7) == 1  # never zero rows
