"""Open one of dptrain's HTML pages in headless Chromium, collecting what its console reports.

The pages must work offline, as a user opens them from disk: the browser is the
system's Chromium (Debian's ``chromium`` package, which ``.ci/run`` installs), driven
by Playwright without its own browser download, and every request the page makes to
the network is refused and recorded. Tests skip, naming what is missing, where there
is no Chromium or no Playwright. ``DPTRAIN_CHROMIUM`` points at another binary.
``DPTRAIN_REQUIRE_BROWSER=1`` (set by ``.ci/run`` where it could install Chromium)
turns that skip into a failure, so CI never passes with its page tests silently skipped.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["chromium_path", "open_page", "Console", "plot_layout_problems"]


def _missing(reason: str):
    """Skip for ``reason``, or fail where the environment says the browser must be there."""
    if os.environ.get("DPTRAIN_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{reason}; DPTRAIN_REQUIRE_BROWSER=1 requires the page tests to run", pytrace=False)
    pytest.skip(reason)


def chromium_path() -> str | None:
    explicit = os.environ.get("DPTRAIN_CHROMIUM")
    if explicit:
        return explicit
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


class Console:
    """What a page logged at error level, threw, or tried to fetch from the network."""

    def __init__(self):
        self.errors: list[str] = []
        self.requests: list[str] = []

    def problems(self) -> list[str]:
        return self.errors + [f"network request: {url}" for url in self.requests]


@contextlib.contextmanager
def open_page(path: Path, width: int = 1400, height: int = 1000) -> Iterator[tuple[object, Console]]:
    """(Playwright page, console) for the HTML file ``path``, loaded from disk with the network refused."""
    binary = chromium_path()
    if binary is None:
        _missing("no Chromium on this machine (apt-get install chromium, or set DPTRAIN_CHROMIUM)")
    try:
        from playwright import sync_api
    except ImportError:
        _missing("the page tests need playwright (pip install -e '.[test]')")
    console = Console()
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=binary, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.on("console", lambda m: console.errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: console.errors.append(f"uncaught: {e}"))

            def refuse(route):
                console.requests.append(route.request.url)
                route.abort()

            page.route("http://**/*", refuse)
            page.route("https://**/*", refuse)
            page.goto(Path(path).resolve().as_uri(), wait_until="load")
            yield page, console
        finally:
            browser.close()


# For each plotly plot: its toolbar's box (shown on hover), its title's and its legend's, and its axis titles.
_PLOT_BOXES = """() => Array.from(document.querySelectorAll('.js-plotly-plot')).map((div) => {
  const box = (el) => { if (!el) return null; const r = el.getBoundingClientRect();
                        return r.width && r.height ? [r.left, r.top, r.right, r.bottom] : null; };
  const meet = (a, b) => a != null && b != null && a[0] < b[2] && b[0] < a[2] && a[1] < b[3] && b[1] < a[3];
  const toolbar = box(div.querySelector('.modebar'));
  return { id: div.id, toolbar, title: meet(toolbar, box(div.querySelector('.gtitle'))),
           legend: meet(toolbar, box(div.querySelector('.legend'))),
           axes: Array.from(div.querySelectorAll('.xtitle, .ytitle, .x2title, .y2title')).map((t) => t.textContent) };
})"""


def plot_layout_problems(page, axis_titles: bool = True) -> list[str]:
    """Where a page's plots draw plotly's toolbar over a title or a legend (after hovering over each plot, which
    shows it), or (``axis_titles``) leave an axis title empty: one line each."""
    for plot in page.locator(".js-plotly-plot").all():
        plot.scroll_into_view_if_needed()
        plot.hover()
    problems = []
    for plot in page.evaluate(_PLOT_BOXES):
        if plot["toolbar"] is None:
            problems.append(f"{plot['id']}: no toolbar drawn")
        problems += [f"{plot['id']}: the toolbar covers its {part}" for part in ("title", "legend") if plot[part]]
        if axis_titles:
            problems += [f"{plot['id']}: an empty axis title" for text in plot["axes"] if not text.strip()]
    return problems
