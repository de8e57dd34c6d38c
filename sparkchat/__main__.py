"""`python -m sparkchat`: the same as the `sparkchat` command."""
from sparkchat.cli import main

main()
