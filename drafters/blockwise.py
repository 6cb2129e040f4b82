"""Blockwise parallel decoding heads (Stern, Shazeer & Uszkoreit 2018) on a frozen target.

The paper inserts "a single feedforward layer with hidden size k * d_hidden and output size
k * d_model" after the decoder's output, splits the output into k slices, adds each slice
residually to the decoder output and projects all k with the one shared vocabulary projection:

    z      = ReLU(W_up x_t + b_up)              (..., K*f)    f = hidden_per_head (default d)
    y      = W_down z + b_down                  (..., K*d)    W_down, b_down = 0 at init
    h_k    = x_t + y[k*d : (k+1)*d]             (..., d)
    logits = lm_head(h_k)                       the frozen target LM head, shared by every head

Head k (from 0) predicts token t+k+2 (drafters.heads). The paper's p_1 (the next token) is the
frozen target itself here, verified by the shared decoder, so the K heads are the paper's
p_2 .. p_{K+1}. Zero W_down makes every head start as the target's next-token prediction.
Differs from Medusa: one layer for all heads (the heads share W_up's features) and no trainable
vocabulary projection. Knows nothing about the target model, training loops or trees.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class BlockwiseConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    hidden_per_head: int = 0  # f: the hidden layer is num_heads * f wide; 0 = hidden_size

    def __post_init__(self):
        if self.hidden_per_head == 0:
            self.hidden_per_head = self.hidden_size

    @staticmethod
    def from_target_config(config, **options) -> "BlockwiseConfig":
        text = config.get_text_config()
        return BlockwiseConfig(hidden_size=text.hidden_size, vocab_size=text.vocab_size, **options)


class RowsLinear(nn.Linear):
    """nn.Linear that can compute only some of its output rows: forward(x, rows) = x W[rows]^T + b[rows]. The
    selection happens inside the module's call, so engines that shard parameters (ZeRO-3, FSDP), which gather a
    module's weights only around its own forward and backward, see it used; reading `.weight` from outside would
    get an empty shard there. Same parameters as nn.Linear."""

    def forward(self, x: Tensor, rows: Tensor | None = None) -> Tensor:
        if rows is None:
            return super().forward(x)
        return F.linear(x, self.weight[rows], self.bias[rows])


class BlockwiseHeads(nn.Module):
    def __init__(self, config: BlockwiseConfig):
        super().__init__()
        if config.num_heads < 1 or config.hidden_per_head < 1:
            raise ValueError(f"Blockwise needs num_heads >= 1 and hidden_per_head >= 1, got {config.num_heads}, "
                             f"{config.hidden_per_head}")
        self.config = config
        d, k, f = config.hidden_size, config.num_heads, config.hidden_per_head
        self.up = nn.Linear(d, k * f)
        self.down = RowsLinear(k * f, k * d)
        nn.init.zeros_(self.down.weight)
        nn.init.zeros_(self.down.bias)

    def states(self, x: Tensor, heads: list[int]) -> Tensor:
        # x (..., d) -> (..., len(heads), d); only the selected heads' rows of W_down are used
        d = self.config.hidden_size
        z = F.relu(self.up(x))  # (..., K*f)
        if list(heads) == list(range(self.config.num_heads)):
            y = self.down(z)  # (..., K*d)
        else:
            rows = torch.cat([torch.arange(k * d, (k + 1) * d) for k in heads]).to(x.device)  # (S*d,)
            y = self.down(z, rows)  # (..., S*d)
        return x.unsqueeze(-2) + y.unflatten(-1, (len(heads), d))

    def project(self, h: Tensor, k: int, lm_head: Tensor) -> Tensor:
        # h (..., d) -> (..., V) with the frozen target LM head weight (V, d), shared by every head
        return F.linear(h, lm_head)
