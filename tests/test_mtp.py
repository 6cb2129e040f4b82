"""Native MTP drafters (drafters.mtp) on tiny targets of six architectures whose checkpoints carry an MTP layer
(drafters.tiny.write_tiny_mtp_target): DeepSeek-V3 (MLA + MoE) and GLM-4.5 MoE in DeepSeek's layout, Qwen3-Next
(gated attention + MoE) and Qwen3.5 in Qwen's, and DeepSeek's layout on dense Llama and Qwen3 targets.

    reader        the module read from a checkpoint computes the MTP formula as an independent computation does: the
                  raw safetensors tensors in plain torch around a decoder layer that transformers itself loads from
                  the same files (the MTP layer renamed into the model as layer N)
    lossless      greedy speculative decoding with the MTP proposer equals generate; sampling keeps the target's
                  distribution (chi-square)
    training      the recipe lowers the loss
    export        the target's own layout: every other tensor and config.json bit-identical, the MTP tensors the
                  trained ones, read back as the trained module
    refusals      a target without MTP layers, a layer beyond the count: one sentence naming the field, before work
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import ROOT, continuations, fit_drafter, greedy_reference, save_drafter, train_tiny
from drafters.decode.decoder import speculative_generate
from drafters.decode.proposers.loading import load_drafter_proposer, load_proposer
from drafters.decode.proposers.mtp import mtp_proposer
from drafters.decode.sampling import SamplingConfig, warp
from drafters.decode.tree import parse_tree_spec
from drafters.export.dispatch import export_checkpoint
from drafters.layers import DraftKVCache
from drafters.mtp import MtpDrafter, MtpError, read_mtp, read_target_mtp, tensor_files
from drafters.targets import FrozenHead, load_target
from drafters.tiny import MTP_ARCHITECTURES, build_tiny_target
from drafters.training.families import load_recipe
from drafters.training.loop import FeatureBatch
from drafters.training.mtp import chain_loss
from drafters.training.recipe import RecipeError
from test_sampling import chi_square_pvalue

ARCHS = list(MTP_ARCHITECTURES)
RECIPE = str(ROOT / "recipes" / "mtp_tiny.yaml")
PROMPT, NEW = 8, 12


@pytest.fixture(scope="module")
def cache(tmp_path_factory, monkeypatch_module):
    root = tmp_path_factory.mktemp("drafters-cache")
    monkeypatch_module.setenv("DRAFTERS_CACHE", str(root))  # where recipes' tiny-mtp-* targets are written
    return root / "targets"


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def mtp_target(cache, arch):
    return load_target(f"tiny-mtp-{arch}", cache_dir=str(cache))


def raw(files, name):
    with safe_open(files[name], framework="pt") as f:
        return f.get_tensor(name)


def rms(x, w, eps, centred):  # RMSNorm in float32: x * w, or Qwen's x * (1 + w)
    x = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return x * ((1 + w.float()) if centred else w.float())


def independent_block(path, text, layout, tmp_path):
    """transformers' own model, loaded from the target's files with one more layer: the MTP layer's block as layer N
    (Qwen's mtp.layers.0.* renamed to model.layers.N.* first) -> (that decoder layer, the model's rotary)."""
    n = text.num_hidden_layers
    if layout == "qwen":
        copy = tmp_path / "renamed"
        shutil.copytree(path, copy)
        with safe_open(copy / "model.safetensors", framework="pt") as f:
            tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
        tensors.update({f"model.layers.{n}." + k.removeprefix("mtp.layers.0."): v.clone() for k, v in tensors.items()
                        if k.startswith("mtp.layers.0.")})
        save_file(tensors, copy / "model.safetensors", metadata=meta)
        path = copy
    extra = {"num_hidden_layers": n + 1}
    if getattr(text, "layer_types", None) is not None:
        extra["layer_types"] = list(text.layer_types) + ["full_attention"]
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", **extra).eval()
    return model.model.layers[n], model.model.rotary_emb


# ---------------------------------------------------------------- reader


@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_reader_matches_an_independent_computation_of_the_formula(cache, arch, tmp_path):
    target = mtp_target(cache, arch)
    path, text = Path(target.model.config.name_or_path), target.config.get_text_config()
    files, n, eps = tensor_files(path), text.num_hidden_layers, text.rms_norm_eps
    layout = MTP_ARCHITECTURES[arch]
    if layout == "deepseek":
        p = f"model.layers.{n}."
        names = dict(embed=p + "embed_tokens.weight", e=p + "enorm.weight", h=p + "hnorm.weight",
                     proj=p + "eh_proj.weight", norm=p + "shared_head.norm.weight", head=p + "shared_head.head.weight")
    else:
        names = dict(embed="model.embed_tokens.weight", e="mtp.pre_fc_norm_embedding.weight",
                     h="mtp.pre_fc_norm_hidden.weight", proj="mtp.fc.weight", norm="mtp.norm.weight",
                     head="lm_head.weight")
    w = {k: raw(files, v) for k, v in names.items()}
    g = torch.Generator().manual_seed(0)
    hidden, ids = torch.randn(1, 7, text.hidden_size, generator=g), torch.randint(3, 259, (1, 7), generator=g)
    positions = torch.arange(7)[None]
    centred = layout == "qwen"
    # x = proj(cat[norm_e(embed(token)), norm_h(h)]), block, logits = head(norm(y))
    x = torch.cat([rms(w["embed"][ids], w["e"], eps, centred), rms(hidden, w["h"], eps, centred)], -1) @ w["proj"].T
    block, rotary = independent_block(path, text, layout, tmp_path)
    causal = torch.zeros(7, 7).masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), torch.finfo(torch.float32).min)
    y = block(x, position_embeddings=rotary(x, positions), attention_mask=causal[None, None], position_ids=positions)
    expected = rms(y, w["norm"], eps, centred) @ w["head"].T

    config, state, _ = read_mtp(path, text, 0)
    drafter = MtpDrafter(config).eval()
    drafter.load_state_dict(state, strict=True)
    drafter.attach_head(FrozenHead.from_target(target, "normed"))
    _, logits = drafter.step(hidden, ids, target.embed_tokens, DraftKVCache())
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    # control: the other norm convention (x * w against x * (1 + w)) is caught
    wrong = rms(y, w["norm"], eps, not centred) @ w["head"].T
    assert not torch.allclose(logits, wrong, atol=1e-3)


# ---------------------------------------------------------------- decoding


def fitted(target, steps=40):
    """The target's own MTP layer, fitted a few seconds to its greedy continuations (drafts right and wrong)."""
    config, state = read_target_mtp(target)
    drafter = MtpDrafter(config)
    drafter.load_state_dict(state)
    drafter.attach_head(FrozenHead.from_target(target, "normed"))
    sequences, loss_mask = continuations(target, PROMPT, new_tokens=24, rows=4)
    with torch.no_grad():
        features = target.model(sequences, output_hidden_states=True).hidden_states[-1]
    batch = FeatureBatch(features, sequences, None, loss_mask, target.embed_tokens)
    return fit_drafter(drafter, lambda _: chain_loss(drafter, batch, 2).loss, steps, lr=1e-2), sequences


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_decoding_equals_generate(cache, arch):
    target = mtp_target(cache, arch)
    drafter, sequences = fitted(target)
    accepted = 0
    for tree in ("chain:3", "static:[[0],[1],[0,0]]"):
        proposer = mtp_proposer(drafter.config, drafter.state_dict(), target, tree, "test")
        for prompt in sequences[:2, :PROMPT]:
            out, stats = speculative_generate(target, proposer, prompt, max_new_tokens=NEW)
            assert out.tolist() == greedy_reference(target.model, prompt[None], NEW)[0].tolist(), f"{arch} {tree}"
            accepted += sum(stats.accepted)
    assert accepted > 0  # drafts were accepted: the comparison covered accepted paths too


@pytest.mark.slow
def test_sampled_decoding_keeps_the_target_distribution(cache, tmp_path):
    # chi-square on (token 1, token 2) of 600 sampled generations, as tests/test_sampling.py
    target = mtp_target(cache, "deepseek_v3")
    drafter, sequences = fitted(target)
    path = save_drafter(tmp_path / "ckpt", "mtp", drafter, target)
    proposer = load_drafter_proposer(path, target, "static:[[0],[1],[0,0],[1,0]]")
    model, cfg, prompt = target.model, SamplingConfig(temperature=1.0, top_k=4), sequences[0, :PROMPT]
    counts, exact = sampled_pairs(model, proposer, prompt, cfg)
    assert chi_square_pvalue(counts.flatten(), exact.flatten()) > 1e-3


@torch.no_grad()
def sampled_pairs(model, proposer, prompt, cfg, draws=600):
    """(counts of (token 1, token 2) over `draws` sampled generations, their exact target probabilities)."""
    p1 = warp(model(prompt[None]).logits[0, -1], cfg)
    firsts = p1.nonzero().flatten().tolist()
    p2 = {x: warp(model(torch.cat([prompt, torch.tensor([x])])[None]).logits[0, -1], cfg) for x in firsts}
    columns = {x: p2[x].nonzero().flatten().tolist() for x in firsts}
    gen, counts = torch.Generator().manual_seed(3), torch.zeros(len(firsts), 4)
    for _ in range(draws):
        out, _ = speculative_generate(model, proposer, prompt, max_new_tokens=2, sampling=cfg, generator=gen)
        x1, x2 = out[-2:].tolist()
        counts[firsts.index(x1), columns[x1].index(x2)] += 1
    return counts, torch.stack([p1[x] * p2[x][columns[x]] for x in firsts])


# ---------------------------------------------------------------- training and export


@pytest.fixture(scope="module")
def trained(cache, tmp_path_factory):
    summary, out = train_tiny(tmp_path_factory, RECIPE, "eval_every=0", "log_every=1")
    return summary, out


def test_a_few_steps_lower_the_loss(trained):
    _, out = trained
    losses = [row["loss"] for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
              if "grad_norm" in row]  # the training steps' rows
    assert len(losses) >= 3 and losses[-1] < losses[0]


def mtp_names(names, text, layout):  # the MTP tensors, by the test's own reading of the layouts
    prefix = "mtp." if layout == "qwen" else f"model.layers.{text.num_hidden_layers}."
    return {n for n in names if n.startswith(prefix)}


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_next"])
def test_export_writes_the_targets_own_layout(cache, arch, tmp_path):
    target = mtp_target(cache, arch)
    drafter, sequences = fitted(target, steps=5)
    ckpt = save_drafter(tmp_path / "ckpt", "mtp", drafter, target)
    out = export_checkpoint(ckpt, "mtp", tmp_path / "export", target=target).path
    source = Path(target.model.config.name_or_path)
    text, layout = target.config.get_text_config(), MTP_ARCHITECTURES[arch]
    before, after = tensor_files(source), tensor_files(out)
    assert set(before) == set(after)
    assert (out / "config.json").read_bytes() == (source / "config.json").read_bytes()
    mtp = mtp_names(before, text, layout)
    for name in set(before) - mtp:
        a, b = raw(before, name), raw(after, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    trained_proj = drafter.state_dict()["layer.eh_proj.weight"]
    proj = "mtp.fc.weight" if layout == "qwen" else f"model.layers.{text.num_hidden_layers}.eh_proj.weight"
    assert torch.equal(raw(after, proj), trained_proj) and not torch.equal(raw(before, proj), trained_proj)
    _, state, _ = read_mtp(out, text, 0)
    assert state.keys() == drafter.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in drafter.state_dict().items())
    # the export is a proposer: its layer drafts in the decoder, equal to generate
    proposer = load_proposer(str(out), target, parse_tree_spec("chain:3"))
    prompt = sequences[1, :PROMPT]
    result, _ = speculative_generate(target, proposer, prompt, max_new_tokens=NEW)
    assert result.tolist() == greedy_reference(target.model, prompt[None], NEW)[0].tolist()


def test_recipe_export_round_trip(trained, cache, tmp_path):
    summary, _ = trained
    target = mtp_target(cache, "deepseek_v3")
    out = export_checkpoint(summary.checkpoint, "mtp", tmp_path / "export", target=target).path
    _, state, _ = read_mtp(out, target.config.get_text_config(), 0)
    reference = load_drafter_proposer(summary.checkpoint, target, "chain:1").drafter.state_dict()
    assert all(torch.equal(state[k], v) for k, v in reference.items())


# ---------------------------------------------------------------- refusals


def test_a_target_without_mtp_layers_is_refused_before_any_work(tmp_path):
    model, tokenizer = build_tiny_target("tiny-random-llama")
    model.save_pretrained(tmp_path / "llama")
    tokenizer.save_pretrained(tmp_path / "llama")
    with pytest.raises(RecipeError, match=r"config has no num_nextn_predict_layers / mtp_num_hidden_layers"):
        load_recipe([RECIPE, f"target={tmp_path / 'llama'}"])


def test_mtp_tensors_missing_from_the_files_are_refused(tmp_path):
    from drafters.tiny import build_tiny_architecture

    model, tokenizer = build_tiny_architecture("deepseek_v3")  # its config says 1 MTP layer; transformers saves none
    model.save_pretrained(tmp_path / "ds")
    tokenizer.save_pretrained(tmp_path / "ds")
    with pytest.raises(RecipeError, match=r"num_nextn_predict_layers=1 but the safetensors .* hold no "
                                          r"model\.layers\.8\.enorm\.weight"):
        load_recipe([RECIPE, f"target={tmp_path / 'ds'}"])


def test_a_layer_beyond_the_count_is_refused(cache):
    target = mtp_target(cache, "qwen3_5")
    path = target.model.config.name_or_path
    with pytest.raises(RecipeError, match=r"mtp\.layer=1 is beyond the target's MTP layers \(mtp_num_hidden_layers=1"):
        load_recipe([RECIPE, f"target={path}", "mtp.layer=1"])
    with pytest.raises(MtpError, match=r"mtp\.layer=2 is beyond"):
        read_target_mtp(target, 2)
    config = AutoConfig.from_pretrained(path)
    assert config.get_text_config().mtp_num_hidden_layers == 1
