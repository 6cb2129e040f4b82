"""Give a base model a chat template, so that it can answer chat prompts (train/regenerate.py) and a drafter can train
on its answers (train/train.py), as vLLM's --chat-template does for serving.

    python train/chat_target.py gemma3-270m outputs/targets/gemma3-270m-plain [--template plain | FILE.jinja]

Writes the target (any form load_target reads: a shipped short name, a directory, a GGUF file, a Hub id) as a
local Hugging Face directory whose tokenizer carries the template; recipes then name that directory as `target:`.
`plain` (the default) is the text our benches already prompt base targets with (drafters.targets.plain_chat_text):
`User: {question}` and `Assistant:{answer}` turns, so the MT-bench prompts the drafter is measured on are the same
tokens whether eval/tau.py is given the base target or this directory. The written template is checked against
that rendering before the directory is kept.
"""

import argparse
from pathlib import Path

from drafters.errors import UserError
from drafters.targets import load_target, plain_chat_template, plain_chat_text, save_with_chat_template
from drafters.training.data import RowError, tokenize_conversation
from drafters.training.recipe import run_main

# a conversation with every kind of turn, rendered both ways by the check
CHECK_MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."},
                  {"role": "assistant", "content": " Seven.\n"}, {"role": "user", "content": "Another?"}]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="train/chat_target.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("target", help="what load_target reads: a shipped short name, a directory, a GGUF, a Hub id")
    parser.add_argument("out", help="the directory to write (must not exist)")
    parser.add_argument("--template", default="plain", help="plain (default), or a Jinja chat template file")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.exists():
        raise UserError(f"{out} already exists: remove it, or name another directory")
    template = None
    if args.template != "plain":
        try:
            template = Path(args.template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise UserError(f"--template {args.template}: cannot be read as a UTF-8 Jinja file ({err})") from None
        if not template.strip():
            raise UserError(f"--template {args.template} is empty: write the chat template into it")
    target = load_target(args.target)
    if target.tokenizer.chat_template is not None:
        print(f"note: {target.name} has a chat template of its own; the directory carries the new one instead")
    if template is None:
        template = plain_chat_template(target.tokenizer)
        check_plain(target.tokenizer, template)
    check_trainable(target.tokenizer, template, args.template)
    save_with_chat_template(target, template, out)
    print(f"wrote {out}: {target.name} with {'the plain' if args.template == 'plain' else args.template} chat "
          f"template; name it as the recipes' target (target: {out})")


def check_trainable(tokenizer, template: str, name: str) -> None:
    """Training must be able to render the check conversation, answered, and find the answers in it."""
    answered = [*CHECK_MESSAGES, {"role": "assistant", "content": " Eleven."}]
    previous, tokenizer.chat_template = tokenizer.chat_template, template
    try:
        tokens = tokenize_conversation(tokenizer, answered)
    except RowError as err:  # NotPrefixStable included
        raise UserError(f"--template {name}: training cannot use it: {err}") from None
    finally:
        tokenizer.chat_template = previous
    if not any(tokens.loss_mask):
        raise UserError(f"--template {name}: no answer token is trained under it (its rendering drops the assistant "
                        "turns); render every message's content")


def check_plain(tokenizer, template: str) -> None:
    """The template's tokens must be the bench's base-target prompt, turn for turn, and an answer must decode with the
    leading space the model wrote (the bench keeps the decoded answer as the model wrote it after "Assistant:")."""
    if tokenizer.decode(tokenizer(" Seven.", add_special_tokens=False)["input_ids"]) != " Seven.":
        raise UserError("this tokenizer drops an answer's leading space when decoding, so the plain template would "
                        "render a later turn's history otherwise than the model wrote it; write a template for it "
                        "and pass it with --template FILE.jinja")
    rendered = tokenizer.apply_chat_template(CHECK_MESSAGES, chat_template=template, add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]
    bench = tokenizer(plain_chat_text(CHECK_MESSAGES), add_special_tokens=True)["input_ids"]
    if list(rendered) != list(bench):
        raise UserError(f"the plain template renders {len(rendered)} tokens where the bench's base prompt has "
                        f"{len(bench)} for the same turns (this tokenizer adds special tokens or spaces the template "
                        "cannot place); write a template for it and pass it with --template FILE.jinja")


if __name__ == "__main__":
    run_main(main)
