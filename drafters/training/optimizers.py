"""The optimizer a recipe names (`optim.name`), built on a drafter's trainable parameters.

    adamw   torch.optim.AdamW on every trainable parameter (SpecForge's and the EAGLE trainers' choice)
    muon    torch.optim.Muon on the hidden weight matrices, AdamW on the rest (speculators' default): Muon
            orthogonalises each matrix's momentum (Newton-Schulz), G -> U V^T for G = U S V^T, and scales the
            step by 0.2 sqrt(max(rows, cols)) ("match_rms_adamw"), so one optim.lr serves both parts.
            AdamW keeps what Muon is not for: vectors (norms, biases), embeddings and the output heads
            (`lm_head`), whose rows are vocabulary entries rather than directions of one map.

Knows nothing of families or the loop: drafters.training.loop and drafters.training.scale call
`build_optimizer`; the recipe's checks live in drafters.training.schema.Optim.
"""

import torch
from torch import nn

from drafters.training.recipe import RecipeError

OPTIMIZERS = ("adamw", "muon")
HEAD_NAMES = ("lm_head",)  # a Linear under this attribute name is a vocabulary head: AdamW, not Muon


def build_optimizer(optim, module: nn.Module) -> torch.optim.Optimizer:
    """optim: the recipe's drafters.training.schema.Optim; module: the drafter (AdamW gets all its parameters, as
    checkpoints of earlier versions hold them; frozen ones never have a gradient and are skipped)."""
    if optim.name == "adamw":
        return torch.optim.AdamW(module.parameters(), lr=optim.lr,
                                 betas=tuple(optim.betas), weight_decay=optim.weight_decay)
    matrices, rest = muon_split(module)
    if not matrices:
        raise RecipeError(f"optim.name=muon: {type(module).__name__} has no hidden weight matrices for Muon "
                          "(only heads, embeddings and vectors); use optim.name=adamw")
    return MuonWithAdamW(matrices, rest, lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay,
                         momentum=optim.momentum)


def muon_split(module: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """-> (Muon's parameters: the 2-D weights of trainable nn.Linear layers not named in HEAD_NAMES, AdamW's: every
    other trainable parameter), each once, in module order."""
    matrices = {id(m.weight) for name, m in module.named_modules()
                if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] not in HEAD_NAMES and m.weight.requires_grad}
    trainable = [p for p in module.parameters() if p.requires_grad]
    return [p for p in trainable if id(p) in matrices], [p for p in trainable if id(p) not in matrices]


class MuonWithAdamW(torch.optim.Optimizer):
    """torch.optim.Muon and torch.optim.AdamW as one optimizer, what accelerate's prepare, an lr scheduler and a
    checkpoint see: `param_groups` are the two parts' own group dicts (a scheduler's lr reaches both), `step` and
    `zero_grad` run both, and the state dict holds both parts' state dicts."""

    def __init__(self, matrices, rest, *, lr: float, betas: tuple[float, float], weight_decay: float,
                 momentum: float):
        parts = [torch.optim.Muon(matrices, lr=lr, weight_decay=weight_decay, momentum=momentum,
                                  adjust_lr_fn="match_rms_adamw")]
        if rest:
            parts.append(torch.optim.AdamW(rest, lr=lr, betas=betas, weight_decay=weight_decay))
        super().__init__([p for part in parts for group in part.param_groups for p in group["params"]], {"lr": lr})
        self.parts = parts
        self.param_groups = [group for part in parts for group in part.param_groups]

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for part in self.parts:
            part.step()
        return loss

    def zero_grad(self, set_to_none: bool = True):
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"parts": [part.state_dict() for part in self.parts]}

    def load_state_dict(self, state_dict: dict) -> None:
        if len(state_dict.get("parts", ())) != len(self.parts):
            raise RecipeError("the checkpoint's optimizer state is not optim.name=muon's (Muon + AdamW parts); "
                              "resume with the optimizer it was saved with")
        for part, saved in zip(self.parts, state_dict["parts"]):
            part.load_state_dict(saved)
