"""dptrain's self-contained HTML pages: ``dptrain explore`` (planner and cost model, live) and a run's ``report.html``.

Each page is one file that opens offline in any browser: its scripts, styles, data and
plotly.js are inlined (:mod:`dptrain.pages.html`).
"""
