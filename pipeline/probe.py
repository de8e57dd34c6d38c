"""`sparkchat probe`: which precision backends run here, and what each buys.

The command reads its settings from params.yaml's `probe:` section (with `--params`; its defaults
otherwise), lets flags override them, and hands them to the probe library
(model/precision/probe.py), which trains the same small model under every backend and writes
probe.json (DVC metrics; `auto` reads it) and probe.md. torch loads only after the arguments are
parsed, so `--help` answers at once.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from model.precision.options import ProbeOptions
from sparkchat import paths

from .config import ConfigError, load_params

# a flag per ProbeOptions field, named for it: it overrides the field, and its help is the field's docstring
FLAGS = [f.name for f in dataclasses.fields(ProbeOptions)]


def parser() -> argparse.ArgumentParser:
    defaults, docs = ProbeOptions(), ProbeOptions.docs()
    p = argparse.ArgumentParser(prog="sparkchat probe", description=__doc__.splitlines()[0],
                                epilog="Without --params the defaults are those of params.yaml's `probe:` section "
                                       "(model/precision/options.py ProbeOptions); a flag overrides either.")
    p.add_argument("--params", metavar="YAML",
                   help="read the `probe:` section of this params file (and its profile) (default: none)")
    for name in FLAGS:
        default, text = getattr(defaults, name), docs[name].rstrip(".")
        kw = dict(nargs="+") if isinstance(default, list) else dict(type=type(default))
        shown = " ".join(default) if isinstance(default, list) else default
        p.add_argument("--" + name.replace("_", "-"), **kw, help=f"{text} (default: {shown})")
    p.add_argument("--tokens", metavar="FILE",
                   help="token ids (.npy, or uint16 .bin) instead of synthetic Markov data (default: synthetic)")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    p.add_argument("--no-compile", action="store_true", help="run uncompiled (default: compile on CUDA)")
    # under artifacts/ (git-ignored), where `precision.backend: auto` looks: a probe leaves the tree clean
    p.add_argument("--out", default=str(paths.PROBE),
                   help="folder for probe.json, probe.md and probe.partial.json (default: %(default)s)")
    p.add_argument("--merge", nargs="+", metavar="PROBE_JSON",
                   help="probe nothing: merge probe.json files of one configuration into --out (default: off)")
    return p


def main(argv=None):
    a = parser().parse_args(argv)
    from model.precision.probe import merge_probes, run_probe, to_markdown, write_probe  # torch loads here

    if a.merge:
        out = merge_probes([json.loads(Path(f).read_text()) for f in a.merge])
        write_probe(out, a.out)
        print(to_markdown(out))
        return
    # through the same loader as training: a misspelt key or a bad entry stops here, naming it
    try:
        probe = load_params(a.params).probe if a.params else ProbeOptions()
        overrides = {k: getattr(a, k) for k in FLAGS if getattr(a, k) is not None}
        probe = dataclasses.replace(probe, **overrides)  # checked again, flags included
    except ConfigError as e:
        raise SystemExit(f"probe: {e}") from None
    from model.device import resolve_device
    try:
        device = resolve_device(a.device)
    except ValueError as e:
        raise SystemExit(f"probe: --device {e}; leave --device out to use what there is") from None
    from model.memory_fit import MemoryFitError
    try:
        out = run_probe(probe, tokens=a.tokens, device=device, compile=not a.no_compile, out_dir=a.out)
    except MemoryFitError as e:
        raise SystemExit(f"probe: {e}") from None
    print(to_markdown(out))


if __name__ == "__main__":
    main()
