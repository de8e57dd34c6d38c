"""Stage `midtrain`: continue the base model on conversations (chat template, calculator tool calls,
multiple choice, math), learning on every token."""
from .train import main

if __name__ == "__main__":
    main("midtrain")
