"""train/train.py under the name the Medusa / Blockwise documentation uses: trains the recipe's `drafter`, whatever
its family (medusa when it names none). See train/train.py.
"""

from drafters.training.families import train_main
from drafters.training.loop import Summary
from drafters.training.recipe import run_main



def main(argv: list[str]) -> Summary:
    return train_main(argv, "train/heads.py", default="medusa")


if __name__ == "__main__":
    run_main(main)
