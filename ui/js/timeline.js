/*
 * The timeline viewer: its state (the parsed trace, the view's time range,
 * the rows, folds and filter, live mode's flags) and the queries the test
 * hook answers. Its methods come in by concept: Loading (source.js), Layout
 * (layout.js), Overview (overview.js), Rendering (render.js), Interaction
 * (interact.js).
 *
 * Flow: bytes -> the parser's Worker (worker.js, parse.js: per-track sorted
 * typed arrays) -> setData keeps the typed arrays -> render() draws only the
 * visible range. The conventions the data must follow (grouping by job,
 * thread-state names, counters) are in ui/README.md.
 *
 * It must never create a DOM node per event.
 */
import { fmtDur, jobTimelineNote, threadStatesNote } from './format.js';
import { Interaction } from './interact.js';
import { Layout, ROW_H, STATE_H } from './layout.js';
import { ACTIVITY_CLASSES, Overview } from './overview.js';
import { RectBatch, Rendering } from './render.js';
import { Loading, TraceSource } from './source.js';

/**
 * The viewer on one page. Each concept's methods live in its own module as a
 * mixin (a function from a base class to a subclass), so a file reads on its
 * own while the methods share one `this`.
 */
export class Viewer extends Interaction(Rendering(Overview(Layout(Loading(Object))))) {
  constructor(root) {
    super();
    this.root = root;
    this.canvas = root.querySelector('#timeline');
    this.scroller = root.querySelector('#scroller');
    this.spacer = root.querySelector('#spacer');
    this.tooltip = root.querySelector('#tooltip');
    this.status = root.querySelector('#status');
    this.selector = root.querySelector('#selector');
    this.liveBtn = root.querySelector('#live');
    this.ctx = this.canvas.getContext('2d');
    this.source = new TraceSource();
    this.data = null;
    this.state = 'empty';
    this.error = null;
    this.view = { start: 0, end: 1 };
    this.origin = 0;
    this.rows = [];
    this.contentH = 0;
    this.collapsed = new Set();
    // A job rank's thread and tensor rows are folded under its overview until opened.
    this.expanded = new Set();
    this.nameClass = [];
    this.filter = '';
    this.hover = null;
    this.rendered = 0;
    this.frameWaiters = [];
    this.readyWaiters = [];
    this.nameColor = [];
    this.nameState = [];
    this.nameWidth = [];
    this.batch = new RectBatch();
    this.stats = { loadStart: 0, fetchMs: null, decodeMs: null, jsonMs: null, buildMs: null, firstRenderMs: null, lastFrameMs: null };
    this.live = { available: false, enabled: false, paused: false, polls: 0, windowUs: 10e6, inflight: false, timer: null, lastUrl: null, apiJobs: [], apiProcs: [] };
    this.sourceName = '';
    this.rafPending = false;
    this.bindEvents();
    this.resize();
  }

  setData(data, fit) {
    this.data = data;
    this.nameColor = new Array(data.strings.length);
    this.nameClass = new Array(data.strings.length);
    this.nameState = new Array(data.strings.length);
    this.nameWidth = new Array(data.strings.length);
    if (!this.live.enabled) this.origin = data.t0;
    if (fit) this.fit();
    this.state = 'ready';
    this.error = null;
    this.hover = null;
    this.hideTooltip();
    this.refreshSelector();
    this.layout();
    const span = fmtDur(data.t1 - data.t0);
    this.setStatus(`${this.sourceName} · ${data.used.toLocaleString()} events` +
      (data.skipped ? ` (${data.skipped.toLocaleString()} skipped)` : '') + ` · ${span}` +
      (data.repaired ? ' · unterminated file, read up to its last complete event' : '') +
      (data.metadata && data.metadata.downsampled ? ' · downsampled by the agent' : '') +
      jobTimelineNote(data.metadata) + threadStatesNote(data.metadata));
    this.invalidate();
  }
  fit() {
    const d = this.data;
    if (!d) return;
    let span = d.t1 - d.t0;
    if (!(span > 0)) span = 1000;
    this.view = { start: d.t0 - span * 0.01, end: d.t0 + span * 1.01 };
    this.invalidate();
  }
  setStatus(text, isError) {
    this.status.textContent = text;
    this.status.classList.toggle('error', !!isError);
  }


  // ---- the test hook ----
  nextFrame() { return new Promise((resolve) => { this.frameWaiters.push(resolve); this.invalidate(); }); }
  whenReady() {
    if ((this.state === 'ready' && this.rendered > 0 && this.stats.firstRenderMs !== null) || this.state === 'error' ||
      (this.state === 'empty' && this.startupDone)) return Promise.resolve(this.state);
    return new Promise((resolve) => this.readyWaiters.push(resolve));
  }
  trackInfo() {
    const out = [];
    for (const row of this.rows) {
      const base = { type: row.type, y: this.rowTop(row), height: row.h, job: row.g.kind === 'job' ? row.g.name : null, group: row.g.name };
      if (row.type === 'group') { out.push(Object.assign(base, { name: row.g.name })); continue; }
      base.pid = row.p.pid;
      base.rank = row.p.rank;
      base.process = row.label || this.processLabel(row.p);
      if (row.type === 'process') { out.push(Object.assign(base, { name: row.label })); continue; }
      if (row.type === 'fold') { out.push(Object.assign(base, { name: row.label, key: row.key })); continue; }
      if (row.type === 'overview') {
        const o = this.overviewOf(row.p);
        out.push(Object.assign(base, { name: 'overview', running: o.running, waiting: o.waiting, threads: o.threads,
          share: Object.fromEntries(ACTIVITY_CLASSES.map((c, i) => [c.key, o.share[i]])) }));
        continue;
      }
      const t = row.t;
      Object.assign(base, { id: t.id, kind: t.kind, name: t.name, process: this.processLabel(row.p) });
      if (t.kind === 'thread') {
        Object.assign(base, { tid: t.tid, levels: t.slices.levels, slices: t.slices.count, states: t.states ? t.states.count : 0,
          instants: t.instants ? t.instants.count : 0, sliceTop: t.sliceY, rowHeight: ROW_H, stateTop: t.stateY, stateHeight: STATE_H });
      } else if (t.kind === 'counter') {
        Object.assign(base, { series: t.series.map((s) => s.name), samples: t.ts.length, min: t.min, max: t.max });
      } else {
        Object.assign(base, { instants: t.instants.count });
      }
      out.push(base);
    }
    return out;
  }
  /** Opens every fold (a job rank's threads and tensors), or closes them all. */
  expandAll(open = true) {
    if (!this.data) return;
    for (const g of this.data.groups) {
      for (const p of g.processes) {
        for (const role of ['thread', 'tensor']) {
          const key = g.key + '/' + p.key + '/' + role;
          if (open) this.expanded.add(key); else this.expanded.delete(key);
        }
      }
    }
    this.layout();
    this.invalidate();
    if (this.live.enabled && !this.live.paused) this.liveTick();
  }
  /** The verdict on a job over the view (what its group row says), for tests. */
  jobVerdict(name) {
    const g = this.data && this.data.groups.find((x) => x.kind === 'job' && x.name === name);
    return g ? this.verdict(g) : null;
  }
  /** Find slices by name (and optionally pid/tid); returns [{ts, dur, depth, track}], for tests. */
  findSlices(name, pid, tid) {
    const out = [];
    if (!this.data) return out;
    const idx = this.data.strings.indexOf(name);
    if (idx < 0) return out;
    for (const g of this.data.groups) for (const p of g.processes) {
      if (pid != null && String(p.pid) !== String(pid)) continue;
      for (const t of p.tracks) {
        if (t.kind !== 'thread' || (tid != null && String(t.tid) !== String(tid))) continue;
        const s = t.slices;
        for (let d = 0; d < s.levels; d++) for (let i = s.offsets[d]; i < s.offsets[d + 1]; i++) {
          if (s.nm[i] === idx) out.push({ ts: s.st[i], dur: s.du[i], depth: d, track: t.id, pid: p.pid, tid: t.tid });
        }
        if (t.states) for (let i = 0; i < t.states.count; i++) {
          if (t.states.nm[i] === idx) out.push({ ts: t.states.st[i], dur: t.states.du[i], depth: -1, state: true, track: t.id, pid: p.pid, tid: t.tid });
        }
      }
    }
    return out;
  }
}
