// Admin view: progress per rater and item, results, new invites (behind HTTP basic auth).
(function () {
  "use strict";

  function get(path) {
    return fetch(path, { cache: "no-store" }).then(function (r) {
      if (!r.ok) throw new Error(path + ": " + r.status);
      return r.json();
    });
  }

  function cell(row, text) {
    var td = document.createElement("td");
    td.textContent = text === null || text === undefined ? "–" : String(text);
    row.appendChild(td);
  }

  function pct(x) { return x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%"; }

  function fill(tableId, rows, columns) {
    var body = document.querySelector("#" + tableId + " tbody");
    body.textContent = "";
    rows.forEach(function (r) {
      var tr = document.createElement("tr");
      columns.forEach(function (c) { cell(tr, typeof c === "function" ? c(r) : r[c]); });
      body.appendChild(tr);
    });
  }

  function loadProgress() {
    return get("/admin/api/progress").then(function (data) {
      document.getElementById("study-name").textContent = data.study;
      fill("raters", data.raters, ["label", function (r) { return location.origin + "/r/" + r.token; },
        function (r) { return r.started ? "yes" : "no"; }, function (r) { return r.done + "/" + r.total; },
        "practice_done", "checks_answered", function (r) { return pct(r.check_accuracy); }]);
      fill("items", data.items, ["id", "kind", "prompt", "seed", "method_a", "method_b",
        "assigned", "votes", "target"]);
    });
  }

  function loadResults() {
    return get("/admin/api/results").then(function (data) {
      var box = document.getElementById("results");
      box.textContent = "";
      var p = document.createElement("p");
      p.textContent = data.n_votes.main + " votes on main items, " + data.n_votes.main_after_exclusion +
        " after exclusion. Excluded raters: " + (data.excluded_raters.join(", ") || "none") + ".";
      box.appendChild(p);
      var table = document.createElement("table");
      var head = document.createElement("tr");
      ["pair", "question", "win", "tie", "lose", "decisive win rate", "sign test p", "TOST p",
        "equivalent", "α (ordinal)"].forEach(function (h) {
        var th = document.createElement("th"); th.textContent = h; head.appendChild(th);
      });
      table.appendChild(head);
      Object.keys(data.pairs).forEach(function (pair) {
        var qs = data.pairs[pair].questions;
        Object.keys(qs).forEach(function (q) {
          var s = qs[q], tr = document.createElement("tr");
          [pair, q, s.counts.win, s.counts.tie, s.counts.lose, pct(s.decisive.win_rate),
            s.decisive.sign_test_p === null ? null : s.decisive.sign_test_p.toFixed(4),
            s.equivalence.p === null ? null : s.equivalence.p.toFixed(4),
            s.equivalence.equivalent ? "yes" : "no",
            s.krippendorff_alpha_ordinal === null ? null : s.krippendorff_alpha_ordinal.toFixed(3)
          ].forEach(function (v) { cell(tr, v); });
          table.appendChild(tr);
        });
      });
      box.appendChild(table);
    });
  }

  document.getElementById("invite-form").addEventListener("submit", function (event) {
    event.preventDefault();
    var count = parseInt(document.getElementById("invite-count").value, 10) || 1;
    fetch("/admin/api/invites", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ count: count })
    }).then(function (r) { return r.json(); }).then(function (data) {
      document.getElementById("new-invites").textContent = data.invites.map(function (i) {
        return i.label + "  " + location.origin + i.link;
      }).join("\n");
      loadProgress();
    });
  });

  loadProgress().then(loadResults).catch(function (e) {
    document.getElementById("results").textContent = e.message;
  });
})();
