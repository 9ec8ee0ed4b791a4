/*
 * Layout: which rows the view shows (the job/process picker's filter, folded
 * groups, a job rank's overview and its folds of threads and tensors), how
 * tall each is, where each sits on the canvas, and the mapping between time
 * and x.
 *
 * It decides where things go, never draws them (render.js) and never fetches.
 */

// Canvas geometry, in CSS pixels.
export const LABEL_W = 240;
export const AXIS_H = 30;
export const GROUP_H = 24;
export const PROC_H = 20;
export const ROW_H = 18;
export const STATE_H = 10;
export const INST_H = 10;
export const COUNTER_H = 52;
export const OVERVIEW_H = 46;
export const FOLD_H = 18;
// The agent's overview (view=overview): per process, counters in place of its threads and tensors.
export const OVERVIEW_COUNTERS = new Set(['threads', 'activity']);
export const PAD = 3;

/** Viewer methods that lay the rows out and map time to x; mixed into Viewer (timeline.js). */
export const Layout = (Base) => class extends Base {
  // ---- the job/process picker ----
  refreshSelector() {
    const sel = this.selector;
    const keep = this.filter;
    const opts = [['', 'all jobs and processes']];
    const seen = new Set(['']);
    const add = (v, label) => { if (!seen.has(v)) { seen.add(v); opts.push([v, label]); } };
    for (const j of this.live.apiJobs) {
      const id = j && (j.id ?? j.job_id ?? j.name ?? j.job);
      // A job found from its launcher's variables says which (torchrun, mpi, ...).
      const kind = j && j.kind && j.kind !== 'ringwatch' ? ' (' + j.kind + ')' : '';
      if (id != null) add('job:' + id, 'job ' + id + kind);
    }
    if (this.data) {
      for (const g of this.data.groups) {
        if (g.kind === 'job') add('job:' + g.name, 'job ' + g.name);
        for (const p of g.processes) {
          if (p.pid == null) continue;
          add('pid:' + p.pid, '\u2003' + this.processLabel(p));
        }
      }
    }
    for (const p of this.live.apiProcs) {
      if (p && p.pid != null) add('pid:' + p.pid, '\u2003pid ' + p.pid + (p.name || p.comm ? ' · ' + (p.name || p.comm) : ''));
    }
    // The view's own filter is always an option (a job named in the URL before the
    // agent lists it), so the picker never says "all" while one job is shown.
    if (keep && !seen.has(keep)) {
      const [kind, id] = keep.split(/:(.*)/s);
      add(keep, kind === 'pid' ? 'pid ' + id : 'job ' + id);
      const o = opts.pop();
      opts.splice(1, 0, o);
    }
    sel.innerHTML = '';
    for (const [v, label] of opts) {
      const o = document.createElement('option');
      o.value = v;
      o.textContent = label;
      sel.appendChild(o);
    }
    sel.value = keep;
  }
  setFilter(v) {
    this.filter = v || '';
    this.selector.value = this.filter;
    this.layout();
    this.invalidate();
    if (this.live.enabled && !this.live.paused) this.liveTick();
  }
  processLabel(p) {
    const parts = [];
    if (p.rank != null) parts.push('rank ' + p.rank);
    if (p.name) parts.push(p.name);
    if (p.pid != null && !(p.name && p.name === String(p.pid))) parts.push('pid ' + p.pid);
    return parts.join(' · ') || 'process';
  }
  passesFilter(g, p) {
    const f = this.filter;
    if (!f) return true;
    if (f.startsWith('job:')) return g.kind === 'job' && g.name === f.slice(4);
    if (f.startsWith('pid:')) return p.pid != null && String(p.pid) === f.slice(4);
    return true;
  }

  // ---- layout ----
  trackHeight(t) {
    if (t.kind === 'counter') return COUNTER_H;
    if (t.kind === 'instants') { t.instY = PAD; return INST_H + 2 * PAD; }
    let y = PAD;
    t.stateY = t.states ? y : -1;
    if (t.states) y += STATE_H + 2;
    t.instY = t.instants ? y : -1;
    if (t.instants) y += INST_H;
    t.sliceY = y;
    const levels = t.slices.levels;
    y += Math.max(levels, t.states || t.instants ? 0 : 1) * ROW_H;
    return y + PAD;
  }
  layout() {
    const rows = [];
    let y = 0;
    if (this.data) {
      for (const g of this.data.groups) {
        const procs = g.processes.filter((p) => this.passesFilter(g, p));
        if (!procs.length) continue;
        rows.push({ type: 'group', g, y, h: GROUP_H, label: (g.kind === 'job' ? 'job ' : '') + g.name + `  (${procs.length} ${g.kind === 'job' ? 'rank' : 'process'}${procs.length === 1 ? '' : 'es'.slice(g.kind === 'job' ? 1 : 0)})` });
        y += GROUP_H;
        if (this.collapsed.has(g.key)) continue;
        for (const p of procs) {
          rows.push({ type: 'process', g, p, y, h: PROC_H, label: this.processLabel(p) });
          y += PROC_H;
          if (this.collapsed.has(g.key + '/' + p.key)) continue;
          const push = (t) => {
            const h = this.trackHeight(t);
            rows.push({ type: 'track', g, p, t, y, h });
            y += h;
          };
          if (g.kind !== 'job') {
            p.tracks.forEach(push);
            // The agent's overview left this process's threads out: they open on demand.
            const n = (p.named && p.named.thread) || 0;
            if (n && !p.tracks.some((t) => t.kind === 'thread')) {
              const key = g.key + '/' + p.key + '/thread';
              const open = this.expanded.has(key);
              rows.push({ type: 'fold', g, p, key, y, h: FOLD_H, label: `${open ? '▾' : '▸'} ${n} thread${n === 1 ? '' : 's'}${open ? ' (loading …)' : ' (click to open)'}` });
              y += FOLD_H;
            }
            continue;
          }
          // A job's rank: overview first (activities, threads' states), its counters
          // and cycles, then its threads and its tensors, each folded until opened.
          rows.push({ type: 'overview', g, p, y, h: OVERVIEW_H });
          y += OVERVIEW_H;
          // (The agent's overview counters are drawn in the lane, not as rows.)
          p.tracks.filter((t) => (t.kind !== 'thread' || t.role === 'cycles') && !(t.kind === 'counter' && OVERVIEW_COUNTERS.has(t.name))).forEach(push);
          for (const [role, noun] of [['thread', 'thread'], ['tensor', 'tensor']]) {
            const list = p.tracks.filter((t) => t.kind === 'thread' && t.role === role);
            const n = Math.max(list.length, (p.named && p.named[role]) || 0);
            if (!n) continue;
            const key = g.key + '/' + p.key + '/' + role;
            const open = this.expanded.has(key);
            const more = open ? (list.length ? '' : ' (loading …)') : ' (click to open)';
            rows.push({ type: 'fold', g, p, key, y, h: FOLD_H, label: `${open ? '▾' : '▸'} ${n} ${noun}${n === 1 ? '' : 's'}${more}` });
            y += FOLD_H;
            if (open) list.forEach(push);
          }
        }
      }
    }
    this.rows = rows;
    this.contentH = y;
    this.spacer.style.height = Math.max(0, AXIS_H + y + 8 - this.viewH) + 'px';
  }
  resize() {
    const r = this.scroller.getBoundingClientRect();
    const dpr = window.devicePixelRatio || 1;
    this.viewW = Math.max(300, Math.floor(r.width));
    this.viewH = Math.max(150, Math.floor(r.height));
    this.canvas.style.width = this.viewW + 'px';
    this.canvas.style.height = this.viewH + 'px';
    this.canvas.width = Math.floor(this.viewW * dpr);
    this.canvas.height = Math.floor(this.viewH * dpr);
    this.dpr = dpr;
    this.layout();
    this.invalidate();
  }

  // ---- coordinates ----
  get plotX0() { return LABEL_W; }
  get plotX1() { return this.viewW; }
  timeToX(t) { return LABEL_W + (t - this.view.start) / (this.view.end - this.view.start) * (this.viewW - LABEL_W); }
  xToTime(x) { return this.view.start + (x - LABEL_W) / (this.viewW - LABEL_W) * (this.view.end - this.view.start); }
  rowTop(row) { return AXIS_H + row.y - this.scroller.scrollTop; }
  setRange(start, end) {
    if (!(end > start)) return;
    const minSpan = 0.01; // 10 ns
    if (end - start < minSpan) { const c = (start + end) / 2; start = c - minSpan / 2; end = c + minSpan / 2; }
    this.view = { start, end };
    this.invalidate();
    this.scheduleDetail();
  }
  zoomAt(x, factor) {
    const t = this.xToTime(x);
    const { start, end } = this.view;
    this.setRange(t - (t - start) * factor, t + (end - t) * factor);
  }
  panPx(dx) {
    const dt = dx / (this.viewW - LABEL_W) * (this.view.end - this.view.start);
    this.setRange(this.view.start - dt, this.view.end - dt);
  }

  // ---- events ----
};
