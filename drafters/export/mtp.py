"""Export a trained native MTP layer back into its target's own checkpoint layout.

    python eval/export.py outputs/mtp_tiny/checkpoint-final --format mtp --target tiny-mtp-deepseek_v3 --out DIR

mtp  DIR is the target's checkpoint directory (the one it was loaded from, drafters.mtp.target_dir) with the trained
     layer's tensors put in place of its MTP layer's (drafters.mtp: model.layers.{N+j}.* / mtp.*, the block's
     tensors in the checkpoint's own format, each in the dtype the file stores it in). Every other file is copied
     byte for byte; a shard holding MTP tensors is rewritten with its other tensors and its metadata unchanged;
     config.json is the target's: serving engines load DIR as the target and draft with its MTP layer (vLLM
     `{"method": "mtp"}`, SGLang `--speculative-algorithm NEXTN`). The DeepSeek layout's embedding and head copies stay
     the target's (never trained).
Before DIR is renamed into place, the staged copy is read back: every tensor that is not the trained layer's is
bit-identical to the target's, and the MTP layer read from it (drafters.mtp.read_mtp) rebuilds a drafter whose
logits equal the checkpoint's (its weights rounded to the file's dtypes). Knows nothing about training or decoding.
"""

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from drafters.export.common import ExportError, ExportResult, check_out_dir, exported_files, export_target, \
    load_source, write_staged
from drafters.export.reading import CheckReport
from drafters.layers import DraftKVCache
from drafters.mtp import MtpConfig, MtpDrafter, checkpoint_tensors, read_mtp, target_dir, tensor_files


def export_mtp(ckpt_dir, fmt: str, out_dir, *, target=None, dtype: str = "fp32", overwrite: bool = False,
               **_) -> ExportResult:
    if target is None:
        raise ExportError("an MTP export is the target's checkpoint with its MTP layer replaced: pass --target (the "
                          "target it was trained on, loaded from its checkpoint directory)")
    out_dir = Path(out_dir)
    check_out_dir(out_dir, ckpt_dir, overwrite)
    ckpt = load_source(ckpt_dir)
    export_target(ckpt, target)  # the target it was trained for, else ExportError
    config = MtpConfig(**ckpt.config)
    source = target_dir(target)
    files = tensor_files(source)
    text = target.config.get_text_config()
    new = checkpoint_tensors(config, ckpt.state_dict, text.num_hidden_layers)  # checkpoint name -> tensor
    missing = sorted(set(new) - set(files))
    if missing:
        raise ExportError(f"{source}: holds no {missing[0]} (and {len(missing) - 1} more of the trained layer's "
                          "tensors): export into the checkpoint the drafter was read from")

    def write(payload: Path):
        copy_with_replaced(source, payload, files, new)
        return check_mtp_export(payload, source, text, config, ckpt.state_dict, set(new))

    report = write_staged(out_dir, ckpt_dir, fmt, write, overwrite)
    report.path = out_dir
    return ExportResult(path=out_dir, fmt=fmt, dtype="the target's", config=json.loads(
        (out_dir / "config.json").read_text()), check=report, files=exported_files(out_dir))


def copy_with_replaced(source: Path, payload: Path, files: dict[str, Path], new: dict) -> None:
    """source's files into payload; the shards holding a name of `new` rewritten with those tensors replaced (each in
    the dtype the shard stores), every other tensor and the shard's metadata as they were."""
    shutil.copytree(source, payload, ignore=shutil.ignore_patterns(".*"))
    for shard in sorted({files[name] for name in new}):
        with safe_open(shard, framework="pt") as f:
            tensors, metadata = {name: f.get_tensor(name) for name in f.keys()}, f.metadata()
        for name, tensor in new.items():
            if files[name] == shard:
                tensors[name] = tensor.detach().to("cpu", tensors[name].dtype).contiguous()
        save_file(tensors, payload / shard.name, metadata=metadata)


def check_mtp_export(payload: Path, source: Path, text_config, config: MtpConfig, state: dict,
                     replaced: set[str]) -> CheckReport:
    """Every tensor outside `replaced` bit-identical to source's; the MTP layer read back from payload drafts the
    checkpoint's logits (weights rounded to the file's dtypes) -> the report."""
    before, after = tensor_files(source), tensor_files(payload)
    if set(before) != set(after):
        raise ExportError(f"{payload}: holds other tensor names than {source}")
    for name in sorted(set(before) - replaced):
        with safe_open(before[name], framework="pt") as a, safe_open(after[name], framework="pt") as b:
            x, y = a.get_tensor(name), b.get_tensor(name)
        if x.dtype != y.dtype or not torch.equal(x, y):
            raise ExportError(f"{payload}: {name} differs from the target's")
    read_config, read_state, _ = read_mtp(payload, text_config, config.layer)
    rounded = {k: v.to(read_state[k].dtype) for k, v in state.items()}
    diff = max_logit_diff(read_config, read_state, rounded)
    if diff > 1e-4:
        raise ExportError(f"{payload}: the MTP layer read back drafts other hidden states than the checkpoint "
                          f"(max |diff| {diff:.2e})")
    return CheckReport(payload, "mtp", "mtp", None, None, None, len(read_state), diff, diff)


@torch.no_grad()
def max_logit_diff(config: MtpConfig, a: dict, b: dict, seed: int = 0) -> float:
    """Two MTP states run on the same random (h, token) pairs -> max |difference| of the hidden states they hand on
    and their norm (the head is the target's, the same for both)."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, 6, config.hidden_size, generator=generator)
    ids = torch.randint(0, config.vocab_size, (1, 6), generator=generator)
    embed = torch.nn.Embedding.from_pretrained(torch.randn(config.vocab_size, config.hidden_size, generator=generator))
    outs = []
    for state in (a, b):
        drafter = MtpDrafter(config).eval()
        drafter.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
        drafter.attach_head(lambda x: x)  # compare what the head reads
        outs.append(drafter.step(hidden, ids, embed, DraftKVCache()))
    return max(float((x - y).abs().max()) for x, y in zip(*outs))
