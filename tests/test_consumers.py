"""Our exports read by the code that consumes them (eval/check_consumers.py): speculators 0.9
loads the vllm export and reproduces our logits (EAGLE-3, DSpark, P-EAGLE), a drafter speculators
saved drafts the same chain here, SGLang's config handling and weight-name mapping cover the sglang
export. Each check has a control with a planted fault that it must catch.

The consumers live in their own virtual environment (speculators pins transformers <= 5.19):
    bash .ci/consumers-venv                      # about 4 minutes on a 2-core CPU machine
    pytest -m consumers
Without it these tests skip. DRAFTERS_CONSUMERS_VENV points at another location.
"""

import json
import os
from pathlib import Path

import pytest

from conftest import load_script

check = load_script("eval/check_consumers.py")
VENV = Path(os.environ.get("DRAFTERS_CONSUMERS_VENV", check.DEFAULT_VENV))

pytestmark = [
    pytest.mark.consumers,
    pytest.mark.skipif(not (VENV / "bin" / "python").is_file(),
                       reason=f"no consumers venv at {VENV}: create it with `bash .ci/consumers-venv`"),
]


@pytest.fixture(scope="module")
def tiny():
    from drafters.targets import load_target

    return load_target("tiny-random-llama")


def run(name, target, tmp_path, corrupt=None):
    result = check.CHECKS[name](target, tmp_path, VENV, corrupt=corrupt)
    return result, check.failures(name, result)


def test_speculators_reproduces_our_vllm_export(tiny, tmp_path):
    result, failures = run("vllm->speculators", tiny, tmp_path)
    assert failures == [] and result["max_abs_logit_diff"] <= check.TOLERANCE
    assert result["speculators_read"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # HF indices


@pytest.mark.parametrize("norms", [{"norm_before_fc": True}, {"fc_norm": True}, {"norm_before_residual": True}],
                         ids=lambda n: next(iter(n)))
def test_speculators_applies_our_norm_options_as_we_do(tiny, tmp_path, norms):
    # the options travel in the vllm layout (drafters.export.eagle3); speculators' own forward must equal ours
    result = check.check_vllm_export(tiny, tmp_path, VENV, norms=norms)
    assert result["max_abs_logit_diff"] <= check.TOLERANCE, result["max_abs_logit_diff_per_step"]
    assert result["field_differences"] == [] and all(result["speculators_read"][k] for k in norms)


def test_speculators_applies_its_training_defaults_from_our_export_as_we_do(tiny, tmp_path):
    # norm_output and a sliding-window layer (speculators' eagle3 defaults) travel in the vllm layout too; the window
    # (its 2048) is longer than the prompt: tests/test_eagle3.py checks the window itself
    defaults = {"norm_before_fc": True, "norm_output": True, "norm_before_residual": True,
                "layer_types": ["sliding_attention"], "sliding_window": 2048}
    result = check.check_vllm_export(tiny, tmp_path, VENV, norms=defaults)
    assert result["max_abs_logit_diff"] <= check.TOLERANCE, result["max_abs_logit_diff_per_step"]
    read = result["speculators_read"]
    assert result["field_differences"] == [] and read["norm_output"] and read["norm_before_fc"]
    assert (read["sliding_layers"], read["sliding_window"]) == ([0], 2048)


def test_control_speculators_sees_a_wrong_residual(tiny, tmp_path):
    def norm_before_residual(export):  # the field vLLM defaults to True when it is missing
        config = json.loads((export / "config.json").read_text())
        (export / "config.json").write_text(json.dumps({**config, "norm_before_residual": True}))

    result, _ = run("vllm->speculators", tiny, tmp_path, corrupt=norm_before_residual)
    assert result["max_abs_logit_diff"] > 100 * check.TOLERANCE


def edit_config(**fields):
    # a corrupt(export) that sets config.json fields; None removes the field (the reader's default applies)
    def edit(export):
        config = {**json.loads((export / "config.json").read_text()), **fields}
        (export / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return edit


def edit_tensors(change):
    def edit(export):
        from safetensors.torch import load_file, save_file

        tensors = load_file(export / "model.safetensors")
        change(tensors)
        save_file(tensors, export / "model.safetensors")
    return edit


def test_speculators_reproduces_our_dspark_export(tiny, tmp_path):
    result, failures = run("dspark->speculators", tiny, tmp_path)
    assert failures == [] and result["max_abs_logit_diff"] <= check.TOLERANCE
    assert result["max_abs_confidence_diff"] <= check.TOLERANCE and len(result["max_abs_logit_diff_per_slot"]) == 3
    read = result["speculators_read"]
    assert (read["markov_rank"], read["sample_from_anchor"], read["enable_confidence_head"]) == (8, False, True)
    assert read["aux_hidden_state_layer_ids"] == [2, 4, 5] and read["draft_vocab_size"] == 64  # HF indices


@pytest.mark.parametrize("fault", [
    # speculators' DSpark default is True: the Markov bias of slot j would key on token a+j, not a+j-1
    edit_config(sample_from_anchor=None),
    edit_tensors(lambda t: t["markov_head.markov_w2.weight"].zero_()),  # the bias gone: DFlash's logits
], ids=["sample_from_anchor missing", "markov_w2 zeroed"])
def test_control_speculators_sees_a_wrong_dspark_markov_bias(tiny, tmp_path, fault):
    result, failures = run("dspark->speculators", tiny, tmp_path, corrupt=fault)
    assert result["max_abs_logit_diff"] > 100 * check.TOLERANCE
    assert any(f.startswith("max |logit diff|") for f in failures)


def test_speculators_reproduces_our_peagle_export(tiny, tmp_path):
    result, failures = run("peagle->speculators", tiny, tmp_path)
    assert failures == [] and result["max_abs_logit_diff"] <= check.TOLERANCE
    assert len(result["max_abs_logit_diff_per_depth"]) == check.DEPTH  # one pass drafts K tokens
    read = result["speculators_read"]
    assert read["mask_hidden_loaded"] and read["mask_token_id"] == check.MASK_TOKEN_ID
    assert read["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and read["speculative_tokens"] == [check.DEPTH]


@pytest.mark.parametrize("norms", [{"norm_before_fc": True, "norm_before_residual": True}, {"fc_norm": True}],
                         ids=lambda n: "+".join(n))  # fc_norm and norm_before_fc exclude each other
def test_speculators_applies_our_peagle_norm_options_as_we_do(tiny, tmp_path, norms):
    result = check.check_peagle_export(tiny, tmp_path, VENV, norms=norms)
    assert result["max_abs_logit_diff"] <= check.TOLERANCE, result["max_abs_logit_diff_per_depth"]
    assert result["field_differences"] == [] and all(result["speculators_read"][k] for k in norms)


@pytest.mark.parametrize("fault, caught", [
    (edit_config(norm_before_residual=True), "max |logit diff|"),  # speculators' training default; ours is False
    # speculators loads a file without it silently and drafts the mask slots on uninitialised memory
    (edit_tensors(lambda t: t.pop("mask_hidden")), "another mask_hidden"),
], ids=["norm_before_residual", "mask_hidden missing"])
def test_control_speculators_sees_a_wrong_peagle_export(tiny, tmp_path, fault, caught):
    result, failures = run("peagle->speculators", tiny, tmp_path, corrupt=fault)
    assert not result["max_abs_logit_diff"] <= 100 * check.TOLERANCE  # NaN too (uninitialised memory)
    assert any(caught in f for f in failures)


def test_a_drafter_speculators_saved_drafts_the_same_chain_here(tiny, tmp_path):
    result, failures = run("speculators->here", tiny, tmp_path)
    assert failures == [] and result["same_chain"] and len(result["our_chain"]) == 1 + check.STEPS
    # speculators' training defaults (norm_output, norm_before_fc, norm_before_residual, a sliding layer) draft here
    assert result["cli_defaults_same_chain"] and len(result["cli_defaults_our_chain"]) == 1 + check.STEPS


def test_sglang_loads_every_tensor_of_our_sglang_export(tiny, tmp_path):
    result, failures = run("sglang", tiny, tmp_path)
    assert failures == []
    assert result["captured_hf_indices"] == [2, 4, 5]  # written [1, 3, 4]: SGLang adds 1
    assert result["weights"]["midlayer.self_attn.q_proj.weight"] == "model.layers.0.self_attn.qkv_proj.weight"


def test_control_sglang_drops_a_misnamed_tensor(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    def rename(export):
        tensors = load_file(export / "model.safetensors")
        tensors["midlayer.hiddennorm.weight"] = tensors.pop("midlayer.hidden_norm.weight")
        save_file(tensors, export / "model.safetensors")

    _, failures = run("sglang", tiny, tmp_path, corrupt=rename)
    assert any("midlayer.hiddennorm.weight: no SGLang parameter" in f for f in failures)
    assert any("hidden_norm.weight: loaded shards []" in f for f in failures)


@pytest.mark.real
@pytest.mark.parametrize("name", [name for name in check.CHECKS if name not in ("dspark->speculators",
                                                                             "peagle->speculators")])
def test_smollm2(tmp_path, name):
    # DSpark and P-EAGLE on SmolLM2: `python eval/check_consumers.py` (their layouts are the tiny target's; the
    # suite's time)
    from drafters.targets import load_target

    result, failures = run(name, load_target("smollm2-135m-instruct"), tmp_path)
    assert failures == [], result
