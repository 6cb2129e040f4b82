"""drafters: train speculative-decoding drafter heads on a frozen target model and measure them.

The library knows nothing about launchers or command lines: entry scripts live in `train/` and
`eval/` and build everything from a recipe (`drafters.training.recipe`).
"""

__version__ = "0.1.0"
