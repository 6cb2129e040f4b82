"""The architectures users bring (drafters.tiny.TINY_ARCHITECTURES: tiny random models of transformers' own config
classes, saved to a directory as a user's model is): the soft labels equal the model's own distribution for every
one of them, and one architecture of each kind trains, decodes greedily equal to `generate` and exports, through
the steps of eval/architectures.py (which prints the whole matrix: `python eval/architectures.py`)."""

import pytest
import torch

from conftest import load_script  # tests/ is on sys.path under pytest
from drafters.targets import with_cache
from drafters.tiny import TINY_ARCHITECTURES

matrix = load_script("eval/architectures.py")
# one of each kind the decoder or the trainer treats apart (about a second each; the whole matrix is
# eval/architectures.py's): multi-head latent attention with
# experts, chunked attention (and a causal LM whose base_model is not its decoder), per-layer head sizes, a LayerNorm
# target with a logit scale, a legacy rope `type` key, hybrid linear attention (chains with state snapshots)
# ... and an activation with weights of its own (Apertus' xIELU), a final norm named norm_f and a config without
# rotary positions (Nemotron-H)
KINDS = ["deepseek_v3", "llama4", "gemma4", "cohere", "ministral3", "qwen3_next", "apertus", "nemotron_h"]


@pytest.mark.parametrize("arch", sorted(TINY_ARCHITECTURES))
def test_soft_labels_are_the_models_own_distribution(arch, tmp_path):
    from drafters.targets import load_target

    target = load_target(str(matrix.save_model(arch, tmp_path / arch)))
    assert matrix.label_gap(target) < 1e-4


@pytest.mark.parametrize("arch", KINDS)
def test_an_architecture_trains_decodes_and_exports(arch, tmp_path):
    result = matrix.run_steps(arch, "eagle3", tmp_path)
    assert result == {step: "ok" for step in matrix.STEPS}


def test_a_layout_the_decoder_cannot_verify_is_refused_in_one_sentence(tmp_path):
    # DeepSeek-V3.2's sparse-attention indexer keeps a cache of its own: trains and exports, decoding refused
    result = matrix.run_steps("deepseek_v32", "eagle3", tmp_path)
    assert result.pop("decode").startswith("refused (NotImplementedError): decoding: DeepseekV32ForCausalLM has "
                                           "indexed_attention layers, which this decoder cannot verify")
    assert result == {"labels": "ok", "train": "ok", "export": "ok"}


def test_tau_on_a_hybrid_target_verifies_chains_and_says_so(tmp_path, capsys):
    # eval/tau.py on Qwen3-Next (gated DeltaNet layers): a static tree is verified as its first-child chain, said in
    # a note and recorded; greedy output equals generate (tau.py stops on any mismatch); --tree auto is refused
    tau = load_script("eval/tau.py")
    target = str(matrix.save_model("qwen3_next", tmp_path / "qwen3_next"))
    common = ["--target", target, "--proposer", "prompt-lookup", "--bench", "mt_bench", "--limit", "1",
              "--max-new-tokens", "8", "--max-turns", "1"]
    report = tau.main([*common, "--tree", "static:[[0],[1],[0,0]]", "--json", str(tmp_path / "tau.json")])
    assert "verifies the first-child chain of --tree static" in capsys.readouterr().out
    assert any("recurrent layers" in note for note in report["proposer_notes"])
    assert report["greedy_check"] == {"checked": 1, "mismatches": 0, "mismatched": []}
    assert report["mean_tree_nodes_incl_root"] <= 3  # a chain of the root and at most 2 drafts
    with pytest.raises(SystemExit) as stop:
        tau.main([*common, "--tree", "auto"])
    assert "has recurrent layers, so every round verifies a chain" in str(stop.value.code)


@torch.no_grad()
def test_chunked_attention_tree_forward_equals_sequential():
    # Llama-4's chunked layers: a key is visible only inside the query's chunk (16 positions here); the prompt
    # crosses a chunk boundary so the mask matters
    from transformers import DynamicCache

    from drafters.decode.decoder import tree_forward
    from drafters.decode.tree import EAGLE1_PATHS, TreeShape
    from drafters.tiny import build_tiny_architecture

    model, _ = build_tiny_architecture("llama4")
    prompt = torch.randint(3, 259, (30,), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache()
    model(prompt[None], **with_cache(model, cache), use_cache=True)
    shape = TreeShape.from_paths(EAGLE1_PATHS)
    tree = shape.fill(42, torch.randint(3, 259, (shape.num_nodes, 4), generator=torch.Generator().manual_seed(1)))
    logits = tree_forward(model, cache, tree).logits[0]
    for path in tree.paths:
        sequential = model(torch.cat([prompt, tree.tokens[path]])[None]).logits[0, -len(path):]
        torch.testing.assert_close(logits[path], sequential, atol=1e-4, rtol=1e-4)
