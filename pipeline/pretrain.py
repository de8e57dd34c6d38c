"""Stage `pretrain`: the base model on raw text (see pipeline/train.py for the loop)."""
from .train import main

if __name__ == "__main__":
    main("pretrain")
