/*
 * The tuning panel (only when the page is served by an agent): the agent's
 * jobs, the picked job's tuning session (polled while it runs: samples in a
 * table and a convergence chart, best so far, state), start/stop with an
 * optional bearer token, and the reports with links to their files. It talks
 * to nothing but the agent (GET/POST/DELETE /api/jobs/{id}/tuning,
 * GET /api/jobs, GET /api/reports).
 *
 * It never touches the timeline, and fetches nothing until it is opened.
 */
import { fmtBytes, fmtKnobs, fmtRate } from './format.js';

/** How a session's scores read: steps/s where the job marks its steps, else bytes/s. */
function scoreFormat(objective) {
  if (objective === 'steps_per_second') return (v) => (typeof v === 'number' && isFinite(v) ? v.toFixed(2) + ' steps/s' : '–');
  return fmtRate;
}

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === 'class') e.className = v;
    else if (k === 'text') e.textContent = v;
    else e.setAttribute(k, v);
  }
  for (const c of children) if (c != null) e.append(c);
  return e;
}
const SVG_NS = 'http://www.w3.org/2000/svg';
function svgEl(tag, attrs) {
  const e = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  return e;
}
/** The message of an agent's JSON error (`{"error": "..."}` or `{"error": {"message": ...}}`). */
async function errorOf(res) {
  let text = '';
  try { text = await res.text(); } catch (_) { /* no body */ }
  let msg = text;
  try {
    const j = JSON.parse(text);
    const e = j && j.error;
    msg = typeof e === 'string' ? e : e && e.message ? e.message : text;
  } catch (_) { /* not JSON: the text itself */ }
  return `HTTP ${res.status}` + (msg ? ': ' + msg : '');
}

export class TuningPanel {
  constructor(root) {
    this.root = root;
    this.toggle = document.getElementById('tuning-toggle');
    this.jobSel = root.querySelector('#tuning-job');
    this.token = root.querySelector('#tuning-token');
    this.budget = root.querySelector('#tuning-budget');
    this.keepStart = root.querySelector('#tuning-keep-start');
    this.startBtn = root.querySelector('#tuning-start');
    this.stopBtn = root.querySelector('#tuning-stop');
    this.msg = root.querySelector('#tuning-message');
    this.sessionBox = root.querySelector('#tuning-session');
    this.reportsBox = root.querySelector('#tuning-reports');
    this.job = '';
    this.session = null;
    this.timer = null;
    this.polls = 0;
    this.open = false;
    this.lastState = null;
    this.toggle.addEventListener('click', () => this.setOpen(!this.open));
    this.jobSel.addEventListener('change', () => this.pick(this.jobSel.value));
    this.startBtn.addEventListener('click', () => this.start());
    this.stopBtn.addEventListener('click', () => this.stop());
    root.querySelector('#tuning-close').addEventListener('click', () => this.setOpen(false));
  }
  /** Shown only when an agent serves the page. */
  enable() { this.toggle.hidden = false; }
  setOpen(open) {
    this.open = open;
    this.root.hidden = !open;
    this.toggle.classList.toggle('on', open);
    if (open) { this.refreshJobs(); this.refreshReports(); this.schedule(0); } else this.schedule(null);
  }
  headers(json) {
    const h = { accept: 'application/json' };
    if (json) h['content-type'] = 'application/json';
    const t = this.token.value.trim();
    if (t) h.authorization = 'Bearer ' + t;
    return h;
  }
  say(text, isError) {
    this.msg.textContent = text || '';
    this.msg.classList.toggle('error', !!isError);
  }
  async refreshJobs() {
    try {
      const res = await fetch('/api/jobs', { headers: { accept: 'application/json' } });
      if (!res.ok) { this.say('jobs: ' + await errorOf(res), true); return; }
      const body = await res.json();
      const all = Array.isArray(body) ? body : Array.isArray(body && body.jobs) ? body.jobs : [];
      // Only jobs on ringwatch's runtime have knobs to tune (others are only watched).
      const jobs = all.filter((j) => !(j && j.kind && j.kind !== 'ringwatch'));
      const ids = jobs.map((j) => j && (j.id ?? j.job_id ?? j.name)).filter((id) => id != null).map(String);
      const keep = this.job;
      this.jobSel.replaceChildren(el('option', { value: '', text: ids.length ? 'pick a job' : 'no jobs found' }),
        ...ids.map((id) => el('option', { value: id, text: id })));
      if (ids.includes(keep)) this.jobSel.value = keep;
      else if (ids.length === 1 && !keep) { this.jobSel.value = ids[0]; this.pick(ids[0]); }
    } catch (err) {
      this.say('jobs: ' + String(err && err.message || err), true);
    }
  }
  pick(id) {
    this.job = id;
    this.session = null;
    this.lastState = null;
    this.render();
    this.say('');
    this.schedule(0);
  }
  url() { return '/api/jobs/' + encodeURIComponent(this.job) + '/tuning'; }
  /** Next poll in `ms` (null: none): every second while a session runs, every 5 s otherwise. */
  schedule(ms) {
    if (this.timer) clearTimeout(this.timer);
    this.timer = null;
    if (ms == null || !this.open) return;
    this.timer = setTimeout(() => this.poll(), ms);
  }
  async poll() {
    this.timer = null;
    if (!this.open) return;
    if (this.job) {
      const job = this.job;
      try {
        const res = await fetch(this.url(), { headers: { accept: 'application/json' } });
        this.polls++;
        if (job !== this.job) return;
        if (res.status === 404) { this.session = null; this.render(); }
        else if (!res.ok) this.say('tuning: ' + await errorOf(res), true);
        else this.show(await res.json());
      } catch (err) {
        this.say('tuning: ' + String(err && err.message || err), true);
      }
    }
    this.schedule(this.session && this.session.state === 'running' ? 1000 : 5000);
  }
  show(session) {
    const was = this.lastState;
    this.session = session;
    this.lastState = session.state;
    // A session that just ended has (or will have) a report.
    if (was === 'running' && session.state !== 'running') this.refreshReports();
    this.render();
  }
  async start() {
    if (!this.job) { this.say('pick a job first', true); return; }
    const body = {};
    const b = Number(this.budget.value);
    if (this.budget.value !== '' && Number.isInteger(b) && b > 0) body.budget = b;
    this.say('starting…');
    try {
      const res = await fetch(this.url(), { method: 'POST', headers: this.headers(true), body: JSON.stringify(body) });
      if (!res.ok) { this.say('start: ' + await errorOf(res), true); return; }
      this.show(await res.json());
      this.say('tuning session started');
      this.schedule(1000);
    } catch (err) {
      this.say('start: ' + String(err && err.message || err), true);
    }
  }
  async stop() {
    if (!this.job) return;
    const url = this.url() + (this.keepStart.checked ? '?keep=start' : '');
    try {
      const res = await fetch(url, { method: 'DELETE', headers: this.headers(false) });
      if (!res.ok) { this.say('stop: ' + await errorOf(res), true); return; }
      this.show(await res.json());
      this.say('tuning session stopped');
      this.refreshReports();
    } catch (err) {
      this.say('stop: ' + String(err && err.message || err), true);
    }
  }
  render() {
    const s = this.session;
    const box = this.sessionBox;
    this.stopBtn.disabled = !(s && s.state === 'running');
    this.startBtn.disabled = !this.job || !!(s && s.state === 'running');
    if (!this.job) { box.replaceChildren(el('p', { class: 'muted', text: 'Pick a job to see its tuning session.' })); return; }
    if (!s) { box.replaceChildren(el('p', { class: 'muted', text: `No tuning session for ${this.job} yet.` })); return; }
    const samples = Array.isArray(s.samples) ? s.samples : [];
    const facts = el('dl', { class: 'facts' });
    const fact = (k, v) => facts.append(el('dt', { text: k }), el('dd', { text: v }));
    const state = el('span', { class: 'badge state-' + s.state, id: 'tuning-state', text: s.state });
    facts.append(el('dt', { text: 'state' }), el('dd', {}, state));
    if (s.error) fact('error', s.error);
    fact('samples', String(samples.length) + (s.config && s.config.budget ? ' of ' + s.config.budget : ''));
    fact('start knobs', fmtKnobs(s.start_knobs));
    fact('current knobs', fmtKnobs(s.current_knobs));
    const best = s.best;
    const fmtScore = scoreFormat(s.objective);
    if (s.objective) fact('scored by', s.objective === 'steps_per_second' ? 'training steps per second' : 'bytes reduced per second (the job marks no steps)');
    fact('best so far', best ? `${fmtKnobs(best.knobs)} · ${fmtScore(best.predicted_score)} (sample ${best.sample})` : '–');
    if (typeof s.speedup_over_start === 'number') fact('speedup over start', s.speedup_over_start.toFixed(2) + '×');
    if (s.report_id) {
      const a = el('a', { href: '/api/reports/' + encodeURIComponent(s.report_id), target: '_blank', text: s.report_id });
      facts.append(el('dt', { text: 'report' }), el('dd', {}, a));
    }
    const table = el('table', { id: 'tuning-samples' },
      el('thead', {}, el('tr', {}, ...['#', 'fusion', 'cycle', 'hier.', 'score', 'best', 'note'].map((h) => el('th', { text: h })))));
    const tbody = el('tbody');
    let bestSoFar = -Infinity;
    for (const x of samples) {
      const k = x.knobs || {};
      bestSoFar = Math.max(bestSoFar, x.score);
      const note = [x.disturbed && 'disturbed: ' + x.disturbed, x.remeasured_because && 're-measured: ' + x.remeasured_because].filter(Boolean).join('; ');
      tbody.append(el('tr', { 'data-index': String(x.index) },
        el('td', { text: String(x.index) }),
        el('td', { text: k.fusion_threshold_bytes === 0 ? 'off' : fmtBytes(k.fusion_threshold_bytes) }),
        el('td', { text: typeof k.cycle_time_us === 'number' ? (k.cycle_time_us / 1000).toFixed(2) + ' ms' : '–' }),
        el('td', { text: k.hierarchical_allreduce ? 'yes' : 'no' }),
        el('td', { text: fmtScore(x.score) }),
        el('td', { text: fmtScore(bestSoFar) }),
        el('td', { text: note })));
    }
    table.append(tbody);
    box.replaceChildren(facts, this.chart(samples, fmtScore), table);
  }
  /** Score per sample (dots) and the best so far (a step line), as SVG. */
  chart(samples, fmtScore) {
    const W = 400, H = 120, L = 62, R = 8, T = 8, B = 18;
    const svg = svgEl('svg', { id: 'tuning-chart', width: W, height: H, viewBox: `0 0 ${W} ${H}`, role: 'img', 'aria-label': 'convergence: score per sample and best so far' });
    svg.append(svgEl('rect', { x: L, y: T, width: W - L - R, height: H - T - B, class: 'plot' }));
    const scores = samples.map((x) => x.score).filter((v) => typeof v === 'number' && isFinite(v));
    if (!scores.length) {
      const t = svgEl('text', { x: W / 2, y: H / 2, 'text-anchor': 'middle', class: 'muted' });
      t.textContent = 'no samples yet';
      svg.append(t);
      return svg;
    }
    const max = Math.max(...scores) * 1.05 || 1;
    const n = Math.max(samples.length - 1, 1);
    const x = (i) => L + (W - L - R) * (samples.length === 1 ? 0.5 : i / n);
    const y = (v) => T + (H - T - B) * (1 - v / max);
    let best = -Infinity;
    const pts = [];
    samples.forEach((s, i) => {
      if (pts.length) pts.push(`${x(i)},${y(best)}`);
      best = Math.max(best, s.score);
      pts.push(`${x(i)},${y(best)}`);
    });
    svg.append(svgEl('polyline', { points: pts.join(' '), class: 'best' }));
    samples.forEach((s, i) => svg.append(svgEl('circle', { cx: x(i), cy: y(s.score), r: 3, class: s.disturbed ? 'sample disturbed' : 'sample' })));
    const label = (text, px, py, anchor) => { const t = svgEl('text', { x: px, y: py, 'text-anchor': anchor }); t.textContent = text; svg.append(t); };
    label(fmtScore(max), L - 4, T + 8, 'end');
    label('0', L - 4, H - B, 'end');
    label('sample', (L + W - R) / 2, H - 4, 'middle');
    return svg;
  }
  async refreshReports() {
    const box = this.reportsBox;
    try {
      const res = await fetch('/api/reports', { headers: { accept: 'application/json' } });
      if (!res.ok) { box.replaceChildren(el('p', { class: 'muted', text: 'reports: ' + await errorOf(res) })); return; }
      const body = await res.json();
      const reports = Array.isArray(body && body.reports) ? body.reports : [];
      if (!reports.length) { box.replaceChildren(el('p', { class: 'muted', text: 'No reports yet.' })); return; }
      const table = el('table', { id: 'tuning-report-list' },
        el('thead', {}, el('tr', {}, ...['report', 'job', 'created', 'samples', 'speedup', 'files'].map((h) => el('th', { text: h })))));
      const tbody = el('tbody');
      for (const r of reports) {
        const link = (href, text) => (href ? el('a', { href, target: '_blank', text }) : null);
        const files = el('td', {}, link(r.html, 'html'), ' ', link(r.csv, 'csv'), ' ', link(r.parquet, 'parquet'));
        tbody.append(el('tr', { 'data-id': String(r.id) },
          el('td', {}, link(r.html, String(r.id)) || String(r.id)),
          el('td', { text: String(r.job_id ?? '') }),
          el('td', { text: typeof r.created_unix_ms === 'number' ? new Date(r.created_unix_ms).toISOString().slice(0, 16).replace('T', ' ') + 'Z' : '–' }),
          el('td', { text: String(r.samples ?? '–') }),
          el('td', { text: typeof r.speedup_over_start === 'number' ? r.speedup_over_start.toFixed(2) + '×' : '–' }),
          files));
      }
      table.append(tbody);
      box.replaceChildren(table);
    } catch (err) {
      box.replaceChildren(el('p', { class: 'muted', text: 'reports: ' + String(err && err.message || err) }));
    }
  }
}
