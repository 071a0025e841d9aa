// Rater page: instructions, then one pair at a time until the queue is done.
// The page knows videos only by their opaque URLs and answers only "left", "right", "tie" or
// "both_bad"; the server alone knows what they mean. A pair is one side-by-side video (A left,
// B right); studies built before side-by-side serving send two videos, played in sync.
(function () {
  "use strict";

  var token = decodeURIComponent(location.pathname.split("/").filter(Boolean)[1] || "");
  var base = "/api/r/" + encodeURIComponent(token) + "/";
  var single = document.getElementById("video-pair");
  var left = document.getElementById("video-left");
  var right = document.getElementById("video-right");
  var form = document.getElementById("vote");
  var submit = document.getElementById("submit");
  var comment = document.getElementById("comment");
  var statusLine = document.getElementById("status");
  var loadProblem = document.getElementById("load-problem");
  var questions = [];
  var current = null;
  var loadTimeout = 30;
  var generation = 0; // ignores media events of a previous pair
  var playing = [];
  var CHOICES = [["left", "A"], ["tie", "About the same"], ["right", "B"]];
  var BOTH_BAD = ["both_bad", "Both are bad"];
  var KEYS = { a: "left", arrowleft: "left", b: "right", arrowright: "right", s: "tie",
               arrowdown: "tie", x: "both_bad" };

  function show(id) {
    ["instructions", "task", "finished", "released", "full", "problem"].forEach(function (s) {
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
          error.data = data;
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

  function showCompletion(data) {
    if (!data || !data.completion_code) return;
    document.querySelectorAll(".completion").forEach(function (p) {
      p.hidden = false;
      p.querySelector(".completion-code").textContent = data.completion_code;
      var link = p.querySelector(".completion-link");
      if (data.completion_url) { link.href = data.completion_url; link.hidden = false; }
    });
  }

  function route(stage, data) {
    showCompletion(data);
    if (stage === "instructions") show("instructions");
    else if (stage === "practice" || stage === "rating") loadPair();
    else if (stage === "done") show("finished");
    else if (stage === "released") show("released");
    else if (stage === "full") show("full");
    else fail(new Error("unexpected state"));
  }

  function practiceLine(n) {
    var line = document.getElementById("practice-line");
    line.hidden = n === 0;
    line.textContent = n === 1 ? "The first pair is practice and is not counted."
      : "The first " + n + " pairs are practice and are not counted.";
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
      var choices = q.key === "overall" ? CHOICES.concat([BOTH_BAD]) : CHOICES;
      choices.forEach(function (choice) {
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

  function nextQuestion() {
    var given = answers();
    for (var i = 0; i < questions.length; i++) if (!given[questions[i].key]) return questions[i].key;
    return null;
  }

  function updateSubmit() {
    var locked = document.body.dataset.locked !== "no";
    submit.disabled = locked || Object.keys(answers()).length !== questions.length;
    var next = locked ? null : nextQuestion();
    form.querySelectorAll("fieldset").forEach(function (f) {
      f.classList.toggle("current", f.dataset.question === next);
    });
  }

  function stopAll() {
    [single, left, right].forEach(function (v) {
      v.onended = v.onerror = v.ontimeupdate = v.onclick = null;
      v.pause();
    });
  }

  function whenReady(video) {
    return new Promise(function (resolve, reject) {
      if (video.readyState >= 4) { resolve(); return; }
      video.addEventListener("canplaythrough", resolve, { once: true });
      video.addEventListener("error", reject, { once: true });
    });
  }

  function loadFailed(mine, why) {
    if (mine !== generation) return;
    generation++; // ignore whatever the videos do from now on
    stopAll();
    statusLine.textContent = why;
    loadProblem.hidden = false;
  }

  function playPair(urls) {
    var mine = ++generation;
    stopAll();
    loadProblem.hidden = true;
    var twoMode = urls.length === 2;
    document.getElementById("pair").hidden = twoMode;
    document.getElementById("two").hidden = !twoMode;
    playing = twoMode ? [left, right] : [single];
    var ended = playing.map(function () { return false; });
    var played = playing.map(function () { return false; });
    playing.forEach(function (v, i) { v.src = urls[i]; v.load(); });
    statusLine.textContent = "Loading the videos…";
    var timer = setTimeout(function () {
      loadFailed(mine, "The videos did not load within " + loadTimeout + " s.");
    }, loadTimeout * 1000);

    function restartAll() {
      playing.forEach(function (v) { v.currentTime = 0; });
      return Promise.all(playing.map(function (v) { return v.play(); })).catch(function () {
        statusLine.textContent = "Click the video to start playback.";
      });
    }

    playing.forEach(function (v, i) {
      v.onerror = function () { clearTimeout(timer); loadFailed(mine, "The videos could not be played."); };
      v.onended = function () {
        if (mine !== generation) return;
        ended[i] = true;
        played[i] = true;
        if (played.every(Boolean) && document.body.dataset.locked !== "no") {
          setLocked(false);
          statusLine.textContent = "Played through. Please answer (the pair keeps looping).";
        }
        if (ended.every(Boolean)) { // loop together from the start: they stay in sync
          ended = playing.map(function () { return false; });
          restartAll();
        }
      };
      v.onclick = function () { if (v.paused) restartAll(); };
    });
    if (twoMode) {
      left.ontimeupdate = function () {
        if (mine !== generation || right.paused || right.ended || left.paused) return;
        if (Math.abs(left.currentTime - right.currentTime) > 0.15) right.currentTime = left.currentTime;
      };
    }
    Promise.all(playing.map(whenReady)).then(function () {
      clearTimeout(timer);
      if (mine !== generation) return;
      statusLine.textContent = "Playing… the answers unlock after one play-through.";
      restartAll();
    }, function () {
      clearTimeout(timer);
      loadFailed(mine, "The videos could not be played.");
    });
  }

  function urlsOf(data) { return data.video ? [data.video] : [data.left, data.right]; }

  function loadPair() {
    request("GET", "current").then(function (data) {
      if (data.done) {
        stopAll(); showCompletion(data);
        show(data.stage === "released" ? "released" : "finished"); return;
      }
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
      document.getElementById("comment-box").open = false;
      setLocked(true);
      show("task");
      playPair(urlsOf(data));
    }).catch(fail);
  }

  function reportPair(reason) {
    if (!current) return;
    var note = comment.value.trim();
    var body = { assignment: current.assignment, reason: reason };
    if (note) body.comment = note;
    request("POST", "report", body).then(loadPair).catch(function (error) {
      if (error.status === 409) loadPair(); else fail(error);
    });
  }

  form.addEventListener("change", updateSubmit);
  form.addEventListener("submit", function (event) {
    event.preventDefault();
    if (!current || submit.disabled) return;
    var a = answers();
    var body = { assignment: current.assignment, overall: a.overall, criteria: {} };
    questions.forEach(function (q) { if (q.key !== "overall") body.criteria[q.key] = a[q.key]; });
    if (comment.value.trim()) body.comment = comment.value.trim();
    submit.disabled = true;
    request("POST", "vote", body).then(loadPair).catch(function (error) {
      if (error.status === 425) { // the server has not seen a full play-through yet
        statusLine.textContent = "Please watch the pair through once more before answering.";
        setTimeout(updateSubmit, 1000 * Math.min(10, (error.data && error.data.wait_seconds) || 1));
      } else if (error.status === 409) loadPair();
      else fail(error);
    });
  });

  document.addEventListener("keydown", function (event) {
    if (document.getElementById("task").hidden || document.body.dataset.locked !== "no") return;
    if (event.target === comment || event.ctrlKey || event.metaKey || event.altKey) return;
    var key = event.key.toLowerCase();
    if (key === "enter") {
      if (!submit.disabled) { event.preventDefault(); form.requestSubmit(); }
      return;
    }
    if (key === "backspace") {
      var given = questions.filter(function (q) { return answers()[q.key]; });
      if (given.length) {
        form.querySelector('input[name="' + given[given.length - 1].key + '"]:checked').checked = false;
        updateSubmit();
      }
      event.preventDefault();
      return;
    }
    var value = KEYS[key];
    var next = nextQuestion();
    if (!value || !next) return;
    var input = form.querySelector('input[name="' + next + '"][value="' + value + '"]');
    if (!input) return; // "both are bad" only answers the overall question
    input.checked = true;
    event.preventDefault();
    updateSubmit();
  });

  document.getElementById("start").addEventListener("click", function () {
    request("POST", "start").then(function (data) { route(data.stage, data); }).catch(fail);
  });
  document.getElementById("retry").addEventListener("click", init);
  document.getElementById("reload-pair").addEventListener("click", function () {
    if (current) playPair(urlsOf(current));
  });
  document.getElementById("report-broken").addEventListener("click", function () {
    reportPair("not_loading");
  });
  document.getElementById("report-other").addEventListener("click", function () {
    if (!comment.value.trim()) {
      document.getElementById("comment-box").open = true;
      comment.focus();
      statusLine.textContent = "Describe the problem in the comment box, then click the report button again.";
      return;
    }
    reportPair("other");
  });

  function init() {
    request("GET", "state").then(function (data) {
      questions = data.questions;
      loadTimeout = data.load_timeout || loadTimeout;
      practiceLine(data.practice_items || 0);
      buildQuestions();
      route(data.stage, data);
    }).catch(fail);
  }
  init();
})();
