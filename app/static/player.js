// Synced looping playback of the method clips (the `js_on_load` of the player's gr.HTML).
// `element` is the component's root; `watch` re-runs setup after each new result.
// The clips start together once every one can play, restart together at the end of each loop,
// and a clip that drifts from the first by more than 0.15 s is moved back in line.
// State for tests and styling: data-state (loading | playing | paused | error), data-loops.
(function () {
  function setup() {
    var root = element.querySelector('.aq-player');
    if (!root || root.dataset.ready) return;
    root.dataset.ready = '1';
    var vids = Array.prototype.slice.call(root.querySelectorAll('video'));
    if (!vids.length) return;
    var paused = false, started = false, loops = 0, pending = null;
    var toggle = root.querySelector('.aq-toggle');
    var restartBtn = root.querySelector('.aq-restart');

    function setState(s) {
      root.dataset.state = s;
      if (toggle) toggle.textContent = s === 'paused' ? 'Play' : 'Pause';
    }
    function playAll() {
      vids.forEach(function (v) {
        var p = v.play();
        if (p && p.catch) p.catch(function () {});
      });
    }
    function restart(countLoop) {
      if (pending) { clearTimeout(pending); pending = null; }
      vids.forEach(function (v) { v.pause(); v.currentTime = 0; });
      if (countLoop) { loops += 1; root.dataset.loops = String(loops); }
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
      v.addEventListener('canplay', maybeStart);
      v.addEventListener('canplaythrough', maybeStart);
      v.addEventListener('loadeddata', maybeStart);
      v.addEventListener('ended', function () {
        if (vids.every(function (x) { return x.ended; })) { restart(true); return; }
        if (!pending) pending = setTimeout(function () { pending = null; restart(true); }, 250);
      });
      v.addEventListener('error', function () {
        setState('error');
        var msg = root.querySelector('.aq-player-msg');
        if (msg) msg.textContent = 'A clip could not be loaded: the server keeps only the most ' +
          'recent results. Generate again to see it.';
      });
      v.addEventListener('click', function () { if (toggle) toggle.click(); });
    });
    vids[0].addEventListener('timeupdate', function () {
      if (paused || pending) return;
      var t = vids[0].currentTime;
      vids.slice(1).forEach(function (v) {
        if (!v.ended && Math.abs(v.currentTime - t) > 0.15) v.currentTime = t;
      });
    });
    if (toggle) toggle.addEventListener('click', function () {
      paused = !paused;
      if (paused) { vids.forEach(function (v) { v.pause(); }); setState('paused'); }
      else { playAll(); setState('playing'); }
    });
    if (restartBtn) restartBtn.addEventListener('click', function () { restart(false); });
    setState('loading');
    maybeStart();
  }
  setup();
  if (typeof watch === 'function') watch('value', setup);
})();
