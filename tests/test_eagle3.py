import re

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import drafters.layers as layers
from drafters.draft_vocab import build_draft_vocab
from drafters.layers import (
    DraftKVCache,
    ttt_attention,
    ttt_attention_mask,
    ttt_input_ids,
    ttt_label_mask,
    ttt_label_rows,
)
from drafters.eagle3 import Eagle3Config, Eagle3Drafter, fuse_features
from drafters.losses import soft_cross_entropy_draft_vocab
from drafters.training.eagle3 import TTTOptions, ttt_loss
from drafters.training.loop import FeatureBatch

CONVERSATIONS = [
    [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "An apple."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there!"}],
]


def chat_batch(tokenizer):
    """Right-padded ChatML rows; loss mask on the assistant reply and its <|im_end|>."""
    rows, masks = [], []
    for messages in CONVERSATIONS:
        prompt = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True,
                                               tokenize=False)
        reply = messages[1]["content"] + "<|im_end|>"
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        reply_ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
        rows.append(prompt_ids + reply_ids)
        masks.append([0] * len(prompt_ids) + [1] * len(reply_ids))
    seq_len = max(len(row) for row in rows)
    input_ids = torch.tensor([row + [0] * (seq_len - len(row)) for row in rows])
    loss_mask = torch.tensor([mask + [0] * (seq_len - len(mask)) for mask in masks])
    return input_ids, loss_mask


def target_inputs(model, tokenizer, layers):
    input_ids, loss_mask = chat_batch(tokenizer)
    with torch.no_grad():
        out = model(input_ids, attention_mask=(input_ids != 0).long(), output_hidden_states=True)
    return fuse_features(out.hidden_states, layers), input_ids, out.logits, loss_mask


def make_drafter(model, input_ids, loss_mask, draft_vocab_size=64, seed=0):
    config = Eagle3Config.from_target_config(model.config, draft_vocab_size)
    vocab = build_draft_vocab([(input_ids, loss_mask)], config.vocab_size, draft_vocab_size)
    torch.manual_seed(seed)
    return Eagle3Drafter(config, vocab)


def decode_reference(drafter, features, input_ids, embed, t, steps):
    """Draft from position t as the decoder does: prefill step-0 inputs (feature_s, token_{s+1})
    for s = 0..t into a KV cache, then feed the drafter's own output hidden back, one step at a
    time, with token_{t+1+i} (the tokens TTT teacher-forces) at RoPE position t+i."""
    cache = DraftKVCache()
    hidden, logits = drafter.prefill(features[:, :t + 1], input_ids[:, 1:t + 2], embed, cache)
    step_logits, hidden = [logits[:, t]], hidden[:, t:t + 1]
    for i in range(1, steps):
        positions = torch.tensor([[t + i]])
        hidden, logits = drafter.step(hidden, input_ids[:, t + 1 + i:t + 2 + i], embed, cache,
                                      positions=positions)
        step_logits.append(logits[:, 0])
    assert len(cache) == t + steps
    return step_logits  # step i: (B, Vd)


def assert_ttt_matches_decoding(drafter, batch: FeatureBatch, positions):
    """TTT step i's logits at each position t == the decoder's i-th draft from t (decode_reference), i < STEPS."""
    with torch.no_grad():
        out = ttt_loss(drafter, batch, TTTOptions(steps=STEPS), return_logits=True)
        for t in positions:
            reference = decode_reference(drafter, batch.features, batch.input_ids, batch.embed, t, STEPS)
            for i in range(STEPS):
                torch.testing.assert_close(out.step_logits[i][:, t], reference[i], atol=1e-5, rtol=0)


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_gemma3"])
def setup(request):
    model, tokenizer = request.getfixturevalue(request.param)
    config = Eagle3Config.from_target_config(model.config, 64)
    features, input_ids, logits, loss_mask = target_inputs(model, tokenizer, config.aux_layers)
    drafter = make_drafter(model, input_ids, loss_mask)
    return model, drafter, features, input_ids, logits, loss_mask


STEPS = 4


def test_ttt_equals_step_by_step_decoding_with_kv_cache(setup):
    model, drafter, features, input_ids, logits, loss_mask = setup
    embed = model.get_input_embeddings()
    seq_len = input_ids.shape[1]
    assert_ttt_matches_decoding(drafter, FeatureBatch(features, input_ids, logits, loss_mask, embed),
                                (0, 3, seq_len // 2, seq_len - 1 - STEPS))


@pytest.mark.parametrize("tv_weight", [0.0, 1.0])
def test_fused_lm_head_loss_equals_the_logits_path(setup, tv_weight):
    # ttt_loss's training path fuses the LM head into the soft CE (drafters.losses.linear_soft_cross_entropy);
    # return_logits=True builds every step's logits and scores them unfused: same losses and gradients
    model, drafter, features, input_ids, logits, loss_mask = setup
    embed = model.get_input_embeddings()
    results = []
    for return_logits in (True, False):
        drafter.zero_grad()
        out = ttt_loss(drafter, FeatureBatch(features, input_ids, logits, loss_mask, embed),
                       TTTOptions(steps=STEPS, tv_weight=tv_weight), return_logits=return_logits)
        out.loss.backward()
        results.append((out, {n: p.grad.clone() for n, p in drafter.named_parameters()}))
    (reference, reference_grads), (fused, fused_grads) = results
    assert fused.step_logits == [] and reference.loss > 0
    torch.testing.assert_close(fused.step_losses, reference.step_losses, rtol=1e-5, atol=1e-7)
    assert torch.equal(fused.step_accuracies, reference.step_accuracies)
    assert torch.equal(fused.step_counts, reference.step_counts)
    for name, grad in reference_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-7, msg=name)


def full_causal_mask(seq_len, step, device=None):  # WRONG: sees every earlier step's keys <= t
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    return torch.cat([causal] * (step + 1), dim=1)


def latest_step_only_mask(seq_len, step, device=None):  # WRONG: forgets steps 1..i-1
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    blocks = [causal] + [torch.zeros_like(causal)] * (step - 1) + [torch.eye(seq_len).bool()]
    return torch.cat(blocks[:step + 1], dim=1)


def dense_ttt_attention(mask_fn):
    def attend(q, keys, values, step):  # the dense reference path, over a (T, (i+1)T) mask
        mask = mask_fn(q.shape[2], step, q.device)
        return torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
    return attend


@pytest.mark.parametrize("wrong_mask", [full_causal_mask, latest_step_only_mask])
def test_decoding_comparison_catches_a_wrong_ttt_mask(setup, wrong_mask, monkeypatch):
    model, drafter, features, input_ids, logits, loss_mask = setup
    embed = model.get_input_embeddings()
    monkeypatch.setattr(layers, "ttt_attention", dense_ttt_attention(wrong_mask))
    t = input_ids.shape[1] // 2
    with torch.no_grad():
        out = ttt_loss(drafter, FeatureBatch(features, input_ids, logits, loss_mask, embed), TTTOptions(steps=STEPS),
                       return_logits=True)
        reference = decode_reference(drafter, features, input_ids, embed, t, STEPS)
    torch.testing.assert_close(out.step_logits[0][:, t], reference[0], atol=1e-5, rtol=0)
    # step 2: the full-causal mask is wrong from step 1 on, the latest-step-only one from step 2
    assert (out.step_logits[2][:, t] - reference[2]).abs().max() > 1e-3


def attention_inputs(step, dtype, seq_len=13, heads=4, kv_heads=2, dim=16):
    generator = torch.Generator().manual_seed(step)
    q = torch.randn(2, heads, seq_len, dim, generator=generator) * 2
    keys = torch.randn(2, kv_heads, (step + 1) * seq_len, dim, generator=generator) * 2
    values = torch.randn(2, kv_heads, (step + 1) * seq_len, dim, generator=generator)
    return [x.to(dtype).requires_grad_() for x in (q, keys, values)]


@pytest.mark.parametrize("step", [0, 1, 3, 6])
def test_ttt_attention_equals_the_dense_mask_with_gradients(step):
    """The linear-memory TTT attention == softmax under the dense (T, (i+1)T) mask, outputs and the gradients of
    q, keys and values (fp32; GQA with 2 query heads per key head)."""
    results = []
    for attend in (ttt_attention, dense_ttt_attention(ttt_attention_mask)):
        q, keys, values = attention_inputs(step, torch.float32)
        out = attend(q, keys, values, step)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((out, q.grad, keys.grad, values.grad))
    for name, ours, reference in zip(("out", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5, msg=name)


def test_ttt_attention_in_bf16_keeps_the_diagonal_scores_exact():
    # the diagonal scores ride in the query as hi + lo bf16 parts: no worse than the dense path, against fp32
    step = 4
    reference = dense_ttt_attention(ttt_attention_mask)(*attention_inputs(step, torch.float32), step)
    errors = {}
    for name, attend in (("linear", ttt_attention), ("dense", dense_ttt_attention(ttt_attention_mask))):
        out = attend(*attention_inputs(step, torch.bfloat16), step)
        errors[name] = (out.float() - reference).abs().max().item()
    assert errors["linear"] <= 1.5 * errors["dense"] + 1e-3, errors


def test_label_and_input_alignment_on_a_hand_made_sequence():
    batch, seq_len, vocab = 1, 8, 16
    target_logits = torch.eye(vocab)[:seq_len][None] * 10  # row r peaks at id r
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1]])
    input_ids = torch.arange(100, 100 + seq_len)[None]  # token s = 100 + s
    for step in range(3):
        labels, label_mask = ttt_label_rows(target_logits, step), ttt_label_mask(loss_mask, step)
        assert labels.shape == (batch, seq_len - 1 - step, vocab)
        for t in range(seq_len - 1 - step):
            assert int(labels[0, t].argmax()) == t + 1 + step  # target row t+1+i
            expected = int(loss_mask[0, t + 2 + step]) if t + 2 + step < seq_len else 0
            assert int(label_mask[0, t]) == expected  # token t+2+i is supervised
        tokens = ttt_input_ids(input_ids, step)[0]
        assert tokens[: seq_len - 1 - step].tolist() == list(range(101 + step, 100 + seq_len))


@pytest.mark.parametrize("normalize", ["positions", "counted"])
def test_ttt_losses_equal_hand_aligned_decoding_losses(tiny_llama, normalize):
    # End to end: TTT step losses == soft CE of the decode path's logits at (i, t) against the
    # target row t+1+i, masked by loss_mask[t+2+i], normalised as documented.
    model, tokenizer = tiny_llama
    config = Eagle3Config.from_target_config(model.config, 64)
    features, input_ids, logits, loss_mask = target_inputs(model, tokenizer, config.aux_layers)
    drafter = make_drafter(model, input_ids, loss_mask)
    embed, (batch, seq_len), steps = model.get_input_embeddings(), input_ids.shape, 3
    with torch.no_grad():
        out = ttt_loss(drafter, FeatureBatch(features, input_ids, logits, loss_mask, embed),
                       TTTOptions(steps=steps, normalize=normalize), return_logits=True)
        totals, counts = torch.zeros(steps), torch.zeros(steps)
        for t in range(seq_len - 2):
            steps_with_label = min(steps, seq_len - 2 - t)  # token t+2+i must exist
            reference = decode_reference(drafter, features, input_ids, embed, t, steps_with_label)
            for i in range(steps_with_label):
                row = logits[:, t + 1 + i]  # (B, V)
                _, _, count = soft_cross_entropy_draft_vocab(
                    reference[i][:, None], row[:, None], drafter.t2d, loss_mask[:, None, t + 2 + i])
                loss_sum, _, _ = soft_cross_entropy_draft_vocab(
                    reference[i][:, None], row[:, None], drafter.t2d, loss_mask[:, None, t + 2 + i],
                    num_positions=1)
                totals[i] += loss_sum
                counts[i] += count
    expected = totals / (batch * seq_len) if normalize == "positions" else totals / counts
    torch.testing.assert_close(out.step_losses, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.step_counts.float(), counts)
    weights = torch.tensor([1.0, 0.8, 0.64])
    torch.testing.assert_close(out.loss, (weights * expected).sum(), atol=1e-5, rtol=1e-5)


def test_prefill_chunks_and_crop_match_one_prefill(tiny_llama):
    model, tokenizer = tiny_llama
    config = Eagle3Config.from_target_config(model.config, 64)
    features, input_ids, _, loss_mask = target_inputs(model, tokenizer, config.aux_layers)
    drafter, embed = make_drafter(model, input_ids, loss_mask), model.get_input_embeddings()
    next_ids, seq_len = input_ids[:, 1:], input_ids.shape[1] - 1
    with torch.no_grad():
        _, whole = drafter.prefill(features[:, :seq_len], next_ids, embed, DraftKVCache())
        cache = DraftKVCache()
        drafter.prefill(features[:, :5], next_ids[:, :5], embed, cache)
        drafter.prefill(features[:, 5:9], next_ids[:, 5:9], embed, cache)  # 4 rejected drafts
        cache.crop(5)
        _, rest = drafter.prefill(features[:, 5:seq_len], next_ids[:, 5:], embed, cache)
    torch.testing.assert_close(rest, whole[:, 5:], atol=1e-5, rtol=0)


def test_topk_tokens_map_through_d2t(setup):
    model, drafter, *_ = setup
    logits = torch.full((2, 64), -5.0)
    logits[0, 3], logits[1, 63] = 5.0, 5.0
    _, target_ids = drafter.topk_tokens(logits, k=1)
    assert target_ids[:, 0].tolist() == drafter.draft_vocab.used[[3, 63]].tolist()


def test_soft_ce_matches_hand_computation():
    t2d = torch.tensor([True, False, True, True, False])  # draft vocab = target ids 0, 2, 3
    target = torch.tensor([[[2.0, 0.0, 1.0, -1.0, 0.5],   # argmax 0: counted
                            [0.0, 3.0, 1.0, 0.0, 0.0],    # argmax 1 (out of vocab): masked
                            [0.0, 0.0, 0.5, 2.0, 0.0],    # argmax 3: counted
                            [0.0, 0.0, 4.0, 0.0, 0.0]]])  # loss_mask 0: masked
    draft = torch.tensor([[[0.5, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 2.0, 1.0], [0.0, 0.0, 1.0]]])
    loss_mask = torch.tensor([[1, 1, 1, 0]])

    def ce(target_row, draft_row):  # -sum_d p_d log q_d, p renormalised over ids 0, 2, 3
        p = torch.softmax(torch.tensor([target_row[0], target_row[2], target_row[3]]), 0)
        return -(p * torch.log_softmax(draft_row, 0)).sum()

    expected_sum = ce(target[0, 0], draft[0, 0]) + ce(target[0, 2], draft[0, 2])
    loss, accuracy, count = soft_cross_entropy_draft_vocab(draft, target, t2d, loss_mask)
    assert int(count) == 2
    torch.testing.assert_close(loss, expected_sum / 2)
    # position 0: draft argmax 1 -> target id 2 != 0 (wrong); position 2: 1 -> 2 != 3 (wrong)
    assert float(accuracy) == 0.0
    draft[0, 2] = torch.tensor([0.0, 0.0, 3.0])  # draft id 2 -> target id 3 == argmax: right
    _, accuracy, _ = soft_cross_entropy_draft_vocab(draft, target, t2d, loss_mask)
    assert float(accuracy) == 0.5
    loss_all, _, _ = soft_cross_entropy_draft_vocab(draft, target, t2d, loss_mask, num_positions=4)
    expected_sum = ce(target[0, 0], draft[0, 0]) + ce(target[0, 2], draft[0, 2])
    torch.testing.assert_close(loss_all, expected_sum / 4)


# Produced once by printing `losses` in the test below (tiny-random-llama, seed 0, draft vocab 64,
# K=3, AdamW lr 3e-3, 6 steps; torch 2.13.0 CPU, transformers 5.23, 1 thread).
GOLDEN = [0.997812032699585, 0.9923856854438782, 0.9768880605697632, 0.9694072604179382,
          0.9666265249252319, 0.9661418199539185]


def test_training_reproduces_golden_losses_and_leaves_target_untouched(tiny_llama):
    model, tokenizer = tiny_llama
    config = Eagle3Config.from_target_config(model.config, 64)
    features, input_ids, logits, loss_mask = target_inputs(model, tokenizer, config.aux_layers)
    drafter = make_drafter(model, input_ids, loss_mask, seed=0)
    embed = model.get_input_embeddings()
    target_before = {name: p.detach().clone() for name, p in model.state_dict().items()}
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        out = ttt_loss(drafter, FeatureBatch(features, input_ids, logits, loss_mask, embed), TTTOptions(steps=3))
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        losses.append(out.loss.item())
    assert losses[-1] < losses[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(GOLDEN), rtol=1e-4, atol=0)
    for name, p in model.state_dict().items():
        assert torch.equal(p, target_before[name]), f"target tensor {name} changed"
    assert all(p.grad is None for p in model.parameters())
    assert all(p is not embed.weight and p.data_ptr() != embed.weight.data_ptr()
               for p in drafter.parameters())
    assert not any("embed" in key for key in drafter.state_dict())


def test_state_dict_names_are_the_serving_names(setup):
    _, drafter, *_ = setup
    assert set(drafter.state_dict()) == {
        "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
        *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
        *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
        *(f"midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm",
                                           "post_attention_layernorm")),
    }
    h = drafter.config.hidden_size
    assert drafter.midlayer.self_attn.q_proj.weight.shape[1] == 2 * h
    assert drafter.fc.weight.shape == (h, 3 * h)
    assert drafter.lm_head.weight.shape == (64, h)


def test_init_from_target_copies_draft_vocab_rows(setup):
    model, drafter, *_ = setup
    drafter = Eagle3Drafter(drafter.config, drafter.draft_vocab)
    drafter.init_from_target(model.get_output_embeddings().weight)
    used = drafter.draft_vocab.used
    assert torch.equal(drafter.lm_head.weight, model.get_output_embeddings().weight[used])


def test_config_from_targets(tiny_llama, tiny_gemma3):
    gemma = Eagle3Config.from_target_config(tiny_gemma3[0].config, 32)
    assert gemma.hidden_act == "gelu_pytorch_tanh" and gemma.head_dim == 16
    assert gemma.rope_theta == 1e6 and gemma.rope_scaling is None  # full-attention layers' rope
    assert gemma.aux_layers == [2, 4, 5] and gemma.max_position_embeddings == 1024
    rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    target = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                         max_position_embeddings=512, rope_parameters=rope)
    config = Eagle3Config.from_target_config(target, 100, layers=[1, 3, 6])
    assert config.rope_theta == 5e5 and config.rope_scaling["rope_type"] == "llama3"
    assert config.head_dim == 16 and config.aux_layers == [1, 3, 6]
    drafter = Eagle3Drafter(config)
    assert drafter.rotary_emb.rope_type == "llama3"
    with pytest.raises(ValueError, match="aux layers"):
        Eagle3Config.from_target_config(target, 100, layers=[2, 2, 5])
    with pytest.raises(ValueError, match="draft_vocab_size"):
        Eagle3Config.from_target_config(target, 101)


def test_init_layer_from_target_makes_the_hidden_stream_that_layer(tiny_llama):
    """With the embed half of q/k/v at zero, the drafter's layer on hidden x computes exactly the target
    layer on x (same RoPE, causal attention): the init copies every weight to its place."""
    model, _ = tiny_llama
    drafter = Eagle3Drafter(Eagle3Config.from_target_config(model.config, 64))
    layer = model.model.layers[-1]
    drafter.init_layer_from(layer)
    torch.manual_seed(0)
    x, embeds = torch.randn(2, 7, model.config.hidden_size), torch.randn(2, 7, model.config.hidden_size)
    positions = torch.arange(7)[None]
    with torch.no_grad():
        mine, _ = drafter.backbone(embeds, x, positions, None, torch.ones(7, 7, dtype=torch.bool).tril())
        cos_sin = model.model.rotary_emb(x, positions)
        theirs = layer(x, attention_mask=None, position_ids=positions, position_embeddings=cos_sin)
    theirs = theirs[0] if isinstance(theirs, tuple) else theirs
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    assert drafter.midlayer.self_attn.q_proj.weight[:, :model.config.hidden_size].abs().sum() == 0


def test_init_layer_refuses_a_layer_it_cannot_hold(tiny_gemma3):
    model, _ = tiny_gemma3
    drafter = Eagle3Drafter(Eagle3Config.from_target_config(model.config, 64))
    with pytest.raises(ValueError, match="Llama-style.*leave init_layer unset"):
        drafter.init_layer_from(model.model.layers[-1])


NORMS = [{"norm_before_fc": True}, {"fc_norm": True}, {"norm_before_residual": True}]


def norm_drafter(model, input_ids, loss_mask, norms):
    config = Eagle3Config.from_target_config(model.config, 64, **norms)
    vocab = build_draft_vocab([(input_ids, loss_mask)], config.vocab_size, 64)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(config, vocab)
    with torch.no_grad():  # norms at their init (ones) would hide a norm applied to the wrong slice
        for name, param in drafter.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return drafter


@pytest.mark.parametrize("norms", NORMS, ids=lambda n: next(iter(n)))
def test_norm_options_keep_ttt_equal_to_step_by_step_decoding(tiny_llama, norms):
    model, tokenizer = tiny_llama
    layers = Eagle3Config.from_target_config(model.config, 64).aux_layers
    features, input_ids, logits, loss_mask = target_inputs(model, tokenizer, layers)
    drafter, embed = norm_drafter(model, input_ids, loss_mask, norms), model.get_input_embeddings()
    assert_ttt_matches_decoding(drafter, FeatureBatch(features, input_ids, logits, loss_mask, embed), (0, 3))


def rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def test_norm_options_compute_what_speculators_names_them(tiny_llama):
    """norm_before_fc: one RMSNorm over the n*h fused features; fc_norm: one per aux layer's h slice;
    norm_before_residual: the residual is hidden_norm(h) (with hidden_norm at weight 1, idempotent, the
    layer on h equals the plain layer on hidden_norm(h))."""
    model, tokenizer = tiny_llama
    h = model.config.hidden_size
    input_ids, loss_mask = chat_batch(tokenizer)
    features = torch.randn(2, 5, 3 * h)
    with torch.no_grad():
        d = norm_drafter(model, input_ids, loss_mask, {"norm_before_fc": True})
        expected = d.fc(rms(features, d.input_norm.weight, d.config.rms_norm_eps))
        torch.testing.assert_close(d.project_hidden_states(features), expected)
        d = norm_drafter(model, input_ids, loss_mask, {"fc_norm": True})
        parts = [rms(p, n.weight, d.config.rms_norm_eps) for p, n in zip(features.split(h, -1), d.fc_norm)]
        torch.testing.assert_close(d.project_hidden_states(features), d.fc(torch.cat(parts, -1)))
        normed = norm_drafter(model, input_ids, loss_mask, {"norm_before_residual": True})
        plain = Eagle3Drafter(Eagle3Config.from_target_config(model.config, 64))
        plain.load_state_dict(normed.state_dict())
        for d in (normed, plain):
            d.midlayer.hidden_norm.weight.fill_(1.0)
        x, e, pos = torch.randn(2, 5, h), torch.randn(2, 5, h), torch.arange(5)[None]
        mask = torch.ones(5, 5, dtype=torch.bool).tril()
        x_normed = rms(x, 1.0, normed.config.rms_norm_eps)
        torch.testing.assert_close(normed.backbone(e, x, pos, None, mask)[0],
                                   plain.backbone(e, x_normed, pos, None, mask)[0], rtol=1e-4, atol=1e-5)
        assert not torch.allclose(plain.backbone(e, x, pos, None, mask)[0], normed.backbone(e, x, pos, None, mask)[0])
    with pytest.raises(ValueError, match="set one of them"):
        Eagle3Config.from_target_config(model.config, 64, norm_before_fc=True, fc_norm=True)


def deeper_drafter(model, input_ids, loss_mask, num_layers=3):
    """A drafter of num_layers decoder layers whose deeper layers hold random (not identity) weights."""
    config = Eagle3Config.from_target_config(model.config, 64, num_layers=num_layers)
    vocab = build_draft_vocab([(input_ids, loss_mask)], config.vocab_size, 64)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(config, vocab)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if name.startswith("layers.") and "norm" in name:
                param.uniform_(0.5, 1.5)
    return drafter


@pytest.mark.parametrize("model_name", ["tiny_llama", "tiny_gemma3"])
def test_a_deeper_drafter_keeps_ttt_equal_to_step_by_step_decoding(request, model_name):
    # three layers: their keys ride in one cache, stacked along the head axis; a layer reading another's heads, or
    # a step seeing the wrong keys of a deeper layer, changes the logits
    model, tokenizer = request.getfixturevalue(model_name)
    layers = Eagle3Config.from_target_config(model.config, 64).aux_layers
    features, input_ids, logits, loss_mask = target_inputs(model, tokenizer, layers)
    drafter, embed = deeper_drafter(model, input_ids, loss_mask), model.get_input_embeddings()
    assert sorted(k for k in drafter.state_dict() if k.startswith("layers.") and k.endswith("o_proj.weight")) == \
        ["layers.1.self_attn.o_proj.weight", "layers.2.self_attn.o_proj.weight"]
    assert_ttt_matches_decoding(drafter, FeatureBatch(features, input_ids, logits, loss_mask, embed),
                                (0, 3, input_ids.shape[1] - 1 - STEPS))


def test_a_deeper_layer_computes_a_llama_decoder_layer_on_the_hidden_stream(tiny_llama):
    # layer 1 by hand: pre-norm attention over its own keys (causal), then the pre-norm MLP, both residual
    model, tokenizer = tiny_llama
    layers = Eagle3Config.from_target_config(model.config, 64).aux_layers
    features, input_ids, _, loss_mask = target_inputs(model, tokenizer, layers)
    drafter, embed = deeper_drafter(model, input_ids, loss_mask, num_layers=2), model.get_input_embeddings()
    c, deeper = drafter.config, drafter.layers["1"]
    with torch.no_grad():
        embeds, hidden = embed(input_ids[:, 1:]), drafter.project_hidden_states(features[:, :-1])
        T = hidden.shape[1]
        positions = torch.arange(T)[None]
        cos, sin = drafter.rotary_emb(hidden, positions)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        first, _ = drafter.midlayer(embeds, hidden, cos, sin, None, causal)
        x = rms(first, deeper.input_layernorm.weight, c.rms_norm_eps)
        q = (x @ deeper.self_attn.q_proj.weight.T).view(2, T, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = (x @ deeper.self_attn.k_proj.weight.T).view(2, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = (x @ deeper.self_attn.v_proj.weight.T).view(2, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        rep = c.num_attention_heads // c.num_key_value_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = (q @ k.transpose(-1, -2)) / c.head_dim ** 0.5
        scores = scores.masked_fill(~causal, float("-inf"))
        attn = (scores.softmax(-1) @ v).transpose(1, 2).flatten(2) @ deeper.self_attn.o_proj.weight.T
        h = first + attn
        m = rms(h, deeper.post_attention_layernorm.weight, c.rms_norm_eps)
        mlp = deeper.mlp
        h = h + (F.silu(m @ mlp.gate_proj.weight.T) * (m @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
        out, _ = drafter.prefill(features[:, :-1], input_ids[:, 1:], embed, DraftKVCache())
        torch.testing.assert_close(out, h, atol=1e-5, rtol=1e-5)
        deeper.start_as_identity()
        out, _ = drafter.prefill(features[:, :-1], input_ids[:, 1:], embed, DraftKVCache())
        torch.testing.assert_close(out, first, atol=0, rtol=0)


def test_a_drafter_without_layers_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="num_hidden_layers=0"):
        Eagle3Config.from_target_config(tiny_llama[0].config, 64, num_layers=0)


# ---- speculators' training defaults: norm_output, sliding-window layers (docs/conventions.md) -----------------------

WINDOW = 3  # positions: the tiny rows are ~20 tokens, so most keys fall outside it
SPECULATORS_OPTIONS = [
    {"norm_output": True},
    {"layer_types": ["sliding_attention"], "sliding_window": WINDOW},
    {"norm_output": True, "norm_before_fc": True, "norm_before_residual": True,
     "layer_types": ["sliding_attention"], "sliding_window": WINDOW},  # speculators 0.9's eagle3 defaults
    {"num_layers": 2, "layer_types": ["full_attention", "sliding_attention"], "sliding_window": WINDOW},
]


def options_drafter(model, input_ids, loss_mask, options):
    config = Eagle3Config.from_target_config(model.config, 64, **options)
    vocab = build_draft_vocab([(input_ids, loss_mask)], config.vocab_size, 64)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(config, vocab)
    with torch.no_grad():  # norms off their init (ones): a norm applied twice or not at all changes the logits
        for name, param in drafter.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return drafter


@pytest.mark.parametrize("options", SPECULATORS_OPTIONS, ids=["norm_output", "window", "speculators", "two_layers"])
def test_speculators_options_keep_ttt_equal_to_step_by_step_decoding(tiny_llama, options):
    model, tokenizer = tiny_llama
    layers = Eagle3Config.from_target_config(model.config, 64).aux_layers
    features, input_ids, logits, loss_mask = target_inputs(model, tokenizer, layers)
    drafter, embed = options_drafter(model, input_ids, loss_mask, options), model.get_input_embeddings()
    seq_len = input_ids.shape[1]
    assert_ttt_matches_decoding(drafter, FeatureBatch(features, input_ids, logits, loss_mask, embed),
                                (0, 3, seq_len // 2, seq_len - 1 - STEPS))


def test_the_window_and_norm_output_change_what_is_drafted(tiny_llama):
    # controls: the same weights without the option draft otherwise (the option is not silently ignored)
    model, tokenizer = tiny_llama
    layers = Eagle3Config.from_target_config(model.config, 64).aux_layers
    features, input_ids, _, loss_mask = target_inputs(model, tokenizer, layers)
    embed, t = model.get_input_embeddings(), input_ids.shape[1] // 2
    plain = options_drafter(model, input_ids, loss_mask, {})
    with torch.no_grad():
        want = decode_reference(plain, features, input_ids, embed, t, STEPS)
        for options in SPECULATORS_OPTIONS[:2]:
            drafter = options_drafter(model, input_ids, loss_mask, options)
            drafter.load_state_dict(plain.state_dict())
            got = decode_reference(drafter, features, input_ids, embed, t, STEPS)
            assert not torch.allclose(got[-1], want[-1], atol=1e-3), options


def test_norm_output_and_the_window_compute_what_speculators_names_them(tiny_llama):
    """norm_output: the step's output hidden is norm(layer output) and lm_head reads it as it is (no second norm);
    a sliding layer at position p sees the keys at positions p - window + 1 .. p only (HF's and vLLM's rule)."""
    model, tokenizer = tiny_llama
    h = model.config.hidden_size
    input_ids, loss_mask = chat_batch(tokenizer)
    x, e, pos = torch.randn(1, 6, h), torch.randn(1, 6, h), torch.arange(6)[None]
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    with torch.no_grad():
        plain = options_drafter(model, input_ids, loss_mask, {})
        post = options_drafter(model, input_ids, loss_mask, {"norm_output": True})
        post.load_state_dict(plain.state_dict())
        out, _ = plain.backbone(e, x, pos, None, causal)
        normed, _ = post.backbone(e, x, pos, None, causal)
        torch.testing.assert_close(normed, plain.norm(out))
        torch.testing.assert_close(post.compute_logits(normed), plain.compute_logits(out))
        windowed = options_drafter(model, input_ids, loss_mask, {"layer_types": ["sliding_attention"],
                                                                 "sliding_window": WINDOW})
        windowed.load_state_dict(plain.state_dict())
        banded = causal & ~torch.ones(6, 6, dtype=torch.bool).tril(-WINDOW)  # keys p - 2 .. p
        torch.testing.assert_close(windowed.backbone(e, x, pos, None, causal, key_positions=pos)[0],
                                   plain.backbone(e, x, pos, None, banded)[0])
    with pytest.raises(ValueError, match="one of .* per decoder layer"):
        Eagle3Config.from_target_config(model.config, 64, layer_types=["sliding_attention"] * 2)
    with pytest.raises(ValueError, match="sliding_window=None"):
        Eagle3Config.from_target_config(model.config, 64, layer_types=["sliding_attention"])


def test_norm_output_fused_loss_equals_the_logits_path(tiny_llama):
    # the fused LM-head loss reads head_input (no second norm under norm_output), as compute_logits does
    model, tokenizer = tiny_llama
    layers = Eagle3Config.from_target_config(model.config, 64).aux_layers
    features, input_ids, logits, loss_mask = target_inputs(model, tokenizer, layers)
    drafter, embed = options_drafter(model, input_ids, loss_mask, SPECULATORS_OPTIONS[2]), model.get_input_embeddings()
    with torch.no_grad():
        batch = FeatureBatch(features, input_ids, logits, loss_mask, embed)
        reference = ttt_loss(drafter, batch, TTTOptions(steps=STEPS), return_logits=True)
        fused = ttt_loss(drafter, batch, TTTOptions(steps=STEPS))
    torch.testing.assert_close(fused.step_losses, reference.step_losses, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_dpace_step_weights_are_the_gradient_of_the_expected_accepted_length(alpha):
    # E[L] = sum_j prod_{k<=j} s_k with s_k = (1 - alpha) a_k + alpha: the weight of step i is dE[L] / dlog s_i,
    # here by autograd, independently of dpace_step_weights' closed form; relative to step 0's
    from drafters.training.eagle3 import dpace_step_weights

    accuracies = torch.tensor([0.55, 0.3, 0.2, 0.1])
    log_s = torch.log((1 - alpha) * accuracies + alpha).requires_grad_()
    expected_length = torch.cumprod(log_s.exp(), 0).sum()
    (grad,) = torch.autograd.grad(expected_length, log_s)
    weights = dpace_step_weights(accuracies, torch.ones(4), alpha)
    torch.testing.assert_close(weights, grad / grad[0])
    if alpha == 1.0:  # no acceptance left in it: K - i, scaled
        torch.testing.assert_close(weights, torch.tensor([4.0, 3.0, 2.0, 1.0]) / 4)
    # a step with nothing counted (every row too short for it) multiplies the chain by 1 and is left out of the sums
    skipped = dpace_step_weights(torch.tensor([0.55, 0.0, 0.2, 0.1]), torch.tensor([5, 0, 3, 2]), alpha)
    s = (1 - alpha) * torch.tensor([0.55, 1.0, 0.2, 0.1]) + alpha
    p0, p2, p3 = s[0], s[0] * s[2], s[0] * s[2] * s[3]
    torch.testing.assert_close(skipped, torch.stack([p0 + p2 + p3, p2 + p3, p2 + p3, p3]) / (p0 + p2 + p3))


def test_ttt_loss_weighs_steps_by_dpace_when_asked(setup):
    from drafters.training.eagle3 import dpace_step_weights

    model, drafter, features, input_ids, logits, loss_mask = setup
    batch = FeatureBatch(features, input_ids, logits, loss_mask, model.get_input_embeddings())
    fixed = ttt_loss(drafter, batch, TTTOptions(steps=STEPS))
    dpace = ttt_loss(drafter, batch, TTTOptions(steps=STEPS, step_weights="dpace", dpace_alpha=0.5))
    torch.testing.assert_close(dpace.step_losses, fixed.step_losses)  # the weights alone differ
    weights = dpace_step_weights(fixed.step_accuracies, fixed.step_counts, 0.5)
    torch.testing.assert_close(dpace.loss, (weights * fixed.step_losses).sum())
    assert not torch.allclose(dpace.loss, fixed.loss)
    dpace.loss.backward()  # the weights are constants: the gradient flows through the step losses only
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in drafter.parameters())


@pytest.mark.parametrize("change, message", [
    ({"step_weights": "learned"}, "eagle3.step_weights='learned': use fixed"),
    ({"dpace_alpha": 1.5}, r"eagle3.dpace_alpha=1.5 must be in \[0, 1\]"),
])
def test_step_weight_settings_are_checked(change, message):
    from drafters.training.eagle3 import Eagle3Options, check_eagle3

    problems = check_eagle3(Eagle3Options(**change), None)
    assert len(problems) == 1
    assert re.search(message, problems[0]), problems
