"""sparkchat: the package above the three wings (pipeline, serve, bench), which stand side by side on
`model/`. It holds what all of them share and the `sparkchat` command's dispatcher; it imports none of
them at import time."""
