"""DFlash exports (drafters.export.dflash): round trips through the independent reader for SGLang's DFlash
drafter and speculators' `dflash`, engine layer ids, refusals before anything is written, the reader failing
on each corruption, and an exported drafter drafting the same trees as its checkpoint in the decoder."""

import json
import shutil
from dataclasses import asdict

import pytest
import torch
from safetensors.torch import load_file, save_file

from drafters.checkpoint import load_checkpoint, save_checkpoint, target_info
from drafters.dflash import DFlashConfig, DFlashDrafter
from drafters.draft_vocab import build_draft_vocab
from drafters.export.reading import ExportCheckError
from drafters.export.dflash import check_dflash_export, read_dflash_export
from drafters.export.dispatch import ExportError, export_checkpoint
from drafters.targets import load_target
from conftest import load_script  # tests/ is on sys.path under pytest

main = load_script("eval/export.py").main
WEIGHTS, BLOCK = "model.safetensors", 5


@pytest.fixture(scope="module")
def target():
    return load_target("tiny-random-llama")  # 8 layers: HF aux layers [2, 4, 5]


def save_dflash(path, target, draft_vocab: int):
    config = DFlashConfig.from_target_config(target.config, draft_vocab, mask_token_id=7, num_layers=2,
                                             block_size=BLOCK)
    counts = (torch.arange(target.vocab_size) * 7919) % 101  # a non-trivial kept-id set
    vocab = build_draft_vocab(counts, target.vocab_size, draft_vocab)
    torch.manual_seed(0)
    drafter = DFlashDrafter(config, vocab)
    with torch.no_grad():  # move norms off 1.0 so a swapped or dropped norm changes the logits
        for param in drafter.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return save_checkpoint(path, family="dflash", config=asdict(config), target=target_info(target),
                           state_dict=drafter.state_dict())


@pytest.fixture(scope="module")
def full(tmp_path_factory, target):  # full vocabulary: exports to both engines
    return save_dflash(tmp_path_factory.mktemp("native") / "full", target, target.vocab_size)


@pytest.fixture(scope="module")
def reduced(tmp_path_factory, target):  # 64 of 259 ids: vllm only, with the target's head rows
    return save_dflash(tmp_path_factory.mktemp("native") / "reduced", target, 64)


@pytest.fixture(scope="module")
def exports(tmp_path_factory, full, reduced, target):
    root = tmp_path_factory.mktemp("exports")
    return {"sglang": export_checkpoint(full, "sglang", root / "sglang").path,
            "vllm": export_checkpoint(full, "vllm", root / "vllm", target=target).path,
            "vllm-reduced": export_checkpoint(reduced, "vllm", root / "vllm-reduced", target=target).path}


def read_config(path):
    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize("source, fmt", [("full", "sglang"), ("full", "vllm"), ("reduced", "vllm")])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_round_trip(tmp_path, request, target, source, fmt, dtype):
    ckpt = request.getfixturevalue(source)
    result = export_checkpoint(ckpt, fmt, tmp_path / "out", target=target, dtype=dtype)
    report = result.check
    assert report.family == "dflash" and report.max_logit_diff <= 1e-5
    assert (report.max_logit_diff_vs_source > 0) == (dtype == "bf16")  # bf16 rounding shows only there
    assert report.aux_layers_hf == [2, 4, 5]
    config, state, head, _, _ = read_dflash_export(result.path, fmt, target=target_info(target))
    assert asdict(config) == load_checkpoint(ckpt).config
    if source == "reduced":  # the target's head rows of the draft vocabulary, in the export dtype
        used = torch.arange(64) + state["d2t"]
        assert torch.equal(head, target.lm_head.weight.detach()[used].to(head.dtype))
    else:
        assert head is None and bool(state["t2d"].all())


def test_engine_layer_ids_mask_token_and_block(exports):
    sglang, vllm = read_config(exports["sglang"]), read_config(exports["vllm"])
    assert sglang["architectures"] == ["DFlashDraftModel"] and sglang["model_type"] == "qwen3"
    assert sglang["dflash_config"] == {"mask_token_id": 7, "target_layer_ids": [1, 3, 4], "block_size": BLOCK}
    assert sglang["num_hidden_layers"] == 2 and sglang["num_target_layers"] == 8 and sglang["block_size"] == BLOCK
    assert sglang["layer_types"] == ["full_attention"] * 2 and sglang["vocab_size"] == 259
    assert vllm["speculators_model_type"] == "dflash" and vllm["aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert vllm["mask_token_id"] == 7 and vllm["block_size"] == BLOCK and vllm["sample_from_anchor"] is False
    assert vllm["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == BLOCK - 1
    assert vllm["transformer_layer_config"]["num_hidden_layers"] == 2
    names = set(load_file(exports["sglang"] / WEIGHTS))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight"} <= names
    assert not {"d2t", "t2d", "lm_head.weight", "embed_tokens.weight"} & names  # the target's, full vocabulary
    assert not {"d2t", "t2d", "lm_head.weight"} & set(load_file(exports["vllm"] / WEIGHTS))
    assert {"d2t", "t2d", "lm_head.weight"} <= set(load_file(exports["vllm-reduced"] / WEIGHTS))


def test_refusals_write_nothing(tmp_path, reduced, full, target):
    with pytest.raises(ExportError, match="draft_vocab_size 64 < the target's 259: SGLang"):
        export_checkpoint(reduced, "sglang", tmp_path / "a", target=target)
    with pytest.raises(ExportError, match="pass --target"):
        export_checkpoint(reduced, "vllm", tmp_path / "b")
    with pytest.raises(ExportError, match="speculative_tokens=5: a DFlash block of 5 drafts 1 .. 4"):
        export_checkpoint(full, "vllm", tmp_path / "c", target=target, speculative_tokens=5)
    with pytest.raises(ExportError, match="not 'medusa'|medusa"):
        export_checkpoint(full, "medusa", tmp_path / "d", target=target)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no output, no staging leftovers


def edit_tensors(change):
    def edit(path):
        tensors = load_file(path / WEIGHTS)
        change(tensors)
        save_file(tensors, path / WEIGHTS)
    return edit


def edit_config(change):
    def edit(path):
        config = read_config(path)
        change(config)
        (path / "config.json").write_text(json.dumps(config))
    return edit


def swap(a, b):  # shapes and dtypes stay valid: only the logits can tell
    def change(tensors):
        tensors[a], tensors[b] = tensors[b], tensors[a]
    return change


CORRUPTIONS = {
    "missing k_norm": ("sglang", edit_tensors(lambda t: t.pop("layers.0.self_attn.k_norm.weight")), "missing"),
    "an embedding": ("sglang", edit_tensors(lambda t: t.update({"embed_tokens.weight": torch.zeros(259, 64)})),
                     "unexpected"),
    "q / k norms swapped": ("sglang", edit_tensors(swap("layers.0.self_attn.q_norm.weight",
                                                        "layers.0.self_attn.k_norm.weight")), "draft logits"),
    "hidden_norm and norm swapped": ("vllm", edit_tensors(swap("hidden_norm.weight", "norm.weight")), "draft logits"),
    "HF ids written for SGLang": ("sglang", edit_config(lambda c: c["dflash_config"].update(
        target_layer_ids=[2, 4, 5])), "aux_layers"),
    "output-of-layer ids written for vLLM": ("vllm", edit_config(lambda c: c.update(
        aux_hidden_state_layer_ids=[1, 3, 4])), "aux_layers"),
    "another mask token": ("vllm", edit_config(lambda c: c.update(mask_token_id=8)), "mask_token_id"),
    "another block size": ("sglang", edit_config(lambda c: c["dflash_config"].update(block_size=8)), "block_size"),
    "DSpark anchor layout": ("vllm", edit_config(lambda c: c.update(sample_from_anchor=True)), "sample_from_anchor"),
    "sliding-window layer": ("sglang", edit_config(lambda c: c.update(
        layer_types=["sliding_attention", "full_attention"])), "sliding-window"),
    "not qwen3 layers": ("vllm", edit_config(lambda c: c["transformer_layer_config"].update(model_type="llama")),
                         "model_type"),
    "shorter context": ("sglang", edit_config(lambda c: c.update(max_position_embeddings=512)),
                        "max_position_embeddings"),
    "too many speculative tokens": ("vllm", edit_config(
        lambda c: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens=BLOCK)), "block_size - 1"),
}


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_reader_fails_on_corruption(tmp_path, exports, full, target, name):
    fmt, corrupt, message = CORRUPTIONS[name]
    copy = shutil.copytree(exports[fmt], tmp_path / fmt)
    check_dflash_export(copy, fmt, target=target_info(target), reference=load_checkpoint(full))  # clean
    corrupt(copy)
    with pytest.raises(ExportCheckError, match=message):
        check_dflash_export(copy, fmt, target=target_info(target), reference=load_checkpoint(full))


def test_reader_fails_on_a_head_that_is_not_the_targets(tmp_path, exports, reduced, target):
    copy = shutil.copytree(exports["vllm-reduced"], tmp_path / "r")
    edit_tensors(lambda t: t["lm_head.weight"].mul_(1.5))(copy)
    with pytest.raises(ExportCheckError, match="not the target's LM head rows"):
        check_dflash_export(copy, "vllm", target=target_info(target), reference=load_checkpoint(reduced),
                            target_head=target.lm_head.weight)


@pytest.mark.parametrize("fmt", ["sglang", "vllm", "vllm-reduced"])
def test_exported_drafter_drafts_exactly_like_its_checkpoint(exports, full, reduced, target, fmt):
    # an export dir is a proposer spec too (eval/tau.py --proposer DIR): the same trees every round
    from drafters.decode.decoder import speculative_generate
    from drafters.decode.proposers.loading import load_proposer
    from drafters.decode.tree import parse_tree_spec

    tree = parse_tree_spec("dynamic:total=8,depth=3,topk=2")
    prompt = torch.tensor([5, 17, 99, 42, 7, 7, 130, 64])
    runs = []
    for source in (reduced if fmt == "vllm-reduced" else full, exports[fmt]):
        proposer = load_proposer(str(source), target, tree)
        trees, propose = [], proposer.propose
        proposer.propose = lambda *a: trees.append(propose(*a)) or trees[-1]  # record, then decode
        out, _ = speculative_generate(target.model, proposer, prompt, max_new_tokens=16, eos_token_ids=set())
        runs.append((out.tolist(), [(t.tokens.tolist(), t.parents.tolist()) for t in trees]))
    assert runs[0] == runs[1]
    assert len(runs[0][1]) >= 10 and all(len(tokens) == 9 for tokens, _ in runs[0][1])  # 8 drafts + root


def test_cli_end_to_end(tmp_path, full, capsys):
    out = tmp_path / "sglang"
    assert main([str(full), "--format", "sglang", "--out", str(out), "--target", "tiny-random-llama",
                 "--dtype", "bf16"]) == 0
    printed = capsys.readouterr().out
    assert f"wrote sglang export (bf16) to {out}" in printed
    assert "validation (sglang, dflash)" in printed and "HF hidden_states [2, 4, 5] -> written [1, 3, 4]" in printed
    assert load_file(out / WEIGHTS)["fc.weight"].dtype == torch.bfloat16
    assert main([str(full), "--format", "vllm", "--out", str(out)]) == 1  # exists: refused
    assert "already exists" in capsys.readouterr().err
