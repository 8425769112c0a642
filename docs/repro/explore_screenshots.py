"""The docs' pictures of ``dptrain explore``: the full page, opened in headless Chromium, one picture per panel.

    python docs/repro/explore_screenshots.py [--out docs/images]

Builds the page as ``dptrain explore`` does (every preset, DP 1-1024), opens it with the
system's Chromium (Debian's ``chromium`` package) through Playwright, sets each panel to
the state its picture shows and saves ``explore_memory.png``, ``explore_scaling.png``
and ``explore_allreduce.png``. Fails if the page logged an error or asked for the network.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from _browser import open_page  # noqa: E402  (the tests' browser harness: offline, console collected)
from dptrain.pages.explore import write_explore  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/images"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        page_file = write_explore(Path(tmp) / "explore.html", progress=print)
        with open_page(page_file, width=1400) as (page, console):
            page.wait_for_selector("body[data-ready='1']", timeout=60_000)
            # memory: the 7B class at DP 8, ZeRO-3, fp32, the chapter's example
            page.select_option("#mem-strategy", "zero3")
            page.select_option("#mem-precision", "fp32")
            page.locator("#memory").screenshot(path=str(args.out / "explore_memory.png"))
            # scaling: GPT-2 small over 100 GbE between hosts of 8, DP 64
            page.select_option("#sc-net", "eth-100")
            page.fill("#sc-dp", "6")
            page.dispatch_event("#sc-dp", "input")
            page.locator("#scaling").screenshot(path=str(args.out / "explore_scaling.png"))
            # all-reduce: 64 MiB on 16 ranks, the ring half way through
            page.fill("#ar-n", "3")
            page.dispatch_event("#ar-n", "input")
            for _ in range(3):
                page.click("#ring-step")
            page.locator("#allreduce").screenshot(path=str(args.out / "explore_allreduce.png"))
            if console.problems():
                raise SystemExit(f"the page reported problems: {console.problems()}")
    print(f"wrote {args.out}/explore_{{memory,scaling,allreduce}}.png")


if __name__ == "__main__":
    main()
