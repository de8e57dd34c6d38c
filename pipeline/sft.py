"""Stage `sft`: supervised fine-tuning on conversations, loss only on the assistant's tokens; writes the
final chat model to artifacts/model."""
from .train import main

if __name__ == "__main__":
    main("sft")
