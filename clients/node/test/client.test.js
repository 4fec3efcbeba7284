// The Node.js client against a real `qmq standalone`: send, sendBatch, pull, ack, nack, the
// ack timeout, and errors.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { QmqClient, QmqError } from '../src/index.js';
import { startStandalone } from '../testing/standalone.js';

let server;
let client;

before(async () => {
  server = await startStandalone();
  client = new QmqClient(server.gateway, { consumerId: 'node-test' });
});

after(async () => {
  await server?.stop();
});

const unique = (what) => `${what}.${randomUUID().slice(0, 12)}`;

async function pullAll(subject, group, count, options = {}) {
  const got = [];
  const deadline = Date.now() + 30_000;
  while (got.length < count && Date.now() < deadline) {
    got.push(...(await client.pull(subject, group, { maxMessages: count - got.length, timeoutMs: 500, ...options })));
  }
  return got;
}

test('the standalone ready line names the gateway', () => {
  assert.match(server.gateway, /^http:\/\/127\.0\.0\.1:\d+$/);
});

test('send, pull and ack: every message once, text and bytes', async () => {
  const subject = unique('node');
  const id = await client.send(subject, { body: 'héllo', properties: { n: 1, ok: true }, tags: ['a'], messageId: 'n-1' });
  assert.equal(id, 'n-1');
  await client.send(subject, { body: new Uint8Array([0xff, 0x00]), messageId: 'n-2' });
  const results = await client.sendBatch(subject, [{ body: 'b1', messageId: 'n-3' }, 'b2']);
  assert.equal(results.length, 2);
  assert.equal(results[0].messageId, 'n-3');
  assert.ok(results.every((r) => !r.error));

  const got = await pullAll(subject, 'g1', 4, { startFrom: 'earliest' });
  assert.deepEqual(got.map((m) => m.messageId).slice(0, 3), ['n-1', 'n-2', 'n-3']);
  assert.equal(got[0].text, 'héllo');
  assert.deepEqual(got[0].properties, { n: 1, ok: true });
  assert.deepEqual(got[0].tags, ['a']);
  assert.equal(got[0].times, 1);
  assert.equal(got[1].text, undefined);
  assert.deepEqual([...got[1].body], [0xff, 0x00]);
  assert.equal(got[3].text, 'b2');

  const acked = await client.ack(got);
  assert.deepEqual(acked.map((r) => r.status), ['acked', 'acked', 'acked', 'acked']);
  assert.deepEqual(await client.pull(subject, 'g1', { timeoutMs: 300 }), []);
});

test('a pull with tags gets only the messages with any, or all, of them', async () => {
  const subject = unique('node-tags');
  await client.sendBatch(subject, [
    { body: '-', messageId: 't-none' },
    { body: 'a', tags: ['a'], messageId: 't-a' },
    { body: 'ab', tags: ['a', 'b'], messageId: 't-ab' },
    { body: 'c', tags: ['c'], messageId: 't-c' },
  ]);
  const any = await pullAll(subject, 'any', 2, { startFrom: 'earliest', tags: ['a', 'b'], tagMatch: 'any' });
  assert.deepEqual(any.map((m) => m.messageId).sort(), ['t-a', 't-ab']);
  const all = await pullAll(subject, 'all', 1, { startFrom: 'earliest', tags: ['a', 'b'], tagMatch: 'all' });
  assert.deepEqual(all.map((m) => m.messageId), ['t-ab']);
  assert.deepEqual(await client.pull(subject, 'all', { timeoutMs: 300, tags: ['a', 'b'], tagMatch: 'all' }), []);
  await client.ack([...any, ...all]);
  await assert.rejects(client.pull(subject, 'all', { timeoutMs: 0, tags: ['c'] }), (err) => {
    assert.ok(err instanceof QmqError);
    assert.equal(err.code, 'TAG_FILTER_CONFLICT');
    assert.equal(err.status, 409);
    return true;
  });
});

test('a message not acked within its ack timeout comes again with times + 1', async () => {
  const subject = unique('node');
  await client.send(subject, { body: 'late', messageId: 'late-1' });
  const [first] = await pullAll(subject, 'g2', 1, { startFrom: 'earliest', ackTimeoutMs: 1000 });
  assert.equal(first.times, 1);
  const [again] = await pullAll(subject, 'g2', 1);
  assert.equal(again.messageId, 'late-1');
  assert.equal(again.times, 2);
  const statuses = await client.ack([first.receipt, again]);
  assert.deepEqual(statuses.map((r) => r.status), ['expired', 'acked']);
});

test('a nacked message comes back after the back-off', async () => {
  const subject = unique('node');
  await client.send(subject, { body: 'retry me', messageId: 'nack-1' });
  const [first] = await pullAll(subject, 'g3', 1, { startFrom: 'earliest' });
  assert.deepEqual((await client.nack([first])).map((r) => r.status), ['nacked']);
  const [again] = await pullAll(subject, 'g3', 1);
  assert.equal(again.messageId, 'nack-1');
  assert.equal(again.times, 2);
  await client.ack([again]);
});

test('a refused request rejects with the gateway error code', async () => {
  await assert.rejects(client.send('bad subject', 'x'), (err) => {
    assert.ok(err instanceof QmqError);
    assert.equal(err.code, 'SUBJECT_INVALID');
    assert.equal(err.status, 400);
    assert.equal(err.retriable, false);
    return true;
  });
  await assert.rejects(client.pull(unique('node'), 'g', { maxMessages: 5000 }), { code: 'VALUE_INVALID', status: 400 });
  const away = new QmqClient('http://127.0.0.1:9', { timeoutMs: 2000 });
  await assert.rejects(away.send('s', 'x'), (err) => err.code === 'NETWORK' && err.retriable);
  assert.throws(() => new QmqClient('localhost:1'), TypeError);
});
