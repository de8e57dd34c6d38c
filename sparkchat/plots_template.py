"""Writes the HTML page template that makes `dvc plots show` and `dvc plots diff` work offline.

DVC's default page loads Vega, Vega-Lite and vega-embed from a CDN, so without internet it is blank.
A custom page (`.dvc/config`: `plots.html_template`) that leaves out DVC's `{scripts}` placeholder
and carries the three libraries inline is self-contained. The libraries are third-party code, so they
are not committed: vl-convert-python (a dependency) ships them, and this module copies them into the
template at install time (`make install` runs `python -m sparkchat.plots_template`). Inline rather than
files beside the template, because DVC copies the template's text into dvc_plots/index.html, elsewhere.
"""
from __future__ import annotations

import sys
from pathlib import Path

# DVC fills these in the template's text; the first is required, the third (the CDN tags) left out
PLOT_DIVS, REFRESH, CDN_SCRIPTS = "{plot_divs}", "{refresh_tag}", "{scripts}"

PAGE = """<!DOCTYPE html>
<html>
<head>
    {refresh_tag}
    <meta charset="utf-8">
    <title>DVC Plot</title>
    <!-- LIBRARIES, copied from vl-convert-python at install (python -m sparkchat.plots_template) -->
    <script>
// wrapped in a function so the bundle's top-level names stay out of the page's global scope; the
// bundle exports window.vega, window.vegaLite and window.vegaEmbed, which DVC's plot divs call
(function () {
BUNDLE
})();
    </script>
    <style>
        table { border-spacing: 15px; }
    </style>
</head>
<body>
    {plot_divs}
</body>
</html>
"""


def template_path(project: Path = Path(".")) -> Path:
    """Where `.dvc/config`'s `plots.html_template` says the page is (relative paths are under .dvc/)."""
    from dvc.config import Config
    dvc_dir = project / ".dvc"
    if not dvc_dir.is_dir():
        raise SystemExit(f"{dvc_dir.resolve()} is not a folder: run this from the project root")
    value = Config(dvc_dir=str(dvc_dir)).get("plots", {}).get("html_template")
    if not value:
        raise SystemExit(f"{dvc_dir / 'config'} sets no plots.html_template: nowhere to write the page")
    return dvc_dir / value


def dvc_vegalite_major() -> str:
    """The Vega-Lite major version of the specs DVC writes (its templates' $schema, e.g. 'v5')."""
    from dvc_render.vega_templates import TEMPLATES
    schemas = {t.DEFAULT_CONTENT["$schema"] for t in TEMPLATES}
    majors = {s.rsplit("/", 1)[-1].removesuffix(".json") for s in schemas}
    if len(majors) != 1:
        raise SystemExit(f"DVC's plot templates name several Vega-Lite schemas: {sorted(schemas)}")
    return majors.pop()


def render_page() -> str:
    import vl_convert as vlc
    major = dvc_vegalite_major().lstrip("v")
    versions = [v for v in vlc.get_vegalite_versions() if v.split(".")[0] == major]
    if not versions:
        raise SystemExit(f"vl-convert-python offers Vega-Lite {vlc.get_vegalite_versions()}, none of "
                         f"v{major}, the version DVC's plots are written for")
    vl_version = max(versions, key=lambda v: tuple(int(p) for p in v.split(".")))
    bundle = vlc.javascript_bundle(vl_version=vl_version)
    # text the HTML parser or DVC's placeholder filling would act on inside the script
    for bad in ("</script", "<!--", PLOT_DIVS, REFRESH, CDN_SCRIPTS):
        if bad in bundle.lower():
            raise SystemExit(f"the vl-convert-python bundle contains {bad!r}, which cannot sit in the page")
    libraries = (f"Vega {vlc.get_vega_version()}, Vega-Lite {vl_version}, "
                 f"vega-embed {vlc.get_vega_embed_version()}")
    return PAGE.replace("LIBRARIES", libraries).replace("BUNDLE", bundle)


def write(project: Path = Path(".")) -> Path:
    path = template_path(project)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_page(), encoding="utf-8")
    return path


def main() -> None:
    path = write()
    print(f"wrote {path}: dvc plots show works offline", file=sys.stderr)


if __name__ == "__main__":
    main()
