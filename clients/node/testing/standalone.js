// Start a real `qmq standalone` (the project's .venv, or $QMQ_PYTHON) on port 0 and wait for its
// `qmq ready` line, with a deadline; never a sleep.
import { spawn } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve, dirname } from 'node:path';
import { fileURLToPath } from 'node:url';

const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), '..', '..', '..');
const READY_TIMEOUT_MS = 90_000;

export async function startStandalone() {
  const python = process.env.QMQ_PYTHON ?? join(ROOT, '.venv', 'bin', 'python');
  const dataDir = mkdtempSync(join(tmpdir(), 'qmq-node-'));
  const child = spawn(
    python,
    ['-m', 'qmq', 'standalone', '--data-dir', join(dataDir, 'data'), '--host', '127.0.0.1',
      '--meta-port', '0', '--broker-port', '0', '--delay-port', '0', '--gateway-port', '0'],
    { stdio: ['ignore', 'pipe', 'inherit'], env: { ...process.env, QMQ_LOG_LEVEL: 'WARNING' } },
  );
  const ready = await new Promise((resolveReady, reject) => {
    let buffered = '';
    const timer = setTimeout(() => {
      child.kill('SIGKILL');
      reject(new Error(`qmq standalone printed no ready line within ${READY_TIMEOUT_MS} ms`));
    }, READY_TIMEOUT_MS);
    child.on('exit', (code) => {
      clearTimeout(timer);
      reject(new Error(`qmq standalone (${python}) exited with status ${code} before it was ready`));
    });
    child.stdout.on('data', (chunk) => {
      buffered += chunk.toString('utf8');
      for (const line of buffered.split('\n')) {
        if (line.startsWith('qmq ready')) {
          clearTimeout(timer);
          resolveReady(Object.fromEntries(line.split(/\s+/).slice(2).map((p) => p.split(/=(.*)/s, 2))));
        }
      }
      buffered = buffered.slice(buffered.lastIndexOf('\n') + 1);
    });
  });
  child.stdout.resume(); // keep draining, so the process never blocks on a full pipe
  return {
    ready,
    gateway: ready.gateway,
    async stop() {
      const exited = new Promise((r) => child.once('exit', r));
      child.kill('SIGTERM');
      await exited;
      rmSync(dataDir, { recursive: true, force: true });
    },
  };
}
