"""The distributed engines a run can be launched under (`accelerate launch --config_file recipes/accelerate/...`):
what a launch asks that the machine or the recipe cannot give (refused in one sentence before the Accelerator
starts), which engines shard the drafter's parameters, and how a shipped GPU configuration runs on CPU processes
(the device fields swapped: what CI and train/bench.py run). make_accelerator (drafters.training.loop) uses it.
"""

import os
from contextlib import contextmanager
from pathlib import Path

import torch

from drafters.fingerprint import remember_samples
from drafters.targets import resolve_precision
from drafters.training.recipe import RecipeError

SHIPPED = Path(__file__).resolve().parents[2] / "recipes" / "accelerate"  # ddp_8gpu, zero2/3_8gpu, fsdp_8gpu


def on_cpus(config: dict, processes: int = 2) -> dict:
    """A shipped GPU configuration with only its device fields swapped for `processes` CPU processes: fp32 (not
    every CPU has native bf16, and fp32 makes runs comparable with one process). distributed_type stays:
    accelerate launch starts MULTI_GPU, DEEPSPEED and FSDP configurations through torchrun, which runs on CPUs
    too (the trainer then uses gloo), while MULTI_CPU would need mpirun."""
    return {**config, "num_processes": processes, "mixed_precision": "no"}


def check_launch_config(recipe, gpu: bool) -> str:
    """What an accelerate config asks that this machine or this recipe cannot give, refused in one sentence naming
    the config field, before the Accelerator starts: `accelerate launch` passes the config's fields to every
    process as ACCELERATE_* / FSDP_* environment variables. -> the drafter's autocast (launch_precision)."""
    if not gpu and os.environ.get("ACCELERATE_USE_FSDP") == "true" and os.environ.get("FSDP_VERSION", "1") == "1":
        raise RecipeError("the accelerate config asks for FSDP v1 (fsdp_version: 1, the default), which needs a GPU; "
                          "set fsdp_version: 2 in its fsdp_config (FSDP2 runs on CPUs; recipes/accelerate/"
                          "fsdp_8gpu.yaml)")
    return launch_precision(recipe)


def launch_precision(recipe) -> str:
    """The drafter's autocast: the recipe's mixed_precision resolved on this machine, checked against what the launch
    asks (`accelerate launch` passes ACCELERATE_MIXED_PRECISION, "no" when no config file says otherwise). A
    recipe's `auto` takes the launch's "no": the documented `accelerate launch train/eagle.py RECIPE` without a
    config file then trains, in float32 autocast, instead of being refused."""
    asked = os.environ.get("ACCELERATE_MIXED_PRECISION")
    chosen = resolve_precision("auto", recipe.mixed_precision)[1]
    if recipe.mixed_precision == "auto" and asked == "no":
        return "no"
    if asked not in (None, chosen):
        raise RecipeError(f"the accelerate config asks mixed_precision: {asked}, but the recipe's mixed_precision="
                          f"{recipe.mixed_precision} resolves to {chosen} on this machine"
                          + (" (no native bf16 on this CPU)" if asked == "bf16" and chosen == "no" else "")
                          + f": set mixed_precision: \"{chosen}\" in the accelerate config, or the recipe's "
                          f"mixed_precision={asked}")
    return chosen


def shards_parameters(accelerator) -> bool:
    """DeepSpeed ZeRO-3 and FSDP keep each parameter in shards outside a module's own forward and backward: the
    drafter's `.weight`s read from outside are empty there, so evaluation and checkpoints use a gathered copy
    (RunBase.whole_drafter)."""
    from accelerate.utils import DistributedType

    plugin = accelerator.state.deepspeed_plugin
    return (accelerator.distributed_type == DistributedType.FSDP
            or (plugin is not None and int(plugin.zero_stage) == 3))


@contextmanager
def outside_zero3():
    """Loads inside this block are plain: under a ZeRO-3 launch accelerate registers its DeepSpeed config with
    transformers, whose from_pretrained then builds every model under deepspeed.zero.Init, partitioned and in
    the engine's dtype. The frozen target is never prepared or sharded, so it must load as the recipe says
    (the bf16 target of a recipe came back float32 and partitioned)."""
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


def check_split(recipe, accelerator, decoder: bool) -> None:
    """What a recipe's split_target=true cannot run under, refused in one sentence before the target loads."""
    from accelerate.utils import DistributedType

    if not recipe.split_target:
        return
    if not decoder:
        raise RecipeError("split_target=true with features.dir: a run from a feature store loads none of the "
                          "target's decoder layers (only its embeddings, final norm and LM head), so there is "
                          "nothing to split; set split_target=false")
    if accelerator.num_processes < 2:
        raise RecipeError("split_target=true shards the target's decoder layers across the launch's processes, and "
                          "this launch has one: start several (torchrun --nproc_per_node N, or accelerate launch "
                          "--num_processes N) or set split_target=false")
    if accelerator.distributed_type not in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        raise RecipeError(f"split_target=true runs under data parallelism (DDP) only, where every process holds the "
                          f"whole drafter and evaluates beside the others; this launch is "
                          f"{accelerator.distributed_type.value}: launch without a DeepSpeed / FSDP config, or set "
                          "split_target=false")


def split_target(target, accelerator) -> tuple[int, int]:
    """Shard each frozen decoder layer of `target` across the launch's processes with FSDP2's fully_shard (no
    optimizer, no gradients: its parameters are frozen). In the target's forward each layer all-gathers its
    parameters, runs, and frees the gathered copy (reshard_after_forward), so a process holds 1/N of the layers
    plus one whole layer at a time; the computation, and so every feature, is the unsplit one's, bit for bit
    (tests/test_split_target.py). Every process must then call the forward together: training does (DDP steps
    together), and the held-out evaluation runs on every process. -> (parameters this process holds, of the whole).
    The embeddings, final norm and LM head stay whole (the drafter and the labels read them directly). Called on
    the target as loaded (in host memory), before it moves to the device: fully_shard places each process's shards
    on the mesh's device, so no device ever holds the whole target; host memory holds it once per process while
    it loads."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    whole = sum(p.numel() for p in target.model.parameters())
    # the weights fingerprint of the layers held whole (a shard has a part of them; those on the meta device are
    # read from their files)
    remember_samples(target.model, target.decoder_layers)
    mesh = init_device_mesh(accelerator.device.type, (accelerator.num_processes,))
    for layer in target.decoder_layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    if target.checkpoint_files is not None:  # loaded with decoder="meta": read this process's rows only
        fill_shards(target, accelerator.device)
    target.shards = accelerator.num_processes
    held = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in target.model.parameters())
    return held, whole


def fill_shards(target, device) -> None:
    """The sharded decoder layers of a target loaded with decoder="meta" (drafters.targets), materialised on
    `device` and filled from the checkpoint: FSDP2 keeps rows [r * ceil(n / N), ...) of each (n, ...) tensor on
    process r, and only those rows are read (safetensors slices), so no process ever holds a whole layer stack."""
    from safetensors import safe_open

    for layer in target.decoder_layers:
        layer.to_empty(device=device)
    names = {id(p): name for name, p in target.model.named_parameters()}
    for layer in target.decoder_layers:
        for param in layer.parameters():
            name, local = names[id(param)], param.to_local()
            rows = -(-param.shape[0] // param.device_mesh.size())  # ceil: torch.chunk's piece
            start = min(param.device_mesh.get_local_rank() * rows, param.shape[0])
            with safe_open(target.checkpoint_files[name], framework="pt") as f:
                piece = f.get_slice(name)[start:start + local.shape[0]]
            with torch.no_grad():
                local.copy_(piece.to(local.dtype))
