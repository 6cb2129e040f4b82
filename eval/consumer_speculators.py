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
        and OUT_DIR/drafter-cli-defaults, see `create`), then drafts a greedy chain with the first
        by its own forward: INPUTS holds the prompt's features, its shifted ids and `pending`;
        writes OUT_DIR/chain.safetensors (chain: (1 + K,) target ids, logits: (1, T, Vd) step 0,
        chain_logits: (K, Vd) each chain step's logits).
"""

import json
import sys
from pathlib import Path

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


def read_back(config) -> dict:
    layer = config.transformer_layer_config
    rope = getattr(layer, "rope_parameters", None) or {}
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
        "layer_model_type": layer.model_type,
        "num_hidden_layers": layer.num_hidden_layers,
        "hidden_size": layer.hidden_size,
        "intermediate_size": layer.intermediate_size,
        "num_attention_heads": layer.num_attention_heads,
        "num_key_value_heads": layer.num_key_value_heads,
        "head_dim": layer.head_dim,
        "max_position_embeddings": layer.max_position_embeddings,
        "rms_norm_eps": layer.rms_norm_eps,
        "rope_theta": rope.get("rope_theta"),
        "rope_type": rope.get("rope_type"),
        "hidden_act": layer.hidden_act,
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
    config builder and `from_training_args`): `drafter`, with the EAGLE-3 options this project's
    drafter has (one full-attention layer, no fc / output norms), drafts the chain; and
    `drafter-cli-defaults`, with the CLI's eagle3 defaults (norm_before_fc, norm_output, a sliding
    window on every layer), which a reader here must refuse rather than run with other math."""
    inputs = load_file(inputs_file)
    steps = int(inputs["steps"])
    torch.manual_seed(SEED)  # speculators' own weight init draws from the global generator
    generator = torch.Generator().manual_seed(SEED)
    model = build(verifier_dir, int(inputs["draft_vocab_size"]), steps, generator, full_attention=[0],
                  norm_before_fc=False, norm_output=False)
    model.save_pretrained(out_dir / "drafter")
    build(verifier_dir, int(inputs["draft_vocab_size"]), steps, generator, full_attention=[],
          norm_before_fc=True, norm_output=True).save_pretrained(out_dir / "drafter-cli-defaults")
    chain, step0, chain_logits = greedy_chain(model.eval(), inputs["hidden_states"], inputs["input_ids"],
                                              int(inputs["pending"]), steps)
    save_file({"chain": chain, "logits": step0.contiguous(), "chain_logits": chain_logits.contiguous()},
              out_dir / "chain.safetensors")


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
        draft_vocab_size=draft_vocab_size, norm_before_residual=False, ttt_steps=steps, draft_attn_impl="eager",
        **options)
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


if __name__ == "__main__":
    command, *paths = sys.argv[1:]
    {"load": load, "create": create}[command](*map(Path, paths))
