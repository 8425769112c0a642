"""One self-contained HTML document: styles, data and scripts inline, plotly.js included.

A page written here makes no request when it is opened: plotly.js comes from the
``plotly`` package's own copy (``plotly.offline.get_plotlyjs``), data is embedded as
JSON in a ``<script type="application/json">`` element, and the styles and scripts are
read from this package. Nothing is fetched at view time, so the file can be mailed,
attached to an issue or opened on a machine without a network.
"""

from __future__ import annotations

import functools
import html
import json
from importlib import resources
from pathlib import Path
from typing import Any

from dptrain.train.atomic import write_text_atomic

__all__ = ["plotly_js", "asset", "json_script", "document", "write_page"]


@functools.lru_cache(maxsize=1)
def plotly_js() -> str:
    """The minified plotly.js bundled with the ``plotly`` package (about 4.5 MB)."""
    from plotly.offline import get_plotlyjs

    return get_plotlyjs()


def asset(name: str) -> str:
    """A file shipped in ``dptrain/pages/assets`` (a script or a style sheet)."""
    return resources.files("dptrain.pages").joinpath("assets", name).read_text(encoding="utf-8")


def json_script(element_id: str, data: Any) -> str:
    """``data`` as a JSON script element the page reads with ``JSON.parse`` (``</`` escaped)."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    return f'<script type="application/json" id="{element_id}">{text}</script>'


def document(title: str, body: str, styles: str = "", scripts: tuple[str, ...] = (), plotly: bool = True) -> str:
    """A whole HTML document: ``body`` (HTML), inline ``styles`` and ``scripts`` (run after plotly.js)."""
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
        parts.append(f"<script>{plotly_js()}</script>")
    parts += [f"<script>{s}</script>" for s in scripts]
    parts.append("</body></html>")
    return "\n".join(parts)


def write_page(path: Path, text: str) -> Path:
    """Write the page whole or not at all (a reader never sees half a file)."""
    path = Path(path)
    write_text_atomic(path, text)
    return path
