"""Every drafter family by name: how to build one from a stored config and weights, and the one check
that a drafter fits a target. Native checkpoints, exports and the trainer's resume all come through
here, so a new family (one file at the top of drafters/) is wired in by one entry below.

    config = drafter_config("eagle3", checkpoint.config, where)    # the family's config class
    drafter = build_drafter("eagle3", config, state, where)         # weights loaded, strict
    check_fits(config, target, where)                               # or fit_problems(...) -> [str]

A drafter fits a target when the shapes it reads and writes are the target's: hidden size and
vocabulary for every family; the position range for the families with rotary attention (a drafter
built for a shorter context drifts in serving engines); and the family's own reads (EAGLE-3's
auxiliary layers exist in the target, EAGLE-1's feature is one it knows, DFlash's, DSpark's and P-EAGLE's
layers and mask token). The target's identity
(name, layer count) recorded in a checkpoint is drafters.checkpoint.check_target's business.
"""

from dataclasses import dataclass
from typing import Callable

from torch import nn

from drafters.blockwise import BlockwiseConfig, BlockwiseHeads
from drafters.checkpoint import CheckpointError
from drafters.dflash import DFlashConfig, DFlashDrafter
from drafters.dflash2 import DFlash2Config, DFlash2Drafter
from drafters.draft_vocab import DraftVocab
from drafters.dspark import DSparkConfig, DSparkDrafter
from drafters.eagle1 import FEATURES, Eagle1Config, Eagle1Drafter
from drafters.eagle3 import Eagle3Config, Eagle3Drafter
from drafters.eagle4 import Eagle4Config, Eagle4Drafter
from drafters.medusa import MedusaConfig, MedusaHeads
from drafters.mtp import MtpConfig, MtpDrafter, mtp_count
from drafters.peagle import PEagleConfig, PEagleDrafter


@dataclass(frozen=True)
class Family:
    display_name: str  # how messages name it: "EAGLE-3"
    config: type
    module: type  # the drafter's nn.Module: module(config), or module(config, vocab) with a draft vocabulary
    fit_keys: tuple[str, ...]  # config fields that must equal the target's text config's
    own_problems: Callable = lambda config, text_config: []  # family-specific (config, text) -> [str]
    draft_vocab: bool = False  # its state dict stores a draft vocabulary (d2t / t2d) the module is built with


def _build(family: Family, config, state: dict) -> nn.Module:
    # the family's module, weights not yet loaded; a draft vocabulary is read back from the state dict's d2t / t2d.
    # A frozen target head (DFlash, DSpark, EAGLE-1) is never stored: the caller attaches it
    if not family.draft_vocab:
        return family.module(config)
    vocab = DraftVocab.from_state_dict(state, source="state dict", draft_vocab_size=config.draft_vocab_size,
                                       target_vocab_size=config.vocab_size)
    return family.module(config, vocab)


def _aux_layers_exist(config, text) -> list[str]:
    if all(0 <= i <= text.num_hidden_layers for i in config.aux_layers):
        return []
    return [f"aux_layers {config.aux_layers} outside 0..{text.num_hidden_layers} (target layer count)"]


def _aux_layers_and_mask_token(config, text) -> list[str]:  # DFlash, DSpark, P-EAGLE
    problems = _aux_layers_exist(config, text)
    if not 0 <= config.mask_token_id < text.vocab_size:
        problems.append(f"mask_token_id {config.mask_token_id} is not a token id of the target (vocab "
                        f"{text.vocab_size})")
    return problems


def _same_mtp_target(config, text) -> list[str]:  # MTP: the target's own layer, so the same model and MTP count
    problems = [f"{key}: drafter {config.target_config.get(key)} vs target {getattr(text, key, None)}"
                for key in ("model_type", "num_hidden_layers")
                if config.target_config.get(key) != getattr(text, key, None)]
    count = mtp_count(text)
    if count is None or count[1] <= config.layer:
        problems.append(f"the target declares {count[1] if count else 'no'} MTP layers, the drafter is layer "
                        f"{config.layer}")
    return problems


def _known_feature(config, text) -> list[str]:
    return [] if config.feature in FEATURES else [f"feature {config.feature!r} is none of {', '.join(FEATURES)}"]


_SHAPE = ("hidden_size", "vocab_size")
_ROTARY = (*_SHAPE, "max_position_embeddings")  # + the position range, for the families with rotary attention
FAMILIES: dict[str, Family] = {
    "eagle3": Family("EAGLE-3", Eagle3Config, Eagle3Drafter, _ROTARY, _aux_layers_exist, draft_vocab=True),
    "eagle1": Family("EAGLE-1", Eagle1Config, Eagle1Drafter, _ROTARY, _known_feature),
    "medusa": Family("Medusa", MedusaConfig, MedusaHeads, _SHAPE),
    "blockwise": Family("Blockwise", BlockwiseConfig, BlockwiseHeads, _SHAPE),
    "dflash": Family("DFlash", DFlashConfig, DFlashDrafter, _ROTARY, _aux_layers_and_mask_token, draft_vocab=True),
    "dspark": Family("DSpark", DSparkConfig, DSparkDrafter, _ROTARY, _aux_layers_and_mask_token, draft_vocab=True),
    "dflash2": Family("DFlash2", DFlash2Config, DFlash2Drafter, _ROTARY, _aux_layers_and_mask_token, draft_vocab=True),
    "peagle": Family("P-EAGLE", PEagleConfig, PEagleDrafter, _ROTARY, _aux_layers_and_mask_token, draft_vocab=True),
    "eagle4": Family("EAGLE-4", Eagle4Config, Eagle4Drafter, _ROTARY, _aux_layers_exist, draft_vocab=True),
    "mtp": Family("MTP", MtpConfig, MtpDrafter, _ROTARY, _same_mtp_target),
}


def family_of(config) -> str:
    for name, family in FAMILIES.items():
        if type(config) is family.config:
            return name
    raise TypeError(f"{type(config).__name__} is no registered drafter config")


def _family(name: str, where) -> Family:
    if name not in FAMILIES:
        raise CheckpointError(f"{where}: unknown drafter family {name!r}; known: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def drafter_config(name: str, raw: dict, where):
    """The family's config from a stored dict; a CheckpointError naming `where` if it does not fit."""
    cls = _family(name, where).config
    try:
        return cls(**raw)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{where}: drafter config does not fit {cls.__name__} ({err})") from None


def build_drafter(name: str, config, state: dict, where) -> nn.Module:
    """-> the family's module with `state` loaded strictly (float32, CPU, as stored)."""
    try:
        drafter = _build(_family(name, where), config, state)
    except ValueError as err:
        raise CheckpointError(f"{where}: {err}") from None
    try:
        drafter.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise CheckpointError(f"{where}: weights do not match the drafter config: {err}") from None
    return drafter


def load_drafter(checkpoint, families: tuple[str, ...] | None = None) -> nn.Module:
    """A native drafters.checkpoint.Checkpoint -> its drafter, weights loaded; `families` restricts
    which families the caller can use."""
    if families is not None and checkpoint.family not in families:
        raise CheckpointError(f"{checkpoint.path}: a {checkpoint.family!r} checkpoint, not "
                              f"{' / '.join(families)}")
    config = drafter_config(checkpoint.family, checkpoint.config, checkpoint.path)
    return build_drafter(checkpoint.family, config, checkpoint.state_dict, checkpoint.path)


def fit_problems(config, text_config) -> list[str]:
    """Every way a drafter config does not fit a target's text config (`config.get_text_config()`)."""
    family = FAMILIES[family_of(config)]
    problems = [f"{key}: drafter {getattr(config, key)} vs target {getattr(text_config, key)}"
                for key in family.fit_keys if getattr(config, key) != getattr(text_config, key)]
    return problems + family.own_problems(config, text_config)


def check_fits(config, target, where) -> None:
    """The one fit check: raises a CheckpointError listing every mismatch with `target`."""
    wrong = fit_problems(config, target.config.get_text_config())
    if wrong:
        name = FAMILIES[family_of(config)].display_name
        raise CheckpointError(f"{where}: this {name} drafter does not fit target {target.name!r}: " + "; ".join(wrong)
                              + ". Train or convert a drafter for this target")
