"""Medusa-1 heads (Cai et al. 2024): K heads on the frozen target's last hidden state.

Head k (from 0) predicts token t+k+2 from x_t (drafters.heads):

    h = x_t
    h = h + SiLU(W_j h + b_j)        j = 0 .. num_layers-1, each block its own module, W_j = 0 at init
    logits_k = U_k h                 U_k (V, d) initialised from the target's LM head

so every head starts as the target's own next-token head. `share_lm_head` ("version 2" in TGI's
Medusa loader) projects with the frozen target LM head instead of a trained copy: no U_k to train,
save or export. A trained copy costs K x V x d parameters (SmolLM2-135M: 4 x 49152 x 576 = 113M,
more than the target's 135M minus its embedding), their AdamW states, and a weight-gradient matmul
per head: on CPU the LM heads are most of the training time.

Differs from FasterDecoding/Medusa: that repo builds `[ResBlock(h)] * num_layers`, one block
repeated (weights shared across a head's layers); here the blocks are separate modules.
Knows nothing about the target model, training loops, trees or export formats.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class MedusaConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1  # residual blocks per head
    share_lm_head: bool = False  # True: every head projects with the frozen target LM head

    @staticmethod
    def from_target_config(config, **options) -> "MedusaConfig":
        text = config.get_text_config()
        return MedusaConfig(hidden_size=text.hidden_size, vocab_size=text.vocab_size, **options)


class ResBlock(nn.Module):
    # x + SiLU(W x + b); W starts at zero (b keeps nn.Linear's init, as in the Medusa repo)
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)

    def forward(self, x: Tensor) -> Tensor:
        return x + F.silu(self.linear(x))


class MedusaHead(nn.Module):
    def __init__(self, config: MedusaConfig):
        super().__init__()
        self.blocks = nn.ModuleList(ResBlock(config.hidden_size) for _ in range(config.num_layers))
        self.lm_head = None if config.share_lm_head else nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def trunk(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class MedusaHeads(nn.Module):
    def __init__(self, config: MedusaConfig):
        super().__init__()
        if config.num_heads < 1 or config.num_layers < 0:
            raise ValueError(f"Medusa needs num_heads >= 1 and num_layers >= 0, got {config.num_heads}, "
                             f"{config.num_layers}")
        self.config = config
        self.heads = nn.ModuleList(MedusaHead(config) for _ in range(config.num_heads))

    @torch.no_grad()
    def init_from_target(self, lm_head_weight: Tensor) -> None:
        # lm_head_weight (V, d): every head's projection starts as a copy of the target's
        for head in self.heads:
            if head.lm_head is not None:
                head.lm_head.weight.copy_(lm_head_weight)

    def states(self, x: Tensor, heads: list[int]) -> Tensor:
        # x (..., d) -> (..., len(heads), d)
        return torch.stack([self.heads[k].trunk(x) for k in heads], dim=-2)

    def project(self, h: Tensor, k: int, lm_head: Tensor) -> Tensor:
        # h (..., d) -> (..., V); lm_head (V, d) = the frozen target LM head weight
        own = self.heads[k].lm_head  # called, not read: sharding engines (ZeRO-3, FSDP) gather it around the call
        return F.linear(h, lm_head) if own is None else own(h)
