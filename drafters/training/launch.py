"""The distributed engines a run can be launched under (`accelerate launch --config_file recipes/accelerate/...`):
what a launch asks that the machine or the recipe cannot give (refused in one sentence before the Accelerator
starts), which engines shard the drafter's parameters, and how a shipped GPU configuration runs on CPU processes
(the device fields swapped: what CI and train/bench.py run). make_accelerator (drafters.training.loop) uses it.
"""

import os
from contextlib import contextmanager
from pathlib import Path

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
