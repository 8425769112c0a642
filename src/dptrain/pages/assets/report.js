// report.html (dptrain.pages.run_report): draw each figure embedded as JSON in #report-figures into the
// element of the same id, and let the loss axis switch between linear and log scale.
(function () {
  "use strict";
  const figures = JSON.parse(document.getElementById("report-figures").textContent);
  const config = { responsive: true, displaylogo: false };
  for (const [id, figure] of Object.entries(figures)) {
    Plotly.newPlot(id, figure.data, figure.layout, config);
  }
  const toggle = document.getElementById("loss-log");
  if (toggle && figures["fig-loss"]) {
    toggle.addEventListener("change", function () {
      Plotly.relayout("fig-loss", { "yaxis.type": toggle.checked ? "log" : "linear" });
    });
  }
})();
