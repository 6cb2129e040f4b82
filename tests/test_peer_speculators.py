"""The speculators 0.9.0 adapter of eval/peers.py (drafters/peers/speculators.py): its offline files hold our
store's tokens and hidden states bit for bit, the last hidden state un-normed so that speculators' own norm gives our
labels back, the mask shifted so that speculators scores exactly our EAGLE-3 labels; the command lines say what they
should; and, with speculators' venv, a few training steps whose output (its default output included) our reader loads
and our decoder drafts with, losslessly.

The venv is never made here (CI does not download or build the peers):
    bash .ci/consumers-venv                      # .venv-speculators, shared with the consumer checks
    pytest -m peers tests/test_peer_speculators.py
Without it the `peers` test skips. DRAFTERS_CONSUMERS_VENV points at another location.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import drafters.peers.speculators as peer
from conftest import greedy_reference, PEER_SETTINGS as SETTINGS, stored
from drafters.layers import ttt_label_mask

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("DRAFTERS_CONSUMERS_VENV", ROOT / ".venv-speculators"))


@pytest.fixture(scope="module")
def target():
    from drafters.targets import load_target

    return load_target("tiny-random-llama")


@pytest.fixture(scope="module")
def data(store, target, tmp_path_factory):
    out = tmp_path_factory.mktemp("speculators") / "data"
    return out, peer.convert(store, out, target=target)


def rms_norm(x, weight, eps):  # what speculators' verifier norm computes (Llama's RMSNorm)
    x = x.float()
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def test_the_offline_files_hold_the_store_bit_for_bit(store, data, target):
    from datasets import load_from_disk

    out, counts = data
    examples, rows = stored(store), load_from_disk(str(out))
    assert counts == {"rows": 20, "tokens": sum(len(e[1]) for e in examples),
                      "supervised": sum(sum(e[2][2:]) for e in examples)}
    assert len(rows) == 21  # and the validation copy of the last row
    norm = target.final_norm
    for i, (_, ids, mask, label, features) in enumerate(examples + examples[-1:]):
        row, hs = rows[i], load_file(out / "hidden_states" / f"hs_{i}.safetensors")
        assert sorted(hs) == ["hidden_states", "token_ids"] and row["seq_len"] == len(ids)
        assert row["input_ids"].dtype == row["loss_mask"].dtype == hs["token_ids"].dtype == torch.int64
        assert row["input_ids"].tolist() == hs["token_ids"].tolist() == ids
        assert row["loss_mask"].tolist() == mask[1:] + [0]  # speculators' convention: the label READ at s
        assert hs["hidden_states"].shape == (len(ids), 4, 64) and hs["hidden_states"].dtype == features.dtype
        assert torch.equal(hs["hidden_states"][:, :3].flatten(1), features)  # the fused aux layers, bit for bit
        assert torch.equal(hs["hidden_states"][:, 3], peer.unnorm(label, norm.weight.float()))
        # speculators norms the last layer itself: its norm of what we wrote is our label, to bf16 rounding
        torch.testing.assert_close(rms_norm(hs["hidden_states"][:, 3], norm.weight, norm.variance_epsilon),
                                   label.float(), rtol=1e-2, atol=1e-2)
    freq = torch.load(out / "token_freq.pt", weights_only=True)
    supervised = torch.cat([torch.tensor(ids)[torch.tensor(mask).bool()] for _, ids, mask, *_ in examples])
    assert freq == {int(k): int(v) for k, v in zip(*supervised.unique(return_counts=True))}


def test_unnorm_is_undone_by_the_verifier_norm():
    torch.manual_seed(0)
    weight, x = torch.rand(32) + 0.5, torch.randn(5, 32) * 7
    label = rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(rms_norm(peer.unnorm(label, weight), weight, 1e-6), label, rtol=1e-5, atol=1e-6)
    weight[3] = 0.0  # a zero weight: the label is 0 there whatever x was; the rest still comes back
    label = rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(rms_norm(peer.unnorm(label, weight), weight, 1e-6), label, rtol=1e-5, atol=1e-6)


def test_the_mask_shift_makes_speculators_score_exactly_our_labels(data):
    # speculators (shift_batch, align_for_step): step i's row t reads token t+1+i and is scored against the target's
    # row t+1+i iff its loss_mask[t+1+i]; ours: iff token t+2+i is to learn (ttt_label_mask)
    from datasets import load_from_disk

    out, _ = data
    for row in load_from_disk(str(out)):
        spec_mask = row["loss_mask"]
        ours = torch.cat([spec_mask.new_zeros(1), spec_mask[:-1]])  # the store's mask: spec_mask[s] = ours[s+1]
        seq_len = spec_mask.numel()
        for step in range(3):
            scored = spec_mask[1 + step:seq_len]  # (T-1-i,): row t -> loss_mask[t+1+i]
            assert torch.equal(scored.bool(), ttt_label_mask(ours[None], step)[0].bool())


def test_convert_is_cheap_to_redo_and_takes_the_rows_asked_for(store, data, target, tmp_path):
    out, counts = data
    before = (out / "convert.json").stat().st_mtime_ns
    assert peer.convert(store, out, target=target) == counts and (out / "convert.json").stat().st_mtime_ns == before
    some = peer.convert(store, tmp_path / "some", rows=[3, 1], target=target)
    examples = [e for e in stored(store) if e[0] in (1, 3)]
    assert some == {"rows": 2, "tokens": sum(len(e[1]) for e in examples),
                    "supervised": sum(sum(e[2][2:]) for e in examples)}
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "mine.txt").write_text("not the converter's")
    with pytest.raises(peer.PeerError, match="not written by convert"):
        peer.convert(store, tmp_path / "other", target=target)


def test_the_command_lines(data, tmp_path):
    out, counts = data
    matched, env = peer.command(Path("python"), out, Path("target"), tmp_path / "run", SETTINGS)
    defaults, _ = peer.command(Path("python"), out, Path("target"), tmp_path / "run", {**SETTINGS, "kind": "defaults"})

    def flags(argv):
        pairs, key = {}, None
        for arg in argv[3:]:
            if arg.startswith("--"):
                key = arg
                pairs[key] = []
            else:
                pairs[key].append(arg)
        return pairs

    m, d = flags(matched), flags(defaults)
    assert matched[:3] == ["python", "-m", "speculators.train"] and env["OMP_NUM_THREADS"] == "1"
    assert m["--target-layer-ids"] == ["2", "4", "5"] and m["--total-seq-len"] == ["128"]
    assert m["--ttt-step-loss-decay"] == ["0.8"] and m["--draft-vocab-size"] == ["64"] and m["--loss-fn"] == ["ce"]
    assert m["--full-attention-indices"] == ["0"] and "--no-norm-output" in m and m["--optimizer"] == ["adamw"]
    ratio = float(m["--train-data-ratio"][0])
    assert int((counts["rows"] + 1) * ratio) == counts["rows"]  # every converted row trains, the copy validates
    cpu = {"--draft-attn-impl", "--loss-implementation", "--num-workers", "--on-missing"}
    fixed = {"--speculator-type", "--verifier-name-or-path", "--data-path", "--save-path", "--log-dir", "--epochs",
             "--seed", "--target-layer-ids", "--total-seq-len", "--train-data-ratio"}
    assert set(d) == cpu | fixed and set(m) > set(d)
    with pytest.raises(peer.PeerError, match="schedule"):
        peer.command(Path("python"), out, Path("target"), tmp_path, {**SETTINGS, "schedule": "wsd"})


def test_exported_is_the_last_epoch(tmp_path):
    with pytest.raises(peer.PeerError, match="no saved epoch"):
        peer.exported(tmp_path)
    for epoch in ("0", "1", "10"):
        (tmp_path / epoch).mkdir()
        (tmp_path / epoch / "config.json").write_text("{}")
    (tmp_path / "checkpoint_best").symlink_to("1")
    assert peer.exported(tmp_path) == (tmp_path / "10", "vllm")


def test_the_patches_are_recorded_with_their_reasons():
    for name, why in peer.PATCHES:
        text = (peer.PATCH_DIR / name).read_text()
        head = text[:text.index("\n--- a/")]
        assert name.startswith(f"{peer.NAME}-{peer.VERSION}-") and why
        assert head and all(line.startswith("#") for line in head.splitlines())


# ---- with speculators' venv: train a few steps, read the output back, decode with it -------------------------------

@pytest.mark.peers
@pytest.mark.skipif(not (VENV / "bin" / "python").is_file(),
                    reason=f"no speculators venv at {VENV}: create it with `bash .ci/consumers-venv`")
@pytest.mark.parametrize("kind", ["matched", "defaults"])
def test_speculators_trains_and_our_decoder_drafts_with_its_output(data, store, target, tmp_path, kind):
    from drafters.decode.decoder import speculative_generate
    from drafters.decode.proposers.loading import load_proposer
    from drafters.decode.tree import parse_tree_spec
    from drafters.export.eagle3_reader import read_eagle3_export

    python = peer.install(ROOT, VENV)
    target_dir = tmp_path / "target"
    target.model.save_pretrained(target_dir)
    target.tokenizer.save_pretrained(target_dir)
    argv, env = peer.command(python, data[0], target_dir, tmp_path / "out", {**SETTINGS, "kind": kind})
    done = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    path, fmt = peer.exported(tmp_path / "out")
    config, *_ = read_eagle3_export(path, fmt)
    if kind == "defaults":  # speculators' own: EAGLE-3.1's norms, a sliding-window layer, the whole vocabulary
        assert (config.norm_output, config.norm_before_fc, config.norm_before_residual) == (True, True, True)
        assert (config.layer_types, config.sliding_window) == (["sliding_attention"], 2048)
        assert config.draft_vocab_size == target.vocab_size
    else:
        assert (config.norm_output, config.layer_types, config.draft_vocab_size) == (False, ["full_attention"], 64)
    prompt = torch.tensor([5, 17, 99, 42, 7, 7, 130, 64])
    proposer = load_proposer(str(path), target, parse_tree_spec("chain:3"))
    out, _ = speculative_generate(target.model, proposer, prompt, max_new_tokens=16, eos_token_ids=set())
    assert out.tolist() == greedy_reference(target.model, prompt[None], 16)[0].tolist()


@pytest.mark.peers
@pytest.mark.skipif(not (VENV / "bin" / "python").is_file(),
                    reason=f"no speculators venv at {VENV}: create it with `bash .ci/consumers-venv`")
def test_the_recorded_defaults_are_speculators_own():
    probe = ("import json; from speculators.train.config import TrainConfig; "
             "print(json.dumps(TrainConfig(speculator_type='eagle3').flatten(), default=str))")
    done = subprocess.run([str(VENV / "bin" / "python"), "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    assert {k: theirs[k] for k in peer.DEFAULTS if k in theirs} == \
        {k: v for k, v in peer.DEFAULTS.items() if k in theirs}
    assert len([k for k in peer.DEFAULTS if k in theirs]) >= 25
