// Send three messages and consume them as consumer group "example", over the HTTP gateway.
//   node examples/send_and_consume.js http://127.0.0.1:8088
import { QmqClient } from '../src/index.js';

const gateway = process.argv[2] ?? process.env.QMQ_GATEWAY ?? 'http://127.0.0.1:8088';
const client = new QmqClient(gateway, { consumerId: 'example-node' });
const subject = 'example.orders';

// a group starts at the latest message: pull once so it exists before the sends
await client.pull(subject, 'example', { timeoutMs: 0 });
for (let i = 1; i <= 3; i++) {
  const id = await client.send(subject, { body: JSON.stringify({ order: i }), properties: { region: 'eu' }, tags: ['new'] });
  console.log(`sent ${id}`);
}
let left = 3;
while (left > 0) {
  const messages = await client.pull(subject, 'example', { maxMessages: 10, timeoutMs: 5000 });
  for (const m of messages) console.log(`received ${m.messageId} (attempt ${m.times}): ${m.text}`);
  await client.ack(messages);
  left -= messages.length;
}
