"""train/train.py under the name the documentation uses: `accelerate launch train/eagle.py RECIPE.yaml` trains the
recipe's `drafter`, whatever its family (eagle3 when it names none). See train/train.py.
"""

from drafters.training.families import train_main
from drafters.training.loop import Summary
from drafters.training.recipe import run_main



def main(argv: list[str]) -> Summary:
    return train_main(argv, "train/eagle.py")


if __name__ == "__main__":
    run_main(main)
