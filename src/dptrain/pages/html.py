"""One self-contained HTML document: styles, data and scripts inline, plotly.js included.

A page written here makes no request when it is opened: plotly.js comes from the
``plotly`` package's own copy (``plotly.offline.get_plotlyjs``), data is embedded as
JSON in a ``<script type="application/json">`` element, and the styles and scripts are
read from this package. Nothing is fetched at view time, so the file can be mailed,
attached to an issue or opened on a machine without a network.

That costs each page about 4.6 MB of plotly.js. A run's report may instead take it from
plotly's CDN (``cdn``: a script tag at the version the ``plotly`` package ships; the page
then needs a network) or from one copy shared by the runs of a folder (``shared``:
``plotly-<version>.min.js`` in the run directory's parent, written once, atomically,
and referred to relatively, so the folder moves whole): :func:`plotly_script`.
"""

from __future__ import annotations

import functools
import html
import json
from importlib import resources
from pathlib import Path
from typing import Any

from dptrain.utils.atomic import write_text_atomic

__all__ = ["PLOTLY_JS_MODES", "plotly_js", "plotly_script", "asset", "json_script", "document", "write_page"]

PLOTLY_JS_MODES = ("inline", "cdn", "shared")


@functools.lru_cache(maxsize=1)
def plotly_js() -> str:
    """The minified plotly.js bundled with the ``plotly`` package (about 4.5 MB)."""
    from plotly.offline import get_plotlyjs

    return get_plotlyjs()


def _plotly_version() -> str:
    from plotly.offline import get_plotlyjs_version

    return get_plotlyjs_version()


def plotly_script(mode: str = "inline", page_dir: Path | None = None) -> str:
    """The ``<script>`` element that gives a page in ``page_dir`` plotly.js, by ``mode`` (:data:`PLOTLY_JS_MODES`).

    ``shared`` writes ``plotly-<version>.min.js`` into ``page_dir``'s parent unless it is
    there already (atomically: a page never refers to half a file) and refers to it as
    ``../plotly-<version>.min.js``.
    """
    if mode == "inline":
        return f"<script>{plotly_js()}</script>"
    name = f"plotly-{_plotly_version()}.min.js"
    if mode == "cdn":
        return f'<script src="https://cdn.plot.ly/{name}" charset="utf-8"></script>'
    if mode == "shared":
        if page_dir is None:
            raise ValueError("plotly.js shared between pages needs the page's folder (page_dir)")
        shared = Path(page_dir).resolve().parent / name
        if not shared.is_file():
            write_text_atomic(shared, plotly_js())
        return f'<script src="../{html.escape(name)}" charset="utf-8"></script>'
    raise ValueError(f"plotly.js mode must be one of {', '.join(PLOTLY_JS_MODES)}; got {mode!r}")


def asset(name: str) -> str:
    """A file shipped in ``dptrain/pages/assets`` (a script or a style sheet)."""
    return resources.files("dptrain.pages").joinpath("assets", name).read_text(encoding="utf-8")


def json_script(element_id: str, data: Any) -> str:
    """``data`` as a JSON script element the page reads with ``JSON.parse`` (``</`` escaped)."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    return f'<script type="application/json" id="{element_id}">{text}</script>'


def document(title: str, body: str, styles: str = "", scripts: tuple[str, ...] = (), plotly: bool = True,
             plotly_tag: str | None = None) -> str:
    """A whole HTML document: ``body`` (HTML), inline ``styles`` and ``scripts`` (run after plotly.js).

    ``plotly_tag``: the element that loads plotly.js (:func:`plotly_script`); default inline.
    """
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{html.escape(title)}</title>",
        f"<style>{asset('base.css')}{styles}</style>",
        "</head><body>",
        body,
    ]
    if plotly:
        parts.append(plotly_tag if plotly_tag is not None else plotly_script("inline"))
    parts += [f"<script>{s}</script>" for s in scripts]
    parts.append("</body></html>")
    return "\n".join(parts)


def write_page(path: Path, text: str) -> Path:
    """Write the page whole or not at all (a reader never sees half a file)."""
    path = Path(path)
    write_text_atomic(path, text)
    return path
