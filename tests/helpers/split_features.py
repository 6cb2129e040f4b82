"""Run under torchrun with N processes: `python split_features.py OUT TARGET`, TARGET's decoder layers split across
them (drafters.training.launch.split_target; a model directory's layers read shard by shard, decoder="meta"), its
features on fixed ids; process 0 saves them and what each process holds to OUT.safetensors / OUT.json
(tests/test_split_target.py compares them with one process's)."""

import json
import sys

import torch
from accelerate import Accelerator
from safetensors.torch import save_file

from drafters.checkpoint import target_info
from drafters.targets import load_target
from drafters.training.launch import split_target
from drafters.training.recipe import exit_launched_process

LAYERS = [2, 4, 5]


def fixed_ids() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 250, (3, 21), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0  # a padded row
    return ids, mask


def main(out: str, name: str) -> None:
    accelerator = Accelerator(cpu=True)
    target = load_target(name, decoder="meta")
    read_by_shards = target.checkpoint_files is not None
    held, whole = split_target(target, accelerator)
    ids, mask = fixed_ids()
    # every process calls the forward: twice, as a training run's consecutive micro-steps do
    first = target.features(ids, mask, layers=LAYERS, pre_norm_last=True, logits=True)
    second = target.features(ids[:, :9], mask[:, :9], layers=LAYERS, logits=True)
    helds = accelerator.gather(torch.tensor([held]))
    fingerprint = target_info(target)["weights_fingerprint"]  # every process: no collective, layers sharded
    if accelerator.is_main_process:
        save_file({**{f"hidden_{i}": first.hidden_states[i] for i in LAYERS}, "last": first.last_hidden,
                   "pre_norm": first.pre_norm_last, "logits": first.logits, "second_logits": second.logits},
                  f"{out}.safetensors")
        with open(f"{out}.json", "w") as f:
            json.dump({"held": helds.tolist(), "whole": whole, "processes": accelerator.num_processes,
                       "read_by_shards": read_by_shards, "fingerprint": fingerprint}, f)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    # as train/*.py do: FSDP2's mesh keeps gloo's threads alive into the interpreter's teardown, where one can abort
    # the process (exit -6) after the files above are complete
    exit_launched_process(0)
