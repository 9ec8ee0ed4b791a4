/*
 * Binary searches over the parser's sorted typed arrays (slice starts per
 * nesting level, counter timestamps): what keeps a frame and a hover
 * O(log n) rather than O(events). Pure functions.
 */

export function lowerBound(a, lo, hi, v) {
  while (lo < hi) {
    const m = (lo + hi) >>> 1;
    if (a[m] < v) lo = m + 1; else hi = m;
  }
  return lo;
}
export function upperBound(a, lo, hi, v) {
  while (lo < hi) {
    const m = (lo + hi) >>> 1;
    if (a[m] <= v) lo = m + 1; else hi = m;
  }
  return lo;
}
// The slice of a non-overlapping run [lo, hi) that contains time, or the
// nearest one within tol (so sub-pixel slices can be hovered).
export function hitFlat(st, du, lo, hi, time, tol) {
  const i = upperBound(st, lo, hi, time) - 1;
  if (i >= lo && st[i] + du[i] >= time) return i;
  let best = -1, bestD = tol;
  for (const j of [i, i + 1]) {
    if (j < lo || j >= hi) continue;
    const d = time < st[j] ? st[j] - time : time - (st[j] + du[j]);
    if (d <= bestD) { best = j; bestD = d; }
  }
  return best;
}
export function nearest(st, time, tol) {
  const i = lowerBound(st, 0, st.length, time);
  let best = -1, bestD = tol;
  for (const j of [i - 1, i]) {
    if (j < 0 || j >= st.length) continue;
    const d = Math.abs(st[j] - time);
    if (d <= bestD) { best = j; bestD = d; }
  }
  return best;
}

