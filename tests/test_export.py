import json
import shutil
from dataclasses import asdict, replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from drafters.checkpoint import load_checkpoint, save_checkpoint, target_info
from drafters.draft_vocab import build_draft_vocab
from drafters.eagle3 import Eagle3Config, Eagle3Drafter
from drafters.export.common import ExportError
from drafters.export.dispatch import export_checkpoint
from drafters.export.eagle3_reader import check_export
from drafters.export.reading import ExportCheckError
from drafters.decode.sampling import SamplingConfig
from drafters.targets import load_target
from conftest import load_script  # tests/ is on sys.path under pytest


main = load_script("eval/export.py").main

DRAFT_VOCAB = 64


@pytest.fixture(scope="module")
def target():
    return load_target("tiny-random-llama")  # 8 layers: HF aux layers [2, 4, 5]


def save_eagle3(path, target, **config_changes):
    config = Eagle3Config.from_target_config(target.config, draft_vocab_size=DRAFT_VOCAB)
    counts = (torch.arange(target.vocab_size) * 7919) % 101  # a non-trivial kept-id set
    vocab = build_draft_vocab(counts, target.vocab_size, DRAFT_VOCAB)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(config, vocab)
    with torch.no_grad():  # move norms off 1.0 so a swapped or dropped norm changes the logits
        for param in drafter.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    state = drafter.state_dict()
    config = replace(config, **config_changes)
    return save_checkpoint(path, family="eagle3", config=asdict(config),
                           target=target_info(target), state_dict=state)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, target):
    return save_eagle3(tmp_path_factory.mktemp("native") / "ckpt", target)


@pytest.fixture(scope="module")
def exports(tmp_path_factory, ckpt, target):
    root = tmp_path_factory.mktemp("exports")
    return {fmt: export_checkpoint(ckpt, fmt, root / fmt, target=target).path
            for fmt in ("sglang", "vllm", "native")}


def read_config(path):
    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize("fmt", ["sglang", "vllm", "native"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_round_trip(tmp_path, ckpt, target, fmt, dtype):
    out = export_checkpoint(ckpt, fmt, tmp_path / "out", target=target, dtype=dtype).path
    report = check_export(out, fmt, target=target_info(target), reference=load_checkpoint(ckpt))
    assert report.max_logit_diff <= 1e-5
    assert report.aux_layers_hf == [2, 4, 5]
    assert report.float_dtype == {"fp32": "torch.float32", "bf16": "torch.bfloat16"}[dtype]
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["out"]  # no temporary directory left behind


def test_layer_ids_per_engine(exports, ckpt):
    assert load_checkpoint(ckpt).config["aux_layers"] == [2, 4, 5]  # HF hidden_states indices
    sglang = read_config(exports["sglang"])
    assert sglang["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # HF - 1
    assert read_config(exports["vllm"])["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # HF


def test_engine_fields_that_fail_silently(exports, target):
    sglang, vllm = read_config(exports["sglang"]), read_config(exports["vllm"])
    assert sglang["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (sglang["draft_vocab_size"], sglang["vocab_size"]) == (DRAFT_VOCAB, target.vocab_size)
    assert sglang["tie_word_embeddings"] is False and sglang["num_hidden_layers"] == 1
    assert sglang["max_position_embeddings"] == target.max_position_embeddings == 1024
    assert vllm["norm_before_residual"] is False  # residual on the un-normed h; vLLM default True
    assert vllm["transformer_layer_config"]["max_position_embeddings"] == 1024
    assert vllm["speculators_config"]["proposal_methods"][0]["proposal_type"] == "greedy"
    sglang_keys = load_file(exports["sglang"] / "model.safetensors").keys()
    vllm_keys = load_file(exports["vllm"] / "model.safetensors").keys()
    assert "midlayer.hidden_norm.weight" in sglang_keys
    assert "layers.0.hidden_norm.weight" in vllm_keys
    assert not any(k.startswith("midlayer.") for k in vllm_keys)
    assert not any("embed_tokens" in k for k in sglang_keys)  # SGLang always uses the target's


def test_vllm_export_carries_the_target_embedding_and_every_norm_flag(exports, target):
    # speculators 0.9 fills a missing embedding from the verifier only while it is NaN, which it is
    # not under transformers 5.x: without the file's embedding it drafted on uninitialised memory
    # (found by eval/check_consumers.py on SmolLM2: max |logit diff| 1.25)
    tensors = load_file(exports["vllm"] / "model.safetensors")
    assert torch.equal(tensors["embed_tokens.weight"], target.embed_tokens.weight)
    config = read_config(exports["vllm"])
    # speculators' trainer defaults norm_before_fc and norm_output to True: never leave them implicit
    assert (config["norm_before_fc"], config["fc_norm"], config["norm_output"]) == (False, False, False)


def test_vllm_export_without_a_target_has_no_embedding(tmp_path, ckpt):
    out = export_checkpoint(ckpt, "vllm", tmp_path / "out").path
    assert "embed_tokens.weight" not in load_file(out / WEIGHTS)


# ---- the independent reader must fail on each corruption ----------------------------------------

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


def swap_t2d(tensors):  # same count, but a kept id moves: d2t and t2d disagree
    t2d = tensors["t2d"]
    kept, dropped = t2d.nonzero()[0, 0], (~t2d).nonzero()[0, 0]
    t2d[kept], t2d[dropped] = False, True


def swap_norms(tensors):  # shapes and dtypes stay valid: only the logits can tell
    a, b = "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight"
    tensors[a], tensors[b] = tensors[b], tensors[a]


WEIGHTS = "model.safetensors"
CORRUPTIONS = {
    "missing key": ("sglang", edit_tensors(lambda t: t.pop("lm_head.weight")), "missing"),
    "unexpected embedding": ("sglang", edit_tensors(
        lambda t: t.update({"embed_tokens.weight": torch.zeros(259, 64)})), "unexpected"),
    "embedding of another shape": ("vllm", edit_tensors(
        lambda t: t.update({"embed_tokens.weight": torch.zeros(300, 64)})), "embed_tokens"),
    # read (speculators' defaults, vLLM serves them), and not the source's: its logits would differ
    "EAGLE-3.1 output norm": ("vllm", edit_config(lambda c: c.update(norm_output=True)),
                              "config read back differs.*norm_output"),
    "EAGLE-3.1 fc norm in eagle_config": ("sglang", edit_config(
        lambda c: c["eagle_config"].update(norm_before_fc=True)), "norm_before_fc"),
    "sliding-window draft layer": ("vllm", edit_config(lambda c: c["transformer_layer_config"].update(
        layer_types=["sliding_attention"], sliding_window=2048)), "config read back differs.*layer_types"),
    "sliding-window layer for SGLang": ("sglang", edit_config(lambda c: c.update(
        layer_types=["sliding_attention"], sliding_window=2048)), "--speculative-draft-window-size"),
    "sliding layer without a window": ("vllm", edit_config(lambda c: c["transformer_layer_config"].update(
        layer_types=["sliding_attention"], sliding_window=None)), "sliding_window"),
    "wrong shape": ("sglang", edit_tensors(
        lambda t: t.update({"fc.weight": t["fc.weight"][:, :128].contiguous()})), "shapes"),
    "wrong d2t dtype": ("vllm", edit_tensors(
        lambda t: t.update({"d2t": t["d2t"].int()})), "int64"),
    "mixed float dtypes": ("sglang", edit_tensors(
        lambda t: t.update({"norm.weight": t["norm.weight"].bfloat16()})), "float32 or all"),
    "t2d count": ("sglang", edit_tensors(lambda t: t["t2d"].__setitem__(
        t["t2d"].nonzero()[0, 0], False)), "t2d marks"),
    "t2d disagrees with d2t": ("vllm", edit_tensors(swap_t2d), "disagree"),
    "swapped norms": ("sglang", edit_tensors(swap_norms), "draft logits"),
    "HF ids written for SGLang": ("sglang", edit_config(lambda c: c["eagle_config"].update(
        eagle_aux_hidden_state_layer_ids=[2, 4, 5])), "aux_layers"),
    "norm_before_residual missing": ("vllm", edit_config(
        lambda c: c.pop("norm_before_residual")), "norm_before_residual"),
    "tied embeddings": ("sglang", edit_config(
        lambda c: c.update(tie_word_embeddings=True)), "tie_word_embeddings"),
    "draft_vocab_size as string": ("vllm", edit_config(
        lambda c: c.update(draft_vocab_size="64")), "draft_vocab_size"),
    "shorter context": ("vllm", edit_config(lambda c: c["transformer_layer_config"].update(
        max_position_embeddings=512)), "max_position_embeddings"),
}


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_reader_fails_on_corruption(tmp_path, exports, ckpt, target, name):
    fmt, corrupt, message = CORRUPTIONS[name]
    copy = shutil.copytree(exports[fmt], tmp_path / fmt)
    check_export(copy, fmt, target=target_info(target), reference=load_checkpoint(ckpt))  # clean
    corrupt(copy)
    with pytest.raises(ExportCheckError, match=message):
        check_export(copy, fmt, target=target_info(target), reference=load_checkpoint(ckpt))


# ---- refusals: nothing lands in out_dir ---------------------------------------------------------

def assert_nothing_written(tmp_path, out):
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging leftovers


@pytest.mark.parametrize("fmt", ["sglang", "vllm", "native"])
def test_refuses_shorter_context(tmp_path, target, fmt):
    bad = save_eagle3(tmp_path / "ckpt", target, max_position_embeddings=512)
    with pytest.raises(ExportError, match="max_position_embeddings: drafter config 512 != "
                                          "target 1024"):
        export_checkpoint(bad, fmt, tmp_path / "out")
    assert_nothing_written(tmp_path, tmp_path / "out")


@pytest.mark.parametrize("layers", [[2, 4, 8], [0, 4, 5], [2, 4], [5, 4, 2]])
def test_refuses_bad_layer_ids(tmp_path, target, layers):
    bad = save_eagle3(tmp_path / "ckpt", target, aux_layers=layers)
    with pytest.raises(ExportError, match="aux layers"):
        export_checkpoint(bad, "sglang", tmp_path / "out", target=target)
    assert_nothing_written(tmp_path, tmp_path / "out")


def test_refuses_missing_vocab_maps_and_vocab_mismatch(tmp_path, target, ckpt):
    loaded = load_checkpoint(ckpt)
    state = {k: v for k, v in loaded.state_dict.items() if k != "d2t"}
    no_d2t = save_checkpoint(tmp_path / "no_d2t", family="eagle3", config=loaded.config,
                             target=loaded.target, state_dict=state)
    with pytest.raises(ExportError, match="no d2t"):
        export_checkpoint(no_d2t, "vllm", tmp_path / "out")
    other_vocab = save_checkpoint(tmp_path / "vocab", family="eagle3", config=loaded.config,
                                  target={**loaded.target, "vocab_size": 300},
                                  state_dict=loaded.state_dict)
    with pytest.raises(ExportError, match="vocab_size: drafter config 259 != target 300"):
        export_checkpoint(other_vocab, "sglang", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_refuses_other_family_for_engine_formats(tmp_path, target):
    medusa = save_checkpoint(tmp_path / "medusa", family="medusa", config={"num_heads": 2},
                             target=target_info(target),
                             state_dict={"heads.0.weight": torch.ones(2, 2)})
    holds = {"sglang": "sglang holds EAGLE-3, DFlash and DFlash2 drafters",
             "vllm": "vllm holds EAGLE-3, DFlash, DSpark, P-EAGLE and EAGLE-4 drafters"}
    for fmt in ("sglang", "vllm"):
        with pytest.raises(ExportError, match=f"export of a medusa checkpoint to {fmt} is not "
                                              rf"supported \({holds[fmt]}\); use --format medusa or native"):
            export_checkpoint(medusa, fmt, tmp_path / "out")
    assert_nothing_written(tmp_path, tmp_path / "out")
    copy = export_checkpoint(medusa, "native", tmp_path / "out").path  # native copies any family
    assert torch.equal(load_checkpoint(copy).state_dict["heads.0.weight"], torch.ones(2, 2))


def test_refuses_existing_out_dir(tmp_path, ckpt):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="already exists"):
        export_checkpoint(ckpt, "sglang", tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    with pytest.raises(ExportError, match="no export wrote: keep.txt"):  # never deletes what it did not write
        export_checkpoint(ckpt, "sglang", tmp_path / "out", overwrite=True)
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    (tmp_path / "out" / "keep.txt").unlink()
    export_checkpoint(ckpt, "sglang", tmp_path / "out", overwrite=True)  # an empty directory is replaced
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".drafters-export.json", "config.json", WEIGHTS]


# ---- CLI -----------------------------------------------------------------------------------

def test_cli_end_to_end(tmp_path, ckpt, capsys):
    out = tmp_path / "vllm"
    assert main([str(ckpt), "--format", "vllm", "--out", str(out), "--target",
                 "tiny-random-llama", "--dtype", "bf16", "--speculative-tokens", "5"]) == 0
    printed = capsys.readouterr().out
    assert f"wrote vllm export (bf16) to {out}" in printed
    assert "HF hidden_states [2, 4, 5] -> written [2, 4, 5]" in printed
    config = read_config(out)
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert load_file(out / WEIGHTS)["fc.weight"].dtype == torch.bfloat16
    assert main([str(ckpt), "--format", "sglang", "--out", str(out)]) == 1  # exists: refused
    assert "already exists" in capsys.readouterr().err


def test_dtype_in_either_spelling(tmp_path, ckpt, capsys):
    # drafters.dtypes: --dtype bfloat16 is --dtype bf16; anything else is refused naming what is accepted
    out = tmp_path / "sglang"
    assert main([str(ckpt), "--format", "sglang", "--out", str(out), "--dtype", "bfloat16"]) == 0
    assert f"wrote sglang export (bfloat16) to {out}" in capsys.readouterr().out
    assert read_config(out)["torch_dtype"] == "bfloat16"
    assert load_file(out / WEIGHTS)["fc.weight"].dtype == torch.bfloat16
    with pytest.raises(SystemExit):
        main([str(ckpt), "--format", "sglang", "--out", str(tmp_path / "x"), "--dtype", "fp16"])
    assert "'float32', 'bfloat16', 'fp32', 'bf16'" in capsys.readouterr().err
    with pytest.raises(ExportError, match="dtype 'float16' not supported: choose one of float32, bfloat16, fp32, bf16"):
        export_checkpoint(ckpt, "sglang", tmp_path / "y", dtype="float16")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_exported_drafter_drafts_exactly_like_its_checkpoint(exports, ckpt, target, fmt):
    # an export dir is a proposer spec too (eval/tau.py --proposer DIR): the same trees every round
    from drafters.decode.decoder import speculative_generate
    from drafters.decode.proposers.loading import load_proposer
    from drafters.decode.tree import parse_tree_spec

    tree = parse_tree_spec("dynamic:total=8,depth=3,topk=2")
    prompt = torch.tensor([5, 17, 99, 42, 7, 7, 130, 64])
    runs = []
    for source in (ckpt, exports[fmt]):
        proposer = load_proposer(str(source), target, tree)
        trees, propose = [], proposer.propose
        proposer.propose = lambda *a: trees.append(propose(*a)) or trees[-1]  # record, then decode
        out, _ = speculative_generate(target.model, proposer, prompt, max_new_tokens=16, eos_token_ids=set())
        runs.append((out.tolist(), [(t.tokens.tolist(), t.parents.tolist()) for t in trees]))
    assert runs[0] == runs[1]
    assert len(runs[0][1]) >= 10 and all(len(tokens) == 9 for tokens, _ in runs[0][1])  # 8 drafts + root


def test_exported_drafter_for_a_shorter_context_target_is_refused(exports):
    from drafters.decode.proposers.loading import load_proposer
    from drafters.decode.tree import parse_tree_spec

    short = load_target("tiny-random-llama")
    short.config.max_position_embeddings //= 2  # as if the target were another model
    with pytest.raises(ValueError, match="max_position_embeddings"):
        load_proposer(str(exports["sglang"]), short, parse_tree_spec("chain:3"))


def as_speculators_saves_it(path):
    # how speculators 0.9's own save_pretrained writes the same drafter (eval/check_consumers.py
    # saw it): the model class as architecture, transformers 5.x rope_parameters and dtype,
    # target_hidden_size null, an explicit full-attention layer type
    config = read_config(path)
    layer = config["transformer_layer_config"]
    layer["rope_parameters"] = {"rope_theta": layer.pop("rope_theta"), "rope_type": "default"}
    del layer["rope_scaling"], layer["torch_dtype"]
    layer["layer_types"] = ["full_attention"]
    config.update(architectures=["Eagle3DraftModel"], target_hidden_size=None, dtype="float32")
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("embedding", ["target's", "own"])
def test_a_speculators_saved_drafter_drafts_here(tmp_path, exports, target, embedding):
    # speculators' saves were refused here (architectures ['Eagle3DraftModel'], no rope_theta);
    # a drafter with its own embedding drafts with it, as vLLM does
    from drafters.decode.proposers.loading import load_proposer
    from drafters.decode.tree import parse_tree_spec

    copy = shutil.copytree(exports["vllm"], tmp_path / "speculators")
    as_speculators_saves_it(copy)
    if embedding == "own":
        edit_tensors(lambda t: t["embed_tokens.weight"].mul_(-1))(copy)
    prompt, tree = torch.tensor([5, 17, 99, 42, 7, 7, 130, 64]), parse_tree_spec("chain:3")
    outs = []
    for source in (exports["vllm"], copy):
        proposer = load_proposer(str(source), target, tree)
        outs.append(proposer.embed.weight.clone())
        proposer.reset(prompt, target.features(prompt[None], layers=proposer.needs.layers, logits=False))
        outs.append(proposer.propose(prompt, 9, SamplingConfig(temperature=0.0)).tokens)
    assert torch.equal(outs[0], target.embed_tokens.weight)
    assert torch.equal(outs[2], outs[0] if embedding == "target's" else -outs[0])
    assert torch.equal(outs[1], outs[3]) == (embedding == "target's")


@pytest.mark.parametrize("norms", [{"norm_before_fc": True}, {"fc_norm": True}, {"norm_before_residual": True}],
                         ids=lambda n: next(iter(n)))
def test_norm_options_travel_in_the_vllm_layout_and_are_refused_in_sglang(tmp_path, target, norms):
    """The vllm export writes each norm option and its weights; the independent reader rebuilds the drafter from the
    files alone and its draft logits equal the source's (check_export), the decoder's loader reads it back with the
    option on; sglang, written without norm options, refuses the drafter."""
    from drafters.decode.proposers.loading import load_proposer
    from drafters.decode.tree import parse_tree_spec

    config = Eagle3Config.from_target_config(target.config, 32, **norms)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(config)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)  # not at init: a norm dropped on the way would change the logits
    ckpt = save_checkpoint(tmp_path / "ckpt", family="eagle3", config=asdict(config), target=target_info(target),
                           state_dict=drafter.state_dict())
    result = export_checkpoint(ckpt, "vllm", tmp_path / "vllm", target=target)
    written = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert {k: written[k] for k in ("norm_before_fc", "fc_norm", "norm_before_residual")} == \
        {k: norms.get(k, False) for k in ("norm_before_fc", "fc_norm", "norm_before_residual")}
    assert result.check.max_logit_diff <= 1e-5
    proposer = load_proposer(str(tmp_path / "vllm"), target, parse_tree_spec("chain:2"))
    assert all(getattr(proposer.drafter.config, k) == v for k, v in norms.items())
    with pytest.raises(ExportError, match="the sglang layout is written without norm options; export it with "
                                          "--format vllm"):
        export_checkpoint(ckpt, "sglang", tmp_path / "sglang", target=target)


def test_a_deeper_drafter_travels_in_the_vllm_layout_only(tmp_path, target):
    """Three decoder layers: the vllm layout writes num_hidden_layers 3 and layers.0 .. layers.2 (vLLM's llama_eagle3
    builds that many, all but the first reading the hidden stream alone); the independent reader rebuilds the drafter
    from the files and its draft logits equal the source's; decoding from the export proposes the checkpoint's trees.
    SGLang and llama.cpp build one layer: refused, each in one sentence."""
    from drafters.decode.decoder import speculative_generate
    from drafters.decode.proposers.loading import load_proposer
    from drafters.decode.tree import parse_tree_spec
    from drafters.export.llama_cpp import refusals

    config = Eagle3Config.from_target_config(target.config, 32, num_layers=3)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(config)
    with torch.no_grad():  # norms off 1.0: a deeper layer's norm dropped or swapped on the way changes the logits
        for name, param in drafter.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    ckpt = save_checkpoint(tmp_path / "ckpt", family="eagle3", config=asdict(config), target=target_info(target),
                           state_dict=drafter.state_dict())
    result = export_checkpoint(ckpt, "vllm", tmp_path / "vllm", target=target)
    assert read_config(tmp_path / "vllm")["transformer_layer_config"]["num_hidden_layers"] == 3
    names = load_file(tmp_path / "vllm" / "model.safetensors")
    assert {k.split(".")[1] for k in names if k.startswith("layers.")} == {"0", "1", "2"}
    assert names["layers.1.self_attn.q_proj.weight"].shape[1] == target.config.hidden_size  # the hidden stream only
    assert result.check.max_logit_diff <= 1e-5
    tree, prompt, runs = parse_tree_spec("dynamic:total=8,depth=3,topk=2"), torch.tensor([5, 17, 99, 42, 7]), []
    for source in (ckpt, tmp_path / "vllm"):
        proposer = load_proposer(str(source), target, tree)
        assert proposer.drafter.config.num_hidden_layers == 3
        trees, propose = [], proposer.propose
        proposer.propose = lambda *a: trees.append(propose(*a)) or trees[-1]
        out, _ = speculative_generate(target.model, proposer, prompt, max_new_tokens=12, eos_token_ids=set())
        runs.append((out.tolist(), [t.tokens.tolist() for t in trees]))
    assert runs[0] == runs[1]
    with pytest.raises(ExportError, match="3 decoder layers: SGLang's LlamaForCausalLMEagle3 builds one; export "
                                          "with --format vllm"):
        export_checkpoint(ckpt, "sglang", tmp_path / "sglang", target=target)
    assert refusals("eagle3", asdict(config), target) == [
        "3 decoder layers: llama.cpp's EAGLE-3 graph runs exactly one; serve this drafter with vLLM (export --format "
        "vllm), or train num_layers=1"]


# ---- speculators' training defaults: post-norm output, sliding-window layers, the whole vocabulary -----------------

SPECULATORS_DEFAULTS = {"norm_before_fc": True, "norm_output": True, "norm_before_residual": True,
                        "layer_types": ["sliding_attention"], "sliding_window": 4}  # its window is 2048: 4 here bites
SPECULATORS_OPTIONS = {"norm_output": {"norm_output": True},
                       "window": {"layer_types": ["sliding_attention"], "sliding_window": 4},
                       "speculators defaults": SPECULATORS_DEFAULTS}


def options_checkpoint(path, target, options, draft_vocab_size=32):
    config = Eagle3Config.from_target_config(target.config, draft_vocab_size, **options)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(config)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            param.add_(torch.randn_like(param) * 0.1)  # norms off 1.0: a norm dropped or doubled changes the drafts
    return save_checkpoint(path, family="eagle3", config=asdict(config), target=target_info(target),
                           state_dict=drafter.state_dict())


def decode_runs(sources, target, max_new_tokens=24):
    """(output, drafted chains) of greedy speculative decoding with each source's drafter; the prompt and the
    output outgrow the window of 4."""
    from drafters.decode.decoder import speculative_generate
    from drafters.decode.proposers.loading import load_proposer
    from drafters.decode.tree import parse_tree_spec

    prompt, runs = torch.tensor([5, 17, 99, 42, 7, 7, 130, 64]), []
    for source in sources:
        proposer = load_proposer(str(source), target, parse_tree_spec("chain:3"))
        trees, propose = [], proposer.propose
        proposer.propose = lambda *a: trees.append(propose(*a)) or trees[-1]
        out, _ = speculative_generate(target.model, proposer, prompt, max_new_tokens=max_new_tokens,
                                      eos_token_ids=set())
        runs.append((out.tolist(), [t.tokens.tolist() for t in trees]))
    return prompt, runs


@pytest.mark.parametrize("name", SPECULATORS_OPTIONS)
def test_speculators_options_travel_in_the_vllm_layout_and_decode_losslessly(tmp_path, name):
    """norm_output and a sliding-window layer (speculators' eagle3 defaults, which vLLM serves): the vllm export
    writes them, the independent reader rebuilds the drafter and its logits equal the source's, decoding from the
    export drafts the checkpoint's chains and reproduces greedy generate; SGLang's layout and llama.cpp refuse them,
    each in one sentence naming the field."""
    from conftest import greedy_reference, untied_llama
    from drafters.export.llama_cpp import refusals

    target, options = untied_llama(), SPECULATORS_OPTIONS[name]
    ckpt = options_checkpoint(tmp_path / "ckpt", target, options)
    result = export_checkpoint(ckpt, "vllm", tmp_path / "vllm", target=target)
    written = read_config(tmp_path / "vllm")
    assert written["norm_output"] == options.get("norm_output", False)
    assert written["transformer_layer_config"].get("layer_types") == options.get("layer_types")
    assert written["transformer_layer_config"].get("sliding_window") == options.get("sliding_window")
    assert result.check.max_logit_diff <= 1e-5
    prompt, runs = decode_runs([ckpt, tmp_path / "vllm"], target)
    assert runs[0] == runs[1] and sum(len(chain) > 1 for _, chains in runs for chain in chains) > 0
    assert runs[0][0] == greedy_reference(target.model, prompt[None], 24)[0].tolist()
    sglang = "norm options" if options.get("norm_output") else "--speculative-draft-window-size"
    with pytest.raises(ExportError, match=sglang):
        export_checkpoint(ckpt, "sglang", tmp_path / "sglang", target=target)
    said = " ".join(refusals("eagle3", load_checkpoint(ckpt).config, target))
    assert all((field in said) == (field in options) for field in ("norm_output", "layer_types"))


def test_speculators_default_output_drafts_here(tmp_path):
    """What `speculators train` saves with its eagle3 defaults: Eagle3DraftModel, norm_before_fc, norm_output and
    norm_before_residual on, one sliding-window layer, the target's whole vocabulary with no d2t / t2d (vLLM: draft
    id = target id), rope_parameters, dtype at the top level, target_hidden_size null. Read as vLLM reads it, it
    drafts what the checkpoint it was made from drafts."""
    from conftest import untied_llama
    from drafters.export.eagle3_reader import read_eagle3_export

    target = untied_llama()
    ckpt = options_checkpoint(tmp_path / "ckpt", target, SPECULATORS_DEFAULTS, draft_vocab_size=target.vocab_size)
    export_checkpoint(ckpt, "vllm", tmp_path / "vllm", target=target)
    saved = shutil.copytree(tmp_path / "vllm", tmp_path / "speculators")
    edit_tensors(lambda t: [t.pop(k) for k in ("d2t", "t2d")])(saved)
    config = read_config(saved)
    layer = config["transformer_layer_config"]
    layer["rope_parameters"] = {"rope_theta": layer.pop("rope_theta"), "rope_type": "default"}
    del layer["rope_scaling"], layer["torch_dtype"]
    layer["use_sliding_window"] = True
    config.update(architectures=["Eagle3DraftModel"], target_hidden_size=None, dtype="float32")
    (saved / "config.json").write_text(json.dumps(config))
    notes = []
    read, _, _, _ = read_eagle3_export(saved, "vllm", notes=notes)
    assert (read.norm_output, read.layer_types, read.sliding_window) == (True, ["sliding_attention"], 4)
    assert any("draft id i = target id i" in note for note in notes)
    _, runs = decode_runs([ckpt, saved], target)
    assert runs[0] == runs[1]
    # control: a reduced vocabulary without its mapping is refused (the identity holds for the whole one only)
    edit_tensors(lambda t: t.update({"lm_head.weight": t["lm_head.weight"][:-1].contiguous()}))(saved)
    edit_config(lambda c: c.update(draft_vocab_size=target.vocab_size - 1))(saved)
    with pytest.raises(ExportCheckError, match="missing.*d2t"):
        read_eagle3_export(saved, "vllm")
