"""tests/_browser.py skips a page test without Chromium, but fails it where CI requires the browser."""

from __future__ import annotations

import pytest

from _browser import open_page


@pytest.fixture
def no_chromium(monkeypatch, tmp_path):
    monkeypatch.delenv("DPTRAIN_CHROMIUM", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no chromium on PATH
    page = tmp_path / "page.html"
    page.write_text("<html></html>")
    return page


def test_missing_chromium_skips_by_default(no_chromium, monkeypatch):
    monkeypatch.delenv("DPTRAIN_REQUIRE_BROWSER", raising=False)
    with pytest.raises(pytest.skip.Exception, match="apt-get install chromium"):
        with open_page(no_chromium):
            pass


def test_missing_chromium_fails_where_required(no_chromium, monkeypatch):
    monkeypatch.setenv("DPTRAIN_REQUIRE_BROWSER", "1")
    with pytest.raises(pytest.fail.Exception, match="DPTRAIN_REQUIRE_BROWSER=1"):
        with open_page(no_chromium):
            pass
