"""Tiny random targets built in-process, so tests and demos never download anything.

`tiny-random-llama` and `tiny-random-gemma3` share one byte-level tokenizer (259 ids: 3 specials
plus the 256 byte symbols) with a ChatML chat template, the template family of SmolLM2. The
models are randomly initialised from a fixed seed, so every process builds bit-identical weights.
"""

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_TARGETS = ("tiny-random-llama", "tiny-random-gemma3")


def build_tiny_tokenizer(chat_template: bool = True) -> PreTrainedTokenizerFast:
    # Byte-level BPE with no merges: every UTF-8 byte is one token, offsets map back to characters.
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    if chat_template:
        tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_tiny_target(name: str = "tiny-random-llama", seed: int = 0, num_layers: int = 8,
                      untied_head_seed: int | None = None):
    """Return (model, tokenizer) for a tiny random target: hidden 64, `num_layers` layers, vocab 259.

    Eight layers by default so that the EAGLE-3 default fusion layers [2, L//2, L-3] = [2, 4, 5]
    are distinct. The tiny Llama ties its LM head to the embeddings and then greedily repeats one
    token forever; `untied_head_seed` gives it an untied random head instead, so greedy
    continuations vary and drafts can be right or wrong.
    """
    tokenizer = build_tiny_tokenizer()
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if name == "tiny-random-llama":
        config = LlamaConfig(**common, tie_word_embeddings=True)
        model_cls = LlamaForCausalLM
    elif name == "tiny-random-gemma3":
        # Sliding-window layers alternate with full-attention ones as in Gemma-3; the window is
        # small so tests exercise it.
        config = Gemma3TextConfig(**common, sliding_window=64, query_pre_attn_scalar=16)
        model_cls = Gemma3ForCausalLM
    else:
        raise ValueError(f"unknown tiny target {name!r}; choose one of {', '.join(TINY_TARGETS)}")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_cls(config)
    if untied_head_seed is not None:
        with torch.random.fork_rng():
            torch.manual_seed(untied_head_seed)
            model.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        model.config.tie_word_embeddings = False
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.eval(), tokenizer


# The architectures users bring, each as a tiny random model of transformers' own config class (hidden 64, 8 layers,
# the tiny tokenizer's 259 ids): name -> (config class, the fields its kind needs beyond the common ones). The
# architecture matrix (eval/architectures.py, tests/test_architectures.py) trains, decodes and exports each.
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
TINY_ARCHITECTURES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "qwen3_moe": ("Qwen3MoeConfig", _MOE),
    "mistral-window": ("MistralConfig", {"sliding_window": 16}),  # a window on the config alone (Mistral-7B-v0.1)
    "phi3": ("Phi3Config", {"sliding_window": 16, "pad_token_id": 0}),
    "gemma2": ("Gemma2Config", {"sliding_window": 16, "final_logit_softcapping": 30.0}),
    "gemma3": ("Gemma3TextConfig", {"sliding_window": 16, "query_pre_attn_scalar": 16}),
    "granite": ("GraniteConfig", {"logits_scaling": 4.0, "embedding_multiplier": 2.0}),
    "cohere": ("CohereConfig", {"logit_scale": 0.25}),
    "cohere2": ("Cohere2Config", {"sliding_window": 16, "logit_scale": 0.25}),
    "olmo2": ("Olmo2Config", {}),
    "olmo3": ("Olmo3Config", {"sliding_window": 16}),
    "smollm3": ("SmolLM3Config", {}),
    "seed_oss": ("SeedOssConfig", {}),
    "glm4": ("Glm4Config", {}),
    "exaone4": ("Exaone4Config", {"sliding_window": 16}),
    "ministral3": ("Ministral3Config", {}),
    "gpt_oss": ("GptOssConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16}),
    "deepseek_v3": ("DeepseekV3Config", {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1,
                                         "topk_group": 1, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
                                         "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8,
                                         "qk_nope_head_dim": 8, "v_head_dim": 16, "head_dim": 8,
                                         "num_key_value_heads": 4}),  # latent attention: no grouped heads
    "minimax_m2": ("MiniMaxM2Config", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "llama4": ("Llama4TextConfig", {"num_local_experts": 4, "num_experts_per_tok": 1,
                                    "intermediate_size_mlp": 128, "attention_chunk_size": 16}),
    "gemma4": ("Gemma4TextConfig", {"sliding_window": 16, "vocab_size_per_layer_input": 259,
                                    "hidden_size_per_layer_input": 8}),
    "qwen3_next": ("Qwen3NextConfig", {**_MOE, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
                                       "linear_key_head_dim": 16, "linear_value_head_dim": 16}),
    "qwen3_5": ("Qwen3_5TextConfig", {"linear_num_value_heads": 4, "linear_num_key_heads": 2,
                                      "linear_key_head_dim": 16, "linear_value_head_dim": 16}),
    "granite_hybrid": ("GraniteMoeHybridConfig", {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16,
                                                   "mamba_n_groups": 1, "num_local_experts": 0, "layers_block_type": ["mamba", "attention"] * 4,
                                                   "shared_intermediate_size": 128}),
    "glm4_moe": ("Glm4MoeConfig", {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                   "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}),
    "ernie4_5": ("Ernie4_5Config", {}),
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", {}),
    "apertus": ("ApertusConfig", {}),  # xIELU activations
    "arcee": ("ArceeConfig", {}),
    "lfm2": ("Lfm2Config", {"full_attn_idxs": [2, 5, 7]}),  # short-convolution layers between attention
    "olmo_hybrid": ("OlmoHybridConfig", {}),  # gated DeltaNet beside attention
    "nemotron_h": ("NemotronHConfig", {"layers_block_type": ["mamba", "attention", "mlp", "mamba", "moe", "attention",
                                                             "mamba", "mlp"], "ssm_state_size": 16,
                                       "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 1,
                                       "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                       "moe_shared_expert_intermediate_size": 32}),
    "deepseek_v32": ("DeepseekV32Config", {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1,
                                           "topk_group": 1, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
                                           "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8,
                                           "qk_nope_head_dim": 8, "v_head_dim": 16, "head_dim": 8,
                                           "num_key_value_heads": 4}),  # the sparse-attention indexer
}


def build_tiny_architecture(arch: str, seed: int = 0):
    """(model, tokenizer): a tiny random model of `arch` (TINY_ARCHITECTURES) and the tiny byte tokenizer, its
    LM head scaled to logits of a few units so that greedy continuations vary (a random init's are near-uniform)."""
    import transformers

    if arch not in TINY_ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(TINY_ARCHITECTURES)}")
    class_name, extra = TINY_ARCHITECTURES[arch]
    tokenizer = build_tiny_tokenizer()
    config = getattr(transformers, class_name)(**{
        "vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 1024,
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id, "tie_word_embeddings": False, **extra})
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        try:
            model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        except ValueError:  # no SDPA path (Gemma-2, GPT-OSS): eager, which the tree decoder also drives
            model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        with torch.no_grad():
            model.get_output_embeddings().weight.normal_(0, 1.0)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.eval(), tokenizer


# Tiny targets with native MTP layers (drafters.mtp): arch -> the checkpoint layout its MTP tensors take. Transformers'
# model classes drop MTP weights at load and never save them, so the tiny target is saved first and its MTP layer's
# tensors (random, correctly shaped) are then added to its safetensors, with the config's count field set.
MTP_ARCHITECTURES = {"deepseek_v3": "deepseek", "glm4_moe": "deepseek", "qwen3_next": "qwen", "qwen3_5": "qwen",
                     "llama": "deepseek", "qwen3": "deepseek"}  # the last two: DeepSeek's layout on dense targets
TINY_MTP_PREFIX = "tiny-mtp-"  # tiny-mtp-<arch>: a drafters.targets short name, written once into the cache


def write_tiny_mtp_target(arch: str, directory, seed: int = 0, num_mtp_layers: int = 1):
    """Save the tiny random `arch` (build_tiny_architecture) with its tokenizer into `directory`, plus
    `num_mtp_layers` random MTP layers in the target's own layout (drafters.mtp) -> the directory."""
    from pathlib import Path

    from safetensors import safe_open
    from safetensors.torch import save_file

    from drafters.mtp import MtpConfig, MtpDrafter, MtpNames, checkpoint_tensors

    if arch not in MTP_ARCHITECTURES:
        raise ValueError(f"no tiny MTP target for {arch!r}; choose one of {', '.join(MTP_ARCHITECTURES)}")
    layout, directory = MTP_ARCHITECTURES[arch], Path(directory)
    model, tokenizer = build_tiny_architecture(arch, seed)
    text = model.config.get_text_config()
    setattr(text, "mtp_num_hidden_layers" if arch == "qwen3_5" else "num_nextn_predict_layers", num_mtp_layers)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    file = directory / "model.safetensors"
    with safe_open(file, framework="pt") as f:
        tensors, metadata = {name: f.get_tensor(name) for name in f.keys()}, f.metadata()
    generator = torch.Generator().manual_seed(seed + 1)
    centre = 0.0 if layout == "qwen" else 1.0  # Qwen's norms compute x * (1 + w)
    for layer in range(num_mtp_layers):
        config = MtpConfig.from_target_config(model.config, layout, layer)
        state = {name: (centre + 0.1 * torch.randn(v.shape, generator=generator)) if v.dim() == 1
                 else 0.1 * torch.randn(v.shape, generator=generator)
                 for name, v in MtpDrafter(config).state_dict().items()}
        tensors.update(checkpoint_tensors(config, state, text.num_hidden_layers))
        copies = MtpNames.of(layout, text.num_hidden_layers, layer).copies
        if copies:  # DeepSeek stores the target's embedding and head beside every MTP layer
            tensors[copies["embed"]] = model.get_input_embeddings().weight.detach().clone()
            tensors[copies["head"]] = model.get_output_embeddings().weight.detach().clone()
    save_file({k: v.contiguous() for k, v in tensors.items()}, file, metadata=metadata)
    return directory
