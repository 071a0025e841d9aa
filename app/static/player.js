// Synced playback of the method clips (the `js_on_load` of the player's gr.HTML).
// `element` is the component's root; `watch` re-runs setup after each new result.
// The clips start together once every one can play, restart together at the end of each loop,
// and a clip that drifts from the first by more than 0.15 s is moved back in line. Frame stepping
// and the scrub bar pause every clip on the same frame (the middle of its display interval). The
// comparison view draws one clip over another with a split slider and a zoom; its two videos follow
// the same clock.
// State for tests and styling: data-state (loading | playing | paused | error), data-loops,
// data-frame (the frame shown after stepping or scrubbing, 0-based), data-setup (the data-render
// the last setup ran for: a rendering is live once the two agree).
// Gradio updates the component by patching the old DOM in place (same elements, new attributes), so
// a new result, Blind on/off or Reveal keep the old elements and their listeners: every setup first
// aborts the listeners and timers of the previous one (one AbortController per setup), runs once
// per rendering (data-render changes with each), and sets the comparison menus and videos from the
// HTML, never from what a patched <select> still holds.
(function () {
  function setup() {
    var root = element.querySelector('.aq-player');
    if (!root) { if (element.__aqAbort) { element.__aqAbort.abort(); element.__aqAbort = null; } return; }
    var key = root.dataset.render || '';
    if (element.__aqKey === key && element.__aqAbort) return;
    if (element.__aqAbort) element.__aqAbort.abort();
    var ctl = new AbortController(), sig = {signal: ctl.signal};
    element.__aqAbort = ctl;
    element.__aqKey = key;
    root.dataset.ready = '1';
    root.dataset.setup = key;
    delete root.dataset.frame;
    delete root.dataset.loops;
    var mains = Array.prototype.slice.call(root.querySelectorAll('video.aq-main'));
    if (!mains.length) return;
    var cmpA = root.querySelector('.aq-cmp-a'), cmpB = root.querySelector('.aq-cmp-b');
    var vids = mains.concat([cmpA, cmpB].filter(Boolean));
    var fps = Number(root.dataset.fps) || 16, frames = Number(root.dataset.frames) || 1;
    var paused = false, started = false, loops = 0, pending = null;
    ctl.signal.addEventListener('abort', function () { if (pending) clearTimeout(pending); });
    var toggle = root.querySelector('.aq-toggle');
    var restartBtn = root.querySelector('.aq-restart');
    var scrub = root.querySelector('.aq-scrub'), frameLabel = root.querySelector('.aq-frame');
    var master = mains[0];

    function setState(s) {
      root.dataset.state = s;
      if (toggle) toggle.textContent = s === 'paused' ? 'Play' : 'Pause';
    }
    function frameOf(t) { return Math.max(0, Math.min(frames - 1, Math.floor(t * fps + 1e-6))); }
    function showFrame(n) {
      if (scrub) scrub.value = String(n);
      if (frameLabel) frameLabel.textContent = 'frame ' + (n + 1) + '/' + frames;
    }
    function playAll() {
      vids.forEach(function (v) {
        var p = v.play();
        if (p && p.catch) p.catch(function () {});
      });
    }
    function pauseAll() {
      paused = true;
      if (pending) { clearTimeout(pending); pending = null; }
      vids.forEach(function (v) { v.pause(); });
      setState('paused');
    }
    function setFrame(n) {
      n = Math.max(0, Math.min(frames - 1, n));
      pauseAll();
      var t = (n + 0.5) / fps;
      vids.forEach(function (v) { v.currentTime = t; });
      root.dataset.frame = String(n);
      showFrame(n);
    }
    function restart(countLoop) {
      if (pending) { clearTimeout(pending); pending = null; }
      vids.forEach(function (v) { v.pause(); v.currentTime = 0; });
      if (countLoop) { loops += 1; root.dataset.loops = String(loops); }
      showFrame(0);
      if (!paused) { playAll(); setState('playing'); }
    }
    function maybeStart() {
      if (started) return;
      if (!vids.every(function (v) { return v.readyState >= 3; })) return;
      started = true;
      restart(false);
    }
    vids.forEach(function (v) {
      v.muted = true;
      v.addEventListener('canplay', maybeStart, sig);
      v.addEventListener('canplaythrough', maybeStart, sig);
      v.addEventListener('loadeddata', maybeStart, sig);
      v.addEventListener('ended', function () {
        if (paused) return;
        if (vids.every(function (x) { return x.ended; })) { restart(true); return; }
        if (!pending) pending = setTimeout(function () { pending = null; restart(true); }, 250);
      }, sig);
      v.addEventListener('error', function () {
        setState('error');
        var msg = root.querySelector('.aq-player-msg');
        if (msg) msg.textContent = 'A clip could not be loaded: the server keeps only the most ' +
          'recent results. Generate again to see it.';
      }, sig);
    });
    mains.forEach(function (v) {
      v.addEventListener('click', function () { if (toggle) toggle.click(); }, sig);
    });
    master.addEventListener('timeupdate', function () {
      if (paused || pending) return;
      var t = master.currentTime;
      showFrame(frameOf(t));
      vids.slice(1).forEach(function (v) {
        if (!v.ended && Math.abs(v.currentTime - t) > 0.15) v.currentTime = t;
      });
    }, sig);
    if (toggle) toggle.addEventListener('click', function () {
      if (paused) { paused = false; delete root.dataset.frame; playAll(); setState('playing'); }
      else pauseAll();
    }, sig);
    if (restartBtn) restartBtn.addEventListener('click', function () { restart(false); }, sig);
    var prev = root.querySelector('.aq-prev'), next = root.querySelector('.aq-next');
    function current() {
      return root.dataset.frame !== undefined ? Number(root.dataset.frame) : frameOf(master.currentTime);
    }
    if (prev) prev.addEventListener('click', function () { setFrame(current() - 1); }, sig);
    if (next) next.addEventListener('click', function () { setFrame(current() + 1); }, sig);
    if (scrub) scrub.addEventListener('input', function () { setFrame(Number(scrub.value)); }, sig);

    // The comparison view.
    var stage = root.querySelector('.aq-stage');
    if (stage && cmpA && cmpB) {
      var srcs = mains.map(function (v) { return v.getAttribute('src'); });
      var left = root.querySelector('.aq-cmp-left'), right = root.querySelector('.aq-cmp-right');
      var split = root.querySelector('.aq-split'), zoom = root.querySelector('.aq-zoom');
      var line = root.querySelector('.aq-split-line');
      // the menus say what the HTML draws: left = clip 0, right = data-right
      if (left) left.value = '0';
      if (right) right.value = stage.dataset.right || '0';
      if (srcs[0] && cmpA.getAttribute('src') !== srcs[0]) cmpA.setAttribute('src', srcs[0]);
      var r0 = srcs[Number(stage.dataset.right || 0)];
      if (r0 && cmpB.getAttribute('src') !== r0) cmpB.setAttribute('src', r0);
      function choose(video, index) {
        var src = srcs[Number(index)];
        if (!src || video.getAttribute('src') === src) return;
        video.setAttribute('src', src);
        video.addEventListener('loadeddata', function once() {
          video.currentTime = master.currentTime;
          if (!paused) { var p = video.play(); if (p && p.catch) p.catch(function () {}); }
        }, {signal: ctl.signal, once: true});
      }
      function applySplit() {
        var x = Number(split ? split.value : 50);
        cmpA.style.clipPath = 'inset(0 ' + (100 - x) + '% 0 0)';
        if (line) line.style.left = x + '%';
        stage.dataset.split = String(x);
      }
      function applyZoom() {
        var z = Number(zoom ? zoom.value : 1);
        [cmpA, cmpB].forEach(function (v) { v.style.transform = 'scale(' + z + ')'; });
        stage.dataset.zoom = String(z);
      }
      if (left) left.addEventListener('change', function () { choose(cmpA, left.value); }, sig);
      if (right) right.addEventListener('change', function () { choose(cmpB, right.value); }, sig);
      if (split) split.addEventListener('input', applySplit, sig);
      if (zoom) zoom.addEventListener('change', applyZoom, sig);
      stage.addEventListener('mousemove', function (e) {
        var r = stage.getBoundingClientRect();
        var origin = ((e.clientX - r.left) / r.width * 100) + '% ' + ((e.clientY - r.top) / r.height * 100) + '%';
        [cmpA, cmpB].forEach(function (v) { v.style.transformOrigin = origin; });
      }, sig);
      applySplit();
      applyZoom();
    }
    setState('loading');
    showFrame(0);
    maybeStart();
  }
  setup();
  if (typeof watch === 'function') watch('value', setup);
})();
