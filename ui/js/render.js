/*
 * Rendering: one <canvas> frame of the visible range — the axis, group and
 * process headers, each track's thread states, nested slices, instants and
 * counters. Each nesting level is binary-searched for its first visible
 * slice; slices narrower than a pixel collapse into one mark; rectangles are
 * filled per colour in one path.
 *
 * It never creates a DOM node per event, and never changes what is shown
 * (layout.js) or fetches (source.js): a frame is a function of the view.
 */
import { fmtDur, fmtNum, unitFor } from './format.js';
import { AXIS_H, COUNTER_H, INST_H, LABEL_W, PAD, ROW_H, STATE_H } from './layout.js';
import { lowerBound } from './search.js';

const textColorCache = new Map();
/** Black or white, whichever reads better on a slice of this colour. */
export function textOn(color) {
  let c = textColorCache.get(color);
  if (!c) {
    const n = parseInt(color.slice(1), 16);
    const lum = 0.2126 * ((n >> 16) & 255) + 0.7152 * ((n >> 8) & 255) + 0.0722 * (n & 255);
    c = lum < 140 ? '#ffffff' : '#1a1a1a';
    textColorCache.set(color, c);
  }
  return c;
}
/** Rectangles by colour; a rectangle touching the previous one of the same colour in the same lane extends it. */
export class RectBatch {
  constructor() { this.byColor = new Map(); this.lastColor = null; this.last = null; }
  add(color, x, y, w, h) {
    const l = this.last;
    if (color === this.lastColor && l && y === l[l.length - 3] && h === l[l.length - 1] && x <= l[l.length - 4] + l[l.length - 2] + 0.5) {
      const end = Math.max(l[l.length - 4] + l[l.length - 2], x + w);
      l[l.length - 2] = end - l[l.length - 4];
      return;
    }
    let a = this.byColor.get(color);
    if (!a) { a = []; this.byColor.set(color, a); }
    a.push(x, y, w, h);
    this.lastColor = color;
    this.last = a;
  }
  endLane() { this.lastColor = null; this.last = null; }
  flush(ctx) {
    for (const [color, a] of this.byColor) {
      if (!a.length) continue;
      ctx.fillStyle = color;
      ctx.beginPath();
      for (let q = 0; q < a.length; q += 4) ctx.rect(a[q], a[q + 1], a[q + 2], a[q + 3]);
      ctx.fill();
      a.length = 0;
    }
    this.endLane();
  }
}

export const STATE_COLORS = { 1: '#2f9e44', 2: '#f59f00', 3: '#e03131', 4: '#adb5bd' };
export const ACTIVITY_COLORS = {
  NEGOTIATE_ALLREDUCE: '#748ffc', NEGOTIATE_ALLGATHER: '#748ffc', NEGOTIATE_BROADCAST: '#748ffc',
  QUEUE: '#b197fc', WAIT_FOR_DATA: '#ced4da', WAIT_FOR_OTHER_TENSOR_DATA: '#ced4da',
  MEMCPY_IN_FUSION_BUFFER: '#3bc9db', MEMCPY_OUT_FUSION_BUFFER: '#1098ad',
  ALLREDUCE: '#4263eb', ALLGATHER: '#5c7cfa', BROADCAST: '#3b5bdb',
  RING_ALLREDUCE: '#1c7ed6', NCCL_ALLREDUCE: '#1c7ed6', MPI_ALLREDUCE: '#1c7ed6', TCP_ALLREDUCE: '#1c7ed6',
  HIERARCHICAL_ALLREDUCE: '#1864ab', CYCLE_START: '#495057',
};
export const PALETTE = ['#e599f7', '#74c0fc', '#63e6be', '#ffa8a8', '#91a7ff', '#ffc078', '#a9e34b', '#66d9e8', '#faa2c1', '#b197fc', '#8ce99a', '#ffd43b'];
export const SERIES_COLORS = ['#1c7ed6', '#e8590c', '#2f9e44', '#ae3ec9', '#0c8599', '#c2255c'];

/** Viewer methods that draw a frame; mixed into Viewer (timeline.js). */
export const Rendering = (Base) => class extends Base {
  invalidate() {
    if (this.rafPending) return;
    this.rafPending = true;
    requestAnimationFrame(() => { this.rafPending = false; this.render(); });
  }
  colorOfName(idx) {
    let c = this.nameColor[idx];
    if (c) return c;
    const name = this.data.strings[idx];
    c = ACTIVITY_COLORS[name];
    if (!c) {
      let h = 0;
      for (let i = 0; i < name.length; i++) h = (h * 31 + name.charCodeAt(i)) | 0;
      c = PALETTE[Math.abs(h) % PALETTE.length];
    }
    this.nameColor[idx] = c;
    return c;
  }
  stateColor(idx) {
    let c = this.nameState[idx];
    if (c) return c;
    const n = this.data.strings[idx].toLowerCase();
    const code = n === 'running' ? 1 : n === 'runnable' || n === 'waiting on run queue' ? 2 :
      n === 'blocked' || n === 'uninterruptible' || n === 'iowait' ? 3 : 4;
    c = STATE_COLORS[code];
    this.nameState[idx] = c;
    return c;
  }
  render() {
    const t0 = performance.now();
    const ctx = this.ctx;
    const W = this.viewW, H = this.viewH;
    ctx.setTransform(this.dpr, 0, 0, this.dpr, 0, 0);
    ctx.fillStyle = '#ffffff';
    ctx.fillRect(0, 0, W, H);
    ctx.font = '12px system-ui, -apple-system, "Segoe UI", "DejaVu Sans", sans-serif';
    ctx.textBaseline = 'middle';
    const ticks = this.ticks();
    // grid
    ctx.fillStyle = '#f1f3f5';
    for (const tk of ticks) ctx.fillRect(Math.round(tk.x), AXIS_H, 1, H - AXIS_H);
    if (this.data) {
      const scrollTop = this.scroller.scrollTop;
      for (const row of this.rows) {
        const y = AXIS_H + row.y - scrollTop;
        if (y + row.h < AXIS_H || y > H) continue;
        ctx.save();
        ctx.beginPath();
        ctx.rect(0, Math.max(AXIS_H, y), W, Math.min(y + row.h, H) - Math.max(AXIS_H, y));
        ctx.clip();
        this.drawRow(ctx, row, y);
        ctx.restore();
      }
    }
    this.drawAxis(ctx, ticks);
    if (this.state !== 'ready') this.drawMessage(ctx);
    this.rendered++;
    this.stats.lastFrameMs = performance.now() - t0;
    if (this.state === 'ready' && this.stats.firstRenderMs === null && this.stats.loadStart) {
      this.stats.firstRenderMs = performance.now() - this.stats.loadStart;
    }
    const waiters = this.frameWaiters;
    this.frameWaiters = [];
    for (const w of waiters) w(this.rendered);
    if (this.state === 'ready' || this.state === 'error') this.wakeReady();
  }
  wakeReady() {
    const w = this.readyWaiters;
    this.readyWaiters = [];
    for (const f of w) f(this.state);
  }
  drawMessage(ctx) {
    const msg = this.state === 'loading' ? 'loading ' + this.sourceName + ' …' :
      this.state === 'error' ? 'could not read the trace: ' + this.error :
        'Drop a Chrome-trace or Horovod timeline JSON file here, or use “Open trace file”.';
    ctx.fillStyle = this.state === 'error' ? '#c92a2a' : '#495057';
    ctx.font = '15px system-ui, sans-serif';
    ctx.textAlign = 'center';
    ctx.fillText(msg, (LABEL_W + this.viewW) / 2, AXIS_H + 60);
    ctx.textAlign = 'left';
  }
  ticks() {
    const span = this.view.end - this.view.start;
    const plotW = this.viewW - LABEL_W;
    const raw = span * 110 / plotW;
    const p = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 5, 10].map((m) => m * p).find((s) => s >= raw) || 10 * p;
    const u = unitFor(step);
    const dec = Math.max(0, -Math.floor(Math.log10(step / u.scale) + 1e-9));
    const out = [];
    const first = Math.ceil((this.view.start - this.origin) / step);
    for (let k = first; ; k++) {
      const rel = k * step;
      const t = this.origin + rel;
      if (t > this.view.end) break;
      const label = (Math.abs(rel) < step / 2 ? 0 : rel / u.scale).toFixed(dec) + ' ' + u.name;
      out.push({ x: this.timeToX(t), label });
      if (out.length > 200) break;
    }
    return out;
  }
  drawAxis(ctx, ticks) {
    const W = this.viewW;
    ctx.fillStyle = '#f8f9fa';
    ctx.fillRect(0, 0, W, AXIS_H);
    ctx.fillStyle = '#ced4da';
    ctx.fillRect(0, AXIS_H - 1, W, 1);
    ctx.fillRect(LABEL_W - 1, 0, 1, AXIS_H);
    if (AXIS_H + this.contentH - this.scroller.scrollTop < this.viewH) {
      // below the last track the label column's edge continues to the bottom
      const y0 = Math.max(AXIS_H, AXIS_H + this.contentH - this.scroller.scrollTop);
      ctx.fillRect(LABEL_W - 1, y0, 1, this.viewH - y0);
    }
    ctx.fillStyle = '#212529';
    ctx.font = '11px system-ui, sans-serif';
    ctx.save();
    ctx.beginPath();
    ctx.rect(LABEL_W, 0, W - LABEL_W, AXIS_H);
    ctx.clip();
    for (const tk of ticks) {
      ctx.fillStyle = '#868e96';
      ctx.fillRect(Math.round(tk.x), AXIS_H - 8, 1, 8);
      ctx.fillStyle = '#212529';
      if (tk.x + 3 + ctx.measureText(tk.label).width <= W) ctx.fillText(tk.label, Math.round(tk.x) + 3, AXIS_H / 2 - 2);
    }
    ctx.restore();
    ctx.fillStyle = '#495057';
    ctx.font = '11px system-ui, sans-serif';
    const span = this.view.end - this.view.start;
    ctx.fillText('view ' + fmtDur(span) + (this.live.enabled && !this.live.paused ? ' · live' : ''), 8, AXIS_H / 2 - 2);
  }
  drawRow(ctx, row, y) {
    const W = this.viewW;
    if (row.type === 'group') {
      ctx.fillStyle = row.g.kind === 'job' ? '#343a40' : '#495057';
      ctx.fillRect(0, y, W, row.h);
      ctx.fillStyle = '#ffffff';
      ctx.font = 'bold 12px system-ui, sans-serif';
      let text = (this.collapsed.has(row.g.key) ? '▸ ' : '▾ ') + row.label;
      if (row.g.kind === 'job') {
        const v = this.verdict(row.g);
        if (v) text += '  —  ' + v.text;
      }
      this.clippedText(ctx, text, 8, y + row.h / 2, W - 16);
      return;
    }
    if (row.type === 'fold') {
      this.drawHeader(ctx, row, y, '#f8f9fa', '#495057', '12px system-ui, sans-serif', row.label, 28);
      return;
    }
    if (row.type === 'overview') { this.drawOverview(ctx, row, y); return; }
    if (row.type === 'process') {
      const key = row.g.key + '/' + row.p.key;
      this.drawHeader(ctx, row, y, '#e9ecef', '#212529', 'bold 12px system-ui, sans-serif',
        (this.collapsed.has(key) ? '▸ ' : '▾ ') + row.label, 16);
      return;
    }
    const t = row.t;
    ctx.fillStyle = '#f1f3f5';
    ctx.fillRect(0, y + row.h - 1, W, 1);
    ctx.fillStyle = '#ced4da';
    ctx.fillRect(LABEL_W - 1, y, 1, row.h);
    ctx.font = '12px system-ui, sans-serif';
    ctx.fillStyle = '#343a40';
    if (t.kind === 'counter') {
      this.clippedText(ctx, t.name, 28, y + 13, LABEL_W - 34);
      ctx.fillStyle = '#868e96';
      ctx.font = '11px system-ui, sans-serif';
      let lx = 28;
      t.series.forEach((s, si) => {
        if (lx > LABEL_W - 40) return;
        ctx.fillStyle = SERIES_COLORS[si % SERIES_COLORS.length];
        ctx.fillRect(lx, y + 22, 8, 8);
        ctx.fillStyle = '#495057';
        const w = Math.min(ctx.measureText(s.name).width, LABEL_W - 14 - lx - 12);
        this.clippedText(ctx, s.name, lx + 11, y + 27, w);
        lx += 20 + w;
      });
      ctx.fillStyle = '#868e96';
      this.clippedText(ctx, `scale ${fmtNum(t.min)} … ${fmtNum(t.max)}`, 28, y + 42, LABEL_W - 34);
      this.drawCounter(ctx, t, y);
      return;
    }
    const label = t.label || t.name;
    this.clippedText(ctx, label, 28, y + (t.kind === 'thread' && t.states ? PAD + STATE_H / 2 + 1 : 12), LABEL_W - 34);
    ctx.save();
    ctx.beginPath();
    ctx.rect(LABEL_W, y, W - LABEL_W, row.h);
    ctx.clip();
    if (t.kind === 'thread') {
      const batch = this.batch;
      if (t.states && t.states.summaries) this.drawSummaryStates(batch, t.states, y + t.stateY, STATE_H);
      else if (t.states) this.drawLevel(batch, t.states.st, t.states.du, t.states.nm, 0, t.states.count, y + t.stateY, STATE_H, true, null);
      const s = t.slices;
      const texts = [], textRows = [];
      for (let d = 0; d < s.levels; d++) {
        const top = y + t.sliceY + d * ROW_H;
        if (top > this.viewH || top + ROW_H < AXIS_H) continue;
        const tx = [];
        this.drawLevel(batch, s.st, s.du, s.nm, s.offsets[d], s.offsets[d + 1], top + 1, ROW_H - 2, false, tx);
        texts.push(tx);
        textRows.push(top + 1);
      }
      batch.flush(ctx);
      for (let q = 0; q < texts.length; q++) this.drawTexts(ctx, texts[q], textRows[q], ROW_H - 2);
    }
    if (t.instants) this.drawInstants(ctx, t.instants, y + t.instY);
    const h = this.hover;
    if (h && h.track === t.id && h.kind !== 'counter') {
      const x0 = this.timeToX(h.ts), x1 = this.timeToX(h.ts + (h.dur || 0));
      let top, hh;
      if (h.kind === 'state') { top = y + t.stateY; hh = STATE_H; }
      else if (h.kind === 'instant') { top = y + t.instY; hh = INST_H; }
      else { top = y + t.sliceY + h.depth * ROW_H + 1; hh = ROW_H - 2; }
      ctx.strokeStyle = '#000000';
      ctx.lineWidth = 1.5;
      ctx.strokeRect(Math.max(x0, LABEL_W - 2) - 0.5, top - 0.5, Math.max(2, Math.min(x1, W + 2) - Math.max(x0, LABEL_W - 2)) + 1, hh + 1);
    }
    ctx.restore();
  }
  // A header row (a process, a fold): its band, a rule under it, its text.
  drawHeader(ctx, row, y, background, color, font, text, x) {
    const W = this.viewW;
    ctx.fillStyle = background;
    ctx.fillRect(0, y, W, row.h);
    ctx.fillStyle = '#dee2e6';
    ctx.fillRect(0, y + row.h - 1, W, 1);
    ctx.fillStyle = color;
    ctx.font = font;
    this.clippedText(ctx, text, x, y + row.h / 2, W - x - 8);
  }
  clippedText(ctx, text, x, y, maxW) {
    if (ctx.measureText(text).width <= maxW) { ctx.fillText(text, x, y); return; }
    let lo = 0, hi = text.length;
    while (lo < hi) {
      const m = (lo + hi + 1) >> 1;
      if (ctx.measureText(text.slice(0, m) + '…').width <= maxW) lo = m; else hi = m - 1;
    }
    ctx.fillText(text.slice(0, lo) + '…', x, y);
  }
  // One nesting level: slices never overlap, so binary-search the first one
  // in view and walk right; runs of slices narrower than a pixel collapse into
  // one pixel-wide mark, skipping ahead by binary search (level of detail).
  // Rectangles go to a per-colour batch (touching same-colour ones merge), so
  // a frame costs one fill per colour rather than one per slice.
  drawLevel(batch, st, du, nm, lo, hi, y, h, isState, texts) {
    const vs = this.view.start, ve = this.view.end;
    const x0 = LABEL_W, x1 = this.viewW;
    const k = (x1 - x0) / (ve - vs);
    let i = lowerBound(st, lo, hi, vs);
    if (i > lo && st[i - 1] + du[i - 1] > vs) i--;
    while (i < hi && st[i] <= ve) {
      const xs = x0 + (st[i] - vs) * k;
      const xe = x0 + (st[i] + du[i] - vs) * k;
      const color = isState ? this.stateColor(nm[i]) : this.colorOfName(nm[i]);
      if (xe - xs >= 1) {
        const a = Math.max(xs, x0 - 1), b = Math.min(xe, x1 + 1);
        batch.add(color, a, y, b - a, h);
        if (texts && b - a > 36) texts.push(nm[i], a, b, color);
        i++;
        continue;
      }
      const px = Math.floor(xs);
      const tNext = vs + (px + 1 - x0) / k;
      const j = lowerBound(st, i + 1, hi, tNext);
      batch.add(color, px, y, Math.max(1, Math.min(xe, x1) - px), h);
      i = j - 1 > i && x0 + (st[j - 1] + du[j - 1] - vs) * k > px + 1 ? j - 1 : j;
    }
    batch.endLane();
  }
  // Thread states with the agent's summaries: each slice split top to bottom
  // into running, runnable and off-CPU by its fractions.
  drawSummaryStates(batch, f, y, h) {
    const vs = this.view.start, ve = this.view.end;
    const x0 = LABEL_W, x1 = this.viewW;
    const k = (x1 - x0) / (ve - vs);
    let i = lowerBound(f.st, 0, f.count, vs);
    if (i > 0 && f.st[i - 1] + f.du[i - 1] > vs) i--;
    for (; i < f.count && f.st[i] <= ve; i++) {
      const a = Math.max(x0 + (f.st[i] - vs) * k, x0 - 1);
      const b = Math.min(x0 + (f.st[i] + f.du[i] - vs) * k, x1 + 1);
      const w = Math.max(1, b - a);
      let top = y;
      for (let q = 0; q < 3; q++) {
        const part = f.fr[3 * i + q] * h;
        if (part <= 0) continue;
        batch.add(STATE_COLORS[q + 1], a, top, w, part);
        top += part;
      }
    }
    batch.endLane();
  }
  drawTexts(ctx, texts, y, h) {
    for (let q = 0; q < texts.length; q += 4) {
      const a = texts[q + 1], b = texts[q + 2];
      ctx.fillStyle = textOn(texts[q + 3]);
      this.fastClippedText(ctx, texts[q], a + 4, y + h / 2 + 1, b - a - 8);
    }
  }
  // Slice names: widths measured once per name, then cut by proportion.
  fastClippedText(ctx, nameIdx, x, y, maxW) {
    const name = this.data.strings[nameIdx];
    let w = this.nameWidth[nameIdx];
    if (w === undefined) { w = ctx.measureText(name).width; this.nameWidth[nameIdx] = w; }
    if (w <= maxW) { ctx.fillText(name, x, y); return; }
    const chars = Math.floor(name.length * (maxW - 8) / w);
    if (chars < 2) return;
    ctx.fillText(name.slice(0, chars) + '…', x, y);
  }
  drawInstants(ctx, f, y) {
    const vs = this.view.start, ve = this.view.end;
    const k = (this.viewW - LABEL_W) / (ve - vs);
    let i = lowerBound(f.st, 0, f.count, vs);
    let lastPx = -1;
    ctx.fillStyle = '#495057';
    while (i < f.count && f.st[i] <= ve) {
      const x = Math.round(LABEL_W + (f.st[i] - vs) * k);
      if (x !== lastPx) {
        ctx.beginPath();
        ctx.moveTo(x, y + 1);
        ctx.lineTo(x + 4, y + INST_H - 1);
        ctx.lineTo(x - 4, y + INST_H - 1);
        ctx.closePath();
        ctx.fill();
        lastPx = x;
        // skip the instants that would land on the same pixel
        i = lowerBound(f.st, i + 1, f.count, vs + (x + 0.5 - LABEL_W) / k);
        continue;
      }
      i++;
    }
  }
  drawCounter(ctx, t, y) {
    const x0 = LABEL_W, x1 = this.viewW;
    const top = y + 4, bottom = y + COUNTER_H - 4;
    const lo = Math.min(0, t.min), hi = t.max > lo ? t.max : lo + 1;
    const vy = (v) => bottom - (v - lo) / (hi - lo) * (bottom - top);
    const vs = this.view.start, ve = this.view.end;
    const k = (x1 - x0) / (ve - vs);
    const n = t.ts.length;
    const i0 = Math.max(0, lowerBound(t.ts, 0, n, vs) - 1);
    const i1 = Math.min(n, lowerBound(t.ts, 0, n, ve) + 1);
    ctx.save();
    ctx.beginPath();
    ctx.rect(x0, y, x1 - x0, COUNTER_H);
    ctx.clip();
    t.series.forEach((s, si) => {
      const color = SERIES_COLORS[si % SERIES_COLORS.length];
      const v = s.values;
      // Collapse the samples that fall into one pixel column to their maximum.
      const xs = [], ys = [];
      let curPx = null, curMax = 0;
      for (let i = i0; i < i1; i++) {
        const px = Math.floor(x0 + (t.ts[i] - vs) * k);
        if (px !== curPx) {
          if (curPx !== null) { xs.push(curPx); ys.push(curMax); }
          curPx = px; curMax = v[i];
        } else if (v[i] > curMax) curMax = v[i];
      }
      if (curPx !== null) { xs.push(curPx); ys.push(curMax); }
      if (!xs.length) return;
      ctx.beginPath();
      ctx.moveTo(Math.max(xs[0], x0 - 1), vy(lo));
      for (let q = 0; q < xs.length; q++) {
        const xa = Math.max(xs[q], x0 - 1);
        const xb = q + 1 < xs.length ? xs[q + 1] : Math.min(x1 + 1, xs[q] + 1);
        ctx.lineTo(xa, vy(ys[q]));
        ctx.lineTo(xb, vy(ys[q]));
      }
      ctx.lineTo(xs.length ? Math.min(x1 + 1, xs[xs.length - 1] + 1) : x0, vy(lo));
      ctx.closePath();
      ctx.globalAlpha = 0.3;
      ctx.fillStyle = color;
      ctx.fill();
      ctx.globalAlpha = 1;
      ctx.strokeStyle = color;
      ctx.lineWidth = 1;
      ctx.stroke();
    });
    // scale: max at the top, legend of series
    ctx.fillStyle = '#495057';
    ctx.font = '10px system-ui, sans-serif';
    const label = fmtNum(t.max);
    ctx.fillStyle = 'rgba(255,255,255,0.8)';
    ctx.fillRect(x0 + 2, top - 1, ctx.measureText(label).width + 4, 12);
    ctx.fillStyle = '#495057';
    ctx.fillText(label, x0 + 4, top + 5);
    ctx.restore();
    const h = this.hover;
    if (h && h.kind === 'counter' && h.track === t.id) {
      const x = this.timeToX(h.ts);
      if (x >= x0) { ctx.fillStyle = '#000000'; ctx.fillRect(Math.round(x), y, 1, COUNTER_H); }
    }
  }
};
