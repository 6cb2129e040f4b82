"""Drafters trained by other tools load as proposers here and draft exactly what the same weights draft under
our own export.

Each fixture is a config.json in the shape another tool writes, built here from that tool's documented field
list (no third-party code), over the weights of our own export of one drafter:
- SpecForge (SGLang layout): its draft config (configs/*-eagle3.json) as save_pretrained writes it back through
  LlamaConfig, under transformers 4.x (rope_theta, rope_scaling, torch_dtype) and 5.x (rope_parameters and
  dtype; as reported, rope_theta kept beside them); no eagle_config unless its user gave one;
- speculators (vLLM layout): Eagle3SpeculatorConfig with transformer_layer_config, before 0.5 (transformers
  4.x, no layer ids) and 0.9 (transformers 5.x, Eagle3DraftModel, layer ids);
- the EAGLE repository: EAGLE-1 (eagle/train/*_config.json: no head_dim, rope_theta nor bias) and EAGLE-3
  (eagle/traineagle3/config.json with SGLang's architecture), float16 weights as its checkpoints hold;
- Medusa: MedusaConfig saved by transformers 4.x (torch_dtype) and 5.x (dtype), without hidden/vocab sizes.
Plus each spelling on its own, the note a missing layer id list gives, the option that overrides it, and an
eval/compare.py report with one of our drafters beside another tool's.
"""

import json
import shutil
from dataclasses import asdict, replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from drafters.checkpoint import load_checkpoint, save_checkpoint, target_info
from drafters.decode.decoder import speculative_generate
from drafters.draft_vocab import build_draft_vocab
from drafters.eagle1 import Eagle1Config, Eagle1Drafter
from drafters.eagle3 import Eagle3Config, Eagle3Drafter
from drafters.export.common import MARKER
from drafters.export.dispatch import export_checkpoint
from drafters.export.eagle3_reader import check_export
from drafters.export.reading import ExportCheckError, config_dtype, rope_fields
from drafters.medusa import MedusaConfig, MedusaHeads
from drafters.decode.proposers.loading import load_proposer
from drafters.targets import load_target
from drafters.decode.tree import parse_tree_spec
from conftest import load_script  # tests/ is on sys.path under pytest

DRAFT_VOCAB = 64
ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}
TREE = "dynamic:total=8,depth=3,topk=2"
PROMPT = torch.tensor([5, 17, 99, 42, 7, 7, 130, 64])


@pytest.fixture(scope="module")
def target():
    return load_target("tiny-random-llama")  # 8 layers: engines' default aux layers HF [2, 4, 5]


def perturbed(module, seed: int):
    # random weights off their init (norms off 1.0, Medusa's zero blocks off 0), rounded to float16 values so
    # that the EAGLE repository's float16 files hold exactly the weights our float32 export holds
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(torch.randn_like(param) * 0.1).copy_(param.half().float())
    return module.state_dict()


@pytest.fixture(scope="module")
def ours(tmp_path_factory, target):
    """Our own exports of one drafter per family: {layout: export directory}, plus the native checkpoints."""
    root = tmp_path_factory.mktemp("ours")
    # its own RoPE base and Llama-3 scaling: a reader that drops either spelling drafts differently
    config = replace(Eagle3Config.from_target_config(target.config, draft_vocab_size=DRAFT_VOCAB),
                     rope_theta=5e5, rope_scaling=ROPE_SCALING)
    vocab = build_draft_vocab((torch.arange(target.vocab_size) * 7919) % 101, target.vocab_size, DRAFT_VOCAB)
    save_checkpoint(root / "eagle3", family="eagle3", config=asdict(config), target=target_info(target),
                    state_dict=perturbed(Eagle3Drafter(config, vocab), 0))
    eagle1 = Eagle1Config.from_target_config(target.config, feature="normed")
    save_checkpoint(root / "eagle1", family="eagle1", config=asdict(eagle1), target=target_info(target),
                    state_dict=perturbed(Eagle1Drafter(eagle1), 1))
    medusa = MedusaConfig.from_target_config(target.config, num_heads=3)
    save_checkpoint(root / "medusa", family="medusa", config=asdict(medusa), target=target_info(target),
                    state_dict=perturbed(MedusaHeads(medusa), 2))
    exports = {fmt: export_checkpoint(root / family, fmt, root / f"{fmt}-export", target=target).path
               for fmt, family in [("sglang", "eagle3"), ("vllm", "eagle3"), ("eagle1", "eagle1"),
                                   ("medusa", "medusa")]}
    return {**exports, "native": root / "eagle3"}


def read_config(path):
    return json.loads((path / "config.json").read_text())


# ---- the configs other tools write, from their documented field lists -----------------------------------

LAYER = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
         "max_position_embeddings", "rms_norm_eps", "hidden_act")


def specforge(ours: dict, era: str) -> dict:
    # SpecForge's draft config as save_pretrained writes it back through LlamaConfig; eagle_config only when
    # its user wrote one (SGLang then captures its default layers, which SpecForge trained with)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "attention_bias": False, "attention_dropout": 0.0,
              "bos_token_id": 1, "eos_token_id": 2, "head_dim": ours["head_dim"], "initializer_range": 0.02,
              "mlp_bias": False, "model_type": "llama", "num_hidden_layers": 1, "pad_token_id": None,
              "pretraining_tp": 1, "tie_word_embeddings": False, "use_cache": True,
              "draft_vocab_size": ours["draft_vocab_size"], **{k: ours[k] for k in LAYER}}
    if era == "4.x":
        return {**config, "rope_theta": ours["rope_theta"], "rope_scaling": ours["rope_scaling"],
                "torch_dtype": "float32", "transformers_version": "4.53.2"}
    rope = {"rope_parameters": {**(ours["rope_scaling"] or {"rope_type": "default"}), "rope_theta": ours["rope_theta"]},
            "dtype": "float32", "transformers_version": "5.23.0"}
    # as the issue reported it: rope_theta kept beside rope_parameters, no rope_scaling nor torch_dtype
    return {**config, **rope, **({"rope_theta": ours["rope_theta"]} if era == "5.x" else {})}


def speculators(ours: dict, era: str) -> dict:
    # Eagle3SpeculatorConfig: transformer_layer_config is the layer's LlamaConfig as to_diff_dict writes it
    layer = {k: ours["transformer_layer_config"][k] for k in LAYER + ("head_dim",)}
    layer.update(model_type="llama", num_hidden_layers=1, tie_word_embeddings=False, attention_bias=False,
                 mlp_bias=False, initializer_range=0.02, use_cache=True, pretraining_tp=1)
    theta, scaling = (ours["transformer_layer_config"][k] for k in ("rope_theta", "rope_scaling"))
    config = {"speculators_model_type": "eagle3", "speculators_config": ours["speculators_config"],
              "draft_vocab_size": ours["draft_vocab_size"], "norm_before_residual": False,
              "target_hidden_size": None, "transformer_layer_config": layer}
    if era == "0.4, transformers 4.x":  # before speculators recorded the layer ids: vLLM's default
        layer.update(rope_theta=theta, rope_scaling=scaling, torch_dtype="float32", transformers_version="4.53.2")
        return {**config, "architectures": ["Eagle3Speculator"], "speculators_version": "0.4.0",
                "torch_dtype": "float32", "transformers_version": "4.53.2"}
    layer.update(rope_parameters={**(scaling or {"rope_type": "default"}), "rope_theta": theta},
                 layer_types=["full_attention"],
                 transformers_version="5.23.0")
    return {**config, "architectures": ["Eagle3DraftModel"], "speculators_version": "0.9.0", "dtype": "float32",
            "eagle_aux_hidden_state_layer_ids": ours["eagle_aux_hidden_state_layer_ids"],
            "norm_before_fc": False, "norm_output": False, "embed_requires_grad": False,
            "transformers_version": "5.23.0"}


def eagle_repo(ours: dict, family: str) -> dict:
    # eagle/train/llama_2_chat_7B_config.json (EAGLE-1: no head_dim, no rope_theta = LlamaConfig's 10000, no
    # bias = its loader's True) and eagle/traineagle3/config.json with the rope fields of its Llama-3 configs
    # (EAGLE-3: no head_dim, no eagle_config); float16 weights, as its checkpoints hold
    config = {"bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.02, "model_type": "llama",
              "num_hidden_layers": 1, "pad_token_id": 0, "tie_word_embeddings": False, "torch_dtype": "float16",
              "use_cache": True, **{k: ours[k] for k in LAYER}}
    if family == "eagle1":
        return {**config, "architectures": ["LlamaForCausalLM"], "pretraining_tp": 1, "rope_scaling": None,
                "transformers_version": "4.32.0.dev0"}
    # SGLang loads the EAGLE-3 checkpoints under its own architecture name
    return {**config, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": ours["draft_vocab_size"],
            "rope_theta": ours["rope_theta"], "rope_scaling": ours["rope_scaling"], "transformers_version": "4.28.1"}


def medusa(ours: dict, era: str) -> dict:
    # FasterDecoding/Medusa's MedusaConfig(PretrainedConfig): its three fields and what PretrainedConfig adds
    config = {k: ours[k] for k in ("medusa_num_heads", "medusa_num_layers", "base_model_name_or_path")}
    return {**config, "torch_dtype": "float32", "transformers_version": "4.53.2"} if era == "4.x" else \
        {**config, "dtype": "float32", "transformers_version": "5.23.0"}


# (tool and version, our export it shares the weights with, config builder, float16 weights)
FIXTURES = {
    "SpecForge, transformers 4.x": ("sglang", lambda c: specforge(c, "4.x"), False),
    "SpecForge, transformers 5.x": ("sglang", lambda c: specforge(c, "5.x"), False),
    "SpecForge, transformers 5.x, rope_parameters only": ("sglang", lambda c: specforge(c, "5.x only"), False),
    "speculators 0.4, transformers 4.x": ("vllm", lambda c: speculators(c, "0.4, transformers 4.x"), False),
    "speculators 0.9, transformers 5.x": ("vllm", lambda c: speculators(c, "0.9, transformers 5.x"), False),
    "EAGLE repository, EAGLE-3": ("sglang", lambda c: eagle_repo(c, "eagle3"), True),
    "EAGLE repository, EAGLE-1": ("eagle1", lambda c: eagle_repo(c, "eagle1"), True),
    "Medusa, transformers 4.x": ("medusa", lambda c: medusa(c, "4.x"), False),
    "Medusa, transformers 5.x": ("medusa", lambda c: medusa(c, "5.x"), False),
}


def foreign(tmp_path, ours, name):
    """Our export's weights under the config `name`'s tool writes, without our export marker."""
    layout, build, half = FIXTURES[name]
    path = shutil.copytree(ours[layout], tmp_path / "foreign")
    (path / MARKER).unlink()
    config = build(read_config(ours[layout]))
    assert config != read_config(ours[layout])
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if half:
        weights = path / "model.safetensors"
        save_file({k: v.half() if v.is_floating_point() else v for k, v in load_file(weights).items()}, weights)
    return path


def drafts(spec, target, tree=TREE):
    """Every tree the proposer drafts while decoding a prompt, the output, and the proposer's notes."""
    proposer = load_proposer(str(spec), target, parse_tree_spec(tree))
    trees, propose = [], proposer.propose
    proposer.propose = lambda *a: trees.append(propose(*a)) or trees[-1]  # record, then decode
    out, _ = speculative_generate(target.model, proposer, PROMPT, max_new_tokens=16, eos_token_ids=set())
    return (out.tolist(), [(t.tokens.tolist(), t.parents.tolist()) for t in trees]), getattr(proposer, "notes", [])


@pytest.mark.parametrize("name", FIXTURES)
def test_another_tools_drafter_drafts_exactly_like_our_export_of_the_same_weights(tmp_path, ours, target, name):
    layout = FIXTURES[name][0]
    want, our_notes = drafts(ours[layout], target, "chain:3" if layout == "medusa" else TREE)
    got, notes = drafts(foreign(tmp_path, ours, name), target, "chain:3" if layout == "medusa" else TREE)
    assert got == want and our_notes == []
    assert len(want[1]) >= 5 and all(len(tokens) > 1 for tokens, _ in want[1])  # drafts, every round
    said = " | ".join(notes)
    no_ids = {"SpecForge": "no eagle_config", "speculators 0.4": "no eagle_aux_hidden_state_layer_ids",
              "EAGLE repository, EAGLE-3": "no eagle_config"}
    assert any(part in name for part in no_ids) == ("HF hidden_states indices [2, 4, 5]" in said)
    assert ("head_dim 16" in said) == name.startswith("EAGLE repository")
    assert ("rope_theta 10000.0 (LlamaConfig's)" in said) == (name == "EAGLE repository, EAGLE-1")
    assert ("bias true" in said) == (name == "EAGLE repository, EAGLE-1")


def test_the_missing_eagle_config_message(tmp_path, ours, target):
    path = foreign(tmp_path, ours, "SpecForge, transformers 5.x")
    _, notes = drafts(path, target)
    assert notes == [(
        f"{path}/config.json: no eagle_config (SpecForge writes it only when its user gave one, the EAGLE "
        "repository never): drafting from the layers SGLang captures by default for this 8-layer target, SGLang "
        "\"output of layer\" ids [1, 3, 4] (= [1, L//2-1, L-4]), i.e. HF hidden_states indices [2, 4, 5]; "
        "override with the proposer option DIR:aux_layers=A,B,C (HF hidden_states indices)")]
    vllm = foreign(tmp_path / "v", ours, "speculators 0.4, transformers 4.x")
    assert drafts(vllm, target)[1] == [(
        f"{vllm}/config.json: no eagle_aux_hidden_state_layer_ids (speculators before 0.5 wrote none): drafting "
        "from the layers vLLM captures by default for this 8-layer target, vLLM layer ids [2, 4, 5] "
        "(= [2, L//2, L-3]), i.e. HF hidden_states indices [2, 4, 5]; override with the proposer option "
        "DIR:aux_layers=A,B,C (HF hidden_states indices)")]


def test_the_aux_layers_option_overrides_the_default_and_nothing_recorded(tmp_path, ours, target):
    path = foreign(tmp_path, ours, "SpecForge, transformers 4.x")
    default, _ = drafts(path, target)
    assert drafts(f"{path}:aux_layers=2,4,5", target)[0] == default  # the default, given explicitly
    other, notes = drafts(f"{path}:aux_layers=1,3,6", target)
    assert other[1] != default[1]  # other target features: other drafts
    assert notes == [(f"{path}/config.json: no eagle_config: drafting from HF hidden_states indices [1, 3, 6] "
                      "(SGLang \"output of layer\" ids [0, 2, 5]), given by the aux_layers option, not SGLang's "
                      "default [2, 4, 5]")]
    chain = parse_tree_spec("chain:2")
    for recorded in (ours["sglang"], ours["vllm"], ours["native"]):  # a drafter's recorded layers win
        assert drafts(f"{recorded}:aux_layers=2,4,5", target)[0] == drafts(recorded, target)[0]
        with pytest.raises(ValueError, match=r"records auxiliary layers .*\[2, 4, 5\].*says \[1, 3, 6\]"):
            load_proposer(f"{recorded}:aux_layers=1,3,6", target, chain)
    with pytest.raises(ValueError, match="only EAGLE-3 drafters read auxiliary layers"):
        load_proposer(f"{ours['medusa']}:aux_layers=2,4,5", target, chain)
    with pytest.raises(ValueError, match="known options: aux_layers"):
        load_proposer(f"{path}:layers=2,4,5", target, chain)
    with pytest.raises(ValueError, match="want HF hidden_states indices"):
        load_proposer(f"{path}:aux_layers=2,x,5", target, chain)
    with pytest.raises(ValueError, match=r"aux layers \(HF indices\) \[0, 4, 5\] outside \[1, 7\]"):
        load_proposer(f"{path}:aux_layers=0,4,5", target, chain)


def test_our_own_exports_must_still_record_their_layers(tmp_path, ours, target):
    # check_export validates what eval/export.py writes: no engine default may stand in for its layer ids
    path = shutil.copytree(ours["sglang"], tmp_path / "sglang")
    config = read_config(path)
    del config["eagle_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportCheckError, match="required field 'eagle_config' is missing"):
        check_export(path, "sglang", target=target_info(target), reference=load_checkpoint(ours["native"]))


# ---- the spellings, one by one --------------------------------------------------------------------------

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
SPELLINGS = {  # config fields -> (rope_theta, rope_scaling) read, or the error
    "4.x": ({"rope_theta": 5e5, "rope_scaling": None}, (5e5, None)),
    "4.x scaled": ({"rope_theta": 5e5, "rope_scaling": LLAMA3}, (5e5, LLAMA3)),
    "4.x before 4.45 (type)": ({"rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}},
                               (1e4, {"rope_type": "linear", "factor": 2.0})),
    "4.x without rope_scaling": ({"rope_theta": 5e5}, (5e5, None)),
    "5.x": ({"rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}}, (5e5, None)),
    "5.x scaled": ({"rope_parameters": {**LLAMA3, "rope_theta": 5e5}}, (5e5, LLAMA3)),
    "both, agreeing": ({"rope_theta": 5e5, "rope_scaling": LLAMA3, "rope_parameters": {**LLAMA3, "rope_theta": 5e5}},
                       (5e5, LLAMA3)),
    "neither: LlamaConfig's": ({}, (1e4, None)),
    "thetas disagree": ({"rope_theta": 1e4, "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}},
                        "rope_theta = 10000.0 but rope_parameters.rope_theta = 500000.0"),
    "scalings disagree": ({"rope_scaling": None, "rope_parameters": {**LLAMA3, "rope_theta": 5e5}},
                          "rope_scaling = None but rope_parameters"),
    "per layer type": ({"rope_parameters": {"full_attention": {"rope_theta": 1e6}}}, "holds no rope_theta"),
    "theta as a string": ({"rope_theta": "10000"}, "field 'rope_theta' = '10000' should be int/float"),
}


@pytest.mark.parametrize("name", SPELLINGS)
def test_rope_in_either_spelling(name):
    fields, want = SPELLINGS[name]
    if isinstance(want, str):
        with pytest.raises(ExportCheckError, match=want.replace("(", r"\(").replace(".", r"\.")):
            rope_fields(fields, "config.json", [])
        return
    defaults = []
    assert rope_fields(fields, "config.json", defaults) == {"rope_theta": want[0], "rope_scaling": want[1]}
    assert defaults == (["rope_theta 10000.0 (LlamaConfig's)"] if not fields else [])


def test_dtype_in_either_spelling():
    assert config_dtype({"torch_dtype": "bfloat16"}, "c") == config_dtype({"dtype": "bfloat16"}, "c") == "bfloat16"
    assert config_dtype({"torch_dtype": "float32", "dtype": "float32"}, "c") == "float32"
    assert config_dtype({"torch_dtype": None}, "c") is None  # neither: the weights decide
    with pytest.raises(ExportCheckError, match="torch_dtype = 'float32' but dtype = 'bfloat16'"):
        config_dtype({"torch_dtype": "float32", "dtype": "bfloat16"}, "c")


def test_a_stated_dtype_must_match_the_weights_in_either_spelling(tmp_path, ours, target):
    path = foreign(tmp_path, ours, "SpecForge, transformers 5.x")
    config = read_config(path)
    (path / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    with pytest.raises(ExportCheckError, match="config says torch_dtype 'bfloat16' but the weights are torch.float32"):
        load_proposer(str(path), target, parse_tree_spec("chain:2"))
    path = foreign(tmp_path / "m", ours, "Medusa, transformers 5.x")
    (path / "config.json").write_text(json.dumps({**read_config(path), "dtype": "bfloat16"}))
    with pytest.raises(ExportCheckError, match="torch_dtype 'bfloat16' but the tensors are torch.float32"):
        load_proposer(str(path), target, parse_tree_spec("chain:2"))


# ---- eval/tau.py says it, eval/compare.py shows another tool's drafter beside ours ----------------------

BENCH = "tests/data/tiny_prompts.jsonl"


def test_tau_says_the_default_once_and_records_it(tmp_path, ours, target, capsys):
    path = foreign(tmp_path, ours, "SpecForge, transformers 4.x")
    report = load_script("eval/tau.py").main(["--target", "tiny-random-llama", "--proposer", str(path), "--bench",
                                              BENCH, "--tree", "chain:2", "--limit", "1", "--max-new-tokens", "6",
                                              "--threads", "1", "--json", str(tmp_path / "tau.json")])
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ")]
    assert len(printed) == 1 and "no eagle_config" in printed[0] and "HF hidden_states indices [2, 4, 5]" in printed[0]
    assert report["proposer_notes"] == [printed[0].removeprefix("note: ")]
    assert json.loads((tmp_path / "tau.json").read_text())["proposer_notes"] == report["proposer_notes"]


def test_compare_puts_another_tools_drafter_beside_ours(tmp_path, ours):
    path = foreign(tmp_path, ours, "SpecForge, transformers 5.x")
    specforge_dir = path.rename(tmp_path / "specforge-smol")
    speculators_dir = foreign(tmp_path / "s", ours, "speculators 0.9, transformers 5.x")
    index = load_script("eval/compare.py").main([
        "--target", "tiny-random-llama", "--drafters", str(ours["native"]), f"SpecForge={specforge_dir}",
        str(speculators_dir), str(ours["sglang"]), "--bench", BENCH, "--tree", "chain:2", "--limit", "1",
        "--max-new-tokens", "6", "--threads", "1", "--no-speed", "--out", str(tmp_path / "report")])
    text = index.read_text()
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| eagle3:")}
    assert sorted(rows) == ["eagle3:eagle3", "eagle3:foreign (speculators, vLLM layout)",
                            "eagle3:sglang-export (drafters, SGLang layout)",
                            "eagle3:specforge-smol (SpecForge, SGLang layout)"]
    assert "not recorded (trained elsewhere)" in rows["eagle3:specforge-smol (SpecForge, SGLang layout)"]
    taus = {label: float(row.split("|")[6]) for label, row in rows.items()}
    assert len(set(taus.values())) == 1  # the same weights: the same tau, whoever wrote the files
    assert "eagle3:specforge-smol (SpecForge, SGLang layout): " in text and "no eagle_config" in text


def test_an_eagle_config_without_layer_ids_is_the_default_too(tmp_path, ours, target):
    # SGLang reads eagle_config.get(...): one that names no ids leaves them to its default as well
    path = foreign(tmp_path, ours, "SpecForge, transformers 4.x")
    (path / "config.json").write_text(json.dumps({**read_config(path), "eagle_config": {"use_aux_hidden_state": True}}))
    got, notes = drafts(path, target)
    assert got == drafts(ours["sglang"], target)[0]
    assert notes[-1].startswith(f"{path}/config.json: no eagle_config.eagle_aux_hidden_state_layer_ids (")
    (path / "config.json").write_text(json.dumps({**read_config(path), "eagle_config": {"use_aux_hidden_state": False}}))
    with pytest.raises(ExportCheckError, match="use_aux_hidden_state' = False"):
        drafts(path, target)
