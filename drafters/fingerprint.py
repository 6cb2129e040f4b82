"""A cheap fingerprint of every weight tensor of a target: what a drafter checkpoint records (drafters.checkpoint
.target_info) so that a drafter met with a target of the same shape but other weights is named (check_target).

Every parameter contributes its name, its shape and a strided sample of its flattened values: BLOCKS runs of BLOCK
consecutive elements spread evenly from its first element to its last (all of it when it is smaller). So a model
that differs from another in one decoder layer only (a merged LoRA, a fine-tune of a few layers) has another
fingerprint, while a multi-GB model costs a few hundred small reads: no tensor is hashed whole or copied. Values are
rounded to bfloat16 first, so the same weights loaded in float32 or bfloat16, on any device, agree. A change that
misses every sampled element (a few edited rows) is not seen: this tells models apart, it does not prove equality.

The tensors a loaded model does not hold are read where they are: a target loaded without its decoder layers
(load_target(decoder=False)) or with them sharded across processes keeps their samples, taken before they were
dropped or sharded (`remember_samples`), and layers still on the meta device are read from their safetensors files
(model.checkpoint_files), a few bytes each: every way of loading one model gives the same fingerprint."""

import hashlib
import json
from pathlib import Path

import torch

BLOCKS, BLOCK = 8, 8  # 64 values of each tensor, in 8 runs of 8 consecutive ones (one disk page each)
SAMPLES_ATTRIBUTE = "weight_samples"  # on the model: {name: (shape, sampled values)} of tensors it no longer holds
ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
             "BOOL": torch.bool}


def starts(numel: int) -> list[int]:
    """First flat index of each sampled run of a tensor of `numel` elements (one run: all of it)."""
    if numel <= BLOCKS * BLOCK:
        return [0]
    return [j * (numel - BLOCK) // (BLOCKS - 1) for j in range(BLOCKS)]


def run_length(numel: int) -> int:
    return numel if numel <= BLOCKS * BLOCK else BLOCK


def positions(numel: int) -> list[int]:
    n = run_length(numel)
    return [s + i for s in starts(numel) for i in range(n)]


def rounded(values: torch.Tensor) -> torch.Tensor:
    return values.to("cpu", torch.bfloat16).float()


def sample_tensor(weight: torch.Tensor) -> tuple[tuple[int, ...], torch.Tensor]:
    """(shape, sampled values) of a tensor held in memory, on any device: only the sampled elements are gathered."""
    weight = weight.detach()
    shape = tuple(weight.shape)
    if weight.dim() == 0:
        return shape, rounded(weight.reshape(1))
    index = torch.tensor(positions(weight.numel()), device=weight.device)
    return shape, rounded(weight[torch.unravel_index(index, weight.shape)])


def sample_file(file: Path, name: str, dtype: torch.dtype, headers: dict | None = None
                ) -> tuple[tuple[int, ...], torch.Tensor]:
    """(shape, sampled values) of tensor `name` of a safetensors file, read from the sampled runs alone and converted
    as loading it in `dtype` would (so they equal the sample of the loaded tensor). headers: parsed headers, by file."""
    headers = {} if headers is None else headers
    if file not in headers:
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            headers[file] = (8 + n, json.loads(f.read(n)))
    base, header = headers[file]
    info = header[name]
    shape, stored = tuple(info["shape"]), ST_DTYPES.get(info["dtype"])
    if stored is None:
        raise ValueError(f"{file}: tensor {name} has dtype {info['dtype']}, which the weights fingerprint cannot read")
    size = torch.empty((), dtype=stored).element_size()
    numel, parts = torch.Size(shape).numel(), []
    with open(file, "rb") as f:
        for start in starts(numel):
            f.seek(base + info["data_offsets"][0] + start * size)
            parts.append(f.read(run_length(numel) * size))
    values = torch.frombuffer(bytearray(b"".join(parts)), dtype=stored)
    return shape, rounded(values.to(dtype))


def held(weight: torch.Tensor) -> bool:
    """Whether a parameter's values are all in this process: not on the meta device, not a shard (FSDP2 DTensor)."""
    return not weight.is_meta and not hasattr(weight, "to_local")


def remember_samples(model: torch.nn.Module, module: torch.nn.Module, files: dict | None = None) -> None:
    """Keep on `model` the samples of the parameters of `module` (one of its parts: the decoder layers) before they are
    dropped or sharded: from memory where held, else from `files` (tensor name -> safetensors file) where named."""
    kept = getattr(model, SAMPLES_ATTRIBUTE, None)
    if kept is None:
        kept = {}
        setattr(model, SAMPLES_ATTRIBUTE, kept)  # nn.Module stores a dict as a plain attribute
    inside = {id(p) for p in module.parameters()}
    headers = {}
    for name, weight in model.named_parameters(remove_duplicate=False):
        if id(weight) not in inside:
            continue
        if held(weight):
            kept[name] = sample_tensor(weight)
        elif files and name in files:
            kept[name] = sample_file(Path(files[name]), name, weight.dtype, headers)


def weights_fingerprint(model: torch.nn.Module) -> str:
    """sha256 over every parameter's name, shape and sampled values, in name order. 16 hex digits. A tensor that can
    be read nowhere (sharded without remembered samples, and no file) contributes its name and shape only."""
    samples = dict(getattr(model, SAMPLES_ATTRIBUTE, None) or {})
    files = getattr(model, "checkpoint_files", None) or {}
    headers = {}
    for name, weight in model.named_parameters(remove_duplicate=False):
        if held(weight):
            samples[name] = sample_tensor(weight)
        elif name in samples:
            continue
        elif name in files:
            samples[name] = sample_file(Path(files[name]), name, weight.dtype, headers)
        else:
            samples[name] = (tuple(weight.shape), None)
    digest = hashlib.sha256()
    for name in sorted(samples):
        shape, values = samples[name]
        digest.update(f"{name}:{list(shape)}:".encode())
        digest.update(b"unread" if values is None else values.numpy().tobytes())
    return digest.hexdigest()[:16]


def outer_rows_fingerprint(target) -> str:
    """The fingerprint checkpoints recorded first (still recorded, as "fingerprint", for the versions that read only
    it): sha256 of the embedding's and the LM head's first and last 4 rows and the final norm, rounded to bf16.
    16 hex digits. Blind to the decoder layers."""
    digest = hashlib.sha256()
    for name, weight in (("embed", target.embed_tokens.weight), ("head", target.lm_head.weight),
                         ("norm", target.final_norm.weight)):
        rows = torch.cat([weight[:4], weight[-4:]]) if weight.dim() == 2 else weight
        digest.update(name.encode() + rows.detach().to("cpu", torch.bfloat16).float().numpy().tobytes())
    return digest.hexdigest()[:16]
