/*
 * A job rank's overview lane and the job's verdict: per pixel column, the
 * rank's threads running and waiting for a CPU, and what its tensors were
 * doing (collective, fusion copy, negotiate, queued) — from its own tracks,
 * or from the agent's overview counters (`view=overview`) — and whether the
 * job looks compute-, network- or scheduling-bound over the view.
 *
 * Computed per view and cached on the process; it reads the tracks, never
 * changes them.
 */
import { fmtNum } from './format.js';
import { LABEL_W } from './layout.js';
import { STATE_COLORS } from './render.js';
import { lowerBound, upperBound } from './search.js';

export const OVERVIEW_ACTIVITY_KEYS = ['collective', 'fusion', 'negotiate', 'queued'];
// A rank's overview: what its job's tensors were doing (the class of the activity), in this order of precedence.
export const ACTIVITY_CLASSES = [
  { key: 'coll', label: 'collective', color: '#1c7ed6', test: /^(ALLREDUCE|ALLGATHER|BROADCAST|ALLTOALL|REDUCESCATTER|NCCL|MPI_|GLOO)/i },
  { key: 'fuse', label: 'fusion copy', color: '#ae3ec9', test: /^MEMCPY/i },
  { key: 'nego', label: 'negotiate', color: '#868e96', test: /^NEGOTIATE/i },
  { key: 'queue', label: 'queued', color: '#ced4da', test: /^(QUEUE|WAIT)/i },
];

/** Viewer methods for the overview lanes and verdicts; mixed into Viewer (timeline.js). */
export const Overview = (Base) => class extends Base {
  classOf(idx) {
    let c = this.nameClass[idx];
    if (c !== undefined) return c;
    const name = this.data.strings[idx];
    c = ACTIVITY_CLASSES.findIndex((k) => k.test.test(name));
    this.nameClass[idx] = c;
    return c;
  }
  // A rank's overview over the view, per pixel column (cached per view): the
  // threads running and waiting for a CPU (the average number of each), and for
  // each activity class the share of the column some tensor spent in it (the
  // most of any one tensor: fused tensors run side by side), plus their totals.
  overviewOf(p) {
    const vs = this.view.start, ve = this.view.end;
    const cols = Math.max(1, Math.floor(this.viewW - LABEL_W));
    const key = this.data.generation + ':' + vs + ':' + ve + ':' + cols;
    if (p.ov && p.ov.key === key) return p.ov;
    const k = cols / (ve - vs);
    const lane = () => ({ bins: new Float64Array(cols + 1), diff: new Float64Array(cols + 2) });
    // Adds weight w over [a, b] (µs) to a lane, in column units: whole columns through a difference array.
    const add = (l, a, b, w) => {
      let xa = (a - vs) * k, xb = (b - vs) * k;
      if (xb <= 0 || xa >= cols || !(w > 0)) return;
      xa = Math.max(0, xa); xb = Math.min(cols, xb);
      if (xb <= xa) return;
      const ia = Math.floor(xa), ib = Math.floor(xb);
      if (ia === ib) { l.bins[ia] += (xb - xa) * w; return; }
      l.bins[ia] += (ia + 1 - xa) * w;
      l.diff[ia + 1] += w; l.diff[ib] -= w;
      if (ib < cols) l.bins[ib] += (xb - ib) * w;
    };
    const settle = (l) => { let acc = 0; for (let c = 0; c < cols; c++) { acc += l.diff[c]; l.bins[c] += acc; l.diff[c] = 0; } l.diff[cols] = 0; return l.bins; };
    const run = lane(), rq = lane();
    let threads = 0;
    const classes = ACTIVITY_CLASSES.map(() => new Float64Array(cols));
    const tmp = ACTIVITY_CLASSES.map(lane);
    for (const t of p.tracks) {
      if (t.kind !== 'thread') continue;
      if (t.states) {
        threads++;
        const f = t.states;
        let i = lowerBound(f.st, 0, f.count, vs);
        if (i > 0) i--;
        for (; i < f.count && f.st[i] <= ve; i++) {
          const a = f.st[i], b = a + f.du[i];
          add(run, a, b, f.fr[3 * i]);
          add(rq, a, b, f.fr[3 * i + 1]);
        }
      }
      if (t.role !== 'cycles') {
        // Activities on any track: a tensor's, or a thread's own (a Horovod background thread).
        const s = t.slices;
        let any = false;
        for (let i = 0; i < s.count; i++) {
          const a = s.st[i], b = a + s.du[i];
          if (b < vs || a > ve) continue;
          const c = this.classOf(s.nm[i]);
          if (c < 0) continue;
          add(tmp[c], a, b, s.bz[i]);
          any = true;
        }
        if (!any) continue;
        for (let c = 0; c < tmp.length; c++) {
          const bins = settle(tmp[c]);
          const into = classes[c];
          for (let x = 0; x < cols; x++) { if (bins[x] > into[x]) into[x] = Math.min(1, bins[x]); bins[x] = 0; }
        }
      }
    }
    settle(run); settle(rq);
    // The agent's overview counters (view=overview) add to what the tracks hold
    // (a recorded trace's B/E activities stay as they are there).
    const fromAgent = this.overviewFromCounters(p, vs, ve, cols);
    if (fromAgent) {
      for (let c = 0; c < cols; c++) {
        run.bins[c] += fromAgent.run[c]; rq.bins[c] += fromAgent.rq[c];
        for (let i = 0; i < classes.length; i++) classes[i][c] = Math.max(classes[i][c], fromAgent.classes[i][c]);
      }
      threads = Math.max(threads, fromAgent.threads);
    }
    let runSum = 0, rqSum = 0, peak = 0;
    for (let c = 0; c < cols; c++) { runSum += run.bins[c]; rqSum += rq.bins[c]; peak = Math.max(peak, run.bins[c] + rq.bins[c]); }
    const share = classes.map((a) => { let x = 0; for (let c = 0; c < cols; c++) x += a[c]; return x / cols; });
    p.ov = { key, cols, run: run.bins, rq: rq.bins, classes, threads, peak, running: runSum / cols, waiting: rqSum / cols, share };
    return p.ov;
  }
  // The overview from the agent's counters (view=overview), sampled at each
  // column's middle; null when the process has none.
  overviewFromCounters(p, vs, ve, cols) {
    const threadsC = p.tracks.find((t) => t.kind === 'counter' && t.name === 'threads');
    const actC = p.tracks.find((t) => t.kind === 'counter' && t.name === 'activity');
    if (!threadsC && !actC) return null;
    const k = cols / (ve - vs);
    const series = (c, name) => c && (c.series.find((s) => s.name === name) || null);
    const at = (c, s, t) => {
      if (!c || !s) return 0;
      const i = upperBound(c.ts, 0, c.ts.length, t) - 1;
      return i >= 0 ? s.values[i] : 0;
    };
    const run = new Float64Array(cols), rq = new Float64Array(cols);
    const classes = ACTIVITY_CLASSES.map(() => new Float64Array(cols));
    const sRun = series(threadsC, 'running'), sRq = series(threadsC, 'runnable');
    const sAct = OVERVIEW_ACTIVITY_KEYS.map((n) => series(actC, n));
    let runSum = 0, rqSum = 0, peak = 0;
    for (let c = 0; c < cols; c++) {
      const t = vs + (c + 0.5) / k;
      run[c] = at(threadsC, sRun, t); rq[c] = at(threadsC, sRq, t);
      runSum += run[c]; rqSum += rq[c]; peak = Math.max(peak, run[c] + rq[c]);
      for (let i = 0; i < classes.length; i++) classes[i][c] = at(actC, sAct[i], t);
    }
    const share = classes.map((a) => { let x = 0; for (let c = 0; c < cols; c++) x += a[c]; return x / cols; });
    return { cols, run, rq, classes, threads: (p.named && p.named.thread) || (threadsC ? 1 : 0), peak, running: runSum / cols, waiting: rqSum / cols, share };
  }
  // Whether a job looks compute-, network- or scheduling-bound over the view, from its ranks' overviews.
  verdict(g) {
    const procs = g.processes.filter((p) => this.passesFilter(g, p));
    if (!procs.length) return null;
    let running = 0, waiting = 0, coll = 0, known = 0;
    for (const p of procs) {
      const o = this.overviewOf(p);
      if (!o.threads && !o.share.some((x) => x > 0)) continue;
      known++;
      running += o.running; waiting += o.waiting; coll += o.share[0] + o.share[1];
    }
    if (!known) return null;
    running /= known; waiting /= known; coll /= known;
    const wait = running + waiting > 0 ? waiting / (running + waiting) : 0;
    const pct = (x) => Math.round(100 * x) + '%';
    const figures = `per rank: ${running.toFixed(2)} threads running, ${waiting.toFixed(2)} waiting for a CPU; collectives ${pct(coll)} of the time`;
    let kind;
    if (wait > 0.2) kind = `scheduling-bound (ready threads wait for a CPU ${pct(wait)} of the time)`;
    else if (coll > 0.5) kind = 'network-bound (collectives run most of the time)';
    else kind = 'compute-bound';
    return { kind, text: 'looks ' + kind + ' · ' + figures };
  }
  drawOverview(ctx, row, y) {
    const W = this.viewW, x0 = LABEL_W;
    const o = this.overviewOf(row.p);
    ctx.fillStyle = '#ffffff';
    ctx.fillRect(0, y, W, row.h);
    ctx.fillStyle = '#dee2e6';
    ctx.fillRect(0, y + row.h - 1, W, 1);
    ctx.fillStyle = '#ced4da';
    ctx.fillRect(LABEL_W - 1, y, 1, row.h);
    ctx.fillStyle = '#212529';
    ctx.font = 'bold 12px system-ui, sans-serif';
    this.clippedText(ctx, 'overview', 28, y + 10, LABEL_W - 34);
    ctx.font = '11px system-ui, sans-serif';
    ctx.fillStyle = '#495057';
    const scale = Math.max(1, o.peak);
    this.clippedText(ctx, `${o.running.toFixed(2)} run · ${o.waiting.toFixed(2)} wait for CPU (of ${fmtNum(scale)})`, 28, y + 24, LABEL_W - 34);
    const top = ACTIVITY_CLASSES.map((c, i) => [c, o.share[i]]).filter((x) => x[1] > 0.005).slice(0, 2)
      .map(([c, x]) => `${c.label} ${Math.round(100 * x)}%`).join(' · ');
    this.clippedText(ctx, top ? 'job: ' + top : 'job: no activity in view', 28, y + 37, LABEL_W - 34);
    // Threads: running (green) from the bottom, waiting for a CPU (orange) on top.
    const cpuTop = y + 3, cpuH = 28, base = cpuTop + cpuH;
    for (let c = 0; c < o.cols; c++) {
      const r = o.run[c], q = o.rq[c];
      if (r > 0.001) { const h = r / scale * cpuH; ctx.fillStyle = STATE_COLORS[1]; ctx.fillRect(x0 + c, base - h, 1, h); }
      if (q > 0.001) { const h0 = r / scale * cpuH, h = q / scale * cpuH; ctx.fillStyle = STATE_COLORS[2]; ctx.fillRect(x0 + c, base - h0 - h, 1, h); }
    }
    ctx.fillStyle = '#adb5bd';
    ctx.fillRect(x0, base, W - x0, 1);
    // Activities: per column the class with the most of it, shaded by how much.
    const actTop = base + 3, actH = row.h - (base - y) - 6;
    for (let c = 0; c < o.cols; c++) {
      let best = -1, bv = 0.02;
      for (let i = 0; i < o.classes.length; i++) if (o.classes[i][c] > bv) { bv = o.classes[i][c]; best = i; }
      if (best < 0) continue;
      ctx.globalAlpha = 0.35 + 0.65 * bv;
      ctx.fillStyle = ACTIVITY_CLASSES[best].color;
      ctx.fillRect(x0 + c, actTop, 1, actH);
    }
    ctx.globalAlpha = 1;
  }
};
