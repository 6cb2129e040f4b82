"""Logits warping shared by the target and every drafter, so both sides of a rejection test see
the same distribution.

Order and rules are Hugging Face `generate`'s (transformers 5.x `_get_logits_processor`):
temperature, top-k, top-p, eta, each done by HF's own warper class, on float32 logits, so sampled
outputs are distributed like `model.generate(do_sample=True, ...)` with the same settings.
Temperature 0 means greedy: `warp` returns the one-hot argmax. This module knows nothing about
trees or models.
"""

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers.generation.logits_process import EtaLogitsWarper, TopKLogitsWarper, TopPLogitsWarper


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    eta: float = 0.0  # eta cutoff (Hewitt et al. 2022), 0 = off; as HF `eta_cutoff`
    seed: int | None = None  # seeds the decoder's generator when the caller passes none

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"SamplingConfig.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"SamplingConfig.top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if not 0 <= self.eta < 1:
            raise ValueError(f"SamplingConfig.eta must be in [0, 1) (0 = off), got {self.eta}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def warp(logits: Tensor, cfg: SamplingConfig) -> Tensor:
    # logits (..., V) -> probs (..., V) float32
    scores = logits.float().reshape(-1, logits.shape[-1])  # (R, V): HF warpers take 2-D scores
    if cfg.greedy:
        probs = torch.zeros_like(scores).scatter_(-1, scores.argmax(-1, keepdim=True), 1.0)
        return probs.reshape(logits.shape)
    scores = scores / cfg.temperature
    if cfg.top_k:
        scores = TopKLogitsWarper(top_k=cfg.top_k)(None, scores)
    if cfg.top_p < 1:
        scores = TopPLogitsWarper(top_p=cfg.top_p)(None, scores)
    if cfg.eta > 0:
        scores = EtaLogitsWarper(epsilon=cfg.eta, device=scores.device)(None, scores)
    return scores.softmax(-1).reshape(logits.shape)


def sample(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    # probs (V,) -> () long; greedy one-hot probs give the argmax
    return torch.multinomial(probs, 1, generator=generator)[0]


def sample_without_replacement(probs: Tensor, k: int, generator: torch.Generator | None = None) -> Tensor:
    # probs (V,) -> (<= k,) long, drawn one after another from what is left, renormalised: the
    # sibling order the stochastic verifier assumes (see decoding.verify_sampling).
    k = min(k, int((probs > 0).sum()))
    return torch.multinomial(probs, k, replacement=False, generator=generator)
