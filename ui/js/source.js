/*
 * Where the data comes from: a `?trace=` URL, a local file, or the agent's
 * API (live mode: polling `/api/timeline` every second and following the
 * present; a paused view asks for its own window at the screen's pixels).
 * Bytes go to the parser's Worker; what comes back is handed to the viewer's
 * setData (timeline.js).
 *
 * It must never fetch anything but the agent's `/api/*`, the `?trace=` URL
 * and the files the user opens, and never parse a large trace on the page's
 * thread when a Worker can be had.
 */
import { LABEL_W } from './layout.js';

/** The parser (parse.js), in a Worker when one can be had, on the page's thread otherwise. */
export class TraceSource {
  constructor() {
    this.pending = new Map();
    this.nextId = 1;
    this.inline = null;
    try {
      this.worker = new Worker(new URL('./worker.js', import.meta.url), { type: 'module' });
      this.worker.onmessage = (ev) => this.answer(ev.data);
      this.worker.onerror = (ev) => { this.failAll('worker error: ' + (ev.message || 'unknown')); };
    } catch (err) {
      this.worker = null;
    }
  }
  answer(m) {
    const p = this.pending.get(m.id);
    if (!p) return;
    this.pending.delete(m.id);
    if (m.ok) p.resolve(m.value); else p.reject(new Error(m.error));
  }
  failAll(msg) {
    for (const p of this.pending.values()) p.reject(new Error(msg));
    this.pending.clear();
  }
  call(msg, transfer) {
    if (!this.worker) {
      // The parser is loaded on the page's thread only when it must run there.
      if (!this.inline) this.inline = import('./parse.js');
      return new Promise((resolve) => setTimeout(resolve, 0)).then(() => this.inline).then((parser) => {
        if (msg.type === 'parse') return parser.parse(msg.input, msg.opts).result;
        if (msg.type === 'fetchParse') return parser.fetchParse(msg.url, msg.label, msg.opts).then((r) => r.result);
        return parser.args(msg.gen, msg.index);
      });
    }
    const id = this.nextId++;
    return new Promise((resolve, reject) => {
      this.pending.set(id, { resolve, reject });
      this.worker.postMessage(Object.assign({ id }, msg), transfer || []);
    });
  }
  /** Parse an ArrayBuffer (transferred to the worker) or a string. */
  parse(input, opts) {
    return this.call({ type: 'parse', input, opts }, input instanceof ArrayBuffer ? [input] : []);
  }
  /** Fetch a URL (made absolute here: the Worker would resolve it against its own module's URL) and parse it, off the page's thread. */
  fetchParse(url, opts) {
    return this.call({ type: 'fetchParse', url: new URL(url, location.href).href, label: url, opts });
  }
  args(gen, index) {
    return index < 0 ? Promise.resolve(null) : this.call({ type: 'args', gen, index });
  }
}

/** Viewer methods that load a trace and run live mode; mixed into Viewer (timeline.js). */
export const Loading = (Base) => class extends Base {
  async loadUrl(url) {
    this.beginLoad(url);
    try {
      if (new URL(url, location.href).protocol === 'file:') {
        throw new Error('browsers do not let a page read file: URLs (?trace=' + url + '); open the file with “Open trace file” or drop it here, or serve ui/ over HTTP');
      }
      const data = await this.source.fetchParse(url, { defaultGroup: 'other processes' });
      this.setTiming(data.timing);
      this.setData(data, true);
    } catch (err) { this.fail(err); }
  }
  async loadFile(file) {
    this.stopLive();
    this.beginLoad(file.name);
    try {
      const buf = await file.arrayBuffer();
      this.stats.fetchMs = 0;
      await this.ingest(buf, { defaultGroup: file.name, name: file.name }, true);
    } catch (err) { this.fail(err); }
  }
  beginLoad(name) {
    this.state = 'loading';
    this.sourceName = name;
    this.stats.loadStart = performance.now();
    this.stats.firstRenderMs = null;
    this.setStatus('loading ' + name + ' …');
    this.invalidate();
  }
  async ingest(buf, opts, fit) {
    const data = await this.source.parse(buf, { defaultGroup: opts.defaultGroup });
    this.setTiming(data.timing);
    this.setData(data, fit);
  }
  setTiming(t) {
    if (t.fetchMs !== undefined) this.stats.fetchMs = t.fetchMs;
    this.stats.decodeMs = t.decodeMs;
    this.stats.jsonMs = t.jsonMs;
    this.stats.buildMs = t.buildMs;
  }
  fail(err) {
    this.state = 'error';
    this.error = String(err && err.message || err);
    this.setStatus('error: ' + this.error, true);
    this.invalidate();
    this.wakeReady();
  }

  // ---- live mode (served by the agent) ----
  async detectAgent() {
    try {
      const res = await fetch('/api/jobs', { headers: { accept: 'application/json' } });
      if (!res.ok || !(res.headers.get('content-type') || '').includes('json')) return false;
      const jobs = await res.json();
      this.live.apiJobs = Array.isArray(jobs) ? jobs : Array.isArray(jobs && jobs.jobs) ? jobs.jobs : [];
      try {
        const pr = await fetch('/api/processes');
        if (pr.ok) {
          const procs = await pr.json();
          this.live.apiProcs = Array.isArray(procs) ? procs : Array.isArray(procs && procs.processes) ? procs.processes : [];
        }
      } catch (_) { /* the process list only feeds the selector */ }
      this.live.available = true;
      return true;
    } catch (_) {
      return false;
    }
  }
  startLive() {
    this.live.enabled = true;
    this.live.paused = false;
    this.liveBtn.hidden = false;
    this.updateLiveButton();
    if (!this.live.timer) this.live.timer = setInterval(() => this.liveTick(), 1000);
    this.liveTick();
  }
  stopLive() {
    this.live.enabled = false;
    if (this.live.timer) clearInterval(this.live.timer);
    this.live.timer = null;
    this.updateLiveButton();
  }
  pauseLive() {
    if (this.live.enabled && !this.live.paused) { this.live.paused = true; this.updateLiveButton(); }
  }
  resumeLive() {
    if (!this.live.available) return;
    if (!this.live.enabled) { this.startLive(); return; }
    this.live.paused = false;
    this.updateLiveButton();
    this.liveTick();
  }
  updateLiveButton() {
    const b = this.liveBtn;
    b.classList.toggle('on', this.live.enabled && !this.live.paused);
    b.textContent = this.live.enabled && !this.live.paused ? '● live' : '❚❚ paused — follow live';
  }
  liveUrl(range) {
    const q = new URLSearchParams();
    if (range) {
      // A paused view asks for its own window (absolute, on the answer's clock).
      q.set('from', String(Math.floor(range.start)));
      q.set('to', String(Math.ceil(range.end)));
    } else q.set('from', 'now-' + Math.round(this.live.windowUs / 1e6) + 's');
    if (this.filter.startsWith('job:')) {
      // A job's view is the whole job: every node's agent that has its ranks
      // (the agent merges them on its clock and names a node it misses).
      q.set('job', this.filter.slice(4));
      q.set('scope', 'cluster');
    }
    else if (this.filter.startsWith('pid:')) q.set('pid', this.filter.slice(4));
    // A busy job's last seconds can hold more thread states than one answer
    // may carry: ask the agent to keep the longest ones (it says so) rather
    // than refuse.
    // A screen cannot show more than ~100k slices; fewer also keeps the
    // agent's answer (and its CPU, shared with the job) small.
    q.set('downsample', 'true');
    q.set('max_events', '100000');
    // The agent merges what is shorter than one of our pixels into summary
    // slices (its level of detail): the answer follows the screen, not the job.
    q.set('width', String(Math.max(1, Math.floor(this.viewW - LABEL_W))));
    // Until a rank's threads or tensors are opened, the overview: per process,
    // its threads and tensors merged into two counters (a few kB per rank).
    if (!this.expanded.size) q.set('view', 'overview');
    return '/api/timeline?' + q.toString();
  }
  // Zoomed or panned while live is paused: the agent answers that window at
  // the screen's pixels, so zooming in brings every slice back (debounced).
  scheduleDetail() {
    if (!this.live.enabled || !this.live.paused) return;
    clearTimeout(this.detailTimer);
    this.detailTimer = setTimeout(() => this.fetchDetail(), 300);
  }
  async fetchDetail() {
    if (!this.live.enabled || !this.live.paused) return;
    if (this.detailInflight) { this.detailAgain = true; return; }
    this.detailInflight = true;
    const view = { start: this.view.start, end: this.view.end };
    const url = this.liveUrl(view);
    this.live.lastUrl = url;
    try {
      const data = await this.source.fetchParse(url, { defaultGroup: 'other processes' });
      if (!this.live.enabled || !this.live.paused) return;
      this.live.details = (this.live.details || 0) + 1;
      this.setData(data, false);
    } catch (err) {
      this.setStatus('detail: ' + String(err && err.message || err), true);
    } finally {
      this.detailInflight = false;
      if (this.detailAgain) { this.detailAgain = false; this.scheduleDetail(); }
    }
  }
  async liveTick() {
    if (!this.live.enabled || this.live.paused || this.live.inflight) return;
    this.live.inflight = true;
    const url = this.liveUrl();
    this.live.lastUrl = url;
    try {
      if (this.state !== 'ready') this.beginLoad('agent');
      const data = await this.source.fetchParse(url, { defaultGroup: 'other processes' });
      this.live.polls++;
      if (!this.live.enabled || this.live.paused) return;
      this.sourceName = 'agent (live)';
      this.setTiming(data.timing);
      this.setData(data, false);
      const md = data.metadata || {};
      const now = typeof md.now === 'number' ? md.now : data.t1;
      // In live mode times read as "seconds ago": the axis and tooltips count from the present.
      this.origin = now;
      this.view = { start: now - this.live.windowUs, end: now };
      this.invalidate();
    } catch (err) {
      this.setStatus('live: ' + String(err && err.message || err), true);
    } finally {
      this.live.inflight = false;
    }
  }

};
