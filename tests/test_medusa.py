"""Medusa heads: separate zero-initialised residual blocks, LM heads copied from the target (or
the target's own), head k trained on token t+k+2, the per-head loss against a loop by hand; the
Medusa-format export (layout, reload, refusals)."""

import json
from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from drafters.blockwise import BlockwiseConfig, BlockwiseHeads
from drafters.checkpoint import save_checkpoint, target_info
from drafters.decode.decoder import speculative_generate
from drafters.export.common import ExportError
from drafters.export.dispatch import export_checkpoint
from drafters.export.medusa import MedusaExportError, read_medusa_export
from drafters.heads import HeadRows, head_label_mask, heads_loss
from drafters.medusa import MedusaConfig, MedusaHeads
from drafters.decode.proposers.loading import load_proposer
from drafters.targets import load_target
from drafters.decode.tree import parse_tree_spec

D, V, K, N = 16, 40, 3, 2


def heads(share=False, seed=0) -> MedusaHeads:
    torch.manual_seed(seed)
    return MedusaHeads(MedusaConfig(hidden_size=D, vocab_size=V, num_heads=K, num_layers=N, share_lm_head=share))


def test_parameters_and_initialisation():
    m = heads()
    names = {name for name, _ in m.named_parameters()}
    blocks = {f"heads.{k}.blocks.{j}.linear.{p}" for k in range(K) for j in range(N) for p in ("weight", "bias")}
    assert names == blocks | {f"heads.{k}.lm_head.weight" for k in range(K)}
    assert all(p.requires_grad for p in m.parameters())
    for k in range(K):
        for j in range(N):
            assert torch.count_nonzero(m.heads[k].blocks[j].linear.weight) == 0  # W = 0 at init
    # separate modules, not one repeated (FasterDecoding/Medusa's [ResBlock] * n shares them)
    storages = {m.heads[k].blocks[j].linear.weight.data_ptr() for k in range(K) for j in range(N)}
    assert len(storages) == K * N
    target_head = torch.randn(V, D)
    m.init_from_target(target_head)
    for k in range(K):
        assert torch.equal(m.heads[k].lm_head.weight, target_head)
        assert m.heads[k].lm_head.weight.data_ptr() != target_head.data_ptr()  # a copy, trained apart
    shared = heads(share=True)
    assert not [name for name, _ in shared.named_parameters() if "lm_head" in name]
    assert sum(p.numel() for p in m.parameters()) == sum(p.numel() for p in shared.parameters()) + K * V * D


def test_forward_is_residual_blocks_then_projection():
    m = heads()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_()
    x, lm_head = torch.randn(2, 5, D), torch.randn(V, D)
    states = m.states(x, [0, 2])  # (2, 5, 2, D)
    assert states.shape == (2, 5, 2, D)
    for i, k in enumerate([0, 2]):
        h = x
        for block in m.heads[k].blocks:  # x + SiLU(W x + b), block after block
            h = h + F.silu(h @ block.linear.weight.T + block.linear.bias)
        torch.testing.assert_close(states[..., i, :], h)
        torch.testing.assert_close(m.project(h, k, lm_head), h @ m.heads[k].lm_head.weight.T)
    shared = heads(share=True)
    torch.testing.assert_close(shared.project(x, 1, lm_head), x @ lm_head.T)  # the target's head


def test_head_k_is_trained_on_token_t_plus_k_plus_2():
    # An oracle: x_t = one-hot(t), blocks = identity (all zero: SiLU(0) = 0), and head k's LM head
    # maps position t to the token at t+k+2. Scored on labels shifted by k+2 it is always right.
    T = 12
    ids = torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(0))
    loss_mask = torch.ones(1, T, dtype=torch.long)
    loss_mask[0, :3] = 0
    m = heads()
    x = torch.eye(T, D)[None]  # (1, T, D)
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
        for k in range(K):
            for t in range(T - k - 2):
                m.heads[k].lm_head.weight[ids[0, t + k + 2], t] = 50.0
    out = heads_loss(m, x, ids, loss_mask, torch.zeros(V, D), weights={k: 1.0 for k in range(K)})
    expected_counts = [int(head_label_mask(loss_mask, k).sum()) for k in range(K)]
    assert out.counts.tolist() == expected_counts == [int(loss_mask[0, k + 2:].sum()) for k in range(K)]
    assert out.correct.tolist() == expected_counts  # every supervised position right
    assert out.head_losses.max() < 1e-6
    # the same heads scored on the labels of the next head (a shift of k+3) are mostly wrong
    shifted = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
    wrong = heads_loss(m, x, shifted, torch.cat([loss_mask[:, 1:], loss_mask[:, :1]], dim=1), torch.zeros(V, D),
                       weights={k: 1.0 for k in range(K)})
    assert (wrong.correct < wrong.counts).all()


def test_loss_equals_a_loop_by_hand():
    B, T = 2, 9
    gen = torch.Generator().manual_seed(1)
    m = heads()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(generator=gen)
    x, lm_head = torch.randn(B, T, D, generator=gen), torch.randn(V, D, generator=gen)
    ids = torch.randint(0, V, (B, T), generator=gen)
    loss_mask = (torch.rand(B, T, generator=gen) > 0.3).long()
    teacher = torch.randn(B, T, V, generator=gen)
    weights = {k: 0.8 ** k for k in range(K)}
    for distill in (False, True):
        out = heads_loss(m, x, ids, loss_mask, lm_head, weights=weights, teacher_logits=teacher if distill else None)
        total = 0.0
        for k in range(K):
            ces = []
            for b in range(B):
                for t in range(T - k - 2):
                    if loss_mask[b, t + k + 2]:
                        logits = m.project(m.states(x[b, t], [k])[0], k, lm_head)
                        if distill:  # the target's distribution for token t+k+2 = its logits at t+k+1
                            ces.append(-(teacher[b, t + k + 1].softmax(-1) * logits.log_softmax(-1)).sum())
                        else:
                            ces.append(F.cross_entropy(logits, ids[b, t + k + 2]))
            assert out.counts[k] == len(ces)
            torch.testing.assert_close(out.head_losses[k], torch.stack(ces).mean())
            total = total + weights[k] * torch.stack(ces).mean()
        torch.testing.assert_close(out.loss, total)


def test_rows_gather_each_position_once():
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 0, 1, 0]])
    rows = HeadRows.of(loss_mask, num_heads=2)
    # head 0 (t+2): t in {1, 2, 4}; head 1 (t+3): t in {0, 1, 3}
    assert rows.position.tolist() == [0, 1, 2, 3, 4]
    assert rows.mask.tolist() == [[False, True, True, False, True], [True, True, False, True, False]]
    with pytest.raises(ValueError, match="num_heads >= 1"):
        MedusaHeads(MedusaConfig(hidden_size=D, vocab_size=V, num_heads=0))


# ---------------------------------------------------------------- Medusa-format export


def medusa_checkpoint(path, target, share=False, num_layers=2, tree=None):
    torch.manual_seed(3)
    config = MedusaConfig.from_target_config(target.config, num_heads=K, num_layers=num_layers, share_lm_head=share)
    m = MedusaHeads(config)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(std=0.1)
    save_checkpoint(path, family="medusa", config=asdict(config), target=target_info(target), state_dict=m.state_dict(),
                    extra={"tree": tree})
    return m


@pytest.fixture(scope="module")
def tiny():
    return load_target("tiny-random-llama")


def test_export_writes_the_medusa_layout_and_reloads(tiny, tmp_path):
    tree = {"kind": "greedy", "paths": [[0], [1], [0, 0]], "expected_tau": 1.5, "draft_nodes": 3}
    m = medusa_checkpoint(tmp_path / "ckpt", tiny, tree=tree)
    result = export_checkpoint(tmp_path / "ckpt", "medusa", tmp_path / "out", target=tiny)
    assert result.files == ["config.json", "medusa_lm_head.safetensors"]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config == {"medusa_num_heads": K, "medusa_num_layers": 2, "base_model_name_or_path": "tiny-random-llama",
                      "hidden_size": 64, "vocab_size": 259, "torch_dtype": "float32",
                      "medusa_choices": [[0], [1], [0, 0]]}
    tensors = load_file(tmp_path / "out" / "medusa_lm_head.safetensors")
    # FasterDecoding/Medusa's medusa_head.state_dict(): Sequential(ResBlock x n, Linear) per head
    assert set(tensors) == ({f"{k}.{j}.linear.{p}" for k in range(K) for j in range(2) for p in ("weight", "bias")}
                            | {f"{k}.2.weight" for k in range(K)})
    assert torch.equal(tensors["1.0.linear.weight"], m.heads[1].blocks[0].linear.weight)
    assert torch.equal(tensors["2.1.linear.bias"], m.heads[2].blocks[1].linear.bias)
    assert torch.equal(tensors["0.2.weight"], m.heads[0].lm_head.weight)
    assert result.check.max_logit_diff == 0.0
    read, state, dtype, _ = read_medusa_export(tmp_path / "out", target=target_info(tiny))
    assert read == m.config and dtype == torch.float32
    assert all(torch.equal(state[k], v) for k, v in m.state_dict().items())
    # the export drafts as the checkpoint does (the decoder loads exports by their config.json)
    prompt = torch.randint(3, 259, (10,), generator=torch.Generator().manual_seed(0))
    runs = [speculative_generate(tiny, load_proposer(str(p), tiny, parse_tree_spec("chain:3")), prompt,
                                 max_new_tokens=12)[1].accepted for p in (tmp_path / "ckpt", tmp_path / "out")]
    assert runs[0] == runs[1]


def test_export_of_shared_head_is_version_2_and_bf16_rounds(tiny, tmp_path):
    medusa_checkpoint(tmp_path / "ckpt", tiny, share=True, num_layers=1)
    result = export_checkpoint(tmp_path / "ckpt", "medusa", tmp_path / "out", target=tiny, dtype="bf16",
                               verifier="org/base")
    assert result.config["version"] == "2" and result.config["base_model_name_or_path"] == "org/base"
    tensors = load_file(tmp_path / "out" / "medusa_lm_head.safetensors")
    assert set(tensors) == {f"{k}.0.linear.{p}" for k in range(K) for p in ("weight", "bias")}  # no LM heads
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert read_medusa_export(tmp_path / "out")[0].share_lm_head
    medusa_checkpoint(tmp_path / "deep", tiny, share=True, num_layers=2)
    with pytest.raises(ExportError, match="TGI's version-2 loader asserts medusa_num_layers == 1"):
        export_checkpoint(tmp_path / "deep", "medusa", tmp_path / "deep_out")
    assert not (tmp_path / "deep_out").exists()


def test_wrong_format_wrong_family_wrong_target_and_corrupt_exports_fail_clearly(tiny, tmp_path):
    medusa_checkpoint(tmp_path / "ckpt", tiny)
    blockwise = BlockwiseHeads(BlockwiseConfig.from_target_config(tiny.config, num_heads=K))
    save_checkpoint(tmp_path / "bw", family="blockwise", config=asdict(blockwise.config), target=target_info(tiny),
                    state_dict=blockwise.state_dict())
    with pytest.raises(ExportError, match="export of a blockwise checkpoint to medusa is not supported .*Blockwise "
                                          r"heads share one hidden layer .*\); use --format native$"):
        export_checkpoint(tmp_path / "bw", "medusa", tmp_path / "x")
    assert export_checkpoint(tmp_path / "bw", "native", tmp_path / "bw_native").files == ["drafter.json",
                                                                                         "model.safetensors"]
    with pytest.raises(ExportError, match="export of a medusa checkpoint to sglang is not supported"):
        export_checkpoint(tmp_path / "ckpt", "sglang", tmp_path / "x")
    with pytest.raises(ExportError, match="model_type: checkpoint llama vs target gemma3_text"):
        export_checkpoint(tmp_path / "ckpt", "medusa", tmp_path / "x", target=load_target("tiny-random-gemma3"))
    assert not (tmp_path / "x").exists()
    export_checkpoint(tmp_path / "ckpt", "medusa", tmp_path / "out")
    weights = tmp_path / "out" / "medusa_lm_head.safetensors"
    tensors = load_file(weights)
    save_file({k: v for k, v in tensors.items() if k != "1.1.linear.bias"}, weights)
    with pytest.raises(MedusaExportError, match="missing \\['1.1.linear.bias'\\]"):
        load_proposer(str(tmp_path / "out"), tiny, parse_tree_spec("chain:2"))
    save_file({**tensors, "0.0.linear.weight": tensors["0.0.linear.weight"][:, :32].contiguous()}, weights)
    with pytest.raises(MedusaExportError, match="0.0.linear.weight \\(64, 32\\) != \\(64, 64\\)"):
        read_medusa_export(tmp_path / "out")
    save_file(tensors, weights)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    (tmp_path / "out" / "config.json").write_text(json.dumps({**config, "hidden_size": 32}))
    with pytest.raises(ValueError, match="hidden_size: checkpoint 32 vs target 64"):
        load_proposer(str(tmp_path / "out"), tiny, parse_tree_spec("chain:2"))
