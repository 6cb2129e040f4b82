"""Offline target features (drafters.training.features, train/features.py): online == offline training losses,
what the shards hold, resuming, and clear refusals of features computed for something else."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from drafters.training.data import Example
from drafters.training.features import FeatureStore, FeatureStoreError
from drafters.training.recipe import RecipeError
from drafters.targets import load_target
from conftest import load_script  # tests/ is on sys.path under pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "eagle1_tiny.yaml")
DATA = ROOT / "tests" / "data" / "tiny_conversations.jsonl"
ROWS, TOKENS, HIDDEN = 20, 1427, 64  # the tiny conversations at max_length 128, tiny-random-llama


@pytest.fixture(scope="module")
def scripts():
    return load_script("train/features.py"), load_script("train/eagle.py")


@pytest.fixture(scope="module")
def written(scripts, tmp_path_factory):
    directory = tmp_path_factory.mktemp("features") / "fp32"  # float32 storage: the recipe's features.dtype
    index = scripts[0].main([RECIPE, f"data.path={DATA}", f"features.dir={directory}"])
    return directory, index


def metrics(output_dir):
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def test_online_and_offline_training_give_the_same_losses(scripts, written, tmp_path):
    # Same recipe, same batches (same LengthBuckets), same noise draws: the only difference is where the
    # features come from and that the soft-CE target is recomputed from the stored feature through the
    # frozen head. float32 storage: the stored features are the online ones (a different batch padding
    # in the target forward changes them by float rounding at most), so the losses agree to 1e-6.
    eagle = scripts[1]
    common = [RECIPE, f"data.path={DATA}", "max_steps=4", "eval_every=2"]
    online = eagle.main([*common, f"output_dir={tmp_path / 'online'}"])
    offline = eagle.main([*common, f"output_dir={tmp_path / 'offline'}", f"features.dir={written[0]}"])
    assert offline.losses == pytest.approx(online.losses, rel=1e-6, abs=1e-9)
    for a, b in zip(metrics(tmp_path / "online"), metrics(tmp_path / "offline")):  # feature and token loss
        assert b["step_loss"] == pytest.approx(a["step_loss"], rel=1e-5, abs=1e-9)
        assert b["tokens"] == a["tokens"]
    assert offline.eval["step_acc"] == pytest.approx(online.eval["step_acc"])
    assert offline.eval["loss"] == pytest.approx(online.eval["loss"], rel=1e-6)


def test_dropped_repeats_train_the_same_offline_as_online_from_a_store_written_without_them(scripts, written, tmp_path):
    # data.drop_repeats is applied to the batches, not to the store: the store written without it serves a run
    # with it, and changes the loss of the same batches
    eagle = scripts[1]
    common = [RECIPE, f"data.path={DATA}", "max_steps=4", "eval_every=0"]
    online = eagle.main([*common, "data.drop_repeats=2", f"output_dir={tmp_path / 'online'}"])
    offline = eagle.main([*common, "data.drop_repeats=2", f"output_dir={tmp_path / 'offline'}",
                          f"features.dir={written[0]}"])
    every = eagle.main([*common, f"output_dir={tmp_path / 'all'}", f"features.dir={written[0]}"])
    assert offline.losses == pytest.approx(online.losses, rel=1e-6, abs=1e-9)
    # the same batches (the same input tokens per step), a different loss from the first step on
    assert [m["tokens"] for m in metrics(tmp_path / "offline")] == [m["tokens"] for m in metrics(tmp_path / "all")]
    assert all(abs(a - b) > 1e-4 for a, b in zip(offline.losses, every.losses))
    with pytest.raises(RecipeError, match="data.drop_repeats=1 must be >= 2"):
        eagle.main([*common, "data.drop_repeats=1", f"output_dir={tmp_path / 'bad'}"])


def test_shards_get_the_mode_of_their_index(written):
    # both as a plain open() would write them (they used to be 0600, unreadable to a group sharing the store)
    modes = {p.name: p.stat().st_mode & 0o777 for p in written[0].iterdir()}
    assert set(modes.values()) == {0o666 & ~current_umask()}, modes


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_shards_hold_the_targets_features_tokens_and_masks(written):
    directory, index = written
    assert index["complete"] and index["rows"] == ROWS and index["tokens"] == TOKENS
    assert index["family"] == "eagle1" and index["layer_spec"]["features"] == "normed"
    assert index["target"]["name"] == "tiny-random-llama" and index["target"]["dtype"] == "float32"
    assert len(index["data"]["sha256"]) == 64 and index["data"]["max_length"] == 128
    assert sorted(index["shards"]) == [f"shard-0000{k}.safetensors" for k in range(3)]  # shard_rows 8
    total = sum((directory / name).stat().st_size for name in index["shards"])
    assert index["bytes"] == total and index["bytes_per_token"] == pytest.approx(total / TOKENS)
    assert HIDDEN * 4 + 5 < index["bytes_per_token"] < HIDDEN * 4 + 5 + 8  # feature + id + mask + overhead
    shard = load_file(directory / "shard-00001.safetensors")
    assert shard["features"].shape == (shard["input_ids"].numel(), HIDDEN)
    assert shard["rows"].tolist() == list(range(9, 17))  # data rows (1-based lines) 9..16: shard_rows 8
    # example r of the shard == the target's final-normed hidden states over its tokens, run alone
    target = load_target("tiny-random-llama")
    a, b = shard["offsets"][2:4].tolist()
    ids = shard["input_ids"][a:b].long()[None]
    expected = target.features(ids, logits=False).last_hidden[0]
    torch.testing.assert_close(shard["features"][a:b], expected, atol=1e-5, rtol=1e-5)


def test_bf16_storage_halves_the_feature_bytes(scripts, tmp_path):
    index = scripts[0].main([RECIPE, f"data.path={DATA}", f"features.dir={tmp_path}", "features.dtype=bfloat16",
                             "features.shard_rows=100"])
    assert HIDDEN * 2 + 5 < index["bytes_per_token"] < HIDDEN * 2 + 5 + 8
    assert load_file(tmp_path / "shard-00000.safetensors")["features"].dtype == torch.bfloat16


def test_rerun_resumes_and_rewrites_only_missing_shards(scripts, written, tmp_path):
    directory = tmp_path / "copy"
    shutil.copytree(written[0], directory)
    before = {p.name: p.read_bytes() for p in directory.glob("shard-*")}
    mtimes = {p.name: p.stat().st_mtime_ns for p in directory.glob("shard-*")}
    (directory / "shard-00001.safetensors").unlink()  # as if the run had stopped there
    index = scripts[0].main([RECIPE, f"data.path={DATA}", f"features.dir={directory}"])
    after = {p.name: p.stat().st_mtime_ns for p in directory.glob("shard-*")}
    assert after["shard-00000.safetensors"] == mtimes["shard-00000.safetensors"]  # skipped, not rewritten
    assert after["shard-00002.safetensors"] == mtimes["shard-00002.safetensors"]
    assert (directory / "shard-00001.safetensors").read_bytes() == before["shard-00001.safetensors"]
    assert index["complete"] and index["bytes"] == written[1]["bytes"]
    assert not list(directory.glob(".*"))  # no temporary file left


def test_an_interrupted_multi_process_run_resumes_from_each_processs_list(scripts, written, tmp_path):
    # two processes stopped before the merge: index.json never written, each process's list of finished shards
    # left behind; process 1's list names a shard whose bytes changed since. A rerun keeps what the lists prove.
    directory = tmp_path / "copy"
    shutil.copytree(written[0], directory)
    shards = json.loads((directory / "index.json").read_text())["shards"]
    (directory / "index.json").unlink()
    (directory / "index-rank0.json").write_text(json.dumps({"shards": {
        k: shards[k] for k in ("shard-00000.safetensors", "shard-00002.safetensors")}}))
    (directory / "index-rank1.json").write_text(json.dumps({"shards": {
        "shard-00001.safetensors": {**shards["shard-00001.safetensors"], "sha256": "0" * 64}}}))
    mtimes = {p.name: p.stat().st_mtime_ns for p in directory.glob("shard-*")}
    index = scripts[0].main([RECIPE, f"data.path={DATA}", f"features.dir={directory}"])
    after = {p.name: p.stat().st_mtime_ns for p in directory.glob("shard-*")}
    assert after["shard-00000.safetensors"] == mtimes["shard-00000.safetensors"]  # proven by a list: kept
    assert after["shard-00002.safetensors"] == mtimes["shard-00002.safetensors"]
    assert after["shard-00001.safetensors"] != mtimes["shard-00001.safetensors"]  # its list was wrong: rewritten
    assert index["complete"] and index["shards"] == written[1]["shards"]
    assert not list(directory.glob("index-rank*"))  # merged into index.json and removed


def test_damaged_shards_are_named_before_training_and_the_rerun_repairs_exactly_them(scripts, written, tmp_path):
    directory = tmp_path / "copy"
    shutil.copytree(written[0], directory)
    shards = {p.name: p.read_bytes() for p in directory.glob("shard-*")}
    data = shards["shard-00001.safetensors"]
    (directory / "shard-00001.safetensors").write_bytes(data[: len(data) // 2])  # truncated
    (directory / "shard-00002.safetensors").unlink()  # deleted
    flipped = bytearray(shards["shard-00000.safetensors"])  # same size, one feature byte changed
    flipped[-7] ^= 0xFF
    (directory / "shard-00000.safetensors").write_bytes(bytes(flipped))
    with pytest.raises(FeatureStoreError) as refused:  # used to be SafetensorError / FileNotFoundError mid-training
        scripts[1].main([RECIPE, f"data.path={DATA}", f"output_dir={tmp_path / 'run'}", f"features.dir={directory}"])
    message = str(refused.value)
    assert f"features.dir={directory}: 3 of {len(shards)} shards are damaged (" in message
    assert "shard-00000.safetensors has other bytes than were written" in message
    assert f"shard-00001.safetensors has {len(data) // 2} bytes, {len(data)} were written" in message
    assert "shard-00002.safetensors is missing" in message and "rerun python train/features.py" in message
    mtimes = {p.name: p.stat().st_mtime_ns for p in directory.glob("shard-*")}
    scripts[0].main([RECIPE, f"data.path={DATA}", f"features.dir={directory}"])  # the repair the message names
    assert {p.name: p.read_bytes() for p in directory.glob("shard-*")} == shards
    untouched = set(shards) - {"shard-00000.safetensors", "shard-00001.safetensors", "shard-00002.safetensors"}
    assert all(directory.joinpath(n).stat().st_mtime_ns == mtimes[n] for n in untouched)
    FeatureStore.open(directory)


def test_a_directory_written_by_another_recipe_is_not_resumed(scripts, written, tmp_path):
    directory = tmp_path / "copy"
    shutil.copytree(written[0], directory)
    with pytest.raises(FeatureStoreError, match="written by another recipe.*shard_rows.*delete"):
        scripts[0].main([RECIPE, f"data.path={DATA}", f"features.dir={directory}", "features.shard_rows=4"])


@pytest.mark.parametrize("overrides, field", [
    (["data.max_length=100"], "data.max_length is 128 in the stored features but 100"),
    (["eagle1.feature=pre_norm"], "layer_spec.features is 'normed' in the stored features but 'pre_norm'"),
    (["target=tiny-random-gemma3"], "target.name is 'tiny-random-llama'"),
    (["dtype=bfloat16"], "target.dtype is 'float32'"),
])
def test_features_for_another_run_are_refused(scripts, written, tmp_path, overrides, field):
    with pytest.raises(FeatureStoreError, match=f"{field}.*train/features.py"):
        scripts[1].main([RECIPE, f"data.path={DATA}", f"output_dir={tmp_path}", f"features.dir={written[0]}",
                         *overrides])


def test_a_store_grows_with_its_data_and_equals_one_written_from_scratch(scripts, written, tmp_path):
    # 12 rows, then 8 appended (regeneration appends): the full shard of rows 1-8 is kept, the partial one (9-12) and
    # the new one are computed, and every shard's bytes are those of the store written for the 20 rows at once
    directory, first = tmp_path / "store", tmp_path / "first.jsonl"
    first.write_text("".join(DATA.read_text().splitlines(keepends=True)[:12]))
    scripts[0].main([RECIPE, f"data.path={first}", f"features.dir={directory}"])
    kept = (directory / "shard-00000.safetensors").stat().st_mtime_ns
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    with pytest.raises(FeatureStoreError, match=r"another data file .*12 examples there, 20 now\). If the data grew "
                                                r"or changed, rerun with features.update=true: 1 of the 3 shards"):
        scripts[0].main([RECIPE, f"data.path={DATA}", f"features.dir={directory}"])
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before  # refused before touching anything
    index = scripts[0].main([RECIPE, f"data.path={DATA}", f"features.dir={directory}", "features.update=true"])
    assert (directory / "shard-00000.safetensors").stat().st_mtime_ns == kept
    assert index["complete"] and index["rows"] == ROWS and index["shards"] == written[1]["shards"]  # sha256 each
    assert index["data"]["sha256"] == written[1]["data"]["sha256"]
    FeatureStore.open(directory)  # and training reads it for the 20 rows


def test_an_update_reads_each_kept_shard_once_and_computes_damaged_ones_again(scripts, tmp_path, monkeypatch):
    # rows 17-20 appended to a store of rows 1-16 in shards of 4, whose shard 0 has one feature byte flipped (same
    # size, still a shard) and shard 1 a damaged header (not a shard): both are computed again, shards 2 and 3 kept,
    # and every shard kept or written is hashed once (the update's check and write_features' used to read each
    # kept shard twice)
    from drafters.training import features

    directory, first, small = tmp_path / "store", tmp_path / "first.jsonl", "features.shard_rows=4"
    first.write_text("".join(DATA.read_text().splitlines(keepends=True)[:16]))
    scripts[0].main([RECIPE, f"data.path={first}", f"features.dir={directory}", small])
    for name, at in (("shard-00000.safetensors", -7), ("shard-00001.safetensors", 20)):
        damaged = bytearray((directory / name).read_bytes())
        damaged[at] ^= 0xFF
        (directory / name).write_bytes(bytes(damaged))
    hashed, file_sha256 = [], features.file_sha256
    monkeypatch.setattr(features, "file_sha256", lambda path: hashed.append(Path(path).name[-17:-12]) or
                        file_sha256(path))
    index = scripts[0].main([RECIPE, f"data.path={DATA}", f"features.dir={directory}", small, "features.update=true"])
    # shard 0: its check, then its rewrite; shard 1 is not kept (unreadable); shards 2, 3 kept; shard 4 is new
    assert sorted(hashed) == ["00000", "00000", "00001", "00002", "00003", "00004"]
    monkeypatch.undo()
    fresh = scripts[0].main([RECIPE, f"data.path={DATA}", f"features.dir={tmp_path / 'fresh'}", small])
    assert index["shards"] == fresh["shards"]  # the bytes of the store written for the 20 rows at once


def test_an_update_recomputes_only_changed_shards_and_drops_those_past_the_end(scripts, written, tmp_path):
    # row 10 edited (shard 1 holds rows 9-16) and rows 17-20 dropped: shard 0 kept, shard 1 computed, shard 2 removed
    directory, data = tmp_path / "store", tmp_path / "edited.jsonl"
    shutil.copytree(written[0], directory)
    rows = [json.loads(line) for line in DATA.read_text().splitlines()[:16]]
    rows[9]["conversations"][-1]["content"] += " That is all."
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    kept = (directory / "shard-00000.safetensors").stat().st_mtime_ns
    index = scripts[0].main([RECIPE, f"data.path={data}", f"features.dir={directory}", "features.update=true"])
    assert (directory / "shard-00000.safetensors").stat().st_mtime_ns == kept
    assert sorted(p.name for p in directory.glob("shard-*")) == ["shard-00000.safetensors", "shard-00001.safetensors"]
    fresh = scripts[0].main([RECIPE, f"data.path={data}", f"features.dir={tmp_path / 'fresh'}"])
    assert index["shards"] == fresh["shards"] and index["shards"]["shard-00001.safetensors"] != \
        written[1]["shards"]["shard-00001.safetensors"]


def test_changed_data_is_refused(scripts, written, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text(DATA.read_text().replace("2+2 is 4.", "2+2 is four."))
    with pytest.raises(FeatureStoreError, match="data.sha256 is '[0-9a-f]{64}' in the stored features but.*"
                                                "features.update=true keeps the shards whose rows are unchanged"):
        scripts[1].main([RECIPE, f"data.path={data}", f"output_dir={tmp_path}", f"features.dir={written[0]}"])


def test_missing_incomplete_or_mismatched_stores_are_refused(scripts, written, tmp_path):
    with pytest.raises(FeatureStoreError, match="no index.json; write the features first"):
        FeatureStore.open(tmp_path)
    directory = tmp_path / "partial"
    shutil.copytree(written[0], directory)
    index = json.loads((directory / "index.json").read_text())
    (directory / "index.json").write_text(json.dumps({**index, "complete": False}))
    with pytest.raises(FeatureStoreError, match="rerun python train/features.py with the same recipe"):
        FeatureStore.open(directory)
    store = FeatureStore.open(written[0])
    stored = load_file(written[0] / "shard-00000.safetensors")
    a, b = stored["offsets"][:2].tolist()
    example = Example(stored["input_ids"][a:b].tolist(), stored["loss_mask"][a:b].int().tolist(), 1, "x.jsonl")
    assert store.locate([example]) == [0]
    example.input_ids[3] += 1  # tokenized differently now (another tokenizer or template)
    with pytest.raises(FeatureStoreError, match="not stored as this run tokenizes them"):
        store.locate([example])


def test_features_dir_is_required(scripts, tmp_path):
    with pytest.raises(RecipeError, match=r"eagle1_tiny\.yaml: features\.dir is not set"):
        scripts[0].main([RECIPE, f"data.path={DATA}"])


# ---- EAGLE-3: fused aux layers + the final-normed hidden state for the soft labels -------------------

EAGLE3 = str(ROOT / "recipes" / "eagle3_tiny.yaml")
AUX = [2, 4, 5]  # [2, L//2, L-3] of the 8-layer tiny Llama


@pytest.fixture(scope="module")
def written_eagle3(scripts, tmp_path_factory):
    directory = tmp_path_factory.mktemp("features") / "eagle3"
    index = scripts[0].main([EAGLE3, f"data.path={DATA}", f"features.dir={directory}", "features.dtype=float32"])
    return directory, index


def test_eagle3_shards_hold_the_fused_layers_and_the_label_hidden_state(written_eagle3):
    directory, index = written_eagle3
    assert index["family"] == "eagle3" and index["layer_spec"]["features"] == "fused:2,4,5"
    # 3 aux layers + the label hidden state, float32: 4 * 64 * 4 bytes, + id + mask + overhead
    assert 4 * HIDDEN * 4 + 5 < index["bytes_per_token"] < 4 * HIDDEN * 4 + 5 + 8
    shard = load_file(directory / "shard-00000.safetensors")  # shard_rows 512: all 20 examples
    a, b = shard["offsets"][7:9].tolist()
    target = load_target("tiny-random-llama")
    out = target.features(shard["input_ids"][a:b].long()[None], layers=AUX, logits=True)
    fused = torch.cat([out.hidden_states[i][0] for i in AUX], -1)  # (T, 3h)
    torch.testing.assert_close(shard["features"][a:b], fused, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shard["label_hidden"][a:b], out.last_hidden[0], atol=1e-5, rtol=1e-5)
    # the soft labels are recomputed from it: the frozen head gives the target's own logits
    torch.testing.assert_close(target.lm_head(shard["label_hidden"][a:b]), out.logits[0], atol=1e-5, rtol=1e-5)


def test_eagle3_online_and_offline_losses_are_bit_identical_on_the_same_batch(scripts, tmp_path):
    # One batch, computed online (a target forward) and from float32 features written by ONE target forward
    # over the same examples (same padded length): the training loss and its gradients are the same bits.
    from drafters.training.data import build_examples, collate
    from drafters.training.families import TRAINING_FAMILIES, load_recipe
    from drafters.training.features import features_header, offline_batches, write_features
    from drafters.draft_vocab import build_draft_vocab
    from drafters.training.eagle3 import TTTOptions, build_eagle3_drafter, target_inputs_fn, ttt_loss
    from drafters.training.loop import FeatureBatch
    from drafters.training.batches import pad_id

    recipe = load_recipe([EAGLE3, f"data.path={DATA}", f"features.dir={tmp_path}", "features.dtype=float32"])
    target = load_target(recipe.target)
    examples, _ = build_examples(target.tokenizer, str(DATA), max_length=128)
    batch_rows = examples[3:7]
    write_features(tmp_path, target, batch_rows, features_header(recipe, target, TRAINING_FAMILIES["eagle3"]), batch_size=len(batch_rows))
    store = FeatureStore.open(tmp_path)
    drafter = build_eagle3_drafter(recipe, target, build_draft_vocab(
        [(e.input_ids, e.loss_mask) for e in examples], target.vocab_size, recipe.draft_vocab_size))
    online_batch = collate(batch_rows, pad_id(target))
    offline_batch = offline_batches(store, [batch_rows], pad_id(target))[0]
    losses, grads = [], []
    for batch, inputs in ((online_batch, target_inputs_fn(
            load_recipe([EAGLE3, f"data.path={DATA}"]), target, drafter)),
                          (offline_batch, target_inputs_fn(recipe, target, drafter))):
        features, labels = inputs(batch)
        drafter.zero_grad()
        out = ttt_loss(drafter,
                       FeatureBatch(features, batch["input_ids"], labels, batch["loss_mask"], target.embed_tokens),
                       TTTOptions(steps=recipe.eagle3.ttt_steps))
        out.loss.backward()
        losses.append(out.step_losses.detach())
        grads.append([p.grad.clone() for p in drafter.parameters()])
    assert torch.equal(losses[0], losses[1]) and losses[0].sum() > 0
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_eagle3_trains_offline_as_it_trains_online(scripts, written_eagle3, tmp_path):
    # Whole runs: the training batches' target forwards pad differently from the writer's, so the stored
    # features differ from the online ones by float rounding at most.
    common = [EAGLE3, f"data.path={DATA}", "max_steps=4", "eval_every=2"]
    online = scripts[1].main([*common, f"output_dir={tmp_path / 'online'}"])
    offline = scripts[1].main([*common, f"output_dir={tmp_path / 'offline'}", f"features.dir={written_eagle3[0]}",
                               "features.dtype=float32"])
    assert offline.losses == pytest.approx(online.losses, rel=1e-5)
    assert offline.eval["step_acc"] == pytest.approx(online.eval["step_acc"])
    assert offline.eval["loss"] == pytest.approx(online.eval["loss"], rel=1e-5)


def test_eagle3_features_for_other_aux_layers_are_refused(scripts, written_eagle3, tmp_path):
    with pytest.raises(FeatureStoreError, match="layer_spec.features is 'fused:2,4,5' in the stored features but "
                                                "'fused:1,4,6' in this run, so they were computed for other target "
                                                "layers"):
        scripts[1].main([EAGLE3, f"data.path={DATA}", f"output_dir={tmp_path}", f"features.dir={written_eagle3[0]}",
                         "features.dtype=float32", "layers=[1,4,6]"])


def test_a_store_in_another_precision_is_refused(scripts, written_eagle3, tmp_path):
    # the store is float32; asking for bfloat16 features (or the reverse) used to train on the stored precision
    with pytest.raises(FeatureStoreError, match="dtype is 'float32' in the stored features but 'bfloat16' in this "
                                                r"run, so they were computed for another features.dtype"):
        scripts[1].main([EAGLE3, f"data.path={DATA}", f"output_dir={tmp_path}", f"features.dir={written_eagle3[0]}",
                         "features.dtype=bfloat16"])


def test_dflash_trains_from_the_eagle3_store_as_it_trains_online(scripts, written_eagle3, tmp_path):
    # DFlash reads EAGLE-3's layout (fused aux layers + label hidden state): one store serves both
    common = [str(ROOT / "recipes" / "dflash_tiny.yaml"), f"data.path={DATA}", "max_steps=4", "eval_every=2"]
    online = scripts[1].main([*common, f"output_dir={tmp_path / 'online'}"])
    offline = scripts[1].main([*common, f"output_dir={tmp_path / 'offline'}", f"features.dir={written_eagle3[0]}",
                               "features.dtype=float32"])
    assert offline.losses == pytest.approx(online.losses, rel=1e-5)
    assert offline.eval["tau_pred"] == pytest.approx(online.eval["tau_pred"])
    with pytest.raises(FeatureStoreError, match="'fused:2,4,5' in the stored features but 'fused:1,4,6'"):
        scripts[1].main([*common, f"output_dir={tmp_path / 'other'}", f"features.dir={written_eagle3[0]}",
                         "layers=[1,4,6]"])
