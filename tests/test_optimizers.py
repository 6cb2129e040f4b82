"""drafters.training.optimizers: optim.name=muon is torch's Muon on the hidden matrices and AdamW on the rest, one
optimizer to the scheduler and the checkpoint; it resumes exactly and is refused where it cannot run."""

import shutil

import pytest
import torch
from torch import nn

from conftest import load_script  # tests/ is on sys.path under pytest
from drafters.training.optimizers import MuonWithAdamW, build_optimizer, muon_split
from drafters.training.recipe import RecipeError
from drafters.training.schema import Optim


class Toy(nn.Module):  # the shapes of a drafter: an embedding, a fused fc, a norm, a biased layer, a head
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.fc = nn.Linear(12, 6, bias=False)
        self.norm = nn.LayerNorm(6)
        self.mlp = nn.Linear(6, 6)
        self.lm_head = nn.Linear(6, 11, bias=False)
        self.frozen = nn.Linear(6, 6, bias=False).requires_grad_(False)

    def forward(self, ids):
        x = self.embed(ids)
        return self.lm_head(self.mlp(self.norm(self.fc(torch.cat([x, x], -1)))) + self.frozen(x))


def loss_of(model, seed):
    ids = torch.randint(11, (3, 5), generator=torch.Generator().manual_seed(seed))
    return model(ids).logsumexp(-1).mean()


def test_muon_gets_the_hidden_matrices_and_adamw_the_rest():
    toy = Toy()
    matrices, rest = muon_split(toy)
    names = {id(p): n for n, p in toy.named_parameters()}
    assert [names[id(p)] for p in matrices] == ["fc.weight", "mlp.weight"]
    assert [names[id(p)] for p in rest] == ["embed.weight", "norm.weight", "norm.bias", "mlp.bias", "lm_head.weight"]


def test_one_optimizer_steps_as_torchs_muon_and_adamw_would_under_a_scheduler():
    torch.manual_seed(0)
    ours, reference = Toy(), Toy()
    reference.load_state_dict(ours.state_dict())
    optim = Optim(name="muon", lr=0.02, weight_decay=0.01, betas=[0.9, 0.95], momentum=0.9)
    combined = build_optimizer(optim, ours)
    matrices, rest = muon_split(reference)
    parts = [torch.optim.Muon(matrices, lr=0.02, weight_decay=0.01, momentum=0.9, adjust_lr_fn="match_rms_adamw"),
             torch.optim.AdamW(rest, lr=0.02, betas=(0.9, 0.95), weight_decay=0.01)]
    halve = lambda step: 0.5 ** step  # noqa: E731  the lr the scheduler sets must reach both parts
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, halve) for o in (combined, *parts)]
    before = {n: p.detach().clone() for n, p in ours.named_parameters()}
    for step in range(3):
        for model, optimizers in ((ours, [combined]), (reference, parts)):
            loss_of(model, step).backward()
            for o in optimizers:
                o.step()
                o.zero_grad()
        for s in schedulers:
            s.step()
    for (name, a), b in zip(ours.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
        assert name == "frozen.weight" or not torch.equal(a, before[name]), f"{name} did not move"
    assert [g["lr"] for g in combined.param_groups] == [0.02 / 8, 0.02 / 8]


def test_a_muon_step_is_an_orthogonalised_direction():
    # the first step from zero momentum moves a matrix by lr * 0.2 sqrt(max(rows, cols)) * O, O ~ U V^T of the
    # (Nesterov) gradient: all singular values of the step near one scale, whatever the gradient's spread
    layer = nn.Linear(32, 16, bias=False)
    before = layer.weight.detach().clone()
    optimizer = MuonWithAdamW([layer.weight], [], lr=0.1, betas=(0.9, 0.95), weight_decay=0.0, momentum=0.95)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.1, 3, 32)
    layer(x).pow(2).sum().backward()
    assert torch.linalg.svdvals(layer.weight.grad).max() > 10 * torch.linalg.svdvals(layer.weight.grad).min()
    optimizer.step()
    step = (before - layer.weight.detach()) / (0.1 * 0.2 * 32 ** 0.5)
    singular = torch.linalg.svdvals(step)
    assert 0.6 < singular.min() and singular.max() < 1.25, singular


def test_its_state_dict_round_trips_and_refuses_an_adamw_state():
    toy = Toy()
    optimizer = build_optimizer(Optim(name="muon", lr=0.01), toy)
    loss_of(toy, 0).backward()
    optimizer.step()
    saved = optimizer.state_dict()
    fresh = build_optimizer(Optim(name="muon", lr=0.01), toy)
    fresh.load_state_dict(saved)
    for a, b in zip(fresh.parts, optimizer.parts):
        assert a.state_dict()["state"].keys() == b.state_dict()["state"].keys() != set()
    with pytest.raises(RecipeError, match="not optim.name=muon's"):
        fresh.load_state_dict(torch.optim.AdamW(toy.parameters()).state_dict())


def test_a_drafter_without_hidden_matrices_is_refused_in_a_sentence():
    with pytest.raises(RecipeError, match="has no hidden weight matrices for Muon"):
        build_optimizer(Optim(name="muon"), nn.Sequential(nn.LayerNorm(4)))


def test_a_muon_run_resumes_to_bitwise_the_same_weights(tmp_path):
    from drafters.checkpoint import load_checkpoint
    eagle = load_script("train/eagle.py")
    recipe = ["recipes/eagle3_tiny.yaml", "optim.name=muon", "optim.lr=0.02", "save_every=2"]
    whole = eagle.main([*recipe, f"output_dir={tmp_path / 'whole'}"])
    shutil.copytree(tmp_path / "whole" / "checkpoint-4", tmp_path / "part" / "checkpoint-4")
    resumed = eagle.main([*recipe, f"output_dir={tmp_path / 'part'}", "resume_from=latest"])
    assert resumed.steps == whole.steps == 6
    a, b = (load_checkpoint(tmp_path / run / "checkpoint-final").state_dict for run in ("whole", "part"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    adamw = eagle.main(["recipes/eagle3_tiny.yaml", "optim.lr=0.02", f"output_dir={tmp_path / 'adamw'}"])
    assert not torch.equal(load_checkpoint(adamw.checkpoint).state_dict["fc.weight"], a["fc.weight"])  # muon's


def test_an_unknown_optimizer_is_refused_by_the_recipe():
    assert Optim(name="sgd").problems() == ["optim.name='sgd' is not an optimizer this trainer builds: use adamw or "
                                            "muon"]
