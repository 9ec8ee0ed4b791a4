/*
 * ringwatch timeline viewer: the page's entry module (index.html loads it as
 * `<script type="module">`). It makes the Viewer and the tuning panel, wires
 * the toolbar, the file picker and drag and drop, installs the test hook
 * `window.ringwatchViewer`, and starts: `?trace=URL`, else the agent's API
 * (live mode), else it waits for a file.
 *
 * What it is for: draw a Chrome-trace-format timeline (job activities, thread
 * scheduling states, counters) on one <canvas>, from the agent's API, a
 * `?trace=URL`, or a local file, and stay responsive with a million events.
 *
 * What it must never do: fetch anything but the agent's `/api/*`, the
 * `?trace=` URL and the files the user opens; create a DOM node per event;
 * parse a large trace on the main thread when a Worker can be had.
 *
 * The modules, under js/: parse (the parser) and worker (its Worker),
 * source (loading and live mode), timeline (the Viewer), layout, render,
 * overview, interact, search, format, tuning.
 */
import { LABEL_W } from './js/layout.js';
import { TuningPanel } from './js/tuning.js';
import { Viewer } from './js/timeline.js';

// ---------------------------------------------------------------------------
// Start-up: ?trace=URL, else the agent's API, else wait for a file.
// ---------------------------------------------------------------------------
async function main() {
  const viewer = new Viewer(document.body);
  const hook = {
    get state() { return viewer.state; },
    get error() { return viewer.error; },
    get rendered() { return viewer.rendered; },
    nextFrame: () => viewer.nextFrame(),
    whenReady: () => viewer.whenReady(),
    visibleRange: () => ({ start: viewer.view.start, end: viewer.view.end, origin: viewer.origin }),
    setRange: (start, end) => { viewer.pauseLive(); viewer.setRange(start, end); return viewer.nextFrame(); },
    tracks: () => viewer.trackInfo(),
    expandAll: (open) => { viewer.expandAll(open); return viewer.nextFrame(); },
    jobVerdict: (name) => viewer.jobVerdict(name),
    sliceAt: (x, y) => viewer.sliceAt(x, y),
    findSlices: (name, pid, tid) => viewer.findSlices(name, pid, tid),
    timeToX: (t) => viewer.timeToX(t),
    xToTime: (x) => viewer.xToTime(x),
    canvasRect: () => { const r = viewer.canvas.getBoundingClientRect(); return { x: r.x, y: r.y, width: r.width, height: r.height }; },
    setFilter: (v) => { viewer.setFilter(v); return viewer.nextFrame(); },
    stats: () => Object.assign({}, viewer.stats),
    live: () => ({ available: viewer.live.available, enabled: viewer.live.enabled, paused: viewer.live.paused, polls: viewer.live.polls, inflight: viewer.live.inflight, lastUrl: viewer.live.lastUrl, details: viewer.live.details || 0 }),
    loadUrl: (url) => viewer.loadUrl(url),
    axisLabels: () => viewer.ticks().filter((t) => t.x >= LABEL_W).map((t) => t.label),
    pixel: (x, y) => {
      const d = viewer.dpr;
      viewer.render();
      const p = viewer.ctx.getImageData(Math.round(x * d), Math.round(y * d), 1, 1).data;
      return '#' + [p[0], p[1], p[2]].map((v) => v.toString(16).padStart(2, '0')).join('');
    },
    renderNow: () => { const t = performance.now(); viewer.render(); return performance.now() - t; },
    usesWorker: () => !!viewer.source.worker,
  };
  window.ringwatchViewer = hook;
  const tuning = new TuningPanel(document.getElementById('tuning'));
  hook.tuning = () => ({ open: tuning.open, job: tuning.job, state: tuning.session && tuning.session.state, samples: tuning.session && Array.isArray(tuning.session.samples) ? tuning.session.samples.length : 0, polls: tuning.polls });

  const fileInput = document.getElementById('file');
  document.getElementById('open').addEventListener('click', () => fileInput.click());
  fileInput.addEventListener('change', () => { if (fileInput.files && fileInput.files[0]) viewer.loadFile(fileInput.files[0]); fileInput.value = ''; });
  document.getElementById('fit').addEventListener('click', () => { viewer.pauseLive(); viewer.fit(); });
  viewer.selector.addEventListener('change', () => viewer.setFilter(viewer.selector.value));
  viewer.liveBtn.addEventListener('click', () => { if (viewer.live.enabled && !viewer.live.paused) viewer.pauseLive(); else viewer.resumeLive(); });
  const drop = document.getElementById('drop');
  let depth = 0;
  window.addEventListener('dragenter', (e) => { e.preventDefault(); depth++; drop.hidden = false; });
  window.addEventListener('dragleave', () => { if (--depth <= 0) { depth = 0; drop.hidden = true; } });
  window.addEventListener('dragover', (e) => e.preventDefault());
  window.addEventListener('drop', (e) => {
    e.preventDefault();
    depth = 0;
    drop.hidden = true;
    const f = e.dataTransfer && e.dataTransfer.files && e.dataTransfer.files[0];
    if (f) viewer.loadFile(f);
  });

  const params = new URLSearchParams(location.search);
  const trace = params.get('trace');
  if (trace) {
    await viewer.loadUrl(trace);
  } else if (location.protocol.startsWith('http') && await viewer.detectAgent()) {
    const w = Number(params.get('window'));
    if (w > 0) viewer.live.windowUs = w * 1e6;
    viewer.refreshSelector();
    viewer.startLive();
    tuning.enable();
  } else {
    viewer.startupDone = true;
    viewer.invalidate();
    viewer.wakeReady();
  }
}

// A module script runs once the document is parsed: the elements are there.
main();
