// Shared by e2e.mjs and bench-1m.mjs: a static file server on loopback, the
// optional mock agent API, and launching Debian's Chromium through playwright-core.
import { createServer } from 'node:http';
import { existsSync, readFileSync, statSync, createReadStream } from 'node:fs';
import { spawnSync } from 'node:child_process';
import { dirname, extname, join, normalize, resolve, sep } from 'node:path';
import { fileURLToPath } from 'node:url';

export const TESTS_DIR = dirname(fileURLToPath(import.meta.url));
export const UI_DIR = resolve(TESTS_DIR, '..');
export const REPO_DIR = resolve(UI_DIR, '..');
export const CHROMIUM = process.env.RINGWATCH_CHROMIUM || '/usr/bin/chromium';
export const CHROMIUM_ARGS = [
  '--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
  '--disable-background-networking', '--disable-component-update', '--disable-sync',
  '--disable-dev-shm-usage',
];

const TYPES = { '.html': 'text/html; charset=utf-8', '.js': 'text/javascript; charset=utf-8', '.mjs': 'text/javascript; charset=utf-8',
  '.css': 'text/css; charset=utf-8', '.json': 'application/json', '.png': 'image/png' };

/**
 * Serves `root` (and any extra url-prefix -> directory mounts) on 127.0.0.1 at
 * a free port. `api(req, res, url)` may answer a request first (return true).
 */
export function startServer({ root = UI_DIR, mounts = {}, api = null } = {}) {
  const requests = [];
  const server = createServer((req, res) => {
    const url = new URL(req.url, 'http://127.0.0.1');
    requests.push(url.pathname + url.search);
    if (api && api(req, res, url)) return;
    let dir = root, path = decodeURIComponent(url.pathname);
    for (const [prefix, d] of Object.entries(mounts)) {
      if (path.startsWith(prefix)) { dir = d; path = path.slice(prefix.length - 1); break; }
    }
    if (path.endsWith('/')) path += 'index.html';
    const file = normalize(join(dir, path));
    if (!(file + sep).startsWith(resolve(dir) + sep) && file !== resolve(dir)) { res.writeHead(403).end('forbidden'); return; }
    if (!existsSync(file) || !statSync(file).isFile()) { res.writeHead(404, { 'content-type': 'text/plain' }).end('not found: ' + url.pathname); return; }
    res.writeHead(200, { 'content-type': TYPES[extname(file)] || 'application/octet-stream', 'content-length': statSync(file).size, 'cache-control': 'no-store' });
    createReadStream(file).pipe(res);
  });
  return new Promise((resolveP, reject) => {
    server.once('error', reject);
    server.listen(0, '127.0.0.1', () => {
      const { port } = server.address();
      resolveP({ server, base: `http://127.0.0.1:${port}`, requests, close: () => new Promise((r) => server.close(r)) });
    });
  });
}

/** playwright-core from ui/tests/node_modules, installed with `npm ci` from the lock file when absent. */
export async function loadPlaywright() {
  const marker = join(TESTS_DIR, 'node_modules', 'playwright-core', 'package.json');
  if (!existsSync(marker)) {
    console.log('ui-test: installing playwright-core (npm ci in ui/tests)');
    const r = spawnSync('npm', ['ci', '--no-audit', '--no-fund', '--loglevel=error'], { cwd: TESTS_DIR, stdio: 'inherit' });
    if (r.status !== 0) throw new Error('`npm ci` in ui/tests failed (exit ' + r.status + '); playwright-core is needed: cd ui/tests && npm ci');
  }
  const version = JSON.parse(readFileSync(marker, 'utf8')).version;
  const mod = await import(join(TESTS_DIR, 'node_modules', 'playwright-core', 'index.mjs'));
  return { chromium: mod.chromium || mod.default.chromium, version };
}

export async function launch(chromium) {
  return chromium.launch({ executablePath: CHROMIUM, headless: true, args: CHROMIUM_ARGS });
}
