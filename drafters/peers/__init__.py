"""Other trainers on the same work (eval/peers.py): each module drives one from a virtual environment of its own and
never imports it, nor does any of our code run inside it (files are the interface). A module provides

    NAME, VERSION, PATCHES [(file in patches/, why)], DEFAULTS {setting: the trainer's own default}
    install(root, venv=None) -> the venv's python     idempotent: torch 2.13.0 (CPU) first, the trainer pinned,
                                                      its CPU patches applied once
    convert(store, out, rows=None) -> {rows, tokens, supervised}   our feature store -> its offline format
    command(python, data, target_dir, out, settings) -> (argv, env)   its training run, matched or its defaults
    exported(out) -> (directory, format)              its drafter, as drafters.export.eagle3_reader reads it
"""

PEERS = ("speculators", "specforge")


class PeerError(Exception):
    """A trainer that cannot be installed, fed or run here: the sentence says which step and why."""
