"""Export a DFlash2 drafter in the DFlash2DraftModel layout, and read such exports back independently.

    python eval/export.py outputs/dflash2_smollm2/checkpoint-final --format sglang --out exports/dflash2-sglang

sglang  the DFlash2 reference layout (z-lab/dflash's DFlash2DraftModel; what SGLang's DFlash drafter loads since
        sgl-project/sglang#35371 and vLLM's since vllm-project/vllm#52816, by the architecture): DFlash's sglang layout
        (drafters.export.dflash: Qwen3 fields, dflash_config {mask_token_id, target_layer_ids = HF index - 1,
        block_size}) with architectures ["DFlash2DraftModel"], dflash_config + {conv_kernel_size, conv_group_size,
        selector_rank, selector_top_k, path_search}, and the tensors
            layers.{i}.attention_conv.base_kernel (2, K, h)   layers.{i}.attention_conv.kernel_projection.weight
            layers.{i}.mlp_conv.base_kernel (2, K, h)         (2 K h/g, h), the same for mlp_conv
            candidate_selector.predecessor_codebook (V, r)    candidate_selector.successor_codebook (V, r)
            candidate_selector.hidden_projection.weight (r, h)
        Full vocabulary only, as DFlash's sglang layout (the engine scores every target id with the target's head).
        path_search is ours (engines walk the candidates slot by slot, our "walk"); a layout without it reads back as
        "walk", the reference's rule.
vllm, llama.cpp: refused (drafters.export.dispatch.REFUSED): speculators' layout is not written for DFlash2 here, and
        the pinned llama.cpp converter has no dynamic convolution or selector tensors.

The reader is DFlash's (drafters.export.dflash.read_dflash_export) told about DFlash2's architecture, fields and
tensors; it rebuilds a DFlash2Drafter and compares its draft logits and selector scores with the source checkpoint's
before the directory is renamed into place.
"""

from pathlib import Path

import torch

from drafters.dflash2 import DFlash2Config, DFlash2Drafter
from drafters.dtypes import DTYPES
from drafters.export.common import ExportError, ExportResult, check_out_dir, export_dtype, export_files, load_source
from drafters.export.dflash import SGLangVariant, preflight, probe_draft_logits, read_dflash_export, sglang_config
from drafters.export.reading import CheckReport, ExportCheckError, compare_with_source, get_field, rebuild

ARCHITECTURE, WEIGHTS_FILE = "DFlash2DraftModel", "model.safetensors"


def export_dflash2(ckpt_dir, fmt: str, out_dir, *, target=None, dtype: str = "fp32", overwrite: bool = False,
                   **_) -> ExportResult:
    if fmt != "sglang":
        raise ExportError(f"a dflash2 checkpoint exports to sglang (DFlash2DraftModel) or native, not {fmt!r}")
    canonical = export_dtype(dtype)  # float32 | bfloat16
    out_dir = Path(out_dir)
    check_out_dir(out_dir, ckpt_dir, overwrite)
    ckpt = load_source(ckpt_dir)
    expected, c = preflight(ckpt, fmt, target, cls=DFlash2Config)  # DFlash's refusals: geometry, layers, vocabulary
    config = sglang_config(c, expected["num_layers"], canonical)
    config["architectures"] = [ARCHITECTURE]
    config["dflash_config"] |= {"conv_kernel_size": c.conv_kernel_size, "conv_group_size": c.conv_group_size,
                                "selector_rank": c.selector_rank, "selector_top_k": c.path_top_k,
                                "path_search": c.path_search}
    tensors = {k: v.detach().to("cpu", DTYPES[canonical] if v.is_floating_point() else v.dtype).contiguous().clone()
               for k, v in ckpt.state_dict.items() if k not in ("d2t", "t2d")}  # the full vocabulary: no mapping
    return export_files(out_dir, ckpt_dir, fmt, dtype, config, tensors, WEIGHTS_FILE,
                        lambda payload: check_dflash2_export(payload, target=expected, reference=ckpt), overwrite)


# ---- independent reader ----------------------------------------------------------------------------


def _config(dflash: dict, fields: dict, where: str) -> DFlash2Config:
    where = f"{where} dflash_config"
    own = {"conv_kernel_size": get_field(dflash, "conv_kernel_size", int, where),
           "conv_group_size": get_field(dflash, "conv_group_size", int, where),
           "selector_rank": get_field(dflash, "selector_rank", int, where),
           "path_top_k": get_field(dflash, "selector_top_k", int, where),
           "path_search": get_field(dflash, "path_search", str, where) if "path_search" in dflash else "walk"}
    if dflash.get("output_multiplier", 1.0) != 1.0:  # the reference scales the unary logits before the softcap
        raise ExportCheckError(f"{where}: output_multiplier = {dflash['output_multiplier']!r}: this project's DFlash "
                               "head does not scale its logits")
    softcap = dflash.get("final_logit_softcapping")  # the reference: tanh(z / cap) * cap when cap > 0
    if softcap is not None and not isinstance(softcap, (int, float)):
        raise ExportCheckError(f"{where}: final_logit_softcapping = {softcap!r} must be a number or null")
    return DFlash2Config(**fields, **own, final_logit_softcapping=float(softcap) if softcap else None)


def _shapes(c: DFlash2Config) -> dict[str, tuple[int, ...]]:
    """DFlash2's own tensors, shaped from the config alone (the backbone's are DFlash's)."""
    h, k, groups, r = c.hidden_size, c.conv_kernel_size, c.hidden_size // c.conv_group_size, c.selector_rank
    shapes = {"candidate_selector.predecessor_codebook": (c.vocab_size, r),  # keyed on target ids
              "candidate_selector.successor_codebook": (c.vocab_size, r),
              "candidate_selector.hidden_projection.weight": (r, h)}
    for i in range(c.num_hidden_layers):
        for conv in ("attention_conv", "mlp_conv"):
            shapes |= {f"layers.{i}.{conv}.base_kernel": (2, k, h),  # [before, after] x taps x channels
                       f"layers.{i}.{conv}.kernel_projection.weight": (2 * k * groups, h)}
    return shapes


DFLASH2 = SGLangVariant(ARCHITECTURE, _config, _shapes)


def read_dflash2_export(path, *, target: dict | None = None):
    """Reads and validates a DFlash2DraftModel export (ours or z-lab's) -> (DFlash2Config with aux layers as HF
    indices, state dict in DFlash2Drafter names with the identity d2t / t2d, the layer ids as written, float dtype)."""
    c, state, _, written, dtype = read_dflash_export(path, "sglang", target=target, variant=DFLASH2)
    return c, state, written, dtype


def check_dflash2_export(path, *, target: dict | None = None, reference=None, seed: int = 0) -> CheckReport:
    """Validates the files; with `reference` (the source Checkpoint), a drafter rebuilt from them must give the
    source's draft logits and selector log-probs (weights rounded to the export dtype) within 1e-5."""
    path = Path(path)
    c, state, written, dtype = read_dflash2_export(path, target=target)
    rebuilt = rebuild(c, state, path)
    diffs = (None, None)
    if reference is not None:
        diffs = compare_with_source(rebuilt, c, state, reference, dtype, path, lambda d: _probe(d, seed),
                                    what="draft logits and selector log-probs")
    return CheckReport(path, "sglang", "dflash2", c.aux_layers, written, str(dtype), len(state), *diffs)


@torch.no_grad()
def _probe(drafter: DFlash2Drafter, seed: int) -> list[torch.Tensor]:
    """DFlash's probe (one block on random context: the convolutions included) and the selector's log q_d(. | a) of
    random predecessors over each slot's candidates."""
    c = drafter.config
    logits = probe_draft_logits(drafter, seed)  # (Bk-1, Vd)
    gen = torch.Generator().manual_seed(seed + 1)
    normed = torch.randn(c.block_size - 1, c.hidden_size, generator=gen)
    prev = torch.randint(0, c.vocab_size, (c.block_size - 1, 3), generator=gen)
    values, cand = logits.topk(c.path_top_k, dim=-1)
    return [logits, drafter.transition_logprobs(normed, values, cand, prev)]
