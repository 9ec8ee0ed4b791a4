/*
 * Formatting: durations and times in the unit that fits them, counter values,
 * bytes and rates, the tuning knobs, the status line's notes on what the
 * agent left out, and HTML escaping.
 *
 * Pure functions of their arguments: never the DOM, never the viewer's state.
 */

const UNITS = [
  { max: 1, scale: 1e-3, name: 'ns' },
  { max: 1e3, scale: 1, name: 'µs' },
  { max: 1e6, scale: 1e3, name: 'ms' },
  { max: Infinity, scale: 1e6, name: 's' },
];
export function unitFor(us) {
  const a = Math.abs(us);
  for (const u of UNITS) if (a < u.max) return u;
  return UNITS[3];
}
// A job's tensor events exist from when the agent asked for them (it asks
// while someone reads the timeline: --job-timeline on-demand).
export function jobTimelineNote(metadata) {
  const jt = metadata && metadata.job_timeline;
  if (!jt) return '';
  const since = jt.streaming_since_unix_ms;
  if (typeof since !== 'number') return ' · the job\'s tensor events are not streamed yet (they start while the timeline is open)';
  return ' · the job\'s tensor events since ' + new Date(since).toLocaleTimeString();
}

// Scheduling intervals shorter than the agent's --min-interval stay in the
// kernel: counted in the figures, not drawn as thread states.
export function threadStatesNote(metadata) {
  const ts = metadata && metadata.thread_states;
  if (!ts || typeof ts.min_interval_us !== 'number') return '';
  return ' · thread states shorter than ' + fmtDur(ts.min_interval_us) + ' are not drawn (agent --min-interval)';
}

/** A duration in µs, with three decimals in the unit that fits it. */
export function fmtDur(us) {
  if (us === 0) return '0 µs';
  const u = unitFor(us);
  return (us / u.scale).toFixed(3) + ' ' + u.name;
}
/** A point in time (µs since the origin), to the microsecond. */
export function fmtTime(us) {
  const u = unitFor(us);
  const dec = Math.max(0, Math.round(Math.log10(u.scale)));
  return (us / u.scale).toFixed(u.name === 'ns' ? 0 : dec) + ' ' + u.name;
}
export function fmtNum(v) {
  const a = Math.abs(v);
  if (a >= 1e12) return (v / 1e12).toFixed(2) + 'T';
  if (a >= 1e9) return (v / 1e9).toFixed(2) + 'G';
  if (a >= 1e6) return (v / 1e6).toFixed(2) + 'M';
  if (a >= 1e4) return (v / 1e3).toFixed(1) + 'k';
  if (Number.isInteger(v)) return String(v);
  return v.toPrecision(4);
}
export function escapeHtml(s) {
  return String(s).replace(/[&<>"']/g, (c) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' }[c]));
}
export function fmtBytes(n) {
  if (typeof n !== 'number' || !isFinite(n)) return '–';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i === 0 ? String(n) : n.toFixed(n < 10 ? 2 : n < 100 ? 1 : 0)) + ' ' + units[i];
}
export function fmtRate(bps) {
  if (typeof bps !== 'number' || !isFinite(bps)) return '–';
  const units = ['B/s', 'kB/s', 'MB/s', 'GB/s', 'TB/s'];
  let i = 0;
  while (Math.abs(bps) >= 1000 && i < units.length - 1) { bps /= 1000; i++; }
  return bps.toFixed(bps < 10 ? 2 : bps < 100 ? 1 : 0) + ' ' + units[i];
}
export function fmtKnobs(k) {
  if (!k) return '–';
  const fusion = k.fusion_threshold_bytes === 0 ? 'fusion off' : 'fusion ' + fmtBytes(k.fusion_threshold_bytes);
  const cycle = typeof k.cycle_time_us === 'number' ? 'cycle ' + (k.cycle_time_us / 1000).toFixed(k.cycle_time_us < 10000 ? 2 : 1) + ' ms' : 'cycle –';
  return fusion + ' · ' + cycle + ' · ' + (k.hierarchical_allreduce ? 'hierarchical' : 'flat');
}
