"""An alias of train/train.py, the same script under the name the Medusa / Blockwise documentation once used: trains
the recipe's `drafter`, whatever its family (medusa when it names none). Recipes name train/train.py; see its docstring.
"""

from drafters.training.families import train_main
from drafters.training.loop import Summary
from drafters.training.recipe import run_main



def main(argv: list[str]) -> Summary:
    return train_main(argv, "train/heads.py", default="medusa")


if __name__ == "__main__":
    run_main(main)
