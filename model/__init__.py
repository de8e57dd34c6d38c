"""sparkchat model code: architecture, tokenizer, chat rendering, generation, precision backends.

Nothing in this package knows about DVC or HTTP."""
