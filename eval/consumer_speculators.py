"""The consumer side of eval/check_consumers.py: runs INSIDE the speculators virtual environment
(.ci/consumers-venv; speculators pins transformers <= 5.19, drafters needs >= 5.20).

It never imports drafters: it reads and writes safetensors / JSON files only, and every model it
builds, loads or runs is speculators' own (`Eagle3DraftModel`, `Eagle3SpeculatorConfig`).

    python eval/consumer_speculators.py load EXPORT_DIR INPUTS OUT_DIR
        speculators' `from_pretrained` loads EXPORT_DIR (our --format vllm export; its verifier
        name_or_path must be a local directory), runs its forward on INPUTS (hidden_states
        (1, T, n*h) fused target features, input_ids (1, T) with input_ids[t] = token t+1,
        position_ids (1, T), steps) and writes OUT_DIR/logits.safetensors (logits.i: (1, T, Vd)
        of TTT step i, teacher-forced) and OUT_DIR/read.json (what its config classes read).
    python eval/consumer_speculators.py create VERIFIER_DIR INPUTS OUT_DIR
        speculators builds and saves its own EAGLE-3 drafters for the verifier (OUT_DIR/drafter
        and OUT_DIR/drafter-cli-defaults, see `create`), then drafts a greedy chain with each
        by its own forward: INPUTS holds the prompt's features, its shifted ids and `pending`;
        writes OUT_DIR/<drafter>.safetensors (chain: (1 + K,) target ids, logits: (1, T, Vd) step 0,
        chain_logits: (K, Vd) each chain step's logits).
    python eval/consumer_speculators.py dspark EXPORT_DIR INPUTS OUT_DIR
        speculators' `DSparkDraftModel.from_pretrained` loads EXPORT_DIR (our dspark --format vllm
        export), runs its forward on INPUTS (hidden_states (1, T, n*h), input_ids (1, T) with
        input_ids[t] = token t: the DFlash family reads no shifted ids, anchors (N,) with
        anchor + block_size <= T) and writes OUT_DIR/logits.safetensors (logits (1, N*Bk, Vd)
        with the Markov bias, confidence (1, N*Bk) logits; slot j of block n at n*Bk + j) and
        OUT_DIR/read.json.
    python eval/consumer_speculators.py peagle EXPORT_DIR INPUTS OUT_DIR
        speculators' `PEagleDraftModel.from_pretrained` loads EXPORT_DIR (our peagle --format vllm
        export) and runs its forward once per slot layout i of INPUTS (hidden_states (1, T, n*h)
        features of positions 0..T-1; input_ids.i (1, T) with input_ids.i[t] = token t+1, EAGLE's
        shift; anchor_pos.i, depth.i (S,) its slots, as its drop-token sampler would draw them);
        writes OUT_DIR/logits.safetensors (logits.i: (1, S, Vd) in slot order) and OUT_DIR/read.json.
"""

import json
import sys
from pathlib import Path
from unittest.mock import patch

import torch
from safetensors.torch import load_file, save_file

SEED = 0


def forward_logits(model, hidden_states, input_ids, position_ids, steps: int) -> list:
    # speculators' forward returns argmax tokens per TTT step; its logits are read off lm_head
    captured = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: captured.append(out.detach()))
    try:
        with torch.no_grad():
            model(hidden_states=hidden_states, input_ids=input_ids,
                  document_ids=torch.zeros_like(input_ids), position_ids=position_ids, ttt_steps=steps)
    finally:
        hook.remove()
    return captured  # steps x (1, T, Vd)


def use_cpu_attention(config) -> None:
    # speculators defaults to "simple_flex_attention" (block masks, meant for GPUs); on a CPU its
    # dense-mask path ("eager", speculators' create_float_mask) runs the same math.
    config.transformer_layer_config._attn_implementation = "eager"


def layer_read_back(layer) -> dict:
    """The drafter's decoder-layer config as speculators rebuilt it (transformer_layer_config)."""
    rope = getattr(layer, "rope_parameters", None) or {}
    return {"layer_model_type": layer.model_type,
            **{key: getattr(layer, key) for key in ("num_hidden_layers", "hidden_size", "intermediate_size",
                                                    "num_attention_heads", "num_key_value_heads", "head_dim",
                                                    "max_position_embeddings", "rms_norm_eps", "hidden_act")},
            "rope_theta": rope.get("rope_theta"), "rope_type": rope.get("rope_type")}


def window_read_back(layer) -> dict:
    """The decoder layers that attend within a sliding window, and the window (None without one)."""
    sliding = [i for i, kind in enumerate(getattr(layer, "layer_types", None) or []) if kind == "sliding_attention"]
    return {"sliding_layers": sliding, "sliding_window": getattr(layer, "sliding_window", None) if sliding else None}


def read_back(config) -> dict:
    layer = config.transformer_layer_config
    return {
        "speculators_model_type": config.speculators_model_type,
        "architectures": list(config.architectures),
        "eagle_aux_hidden_state_layer_ids": config.eagle_aux_hidden_state_layer_ids,
        "draft_vocab_size": config.draft_vocab_size,
        "target_vocab_size": config.target_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "norm_before_residual": config.norm_before_residual,
        "norm_before_fc": config.norm_before_fc,
        "fc_norm": config.fc_norm,
        "norm_output": config.norm_output,
        **layer_read_back(layer),
        **window_read_back(layer),
        "tie_word_embeddings": getattr(layer, "tie_word_embeddings", None),
        "speculative_tokens": [m.speculative_tokens for m in config.speculators_config.proposal_methods],
        "verifier": config.speculators_config.verifier.name_or_path,
        "verifier_architectures": config.speculators_config.verifier.architectures,
    }


def load(export_dir: Path, inputs_file: Path, out_dir: Path) -> None:
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(export_dir)
    use_cpu_attention(config)
    model = Eagle3DraftModel.from_pretrained(export_dir, config=config).float().eval()
    never_loaded = [name for name, p in model.named_parameters() if p.isnan().any()]
    inputs = load_file(inputs_file)
    logits = forward_logits(model, inputs["hidden_states"], inputs["input_ids"], inputs["position_ids"],
                            int(inputs["steps"]))
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({f"logits.{i}": x.contiguous() for i, x in enumerate(logits)}, out_dir / "logits.safetensors")
    verifier = load_file(Path(model.config.speculators_config.verifier.name_or_path) / "model.safetensors")
    read = {**read_back(model.config), "never_loaded": never_loaded,
            # speculators fills a missing embedding from the verifier only while it is NaN
            "embedding_is_verifiers": bool(torch.equal(model.embed_tokens.weight, verifier["model.embed_tokens.weight"])),
            "d2t_equal": bool(torch.equal(model.d2t, load_file(export_dir / "model.safetensors")["d2t"]))}
    (out_dir / "read.json").write_text(json.dumps(read, indent=2) + "\n")


def create(verifier_dir: Path, inputs_file: Path, out_dir: Path) -> None:
    """Two drafters built the way speculators' training CLI builds them (its own draft-layer
    config builder and `from_training_args`), each drafting a chain by speculators' forward:
    `drafter`, with the plain EAGLE-3 options (one full-attention layer, no fc / output norms), and
    `drafter-cli-defaults`, with the CLI's eagle3 defaults (norm_before_fc, norm_output,
    norm_before_residual, a sliding window of 2048 on every layer: longer than the prompt, so the
    window itself is not exercised here; tests/test_eagle3.py checks it)."""
    inputs = load_file(inputs_file)
    steps = int(inputs["steps"])
    torch.manual_seed(SEED)  # speculators' own weight init draws from the global generator
    generator = torch.Generator().manual_seed(SEED)
    model = build(verifier_dir, int(inputs["draft_vocab_size"]), steps, generator, full_attention=[0],
                  norm_before_fc=False, norm_output=False)
    cli = build(verifier_dir, int(inputs["draft_vocab_size"]), steps, generator, full_attention=[],
                norm_before_fc=True, norm_output=True, norm_before_residual=True)
    for name, drafter in (("drafter", model), ("drafter-cli-defaults", cli)):
        drafter.save_pretrained(out_dir / name)
        chain, step0, chain_logits = greedy_chain(drafter.eval(), inputs["hidden_states"], inputs["input_ids"],
                                                  int(inputs["pending"]), steps)
        save_file({"chain": chain, "logits": step0.contiguous(), "chain_logits": chain_logits.contiguous()},
                  out_dir / f"{name}.safetensors")


def build(verifier_dir: Path, draft_vocab_size: int, steps: int, generator, *, full_attention, **options):
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config

    layer_config = create_transformer_layer_config(
        str(verifier_dir), num_layers=1, draft_arch="llama", hidden_act=None, sliding_window=2048,
        full_attention_indices=full_attention)
    vocab_size = layer_config.vocab_size
    kept = torch.randperm(vocab_size, generator=generator)[:draft_vocab_size].sort().values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[kept] = True
    model = Eagle3DraftModel.from_training_args(
        layer_config, t2d=t2d, d2t=kept - torch.arange(draft_vocab_size), verifier_name_or_path=str(verifier_dir),
        draft_vocab_size=draft_vocab_size, ttt_steps=steps, draft_attn_impl="eager",
        **{"norm_before_residual": False, **options})
    with torch.no_grad():  # an untrained drafter with every weight off its init (norms off 1.0)
        for name, param in model.named_parameters():
            if not name.startswith(("embed_tokens", "verifier_")):
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


def greedy_chain(model, hidden_states, input_ids, pending: int, depth: int):
    """A chain of `depth` greedy drafts after the prompt, by speculators' own TTT forward: step j
    at the last prompt position reads token T-1+j of the input ids (teacher forcing), so feeding
    the drafts made so far makes step j draft the next one. Positions past the prompt hold zero
    features; the last prompt position never attends to them (causal step 0, diagonal steps).
    input_ids (1, T): the prompt's ids shifted left by one; the last one becomes `pending`.
    -> ((1 + depth,) target ids: pending and the drafts, step-0 logits (1, T, Vd), logits of each
    chain step at the last prompt position (depth, Vd))."""
    T = input_ids.shape[1]
    chain = [pending]  # target ids
    for j in range(depth):
        ids = torch.cat([input_ids[:, :-1], torch.tensor([chain], dtype=input_ids.dtype)], 1)  # (1, T + j)
        hidden = torch.cat([hidden_states, hidden_states.new_zeros(1, j, hidden_states.shape[2])], 1)
        logits = forward_logits(model, hidden, ids, None, j + 1)  # speculators' default positions 1..
        draft = int(logits[j][0, T - 1].argmax())  # a draft id
        chain.append(draft + int(model.d2t[draft]))  # target id = draft id + d2t[draft id]
    return torch.tensor(chain), logits[0][:, :T], torch.stack([x[0, T - 1] for x in logits])


# ---- DSpark and P-EAGLE: speculators trains them and has no drafting code, so the logits its forward ---------
# scores are captured from it: the random anchors (DSpark) and drop-token chains (P-EAGLE) it would draw are
# replaced by the caller's, and its loss is replaced by a function that keeps its arguments.

def load_draft_model(config_class, model_class, export_dir: Path):
    config = config_class.from_pretrained(export_dir)
    use_cpu_attention(config)
    model = model_class.from_pretrained(export_dir, config=config).float().eval()
    never_loaded = [name for name, p in model.named_parameters() if p.isnan().any()]
    verifier = load_file(Path(model.config.speculators_config.verifier.name_or_path) / "model.safetensors")
    return model, {"never_loaded": never_loaded,
                   "embedding_is_verifiers": bool(torch.equal(model.embed_tokens.weight,
                                                              verifier["model.embed_tokens.weight"]))}


def verifier_states(model, length: int):
    # the forward scores its loss targets from the verifier's last hidden states (1, length, h): not compared
    return torch.zeros(1, length, model.config.transformer_layer_config.hidden_size)


def draft_read_back(config) -> dict:
    layer = config.transformer_layer_config
    return {
        "speculators_model_type": config.speculators_model_type,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "mask_token_id": config.mask_token_id,
        **layer_read_back(layer),
        "vocab_size": layer.vocab_size,
        "attention_bias": getattr(layer, "attention_bias", None),
        "layer_types": list(getattr(layer, "layer_types", None) or []),
        "speculative_tokens": [m.speculative_tokens for m in config.speculators_config.proposal_methods],
        "verifier": config.speculators_config.verifier.name_or_path,
    }


def dspark(export_dir: Path, inputs_file: Path, out_dir: Path) -> None:
    import speculators.models.dflash.core as dflash_core
    import speculators.models.dspark.core as dspark_core
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig

    model, loaded = load_draft_model(DSparkSpeculatorConfig, DSparkDraftModel, export_dir)
    inputs = load_file(inputs_file)
    hidden_states, input_ids, anchors = inputs["hidden_states"], inputs["input_ids"], inputs["anchors"]
    T, n = input_ids.shape[1], anchors.numel()
    scored = {}

    def select_anchors(loss_mask, max_anchors, block_size):  # -> anchor positions (N,), valid (N,)
        return anchors, torch.ones(n, dtype=torch.bool)

    def compute_metrics(logits, targets, confidence_logits, *args, **kwargs):
        scored.update(logits=logits.detach(), confidence=confidence_logits.detach())
        return logits.new_zeros(()), {}

    with torch.no_grad(), patch.object(dflash_core, "select_anchors", select_anchors), \
            patch.object(dspark_core, "compute_metrics", compute_metrics):
        model(hidden_states=hidden_states, input_ids=input_ids, loss_mask=torch.ones(1, T),
              verifier_last_hidden_states=verifier_states(model, T), document_ids=torch.zeros_like(input_ids),
              position_ids=None, max_anchors=n)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({"logits": scored["logits"].contiguous(), "confidence": scored["confidence"].contiguous()},
              out_dir / "logits.safetensors")
    config = model.config
    read = {**draft_read_back(config), **loaded,
            "architectures": list(config.architectures),
            "aux_hidden_state_layer_ids": config.aux_hidden_state_layer_ids,
            "block_size": config.block_size,
            "sample_from_anchor": config.sample_from_anchor,
            "markov_rank": config.markov_rank,
            "markov_head_type": config.markov_head_type,
            "enable_confidence_head": config.enable_confidence_head,
            "confidence_head_with_markov": config.confidence_head_with_markov}
    (out_dir / "read.json").write_text(json.dumps(read, indent=2) + "\n")


def peagle(export_dir: Path, inputs_file: Path, out_dir: Path) -> None:
    import speculators.models.peagle.core as peagle_core
    from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig

    model, loaded = load_draft_model(PEagleSpeculatorConfig, PEagleDraftModel, export_dir)
    inputs = load_file(inputs_file)
    hidden_states = inputs["hidden_states"]  # (1, T, n*h)
    T = hidden_states.shape[1]
    logits = {}
    for i in range(int(inputs["layouts"])):
        input_ids, anchor_pos, depth = inputs[f"input_ids.{i}"], inputs[f"anchor_pos.{i}"], inputs[f"depth.{i}"]
        # the forward gathers ids and features at anchor + depth for every slot (torch.where reads both sides):
        # rows past T exist for that gather only; no slot sees them (none is a depth-0 slot)
        pad = max(int((anchor_pos + depth).max()) + 1 - T, 0)
        hidden = torch.cat([hidden_states, hidden_states.new_zeros(1, pad, hidden_states.shape[2])], 1)
        ids = torch.cat([input_ids, input_ids.new_zeros(1, pad)], 1)  # (1, T + pad)
        logits[f"logits.{i}"] = peagle_forward(model, peagle_core, hidden, ids, anchor_pos, depth)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(logits, out_dir / "logits.safetensors")
    config, saved = model.config, load_file(export_dir / "model.safetensors")
    read = {**draft_read_back(config), **loaded,
            "architectures": list(config.architectures),
            "eagle_aux_hidden_state_layer_ids": config.eagle_aux_hidden_state_layer_ids,
            "norm_before_residual": config.norm_before_residual,
            "norm_before_fc": config.norm_before_fc,
            "fc_norm": config.fc_norm,
            # a file without mask_hidden loads silently: speculators drafts on the parameter's uninitialised memory
            "mask_hidden_loaded": "mask_hidden" in saved and bool(torch.equal(model.mask_hidden.detach(),
                                                                               saved["mask_hidden"].float()))}
    (out_dir / "read.json").write_text(json.dumps(read, indent=2) + "\n")


def peagle_forward(model, peagle_core, hidden_states, input_ids, anchor_pos, depth):
    """speculators' P-EAGLE forward on the slots (anchor_pos, depth) (S,) each: slot s sits at position
    anchor_pos[s] + depth[s] and reads (hidden_states, input_ids) there at depth 0, (mask_hidden, mask token)
    deeper. -> logits (1, S, Vd), the slots' draft logits."""
    scored = {}

    def generate_cod_sample_indices(seq_length, loss_mask, **kwargs):  # -> anchor_pos, depth (S,)
        return anchor_pos, depth

    def compute_metrics(logits, targets, **kwargs):
        scored["logits"] = logits.detach()
        return logits.new_zeros(()), {}

    T = input_ids.shape[1]
    with torch.no_grad(), patch.object(peagle_core, "generate_cod_sample_indices", generate_cod_sample_indices), \
            patch.object(peagle_core, "compute_metrics", compute_metrics):
        model(hidden_states=hidden_states, input_ids=input_ids, document_ids=torch.zeros_like(input_ids),
              loss_mask=torch.ones(1, T), verifier_last_hidden_states=verifier_states(model, T))
    return scored["logits"].contiguous()


if __name__ == "__main__":
    command, *paths = sys.argv[1:]
    {"load": load, "create": create, "dspark": dspark, "peagle": peagle}[command](*map(Path, paths))
