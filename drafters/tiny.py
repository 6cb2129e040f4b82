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
