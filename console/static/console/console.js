// The console's own small script: local times, copy buttons, the tenant switcher, charts.
(function () {
  "use strict";

  // <time datetime="…UTC…" data-local>: show the viewer's local time, keep UTC on hover.
  function localTimes(root) {
    root.querySelectorAll("time[data-local]").forEach(function (el) {
      var at = new Date(el.getAttribute("datetime"));
      if (isNaN(at)) return;
      var dateOnly = el.hasAttribute("data-date");
      el.title = at.toISOString().replace(".000Z", "Z").replace("T", " ") + " UTC";
      el.textContent = dateOnly
        ? at.toLocaleDateString(undefined, { year: "numeric", month: "short", day: "numeric" })
        : at.toLocaleString(undefined, { year: "numeric", month: "short", day: "numeric", hour: "2-digit", minute: "2-digit" });
    });
  }

  function copyButtons(root) {
    root.querySelectorAll("button[data-copy]").forEach(function (btn) {
      if (btn.dataset.bound) return;
      btn.dataset.bound = "1";
      btn.addEventListener("click", function () {
        var target = document.getElementById(btn.getAttribute("data-copy"));
        if (!target) return;
        var text = target.textContent;
        var done = function () {
          var status = document.getElementById(btn.getAttribute("data-copy") + "-status");
          if (status) status.textContent = "Copied to the clipboard.";
        };
        if (navigator.clipboard && window.isSecureContext) {
          navigator.clipboard.writeText(text).then(done, function () { select(target); });
        } else { select(target); done(); }
      });
    });
  }

  function select(el) {
    var range = document.createRange();
    range.selectNodeContents(el);
    var sel = window.getSelection();
    sel.removeAllRanges();
    sel.addRange(range);
    try { document.execCommand("copy"); } catch (e) { /* the text stays selected */ }
  }

  function switcher() {
    var form = document.querySelector("form[data-switcher]");
    if (!form) return;
    form.querySelector("select").addEventListener("change", function (e) {
      window.location.assign(e.target.value);
    });
  }

  var fmt = new Intl.NumberFormat();
  var charts = {};

  function usageChart(root) {
    var data = root.querySelector("#usage-data");
    var canvas = root.querySelector("#usage-chart");
    if (!data || !canvas || !window.Chart) return;
    var d = JSON.parse(data.textContent);
    var labels = d.labels.map(function (t) {
      var at = new Date(t * 1000);
      return d.hourly
        ? at.toLocaleString(undefined, { month: "short", day: "numeric", hour: "2-digit" })
        : at.toLocaleDateString(undefined, { timeZone: "UTC", month: "short", day: "numeric" });
    });
    var css = getComputedStyle(document.documentElement);
    if (charts.usage) charts.usage.destroy();
    charts.usage = new window.Chart(canvas, {
      type: "bar",
      data: {
        labels: labels,
        datasets: [
          { label: "Prompt (uncached)", data: d.uncached, backgroundColor: css.getPropertyValue("--c-uncached").trim(), stack: "in" },
          { label: "Prompt (cached)", data: d.cached, backgroundColor: css.getPropertyValue("--c-cached").trim(), stack: "in" },
          { label: "Completion", data: d.completion, backgroundColor: css.getPropertyValue("--c-completion").trim(), stack: "out" }
        ]
      },
      options: {
        responsive: true, maintainAspectRatio: false, animation: false,
        interaction: { mode: "index", intersect: false },
        scales: { x: { stacked: true }, y: { stacked: true, ticks: { callback: function (v) { return fmt.format(v); } } } },
        plugins: { tooltip: { callbacks: { label: function (c) { return c.dataset.label + ": " + fmt.format(c.parsed.y); } } } }
      }
    });
  }

  function init(root) { localTimes(root); copyButtons(root); usageChart(root); }

  document.addEventListener("DOMContentLoaded", function () { switcher(); init(document); });
  document.addEventListener("htmx:afterSwap", function (e) { init(e.target); });
})();
