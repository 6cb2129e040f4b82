"""Issue 13, "nothing lost, nothing silently wrong", for export and evaluation: every test here
failed on the code before its fix (a deleted run, a reused stale tau, a NaN that validated, a
traceback instead of a counted skip)."""

import json
import re

import pytest
import torch
from conftest import load_script  # tests/ is on sys.path under pytest
from safetensors.torch import load_file, save_file
from test_export import save_eagle3
from test_medusa import medusa_checkpoint

from drafters.checkpoint import load_checkpoint, target_info
from drafters.decode.proposers.loading import load_proposer
from drafters.decode.tree import DynamicSpec, parse_tree_spec
from drafters.export.eagle3_reader import check_export
from drafters.export.common import ExportError
from drafters.export.dispatch import export_checkpoint
from drafters.export.medusa import read_medusa_export
from drafters.export.reading import ExportCheckError
from drafters.targets import load_target
from drafters.training.data import DataError, load_conversations

export_main = load_script("eval/export.py").main


@pytest.fixture(scope="module")
def target():
    return load_target("tiny-random-llama")


@pytest.fixture()
def run_dir(tmp_path, target):
    # what a training run leaves: step checkpoints, the final one, metrics
    run = tmp_path / "run"
    save_eagle3(run / "checkpoint-10", target)
    save_eagle3(run / "checkpoint-final", target)
    (run / "metrics.jsonl").write_text('{"step": 10, "loss": 1.0, "step_acc": [0.5]}\n')
    return run


def listing(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


# ---- 1. --overwrite never deletes what the export did not write --------------------------------

def test_overwrite_refuses_the_run_holding_the_checkpoint(run_dir, capsys):
    before = listing(run_dir)
    code = export_main([str(run_dir / "checkpoint-final"), "--format", "sglang", "--out", str(run_dir),
                        "--overwrite"])
    err = capsys.readouterr().err
    assert code == 1
    assert listing(run_dir) == before  # every checkpoint and the metrics still there
    assert f"refusing to replace {run_dir} (--overwrite)" in err
    assert f"it is or contains the source checkpoint {run_dir / 'checkpoint-final'}" in err
    assert ("(a training run or checkpoint): checkpoint-10/, checkpoint-final/, metrics.jsonl" in err)
    assert not [p for p in run_dir.parent.iterdir() if p.name.startswith(".")]  # no staging left


def test_overwrite_refuses_the_checkpoint_itself_and_foreign_files(run_dir, tmp_path):
    ckpt = run_dir / "checkpoint-final"
    with pytest.raises(ExportError, match="is or contains the source checkpoint"):
        export_checkpoint(ckpt, "native", ckpt, overwrite=True)
    other = tmp_path / "model"  # a directory export did not write, e.g. a Hugging Face model
    other.mkdir()
    (other / "config.json").write_text("{}")
    with pytest.raises(ExportError, match=r"holds 1 entries no export wrote: config.json"):
        export_checkpoint(ckpt, "sglang", other, overwrite=True)
    assert (other / "config.json").read_text() == "{}"


def test_overwrite_replaces_an_earlier_export_but_not_files_added_to_it(run_dir, tmp_path):
    ckpt, out = run_dir / "checkpoint-final", tmp_path / "export"
    export_checkpoint(ckpt, "sglang", out)
    assert json.loads((out / ".drafters-export.json").read_text())["files"] == ["config.json", "model.safetensors"]
    result = export_checkpoint(ckpt, "vllm", out, overwrite=True)  # an earlier export: replaced
    assert result.files == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["speculators_model_type"] == "eagle3"
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="no export wrote: notes.txt"):
        export_checkpoint(ckpt, "sglang", out, overwrite=True)
    assert (out / "notes.txt").read_text() == "mine"


# ---- 3. validation that passed garbage -----------------------------------------------------------

def with_nan(path, name):
    # one NaN written into tensor `name` of the safetensors file at path
    tensors = load_file(path)
    tensors[name][0].view(-1)[0] = float("nan")
    save_file(tensors, path, metadata={"format": "pt"})


def test_a_nan_weight_is_refused_by_the_export_naming_the_tensor(run_dir, tmp_path, target):
    ckpt = run_dir / "checkpoint-final"
    with_nan(ckpt / "model.safetensors", "fc.weight")
    for fmt in ("sglang", "native"):  # used to validate with "max |logit diff| nan"
        with pytest.raises((ExportError, ExportCheckError), match=r"non-finite weights \(NaN or inf\) in fc.weight \(1 of"):
            export_checkpoint(ckpt, fmt, tmp_path / fmt, target=target)
        assert not (tmp_path / fmt).exists()


def test_the_independent_readers_refuse_a_nan_weight(run_dir, tmp_path, target):
    ckpt = run_dir / "checkpoint-final"
    out = export_checkpoint(ckpt, "vllm", tmp_path / "vllm", target=target).path
    with_nan(out / "model.safetensors", "layers.0.mlp.up_proj.weight")
    with pytest.raises(ExportCheckError, match="non-finite weights .* in layers.0.mlp.up_proj.weight"):
        check_export(out, "vllm", target=target_info(target), reference=load_checkpoint(ckpt))
    medusa_checkpoint(tmp_path / "medusa", target)
    out = export_checkpoint(tmp_path / "medusa", "medusa", tmp_path / "medusa-out", target=target).path
    with_nan(out / "medusa_lm_head.safetensors", "0.0.linear.weight")
    with pytest.raises(ExportCheckError, match=r"non-finite weights .* in 0.0.linear.weight"):
        read_medusa_export(out, target=target_info(target))


@pytest.mark.parametrize("spec, message", [
    ("dynamic:total=8,depth=3", "missing topk: a dynamic tree needs all of total, depth, topk"),
    ("dynamic:depth=3", "missing total, topk"),
    ("dynamic:", "missing total, depth, topk"),
    ("dynamic:total=8,depth=3,topk=2,width=4", "bad field 'width=4': expected each of total=N, depth=N, topk=N"),
    ("dynamic:total=8,depth=3,topk=2,topk=4", "bad field 'topk=4'"),
])
def test_a_dynamic_tree_spec_needs_every_key_once(spec, message):
    # dynamic:total=8,depth=3 used to take topk=10 and spend all 8 nodes at depth 1
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_tree_spec(spec)
    assert parse_tree_spec("dynamic:topk=2,total=8,depth=3") == DynamicSpec(total=8, depth=3, topk=2)


def test_an_export_for_another_target_is_refused_listing_what_differs(tmp_path, target):
    # tiny gemma3 and tiny llama agree on hidden size, vocabulary and context: only what the export
    # records about its verifier / base model tells them apart (it used to be measured: tau 1.000)
    gemma = load_target("tiny-random-gemma3")
    save_eagle3(tmp_path / "eagle3", gemma)
    medusa_checkpoint(tmp_path / "medusa", gemma)
    for fmt, source in (("vllm", "eagle3"), ("medusa", "medusa")):
        out = export_checkpoint(tmp_path / source, fmt, tmp_path / f"{fmt}-out", target=gemma).path
        load_proposer(str(out), gemma, parse_tree_spec("chain:2"))  # its own target: fine
        with pytest.raises(ValueError, match="verifier / base model 'tiny-random-gemma3' is not 'tiny-random-llama'"):
            load_proposer(str(out), target, parse_tree_spec("chain:2"))
    config = json.loads((tmp_path / "vllm-out" / "config.json").read_text())
    config["transformer_layer_config"]["vocab_size"] = 49152
    config["target_hidden_size"], config["draft_vocab_size"] = 128, 50000
    (tmp_path / "vllm-out" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as refused:
        load_proposer(str(tmp_path / "vllm-out"), target, parse_tree_spec("chain:2"))
    for problem in ("hidden_size: checkpoint 128 vs target 64", "vocab_size: checkpoint 49152 vs target 259",
                    "draft_vocab_size 50000 is not in 1..259", "verifier / base model 'tiny-random-gemma3'"):
        assert problem in str(refused.value)  # every mismatch listed, not the first one only


def test_a_hub_id_or_local_copy_of_the_target_counts_as_the_same_verifier():
    from drafters.decode.proposers.loading import _same_model

    assert _same_model("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m-instruct")
    assert _same_model("google/gemma-3-270m", "gemma3-270m")
    assert _same_model("meta-llama/Llama-3.1-8B-Instruct", "/models/Llama-3.1-8B-Instruct-Q4_K_M.gguf")
    assert not _same_model("tiny-random-gemma3", "tiny-random-llama")


def test_a_verifier_recorded_as_a_local_directory_is_compared_by_its_config(tmp_path, target):
    # speculators records the verifier it trained with; often a local directory, whose name says nothing
    from drafters.decode.proposers.loading import _verifier_problems

    local = tmp_path / "my-verifier"
    local.mkdir()
    target.config.to_json_file(local / "config.json")
    config = {"speculators_config": {"verifier": {"name_or_path": str(local)}}}
    assert _verifier_problems(config, target) == []
    other = load_target("tiny-random-gemma3")
    other.config.to_json_file(local / "config.json")
    assert _verifier_problems(config, target) == [f"verifier / base model {str(local)!r} is not 'tiny-random-llama'"]


# ---- 4. a message or a counted skip, never a traceback ----------------------------------------------

def chat_row(answer: str) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": answer}]}


@pytest.mark.parametrize("layout", ["jsonl", "json list"])
def test_a_non_utf8_byte_skips_only_its_row_with_file_and_row(tmp_path, layout):
    rows = [json.dumps(chat_row(a)).encode() for a in ("one", "caf\xe9", "three")]
    rows[1] = rows[1].replace(b"\\u00e9", b"\xe9")  # latin-1 e-acute: not UTF-8
    path = tmp_path / ("d.jsonl" if layout == "jsonl" else "d.json")
    path.write_bytes(b"\n".join(rows) + b"\n" if layout == "jsonl" else b"[" + b",\n".join(rows) + b"]")
    conversations, report = load_conversations(str(path))  # used to raise UnicodeDecodeError
    assert [c.messages[1]["content"] for c in conversations] == ["one", "three"]
    assert report.skipped == {"not UTF-8": 1}
    assert report.examples["not UTF-8"][0].startswith(f"{path}:2: byte 0xe9 at character ")


def test_a_junk_folder_as_data_path_names_the_path_and_the_accepted_forms(tmp_path):
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.bin").write_bytes(bytes(range(256)))
    (junk / "state.json").write_text("{not json")  # looks like save_to_disk, is not
    with pytest.raises(DataError, match=f"{junk} is a folder but not a readable `datasets` save_to_disk folder"
                                        r".*\.jsonl file, a save_to_disk folder"):
        load_conversations(str(junk))


# ---- 2. caches and merges trust contents, not names --------------------------------------------------


TAU = load_script("eval/tau.py")  # the command line over evaluate.measure


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    # prompt-lookup shard reports of one 3-item bench: 0/2, 1/2, 1/3, and 1/2 with another --limit
    root = tmp_path_factory.mktemp("shards")
    bench = root / "bench.jsonl"
    bench.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("abc abc abc", "hello hello", "xyz xyz")))

    def shard(name, spec, limit="3"):
        TAU.main(["--target", "tiny-random-llama", "--bench", str(bench), "--limit", limit, "--max-new-tokens", "8",
                  "--threads", "1", "--proposer", "prompt-lookup", "--tree", "chain:3", "--no-baseline",
                  "--shard", spec, "--json", str(root / name)])
        return str(root / name)

    return {"0/2": shard("a.json", "0/2"), "1/2": shard("b.json", "1/2"), "1/3": shard("c.json", "1/3"),
            "1/2 limit 2": shard("d.json", "1/2", limit="2")}


@pytest.mark.parametrize("names, message", [
    (["0/2", "0/2"], r"shard given more than once: 0/2 \(.*a.json, .*a.json\)"),
    (["0/2"], "missing shard 1/2 of 2: run it with --shard and merge all 2"),
    (["0/2", "1/3"], "the shards split the bench in different ways: N=2: "),
    (["0/2", "1/2 limit 2"], "is not a shard of the same run as .*: limit: 2 vs 3"),
])
def test_merge_refuses_anything_but_every_shard_of_one_run_once(shards, names, message):
    with pytest.raises(SystemExit, match=message):
        TAU.main(["--merge", *[shards[n] for n in names]])
    assert TAU.main(["--merge", shards["0/2"], shards["1/2"]])["num_prompts"] == 3  # the complete set merges


def test_merge_refuses_shards_of_a_changed_drafter(shards, tmp_path):
    changed = json.loads(open(shards["1/2"]).read())
    changed["proposer_sha256"] = "0" * 64  # same proposer path, other files
    (tmp_path / "b.json").write_text(json.dumps(changed))
    with pytest.raises(SystemExit, match="proposer_sha256: '0000"):
        TAU.main(["--merge", shards["0/2"], str(tmp_path / "b.json")])


def test_compare_reruns_a_drafter_whose_files_changed_at_the_same_path(run_dir, tmp_path, capsys):
    compare = load_script("eval/compare.py")
    ckpt = run_dir / "checkpoint-final"
    argv = ["--target", "tiny-random-llama", "--drafters", str(ckpt), "--bench", "tests/data/tiny_prompts.jsonl",
            "--tree", "chain:2", "--limit", "1", "--max-new-tokens", "8", "--threads", "1", "--no-speed",
            "--out", str(tmp_path / "report")]
    compare.main(argv)
    compare.main(argv)
    assert capsys.readouterr().out.count("compare: reusing") == 1  # unchanged: reused
    tensors = load_file(ckpt / "model.safetensors")
    tensors["fc.weight"] *= 2  # retrained in place: same path, other weights
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    compare.main(argv)
    assert "compare: reusing" not in capsys.readouterr().out  # used to reuse the stale tau


def test_a_target_of_the_same_shape_with_other_weights_is_named(tmp_path, target, capsys):
    # the target check compared only the shape: a drafter trained for another model of the same shape was measured
    # without a word (issue 38, fault 7). The checkpoint records a fingerprint of the target's weights: export
    # refuses another, tau warns
    from drafters.checkpoint import CheckpointError, target_fingerprint
    from drafters.decode.tree import parse_tree_spec
    from drafters.targets import Target
    from drafters.tiny import build_tiny_target

    assert target_fingerprint(target) == target_fingerprint(load_target("tiny-random-llama", dtype="bfloat16"))
    other = Target(*build_tiny_target("tiny-random-llama", seed=1), "tiny-random-llama")  # same name and shape
    assert target_fingerprint(other) != target_fingerprint(target)
    checkpoint = save_eagle3(tmp_path / "ckpt", target)
    with pytest.raises(ExportError, match=r"with other weights than 'tiny-random-llama' \(weights fingerprint "
                                          r"[0-9a-f]{16} vs [0-9a-f]{16}\).*Use the target it was trained on"):
        export_checkpoint(checkpoint, "sglang", tmp_path / "out", target=other)
    assert not (tmp_path / "out").exists()
    load_proposer(str(checkpoint), other, parse_tree_spec("chain:2"))  # measured, but said
    assert capsys.readouterr().out.count("warning: ") == 1  # said once, by the family's loader
    load_proposer(str(checkpoint), target, parse_tree_spec("chain:2"))  # its own target: nothing said
    assert "warning" not in capsys.readouterr().out
    with pytest.raises(CheckpointError, match="other weights"):
        from drafters.checkpoint import check_target, load_checkpoint
        check_target(load_checkpoint(checkpoint), other)  # what resume_from runs


def merged_lora_target(layer: int = 3, scale: float = 0.02):
    # the tiny Llama with a rank-4 LoRA merged into one decoder layer's MLP: embeddings, LM head, final norm and
    # every other tensor unchanged
    from drafters.targets import Target
    from drafters.tiny import build_tiny_target

    model, tokenizer = build_tiny_target("tiny-random-llama")
    weight = model.model.layers[layer].mlp.down_proj.weight
    generator = torch.Generator().manual_seed(0)
    b = torch.randn(weight.shape[0], 4, generator=generator) * scale
    a = torch.randn(4, weight.shape[1], generator=generator) * scale
    with torch.no_grad():
        weight.add_(b @ a)
    return Target(model.eval().requires_grad_(False), tokenizer, "tiny-random-llama")


def test_a_target_differing_in_one_decoder_layer_is_named(tmp_path, target, capsys):
    # the fingerprint read the embedding's and LM head's outer rows and the final norm only: a merged LoRA (a
    # fine-tune of the decoder layers) passed tau and export without a word. Every tensor is sampled now
    from drafters.checkpoint import CheckpointError, check_target, target_fingerprint
    from drafters.decode.tree import parse_tree_spec
    from drafters.targets import Target
    from drafters.tiny import build_tiny_target

    lora = merged_lora_target()
    assert target_info(lora)["fingerprint"] == target_info(target)["fingerprint"]  # the outer rows agree
    assert target_fingerprint(lora) != target_fingerprint(target)
    copy = Target(*build_tiny_target("tiny-random-llama"), "tiny-random-llama")  # identical weights
    assert target_fingerprint(copy) == target_fingerprint(target)
    checkpoint = save_eagle3(tmp_path / "ckpt", target)
    message = (r"with other weights than 'tiny-random-llama' \(weights fingerprint [0-9a-f]{16} vs [0-9a-f]{16}\): "
               r"the same shape, another model \(the same embedding and LM head: a fine-tune of one base, e\.g\. a "
               r"merged LoRA\); its drafts are for that one")
    with pytest.raises(ExportError, match=message + r"\. Use the target it was trained on"):
        export_checkpoint(checkpoint, "sglang", tmp_path / "out", target=lora)
    with pytest.raises(CheckpointError, match=message):
        check_target(load_checkpoint(checkpoint), lora)  # what resume_from runs
    load_proposer(str(checkpoint), lora, parse_tree_spec("chain:2"))  # what eval/tau.py runs: measured, but said
    out = capsys.readouterr().out
    assert out.count("warning: ") == 1
    assert re.search(message + "; tau measured here is not that drafter's on its own target", out)
    load_proposer(str(checkpoint), copy, parse_tree_spec("chain:2"))
    assert "warning" not in capsys.readouterr().out


def test_a_checkpoint_with_the_first_fingerprint_only_is_compared_the_old_way(tmp_path, target, capsys):
    # checkpoints written before the weights fingerprint record only "fingerprint" (outer rows): they still load,
    # compared as before: another seed is named, a merged LoRA (which that fingerprint cannot see) passes
    from drafters.checkpoint import CheckpointError, check_target
    from drafters.targets import Target
    from drafters.tiny import build_tiny_target

    checkpoint = save_eagle3(tmp_path / "ckpt", target)
    meta = json.loads((checkpoint / "drafter.json").read_text())
    del meta["target"]["weights_fingerprint"]
    (checkpoint / "drafter.json").write_text(json.dumps(meta))
    old = load_checkpoint(checkpoint)
    check_target(old, target)
    check_target(old, merged_lora_target())
    other = Target(*build_tiny_target("tiny-random-llama", seed=1), "tiny-random-llama")
    with pytest.raises(CheckpointError, match=r"other weights than 'tiny-random-llama' \(weights fingerprint "
                                              rf"{meta['target']['fingerprint']} vs [0-9a-f]{{16}}\)"):
        check_target(old, other)
