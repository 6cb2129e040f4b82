"""Blockwise parallel decoding heads: one hidden layer d -> K*f -> K*d, head k = x + its slice,
projected by the frozen target LM head; zero init = the target's own prediction; the
sample_one rule trains one head per micro-batch."""

import pytest
import torch
import torch.nn.functional as F

from drafters.blockwise import BlockwiseConfig, BlockwiseHeads
from drafters.heads import heads_loss
from drafters.training.schema import Data

D, V, K, FF = 16, 40, 3, 8


def heads(hidden_per_head=FF) -> BlockwiseHeads:
    torch.manual_seed(0)
    return BlockwiseHeads(BlockwiseConfig(hidden_size=D, vocab_size=V, num_heads=K, hidden_per_head=hidden_per_head))


def test_parameters_and_zero_initialisation():
    m = heads()
    shapes = {name: tuple(p.shape) for name, p in m.named_parameters()}
    assert shapes == {"up.weight": (K * FF, D), "up.bias": (K * FF,), "down.weight": (K * D, K * FF),
                      "down.bias": (K * D,)}  # no vocabulary projection of its own
    assert heads(hidden_per_head=0).config.hidden_per_head == D  # default f = d: one hidden layer d -> K*d
    x, lm_head = torch.randn(4, D), torch.randn(V, D)
    states = m.states(x, list(range(K)))  # (4, K, D)
    for k in range(K):  # W_down = 0: every head starts as the target's next-token prediction
        torch.testing.assert_close(states[:, k], x)
        torch.testing.assert_close(m.project(states[:, k], k, lm_head), x @ lm_head.T)


def test_forward_is_one_hidden_layer_split_residually():
    m = heads()
    with torch.no_grad():
        m.down.weight.normal_()
        m.down.bias.normal_()
    x = torch.randn(2, 5, D)
    y = F.relu(x @ m.up.weight.T + m.up.bias) @ m.down.weight.T + m.down.bias  # (2, 5, K*D)
    states = m.states(x, list(range(K)))
    for k in range(K):
        torch.testing.assert_close(states[..., k, :], x + y[..., k * D:(k + 1) * D])
    torch.testing.assert_close(m.states(x, [2, 0]), states[..., [2, 0], :])  # a subset: the same slices


def test_sample_one_trains_one_head_per_micro_batch():
    import drafters.training.heads as train

    recipe = train.BlockwiseRecipe(target="t", data=Data(path="x"), num_heads=K,
                                   blockwise=train.BlockwiseOptions(loss="sample_one"))
    picks = [train.loss_weights(recipe, i) for i in range(600)]
    assert all(list(w.values()) == [1.0] for w in picks)
    assert picks == [train.loss_weights(recipe, i) for i in range(600)]  # a function of (seed, micro index)
    counts = [sum(k in w for w in picks) for k in range(K)]
    assert all(150 < c < 250 for c in counts), counts  # uniform over the heads
    assert train.loss_weights(recipe) == pytest.approx({k: 1 / K for k in range(K)})  # evaluation: the mean
    recipe.blockwise.loss = "mean"
    assert train.loss_weights(recipe, 5) == pytest.approx({k: 1 / K for k in range(K)})

    m = heads()
    with torch.no_grad():
        m.down.weight.normal_()
    gen = torch.Generator().manual_seed(0)
    x, ids = torch.randn(2, 10, D, generator=gen), torch.randint(0, V, (2, 10), generator=gen)
    out = heads_loss(m, x, ids, torch.ones(2, 10), torch.randn(V, D, generator=gen), weights={1: 1.0})
    out.loss.backward()
    grad = m.down.weight.grad.unflatten(0, (K, D))  # (K, D, K*FF): rows of each head's slice
    assert grad[1].abs().sum() > 0 and grad[0].abs().sum() == 0 and grad[2].abs().sum() == 0
    assert out.counts.tolist() == [0, 2 * (10 - 3), 0] and out.loss == out.head_losses[1]


def test_rows_of_the_down_projection_are_the_full_projections_rows():
    from drafters.blockwise import RowsLinear

    torch.manual_seed(0)
    layer = RowsLinear(6, 9)
    z, rows = torch.randn(2, 3, 6), torch.tensor([6, 7, 8, 0, 1, 2])
    torch.testing.assert_close(layer(z, rows), layer(z)[..., rows])
    assert torch.equal(layer(z), torch.nn.functional.linear(z, layer.weight, layer.bias))
