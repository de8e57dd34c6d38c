"""The sparkchat DVC pipeline: one module per stage (run as `python -m pipeline.<stage>`) plus what
stages share (config, data loading, training loop, checkpoints, metrics). Knows nothing of HTTP."""
