/*
 * Interaction on the canvas: wheel zoom about the cursor, drag and trackpad
 * pan, shift+wheel scroll, the W/S/A/D/0 keys, clicks that fold headers,
 * and the hover tooltip (its args fetched from the parser's Worker).
 *
 * Zooming, panning or a key pauses live mode; nothing here fetches a trace.
 */
import { escapeHtml, fmtDur, fmtNum, fmtTime } from './format.js';
import { AXIS_H, INST_H, LABEL_W, ROW_H, STATE_H } from './layout.js';
import { hitFlat, nearest, upperBound } from './search.js';

/** Viewer methods that handle the pointer, wheel and keys; mixed into Viewer (timeline.js). */
export const Interaction = (Base) => class extends Base {
  bindEvents() {
    const c = this.canvas;
    window.addEventListener('resize', () => this.resize());
    this.scroller.addEventListener('scroll', () => { this.hideTooltip(); this.invalidate(); });
    c.addEventListener('wheel', (e) => {
      e.preventDefault();
      const x = e.offsetX;
      const unit = e.deltaMode === 1 ? 33 : e.deltaMode === 2 ? 400 : 1;
      if (e.shiftKey) { this.scroller.scrollTop += e.deltaY * unit; return; }
      if (Math.abs(e.deltaX) > Math.abs(e.deltaY)) { this.pauseLive(); this.panPx(-e.deltaX * unit); return; }
      if (x < LABEL_W) { this.scroller.scrollTop += e.deltaY * unit; return; }
      this.pauseLive();
      this.zoomAt(x, Math.exp(Math.max(-400, Math.min(400, e.deltaY * unit)) * 0.002));
      this.updateHover(e.offsetX, e.offsetY, e.clientX, e.clientY);
    }, { passive: false });
    let drag = null;
    c.addEventListener('pointerdown', (e) => {
      if (e.button !== 0) return;
      if (e.offsetX < LABEL_W) { this.clickLabel(e.offsetY); return; }
      drag = { x: e.clientX, moved: false };
      c.setPointerCapture(e.pointerId);
      c.classList.add('dragging');
    });
    c.addEventListener('pointermove', (e) => {
      if (drag) {
        const dx = e.clientX - drag.x;
        if (dx !== 0) {
          drag.moved = true;
          this.pauseLive();
          this.panPx(dx);
          drag.x = e.clientX;
        }
        this.hideTooltip();
        return;
      }
      this.updateHover(e.offsetX, e.offsetY, e.clientX, e.clientY);
    });
    const end = (e) => {
      if (!drag) return;
      drag = null;
      c.classList.remove('dragging');
      try { c.releasePointerCapture(e.pointerId); } catch (_) { /* already released */ }
    };
    c.addEventListener('pointerup', end);
    c.addEventListener('pointercancel', end);
    c.addEventListener('pointerleave', () => { if (!drag) { this.hover = null; this.hideTooltip(); this.invalidate(); } });
    window.addEventListener('keydown', (e) => {
      if (e.target && (e.target.tagName === 'INPUT' || e.target.tagName === 'SELECT')) return;
      const mid = (LABEL_W + this.viewW) / 2;
      const k = e.key.toLowerCase();
      if (k === 'w') { this.pauseLive(); this.zoomAt(mid, 0.8); }
      else if (k === 's') { this.pauseLive(); this.zoomAt(mid, 1.25); }
      else if (k === 'a') { this.pauseLive(); this.panPx((this.viewW - LABEL_W) * 0.15); }
      else if (k === 'd') { this.pauseLive(); this.panPx(-(this.viewW - LABEL_W) * 0.15); }
      else if (k === '0' || k === 'f') { this.pauseLive(); this.fit(); }
    });
  }
  clickLabel(y) {
    const row = this.rowAtY(y);
    if (!row) return;
    let key = null;
    if (row.type === 'fold') {
      if (this.expanded.has(row.key)) this.expanded.delete(row.key); else this.expanded.add(row.key);
      this.layout();
      this.invalidate();
      // Live: an open fold needs every thread and tensor, not the overview.
      if (this.live.enabled && !this.live.paused) this.liveTick();
      return;
    }
    if (row.type === 'group') key = row.g.key;
    else if (row.type === 'process') key = row.g.key + '/' + row.p.key;
    if (!key) return;
    if (this.collapsed.has(key)) this.collapsed.delete(key); else this.collapsed.add(key);
    this.layout();
    this.invalidate();
  }
  rowAtY(y) {
    if (y < AXIS_H) return null;
    const cy = y - AXIS_H + this.scroller.scrollTop;
    const rows = this.rows;
    let lo = 0, hi = rows.length - 1;
    while (lo <= hi) {
      const m = (lo + hi) >> 1;
      const r = rows[m];
      if (cy < r.y) hi = m - 1; else if (cy >= r.y + r.h) lo = m + 1; else return r;
    }
    return null;
  }

  // ---- hit testing ----
  /** The slice, state, instant or counter sample under canvas point (x, y), or null. */
  sliceAt(x, y) {
    if (!this.data || x < LABEL_W || x > this.viewW) return null;
    const row = this.rowAtY(y);
    if (!row || row.type !== 'track') return null;
    const t = row.t;
    const ry = y - this.rowTop(row);
    const time = this.xToTime(x);
    const tol = 2 * (this.view.end - this.view.start) / (this.viewW - LABEL_W);
    const base = { track: t.id, trackName: t.name, pid: row.p.pid, tid: t.tid };
    if (t.kind === 'counter') {
      const i = upperBound(t.ts, 0, t.ts.length, time) - 1;
      if (i < 0) return null;
      const values = {};
      for (const s of t.series) values[s.name] = s.values[i];
      return Object.assign(base, { kind: 'counter', name: t.name, ts: t.ts[i], values });
    }
    if (t.instY >= 0 && ry >= t.instY && ry < t.instY + INST_H) {
      const f = t.instants;
      const i = nearest(f.st, time, tol);
      if (i >= 0) return Object.assign(base, { kind: 'instant', name: this.data.strings[f.nm[i]], ts: f.st[i], dur: 0, argsIndex: f.ar[i] });
      return null;
    }
    if (t.kind !== 'thread') return null;
    if (t.stateY >= 0 && ry >= t.stateY && ry < t.stateY + STATE_H) {
      const f = t.states;
      const i = hitFlat(f.st, f.du, 0, f.count, time, tol);
      if (i < 0) return null;
      return Object.assign(base, { kind: 'state', name: this.data.strings[f.nm[i]], ts: f.st[i], dur: f.du[i], argsIndex: f.ar[i] });
    }
    const depth = Math.floor((ry - t.sliceY) / ROW_H);
    const s = t.slices;
    if (ry < t.sliceY || depth >= s.levels) return null;
    const i = hitFlat(s.st, s.du, s.offsets[depth], s.offsets[depth + 1], time, tol);
    if (i < 0) return null;
    return Object.assign(base, { kind: 'slice', name: this.data.strings[s.nm[i]], ts: s.st[i], dur: s.du[i], depth, argsIndex: s.ar[i], index: i });
  }
  updateHover(x, y, clientX, clientY) {
    const hit = this.sliceAt(x, y);
    const same = hit && this.hover && hit.track === this.hover.track && hit.kind === this.hover.kind && hit.ts === this.hover.ts && hit.name === this.hover.name;
    this.hover = hit;
    if (!hit) { this.hideTooltip(); this.invalidate(); return; }
    this.showTooltip(hit, clientX, clientY, same);
    if (!same) this.invalidate();
  }
  showTooltip(hit, cx, cy, same) {
    const tip = this.tooltip;
    if (!same) {
      const rel = hit.ts - this.origin;
      let html = `<div class="tt-name">${escapeHtml(hit.name)}</div>`;
      if (hit.kind === 'counter') {
        html += `<div><span class="k">at</span> ${fmtTime(rel)}</div>`;
        for (const k in hit.values) html += `<div><span class="k">${escapeHtml(k)}</span> ${escapeHtml(fmtNum(hit.values[k]))} <span class="k">(${escapeHtml(hit.values[k])})</span></div>`;
      } else {
        html += `<div><span class="k">start</span> ${fmtTime(rel)}</div>`;
        if (hit.kind !== 'instant') html += `<div><span class="k">duration</span> ${fmtDur(hit.dur)}</div>`;
        html += `<div class="k">${escapeHtml(hit.trackName)}${hit.depth ? ' · depth ' + hit.depth : ''}</div>`;
        html += '<div class="tt-args"></div>';
      }
      tip.innerHTML = html;
      tip.dataset.kind = hit.kind;
      if (hit.argsIndex >= 0) {
        const gen = this.data.generation;
        const want = hit;
        this.source.args(gen, hit.argsIndex).then((a) => {
          if (this.hover !== want || !a) return;
          const box = tip.querySelector('.tt-args');
          if (!box) return;
          let h = '';
          if (a.cat) h += `<div><span class="k">category</span> ${escapeHtml(a.cat)}</div>`;
          if (a.extra && a.extra.unfinished) h += '<div class="k">not finished when the trace ends</div>';
          if (a.args) for (const k in a.args) {
            const v = a.args[k];
            h += `<div><span class="k">${escapeHtml(k)}</span> ${escapeHtml(typeof v === 'object' ? JSON.stringify(v) : v)}</div>`;
          }
          box.innerHTML = h;
        }).catch(() => { /* args are a nicety; the tooltip stands without them */ });
      }
    }
    tip.hidden = false;
    const w = tip.offsetWidth, h = tip.offsetHeight;
    let left = cx + 14, top = cy + 14;
    if (left + w > window.innerWidth - 4) left = cx - w - 14;
    if (top + h > window.innerHeight - 4) top = cy - h - 14;
    tip.style.left = Math.max(4, left) + 'px';
    tip.style.top = Math.max(4, top) + 'px';
  }
  hideTooltip() { this.tooltip.hidden = true; }

};
