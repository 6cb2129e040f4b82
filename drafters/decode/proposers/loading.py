"""Build a proposer from a command-line spec: a registered name or a drafter checkpoint directory.

Specs:
  prompt-lookup[:max_ngram=3,min_ngram=1]   n-gram lookup in the context (no model)
  draft-model:<target name or path>         a smaller LM sharing the target's tokenizer
  <directory>                               a trained drafter checkpoint: native (drafter.json,
                                            drafters.checkpoint) or exported (config.json), ours or
                                            another tool's (SpecForge, speculators, EAGLE, Medusa)
  <directory>:aux_layers=A,B,C              an EAGLE-3 drafter whose config records no auxiliary layers
                                            drafts from these (HF hidden_states indices) instead of
                                            the serving engine's default; refused where it records others
  <directory>:conf_min=P                    a DSpark drafter's chain cut at the first slot whose confidence head
                                            says < P (llama.cpp's --spec-draft-p-min for DSpark)
  <directory>+prompt-lookup[:options]       the drafter's tree plus one prompt-lookup continuation as
                                            deep as the tree, verified together (greedy only);
                                            options: max_ngram, min_ngram, copy_ngram=N (rounds where
                                            an N-gram match continues for the full depth verify the
                                            lookup's own tree and skip the drafter)

The tree spec decides the draft shape. Prompt lookup maps it onto (depth, branches, node cap):
chain:K -> (K, 1, K); dynamic:total,depth,topk -> (depth, topk, total); static -> (max depth,
number of leaves, number of draft nodes). This module knows nothing about decoding itself.
"""

import json
import re
from pathlib import Path
from typing import Callable

from drafters.checkpoint import CONFIG_FILE, Checkpoint, CheckpointError, check_target, target_info
from drafters.checkpoint import load_checkpoint as read_checkpoint
from drafters.decode.proposers.dflash import dflash_export_loader, dflash_proposer
from drafters.decode.proposers.dflash2 import dflash2_export_loader, dflash2_proposer
from drafters.decode.proposers.draft_model import DraftModelProposer
from drafters.decode.proposers.dspark import DSparkProposer, dspark_export_loader, dspark_proposer
from drafters.decode.proposers.eagle import eagle3_export_loader, eagle3_proposer
from drafters.decode.proposers.eagle1 import eagle1_export_loader, eagle1_proposer
from drafters.decode.proposers.eagle4 import eagle4_export_loader, eagle4_proposer
from drafters.decode.proposers.heads import calibrated_tree, heads_proposer, medusa_export_proposer
from drafters.decode.proposers.mtp import is_mtp_checkpoint, mtp_export_loader, mtp_proposer
from drafters.decode.proposers.hybrid import HybridProposer
from drafters.decode.proposers.peagle import peagle_export_loader, peagle_proposer
from drafters.decode.proposers.prompt_lookup import PromptLookupProposer
from drafters.decode.tree import ChainSpec, DynamicSpec, TreeSpec
from drafters.files import drafter_sha256
from drafters.registry import drafter_config

PROPOSER_SPECS = ("prompt-lookup[:max_ngram=N,min_ngram=N]", "draft-model:<target name or path>",
                  "<drafter checkpoint directory>[:aux_layers=A,B,C]", "<drafter directory>+prompt-lookup[:options]")
DRAFTER_OPTIONS = ("aux_layers", "conf_min")  # DIR:option=value: see split_drafter_spec
# Trained drafters register here, one entry per family of drafters.registry.FAMILIES: family -> build(config, state,
# target, tree, where, *, seed, **options) -> proposer, from a checkpoint's config and weights. A native checkpoint
# comes through proposer_from_checkpoint (the target match checked once there); an export's loader calls its builder.
FAMILY_PROPOSERS: dict[str, Callable] = {
    "eagle3": eagle3_proposer,
    "eagle1": eagle1_proposer,
    "medusa": heads_proposer,
    "blockwise": heads_proposer,
    "dflash": dflash_proposer,
    "dspark": dspark_proposer,
    "dflash2": dflash2_proposer,
    "peagle": peagle_proposer,
    "eagle4": eagle4_proposer,
    "mtp": mtp_proposer,
}
# exported checkpoints (config.json): format -> (detect(config) -> bool,
# load(path, config, target, tree) -> proposer); recorded target fields are checked before. EAGLE-3
# loaders also take aux_layers= (the proposer option).
CHECKPOINT_LOADERS: dict[str, tuple[Callable[[dict], bool], Callable]] = {
    "sglang-eagle3": (lambda c: c.get("architectures") == ["LlamaForCausalLMEagle3"], eagle3_export_loader("sglang")),
    "vllm-eagle3": (lambda c: c.get("speculators_model_type") == "eagle3", eagle3_export_loader("vllm")),
    "sglang-dflash": (lambda c: c.get("architectures") == ["DFlashDraftModel"] and "dflash_config" in c,
                      dflash_export_loader("sglang")),
    "vllm-dflash": (lambda c: c.get("speculators_model_type") == "dflash", dflash_export_loader("vllm")),
    "vllm-dspark": (lambda c: c.get("speculators_model_type") == "dspark", dspark_export_loader),
    "sglang-dflash2": (lambda c: c.get("architectures") == ["DFlash2DraftModel"], dflash2_export_loader),
    "vllm-peagle": (lambda c: c.get("speculators_model_type") == "peagle", peagle_export_loader),
    "vllm-eagle4": (lambda c: c.get("speculators_model_type") == "eagle4", eagle4_export_loader),
    "medusa": (lambda c: "medusa_num_heads" in c, medusa_export_proposer),
    # a target checkpoint with MTP layers (drafters.export.mtp's, or as shipped): its layer 0 drafts
    "mtp": (is_mtp_checkpoint, mtp_export_loader),
    # the EAGLE repository's configs may leave `bias` out (its loader then builds fc with one)
    "eagle1": (lambda c: c.get("num_hidden_layers") == 1 and c.get("architectures") in (
        ["LlamaForCausalLM"], ["LlamaForCausalLMEagle"]) and "draft_vocab_size" not in c, eagle1_export_loader),
}
EAGLE3_FORMATS = ("sglang-eagle3", "vllm-eagle3")


def load_proposer(spec: str, target, tree: TreeSpec):
    if "+prompt-lookup" in spec:  # DRAFTER+prompt-lookup[:options]: lookup continuations as extra branches
        drafter, _, lookup = spec.partition("+")
        return _hybrid(load_proposer(drafter, target, tree), lookup.partition(":")[2], target, tree)
    name, _, arg = spec.partition(":")
    if name == "prompt-lookup":
        return _prompt_lookup(arg, target, tree)
    if name == "draft-model":
        if not arg:
            raise ValueError("proposer 'draft-model' needs a model: draft-model:<target name or path>")
        return _draft_model(arg, target, tree)
    path, options = split_drafter_spec(spec)
    if path.is_dir():
        return load_checkpoint(path, target, tree, **options)
    raise ValueError(f"unknown proposer {spec!r}: use one of {', '.join(PROPOSER_SPECS)}")


def split_drafter_spec(spec: str) -> tuple[Path, dict]:
    """DIR or DIR:aux_layers=A,B,C -> (DIR, {"aux_layers": [A, B, C]}). A value runs on over commas
    up to the next `name=`. Anything else (a named proposer, a directory whose own name holds ':')
    comes back whole, without options."""
    path, _, arg = spec.rpartition(":")
    if Path(spec).is_dir() or not path or not Path(path).is_dir():
        return Path(spec), {}
    options, key = {}, None
    for item in arg.split(","):
        name, eq, value = item.partition("=")
        if eq:
            key = name
            if key not in DRAFTER_OPTIONS:
                raise ValueError(f"drafter option {item!r} in {spec!r}: known options: {', '.join(DRAFTER_OPTIONS)} "
                                 "(e.g. DIR:aux_layers=2,15,27)")
            options[key] = [value]
        elif key is not None:
            options[key].append(item)
        else:
            raise ValueError(f"drafter options {arg!r} in {spec!r}: expected name=value, e.g. aux_layers=2,15,27")
    if "aux_layers" in options:
        values = options["aux_layers"]
        if not all(v.strip().isdigit() for v in values):
            raise ValueError(f"aux_layers={','.join(values)} in {spec!r}: want HF hidden_states indices, e.g. "
                             "aux_layers=2,15,27")
        options["aux_layers"] = [int(v) for v in values]
    if "conf_min" in options:
        value = ",".join(options["conf_min"])
        try:
            options["conf_min"] = float(value)
        except ValueError:
            options["conf_min"] = -1.0
        if not 0.0 <= options["conf_min"] <= 1.0:
            raise ValueError(f"conf_min={value} in {spec!r}: want a confidence in [0, 1], e.g. conf_min=0.8")
    return Path(path), options


def proposer_sha256(spec: str) -> str | None:
    """Content of a drafter directory (its top-level .json and .safetensors files): what a cached or
    merged result must agree on, since a checkpoint can change under the same path. None for a
    named proposer (prompt-lookup, draft-model:...)."""
    path, _ = split_drafter_spec(spec)
    return drafter_sha256(path) if path.is_dir() else None


def _prompt_lookup(arg: str, target, tree: TreeSpec, **overrides: int) -> PromptLookupProposer:
    # arg: "max_ngram=N,min_ngram=N" as typed; overrides (the hybrid's copy lookup) replace those keys
    options = {}
    for item in filter(None, arg.split(",")):
        key, eq, value = item.partition("=")
        if key not in ("max_ngram", "min_ngram") or not eq or not value.isdigit():
            raise ValueError(f"prompt-lookup option {item!r}: expected max_ngram=N or min_ngram=N")
        options[key] = int(value)
    if isinstance(tree, ChainSpec):
        branches = 1
    elif isinstance(tree, DynamicSpec):
        branches = tree.topk
    else:
        branches = sum(1 for i in range(tree.shape.num_nodes) if i not in tree.shape.parents)
    return PromptLookupProposer(depth=tree.depth, branches=branches, max_nodes=tree.budget,
                                eos_token_ids=target.eos_token_ids, **(options | overrides))


def _hybrid(drafter, lookup_options: str, target, tree: TreeSpec) -> HybridProposer:
    # one lookup continuation as deep as the tree (at most tree_depth nodes more to verify per round);
    # copy_ngram=N: rounds where an N-gram (or longer) match continues for the tree's full depth verify the
    # lookup's own tree (the tree's budget and branching) without drafting
    options = [item for item in lookup_options.split(",") if item]
    copy = [item for item in options if item.startswith("copy_ngram=")]
    rest = ",".join(item for item in options if item not in copy)
    lookup = _prompt_lookup(rest, target, ChainSpec(tree.depth))
    copy_lookup = None
    if copy:
        value = copy[-1].partition("=")[2]
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"prompt-lookup option {copy[-1]!r}: expected copy_ngram=N with N >= 1")
        n = int(value)
        copy_lookup = _prompt_lookup(rest, target, tree, min_ngram=n, max_ngram=max(n, lookup.max_ngram))
    hybrid = HybridProposer(drafter, lookup, max_lookup_nodes=tree.depth, copy_lookup=copy_lookup)
    hybrid.notes = getattr(drafter, "notes", [])  # how the drafter's files were read
    return hybrid


def _draft_model(name: str, target, tree: TreeSpec) -> DraftModelProposer:
    from drafters.targets import load_target  # the draft model is loaded like a target

    draft = load_target(name, dtype=str(target.dtype).removeprefix("torch."))
    draft.model.to(target.device)
    return DraftModelProposer(
        draft.model, tree, target_vocab_size=target.lm_head.weight.shape[0],
        tokenizer=draft.tokenizer, target_tokenizer=target.tokenizer,
    )


def load_checkpoint(path: Path, target, tree: TreeSpec, *, aux_layers: list[int] | None = None,
                    conf_min: float | None = None):
    """aux_layers (HF indices): the layers an EAGLE-3 drafter that records none drafts from (else the
    serving engine's default, said in the proposer's notes); where the drafter records its layers
    the option must name the same ones. conf_min: a DSpark drafter's confidence gate (chains only)."""
    if conf_min is not None:
        proposer = load_checkpoint(path, target, tree, aux_layers=aux_layers)
        if not isinstance(proposer, DSparkProposer):
            raise ValueError(f"conf_min={conf_min} for {path}: only DSpark drafters have a confidence head, this is "
                             f"a {type(proposer).__name__.removesuffix('Proposer')} drafter")
        return DSparkProposer(proposer.drafter, proposer.embed, proposer.tree, conf_min=conf_min)
    if (path / CONFIG_FILE).is_file():  # native drafters checkpoint (drafters.checkpoint)
        checkpoint = read_checkpoint(path)  # each family's loader checks it against the target (check_target)
        if checkpoint.family not in FAMILY_PROPOSERS:
            raise ValueError(f"drafter checkpoint {path}: no proposer for family {checkpoint.family!r} yet; "
                             f"known families: {', '.join(sorted(FAMILY_PROPOSERS)) or 'none'}")
        recorded = checkpoint.config.get("aux_layers")  # the families that read auxiliary layers record them
        if aux_layers is not None and recorded is None:
            raise ValueError(f"aux_layers={aux_layers} for {path}: this {checkpoint.family!r} checkpoint reads no "
                             "auxiliary layers (EAGLE-3 and DFlash drafters do)")
        if aux_layers is not None and list(aux_layers) != list(recorded):
            raise ValueError(f"{path / CONFIG_FILE}: records auxiliary layers HF hidden_states {recorded}, but the "
                             f"aux_layers option says {aux_layers}: a drafter drafts only from the layers it was "
                             "trained on; drop the option")
        return proposer_from_checkpoint(checkpoint, target, tree)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ValueError(f"drafter checkpoint {path}: neither {CONFIG_FILE} (a drafters checkpoint) nor "
                         "config.json (an exported EAGLE / Medusa / speculators checkpoint)")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{config_path}: not valid JSON ({error})") from None
    check_export_target(config, target, config_path)
    for fmt, (detect, load) in CHECKPOINT_LOADERS.items():
        if not detect(config):
            continue
        if fmt in EAGLE3_FORMATS:
            return load(path, config, target, tree, aux_layers=aux_layers)
        if aux_layers is not None:
            raise ValueError(f"aux_layers={aux_layers} for {path}: only EAGLE-3 drafters read auxiliary layers, "
                             f"this is a {fmt} export")
        return load(path, config, target, tree)
    raise ValueError(
        f"drafter checkpoint {path}: no loader for this format yet (architectures "
        f"{config.get('architectures')}); known formats: {', '.join(CHECKPOINT_LOADERS) or 'none'}. "
        f"Use one of {', '.join(PROPOSER_SPECS[:2])}"
    )


def proposer_from_checkpoint(ckpt: Checkpoint, target, tree: str | TreeSpec | None = None, *, seed: int = 0,
                             **options):
    """The one loader of a native checkpoint's proposer, every family: the target it records checked against `target`
    (drafters.checkpoint.check_target; other weights of the same shapes: a warning), its config read, its family's
    builder (FAMILY_PROPOSERS) with `options` (DSpark: conf_min). tree None: the checkpoint's calibrated tree (a
    Medusa or Blockwise run writes one)."""
    check_target(ckpt, target, other_weights="warn")
    config = drafter_config(ckpt.family, ckpt.config, ckpt.path)
    tree = calibrated_tree(ckpt) if tree is None else tree
    return FAMILY_PROPOSERS[ckpt.family](config, ckpt.state_dict, target, tree, ckpt.path, seed=seed, **options)


def load_drafter_proposer(path, target, tree: str | TreeSpec | None = None, *, family: str | None = None,
                          seed: int = 0, **options):
    """proposer_from_checkpoint of the native checkpoint at `path`; family: refuse a checkpoint of another."""
    return proposer_from_checkpoint(read_checkpoint(Path(path), family=family), target, tree, seed=seed, **options)


def check_export_target(config: dict, target, where) -> None:
    """Every fact an exported drafter's config.json records about its target must match this target:
    the TARGET_FIELDS it records (through drafters.checkpoint.check_target, the one check native
    checkpoints use), its aux layer ids, draft vocabulary and verifier / base model name."""
    recorded = {**target_info(target), **_recorded_target(config), "name": _recorded_name(config) or "(not recorded)"}
    problems = []
    try:  # fields the export does not record are the target's own: only recorded ones can differ
        check_target(Checkpoint(Path(where), "export", config, recorded, {}, {}), target, other_weights="warn")
    except CheckpointError as error:
        problems.append(str(error))
    problems += _layer_and_vocab_problems(config, target) + _verifier_problems(config, target)
    if problems:
        raise ValueError(f"{where}: this exported drafter was built for another target than {target.name!r}; "
                         "train or export it for this target:\n  - " + "\n  - ".join(problems))


def _recorded_target(config: dict) -> dict:
    # TARGET_FIELDS as an export records them; vLLM speculators nest the layer's fields
    layer = config.get("transformer_layer_config") or {}
    found = {
        "hidden_size": config.get("target_hidden_size", config.get("hidden_size", layer.get("hidden_size"))),
        "vocab_size": config.get("vocab_size", layer.get("vocab_size")),
        "max_position_embeddings": config.get("max_position_embeddings", layer.get("max_position_embeddings")),
        "num_layers": config.get("target_num_hidden_layers", config.get("num_target_layers")),
    }
    return {key: value for key, value in found.items() if value is not None}


def _layer_and_vocab_problems(config: dict, target) -> list[str]:
    problems = []
    layer_ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids",
                                                       config.get("eagle_aux_hidden_state_layer_ids")) or []
    if any(not isinstance(i, int) or not 0 <= i <= target.num_layers for i in layer_ids):
        problems.append(f"auxiliary layer ids {layer_ids} do not exist in {target.name} ({target.num_layers} layers)")
    draft_vocab = config.get("draft_vocab_size")
    if draft_vocab is not None and not (isinstance(draft_vocab, int) and 0 < draft_vocab <= target.vocab_size):
        problems.append(f"draft_vocab_size {draft_vocab} is not in 1..{target.vocab_size} (the target's vocabulary)")
    return problems


def _verifier_problems(config: dict, target) -> list[str]:
    # vLLM speculators record the verifier, Medusa the base model: a name, matched loosely (a Hub id,
    # a local copy's directory or a .gguf file of the same model agree), and architectures exactly
    verifier = (config.get("speculators_config") or {}).get("verifier") or {}
    name, problems = _recorded_name(config), []
    if name and not (_same_local_model(name, target) if _local_config(name) else _same_model(name, target.name)):
        problems.append(f"verifier / base model {name!r} is not {target.name!r}")
    architectures, have = verifier.get("architectures") or [], target_info(target)["architectures"]
    if architectures and have and architectures != have:
        problems.append(f"verifier architectures {architectures} vs target {have}")
    return problems


def _recorded_name(config: dict) -> str | None:
    verifier = (config.get("speculators_config") or {}).get("verifier") or {}
    name = verifier.get("name_or_path") or config.get("base_model_name_or_path")
    return name if isinstance(name, str) and name else None


def _local_config(name: str) -> Path | None:
    config = Path(name).expanduser() / "config.json"
    return config if config.is_file() else None


def _same_local_model(name: str, target) -> bool:
    # a verifier recorded as a local model directory (speculators often records one) is compared by
    # what its config.json says, not by its directory's name
    try:
        config = json.loads(_local_config(name).read_text())
    except (OSError, ValueError):
        return False
    config = config.get("text_config", config)  # multimodal configs nest the language model's
    have = target_info(target)
    recorded = {"model_type": config.get("model_type"), "num_layers": config.get("num_hidden_layers"),
                "hidden_size": config.get("hidden_size"), "vocab_size": config.get("vocab_size")}
    # a field the config does not write (Nemotron-H derives its layer count from its block pattern) cannot differ
    return all(have[k] == v for k, v in recorded.items() if v is not None)


def _same_model(recorded: str, name: str) -> bool:
    # last path component, letters and digits only: HuggingFaceTB/SmolLM2-135M-Instruct ~ smollm2-135m-instruct
    def key(s):
        return re.sub(r"[^a-z0-9]", "", Path(s.rstrip("/")).name.lower().removesuffix(".gguf"))

    a, b = key(recorded), key(name)
    return bool(a and b) and (a in b or b in a)
