// Rater page: instructions, then one pair at a time until the queue is done.
// The page knows clips only by their opaque URLs and answers only "left", "right" or "tie";
// the server alone knows what they mean.
(function () {
  "use strict";

  var token = decodeURIComponent(location.pathname.split("/").filter(Boolean)[1] || "");
  var base = "/api/r/" + encodeURIComponent(token) + "/";
  var left = document.getElementById("video-left");
  var right = document.getElementById("video-right");
  var form = document.getElementById("vote");
  var submit = document.getElementById("submit");
  var statusLine = document.getElementById("status");
  var questions = [];
  var current = null;
  var generation = 0; // ignores media events of a previous pair

  function show(id) {
    ["instructions", "task", "finished", "full", "problem"].forEach(function (s) {
      document.getElementById(s).hidden = s !== id;
    });
  }

  function request(method, path, body) {
    var options = { method: method, headers: { "Accept": "application/json" }, cache: "no-store" };
    if (body !== undefined) {
      options.headers["Content-Type"] = "application/json";
      options.body = JSON.stringify(body);
    }
    return fetch(base + path, options).then(function (response) {
      return response.json().catch(function () { return {}; }).then(function (data) {
        if (!response.ok) {
          var error = new Error(data.error || ("request failed (" + response.status + ")"));
          error.status = response.status;
          throw error;
        }
        return data;
      });
    });
  }

  function fail(error) {
    document.getElementById("problem-text").textContent = error.message;
    show("problem");
  }

  function route(stage) {
    if (stage === "instructions") show("instructions");
    else if (stage === "practice" || stage === "rating") loadPair();
    else if (stage === "done") show("finished");
    else if (stage === "full") show("full");
    else fail(new Error("unexpected state"));
  }

  function buildQuestions() {
    var box = document.getElementById("questions");
    box.textContent = "";
    questions.forEach(function (q) {
      var fieldset = document.createElement("fieldset");
      fieldset.dataset.question = q.key;
      var legend = document.createElement("legend");
      legend.textContent = q.text;
      fieldset.appendChild(legend);
      [["left", "A"], ["tie", "About the same"], ["right", "B"]].forEach(function (choice) {
        var label = document.createElement("label");
        var input = document.createElement("input");
        input.type = "radio";
        input.name = q.key;
        input.value = choice[0];
        input.required = true;
        label.appendChild(input);
        label.appendChild(document.createTextNode(" " + choice[1]));
        fieldset.appendChild(label);
      });
      box.appendChild(fieldset);
    });
  }

  function setLocked(locked) {
    form.querySelectorAll("input").forEach(function (input) { input.disabled = locked; });
    form.querySelectorAll("fieldset").forEach(function (f) { f.disabled = locked; });
    document.body.dataset.locked = locked ? "yes" : "no";
    updateSubmit();
  }

  function answers() {
    var out = {};
    questions.forEach(function (q) {
      var checked = form.querySelector('input[name="' + q.key + '"]:checked');
      if (checked) out[q.key] = checked.value;
    });
    return out;
  }

  function updateSubmit() {
    var locked = document.body.dataset.locked !== "no";
    submit.disabled = locked || Object.keys(answers()).length !== questions.length;
  }

  function whenReady(video) {
    return new Promise(function (resolve) {
      if (video.readyState >= 4) resolve();
      else video.addEventListener("canplaythrough", resolve, { once: true });
    });
  }

  function playPair(leftUrl, rightUrl) {
    var mine = ++generation;
    var ended = { left: false, right: false };
    var played = { left: false, right: false };
    left.pause(); right.pause();
    left.src = leftUrl; right.src = rightUrl;
    left.load(); right.load();
    statusLine.textContent = "Loading the videos…";

    function restartBoth() {
      left.currentTime = 0; right.currentTime = 0;
      return Promise.all([left.play(), right.play()]).catch(function () {
        statusLine.textContent = "Click a video to start playback.";
      });
    }

    function onEnded(side) {
      return function () {
        if (mine !== generation) return;
        ended[side] = true;
        played[side] = true;
        if (played.left && played.right && document.body.dataset.locked !== "no") {
          setLocked(false);
          statusLine.textContent = "Both videos have played. Please answer (they keep looping).";
        }
        if (ended.left && ended.right) { // loop both from the start together: they stay in sync
          ended = { left: false, right: false };
          restartBoth();
        }
      };
    }
    left.onended = onEnded("left");
    right.onended = onEnded("right");
    left.ontimeupdate = function () {
      if (mine !== generation || right.paused || right.ended || left.paused) return;
      if (Math.abs(left.currentTime - right.currentTime) > 0.15) right.currentTime = left.currentTime;
    };
    [left, right].forEach(function (v) {
      v.onclick = function () { if (v.paused) restartBoth(); };
    });
    Promise.all([whenReady(left), whenReady(right)]).then(function () {
      if (mine !== generation) return;
      statusLine.textContent = "Playing… the answers unlock after both videos have played once.";
      restartBoth();
    });
  }

  function loadPair() {
    request("GET", "current").then(function (data) {
      if (data.done) { show("finished"); return; }
      current = data;
      var p = data.progress;
      var banner = document.getElementById("banner");
      var bar = document.getElementById("progress");
      if (data.practice) {
        banner.textContent = "Practice " + (p.practice_done + 1) + " of " + p.practice_total + " (not counted)";
        banner.className = "practice";
        bar.max = Math.max(1, p.practice_total); bar.value = p.practice_done;
      } else {
        banner.textContent = "Pair " + (p.done + 1) + " of " + p.total;
        banner.className = "";
        bar.max = Math.max(1, p.total); bar.value = p.done;
      }
      document.getElementById("prompt").textContent = data.prompt;
      form.reset();
      setLocked(true);
      show("task");
      playPair(data.left, data.right);
    }).catch(fail);
  }

  form.addEventListener("change", updateSubmit);
  form.addEventListener("submit", function (event) {
    event.preventDefault();
    if (!current || submit.disabled) return;
    var a = answers();
    var body = { assignment: current.assignment, overall: a.overall, criteria: {} };
    questions.forEach(function (q) { if (q.key !== "overall") body.criteria[q.key] = a[q.key]; });
    submit.disabled = true;
    request("POST", "vote", body).then(loadPair).catch(function (error) {
      if (error.status === 409) loadPair(); else fail(error);
    });
  });

  document.getElementById("start").addEventListener("click", function () {
    request("POST", "start").then(function (data) { route(data.stage); }).catch(fail);
  });
  document.getElementById("retry").addEventListener("click", init);

  function init() {
    request("GET", "state").then(function (data) {
      questions = data.questions;
      buildQuestions();
      route(data.stage);
    }).catch(fail);
  }
  init();
})();
