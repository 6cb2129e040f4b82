"""llama.cpp as the referee of our decoder: the same prompt ids through both engines, greedy, one chain of
n drafts per round, and the accepted counts compared where the two greedy texts agree.

Why the texts can part: llama.cpp computes in ggml (F32 on the converted F32 weights, or quantised
activations on a Q4_1 file), our decoder in torch. Float32 sums in another order differ by ~1e-6 relative,
so two engines pick different tokens only where the target's top two logits are that close: rare, and
after that point the texts (and so the drafts) are different questions. Where the texts agree, both engines
draft from the same tokens with the same weights, verify the same greedy chain and must accept the same
number of drafts: a difference there is a bug (in the export, the converter, or a decoder), not noise.
So each prompt is compared over its shared greedy prefix: when the outputs part after k tokens, both
engines are run again for exactly k tokens and their accepted counts compared there.

Knows nothing about training; drives llama.cpp only through drafters.engines.llama_cpp.LlamaServer.
"""

from dataclasses import asdict, dataclass

import torch

from drafters.decode.decoder import speculative_generate


@dataclass
class Agreement:
    prompt_tokens: int
    generated: int  # tokens both engines were asked for (the shared prefix when they parted)
    parted_at: int | None  # first generated token where the greedy texts differ; None: identical
    ours_accepted: int  # over `generated` tokens of identical text
    engine_accepted: int
    engine_drafted: int

    @property
    def agrees(self) -> bool:
        return self.ours_accepted == self.engine_accepted

    def to_dict(self) -> dict:
        return asdict(self)


def shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def ours(target, proposer, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], int]:
    """Our decoder's greedy output ids (new tokens only) and its accepted drafts."""
    prompt = torch.tensor(prompt_ids, dtype=torch.long)
    out, stats = speculative_generate(target.model, proposer, prompt, max_new_tokens=max_new_tokens,
                                      eos_token_ids=target.eos_token_ids)
    return out[len(prompt_ids):].tolist(), sum(stats.accepted)


def referee(server, target, proposer, prompt_ids: list[int], max_new_tokens: int) -> Agreement:
    """server: a running LlamaServer with the drafter; proposer: ours for the same drafter, chain of the
    server's n_max. Both greedy, from the same ids."""
    engine = server.complete(prompt_ids, max_new_tokens)
    mine, accepted = ours(target, proposer, prompt_ids, max_new_tokens)
    k = shared_prefix(mine, engine.tokens)
    parted = None if mine == engine.tokens else k
    if parted is not None and k > 0:  # both again, to exactly the shared text
        engine = server.complete(prompt_ids, k)
        mine, accepted = ours(target, proposer, prompt_ids, k)
    elif parted is not None:
        return Agreement(len(prompt_ids), 0, 0, 0, 0, 0)
    return Agreement(len(prompt_ids), len(mine), parted, accepted, engine.draft_accepted, engine.draft_n)


@dataclass
class Parting:
    at: int  # index of the first differing generated token
    tokens: tuple[int, int]  # (reference's, other's)
    logits: tuple[float, float]  # the torch target's logits of both, after the shared prefix
    ranks: tuple[int, int]  # their ranks among the torch target's logits (0 = its argmax)
    relative_gap: float  # max over both of (top logit - logit) / |top logit|

    def near_tie(self, tolerance: float) -> bool:
        # both tokens within `tolerance` of the target's top logit: arithmetic noise can pick either (or a third
        # token as close: at one MT-bench position SmolLM2's top three were within 1.3e-4 of each other)
        return self.relative_gap <= tolerance


@torch.no_grad()
def parting(target, prompt_ids: list[int], reference: list[int], other: list[int]) -> Parting | None:
    """Where two greedy outputs of the same prompt part, and how close to a tie that is in the (torch) target."""
    k = shared_prefix(reference, other)
    if k == min(len(reference), len(other)):
        return None
    a, b = reference[k], other[k]
    logits = target.model(torch.tensor([prompt_ids + reference[:k]])).logits[0, -1].float()  # (V,)
    top = float(logits.max())
    la, lb = float(logits[a]), float(logits[b])
    ranks = tuple(int((logits > x).sum()) for x in (la, lb))
    return Parting(k, (a, b), (la, lb), ranks, (top - min(la, lb)) / max(abs(top), 1e-9))
