"""Stage `params`: params.yaml with the selected profile applied, one file per stage.

Each file holds exactly the sections that stage reads (config.STAGE_SECTIONS), resolved and checked.
The stages depend on their file, not on params.yaml, so DVC re-runs a stage only when one of its own
values changed, whether the change came from params.yaml, `dvc exp run -S`, or an edit to the
profile file in use.
"""
from __future__ import annotations

import dataclasses
import sys

from sparkchat import paths

from .config import STAGE_SECTIONS, ConfigError, load_params
from .metrics import write_json


def main() -> None:
    try:
        p = load_params()
    except ConfigError as e:
        raise SystemExit(f"params: {e}") from None
    for stage, sections in STAGE_SECTIONS.items():
        write_json(paths.stage_params(stage), {s: dataclasses.asdict(getattr(p, s)) for s in sections})
    print(f"params: profile '{p.profile or '(none)'}' resolved for {', '.join(STAGE_SECTIONS)}", file=sys.stderr)


if __name__ == "__main__":
    main()
