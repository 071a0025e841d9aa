// Admin view: progress per rater and item, problem reports, results, exports, new invites, and
// the organiser's actions (release / revoke / exclude), all behind HTTP basic auth.
(function () {
  "use strict";

  function readJson(r) {
    return r.json().catch(function () { return {}; }).then(function (data) {
      if (!r.ok) throw new Error(data.error || (r.url + ": " + r.status));
      return data;
    });
  }

  function get(path) { return fetch(path, { cache: "no-store" }).then(readJson); }

  // Every state-changing request carries the page's CSRF token (a page on another origin
  // cannot read it, and a plain form cannot set a header).
  var csrf = document.querySelector('meta[name="csrf-token"]').content;

  function post(path, body) {
    var options = { method: "POST", headers: { "X-CSRF-Token": csrf } };
    if (body !== undefined) {
      options.headers["Content-Type"] = "application/json";
      options.body = JSON.stringify(body);
    }
    return fetch(path, options).then(readJson);
  }

  function cell(row, content) {
    var td = document.createElement("td");
    if (content instanceof Node) td.appendChild(content);
    else td.textContent = content === null || content === undefined ? "–" : String(content);
    row.appendChild(td);
  }

  function pct(x) { return x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%"; }
  function pp(x) { return x === null || x === undefined ? "no data" : (x >= 0 ? "+" : "") + (100 * x).toFixed(1) + " pp"; }
  function num(x, d) { return x === null || x === undefined ? "no data" : x.toFixed(d); }

  function fill(tableId, rows, columns) {
    var body = document.querySelector("#" + tableId + " tbody");
    body.textContent = "";
    rows.forEach(function (r) {
      var tr = document.createElement("tr");
      columns.forEach(function (c) { cell(tr, typeof c === "function" ? c(r) : r[c]); });
      body.appendChild(tr);
    });
  }

  function actions(list) {
    var span = document.createElement("span");
    list.forEach(function (a) {
      var b = document.createElement("button");
      b.type = "button";
      b.textContent = a[0];
      b.dataset.action = a[0];
      b.addEventListener("click", function () {
        if (a[2] && !confirm(a[2])) return;
        document.getElementById("action-error").textContent = "";
        a[1]().then(refresh).catch(function (e) {
          document.getElementById("action-error").textContent = e.message;
        });
      });
      span.appendChild(b);
    });
    return span;
  }

  function raterActions(r) {
    var base = "/admin/api/raters/" + encodeURIComponent(r.label) + "/";
    var list = [["release", function () { return post(base + "release"); },
                 "Give " + r.label + "'s open items back to the pool?"]];
    if (!r.revoked) {
      list.push(["revoke", function () { return post(base + "revoke"); },
                 "Withdraw " + r.label + "'s invite? The link stops working."]);
    }
    list.push(r.excluded
      ? ["include", function () { return post(base + "exclude", { excluded: false }); }]
      : ["exclude", function () {
          var why = prompt("Exclude " + r.label + "'s votes from the analysis. Reason:");
          return why === null ? Promise.resolve() : post(base + "exclude", { excluded: true, reason: why });
        }]);
    return actions(list);
  }

  function itemActions(it) {
    var path = "/admin/api/items/" + it.id + "/exclude";
    return actions([it.excluded
      ? ["include", function () { return post(path, { excluded: false }); }]
      : ["exclude", function () {
          var why = prompt("Exclude item " + it.id + " (its votes and further assignments). Reason:");
          return why === null ? Promise.resolve() : post(path, { excluded: true, reason: why });
        }]]);
  }

  function status(r) {
    var s = [];
    if (r.revoked) s.push("revoked");
    if (r.expires && new Date(r.expires) < new Date()) s.push("expired");
    if (r.excluded) s.push("excluded" + (r.exclusion_reason ? ": " + r.exclusion_reason : ""));
    if (r.released) s.push(r.released + " released");
    return s.join("; ") || "active";
  }

  function loadProgress() {
    return get("/admin/api/progress").then(function (data) {
      document.getElementById("study-name").textContent = data.study;
      var count = document.getElementById("invite-count");
      count.max = data.invite_limit;
      count.title = "at most " + data.invite_limit + " at a time";
      fill("raters", data.raters, ["label", function (r) { return r.worker_id || "–"; },
        function (r) { return location.origin + "/r/" + r.token; },
        function (r) { return r.started ? "yes" : "no"; }, function (r) { return r.done + "/" + r.total; },
        "practice_done", "checks_answered", function (r) { return pct(r.check_accuracy); },
        function (r) { return r.median_view_seconds === null ? "–" : r.median_view_seconds.toFixed(1) + " s"; },
        function (r) { return r.fast ? "yes" : "no"; }, "last_seen", status, raterActions]);
      fill("reports", data.reports, ["time", "rater", "item", "reason", "comment"]);
      fill("items", data.items, ["id", "kind", "prompt", "seed", "method_a", "method_b",
        "assigned", "votes", "target",
        function (it) { return it.excluded ? "excluded" + (it.exclusion_reason ? ": " + it.exclusion_reason : "") : "active"; },
        itemActions]);
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
      var warnings = data.warnings.slice();
      var table = document.createElement("table");
      var head = document.createElement("tr");
      ["pair", "question", "win", "tie", "lose", "decisive win rate", "sign test p", "Δ",
        "decision interval", "verdict", "α (ordinal)"].forEach(function (h) {
        var th = document.createElement("th"); th.textContent = h; head.appendChild(th);
      });
      table.appendChild(head);
      Object.keys(data.pairs).forEach(function (pair) {
        var qs = data.pairs[pair].questions;
        Object.keys(qs).forEach(function (q) {
          var s = qs[q], mt = s.margin_test, tr = document.createElement("tr");
          [pair, q, s.counts.win, s.counts.tie, s.counts.lose, pct(s.decisive.win_rate),
            num(s.decisive.sign_test_p, 4), pp(s.net_preference.estimate),
            mt.ci_low === null ? "no data" : "[" + pp(mt.ci_low) + ", " + pp(mt.ci_high) + "]",
            mt.verdict, num(s.krippendorff_alpha_ordinal, 3)
          ].forEach(function (v) { cell(tr, v); });
          table.appendChild(tr);
          s.warnings.forEach(function (w) { warnings.push(pair + ", " + q + ": " + w); });
        });
      });
      box.appendChild(table);
      warnings.forEach(function (w) {
        var line = document.createElement("p");
        line.className = "error";
        line.textContent = "⚠ " + w;
        box.appendChild(line);
      });
    });
  }

  function refresh() {
    return loadProgress().then(loadResults).catch(function (e) {
      document.getElementById("results").textContent = e.message;
    });
  }

  document.getElementById("invite-form").addEventListener("submit", function (event) {
    event.preventDefault();
    var error = document.getElementById("invite-error");
    error.textContent = "";
    var count = parseInt(document.getElementById("invite-count").value, 10);
    post("/admin/api/invites", { count: count }).then(function (data) {
      document.getElementById("new-invites").textContent = data.invites.map(function (i) {
        return i.label + "  " + location.origin + i.link;
      }).join("\n");
      loadProgress();
    }).catch(function (e) { error.textContent = e.message; });  // the form keeps its value
  });

  refresh();
})();
