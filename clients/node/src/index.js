// A client of the qmq HTTP gateway (docs/gateway.md): send, pull, ack and nack over the
// built-in fetch, no dependencies. Every method returns a promise; a refused request rejects
// with a QmqError carrying the gateway's error code, the HTTP status and its message.

/** An answer other than 200 from the gateway, or no answer at all. */
export class QmqError extends Error {
  /**
   * @param {string} code - the gateway's error code (SUBJECT_INVALID, THROTTLED, ...) or NETWORK
   * @param {number} status - the HTTP status, 0 when the gateway could not be reached
   * @param {string} message - what was wrong and what to do
   */
  constructor(code, status, message) {
    super(`${code}: ${message}`);
    this.name = 'QmqError';
    this.code = code;
    this.status = status;
  }

  /** Whether sending the same request again may succeed (429, 503: a message_id makes a send safe to repeat). */
  get retriable() {
    return this.status === 0 || this.status === 429 || this.status === 503;
  }
}

const enc = encodeURIComponent;

export class QmqClient {
  /**
   * @param {string} gateway - the gateway's base URL, e.g. http://127.0.0.1:8088 (`gateway=` of `qmq ready`)
   * @param {{timeoutMs?: number, consumerId?: string}} [options] - a request's deadline beyond
   *   its long poll (default 30 s); the consumer id pulls report (default: none)
   */
  constructor(gateway, options = {}) {
    if (typeof gateway !== 'string' || !/^https?:\/\//.test(gateway)) {
      throw new TypeError(`gateway must be an http:// or https:// URL, got ${JSON.stringify(gateway)}`);
    }
    this.gateway = gateway.replace(/\/+$/, '');
    this.timeoutMs = options.timeoutMs ?? 30_000;
    this.consumerId = options.consumerId;
  }

  /**
   * Send one message; resolves with its message id once the broker stored it.
   * @param {string} subject
   * @param {string | Uint8Array | {body?: string | Uint8Array, properties?: object, tags?: string[],
   *   messageId?: string, delayMs?: number, deliverAt?: Date | string}} message - a body alone, or a message
   * @returns {Promise<string>}
   */
  async send(subject, message) {
    const doc = await this.#post(`/v1/subjects/${enc(subject)}/messages`, toWire(message));
    return doc.message_id;
  }

  /**
   * Send a batch (at most 1000); resolves with one result per message, in order:
   * `{messageId}` when stored, `{messageId, error: {code, message}}` when not.
   * @param {string} subject
   * @param {Array<Parameters<QmqClient['send']>[1]>} messages
   * @returns {Promise<Array<{messageId: string, error?: {code: string, message: string}}>>}
   */
  async sendBatch(subject, messages) {
    const doc = await this.#post(`/v1/subjects/${enc(subject)}/messages`, { messages: messages.map(toWire) });
    return doc.results.map((r) => (r.error ? { messageId: r.message_id, error: r.error } : { messageId: r.message_id }));
  }

  /**
   * Long poll: up to `maxMessages`, waiting up to `timeoutMs` for the first. Ack or nack each
   * by its `receipt` within `ackTimeoutMs`, or it goes back to the group (with `times` + 1).
   * @param {string} subject
   * @param {string} group - the consumer group: its consumers share the messages
   * Only messages with any (`tagMatch: 'any'`, the default) or all (`'all'`) of `tags`, when
   * given; the broker filters, and a consumer group pulls with one filter.
   * @param {{maxMessages?: number, timeoutMs?: number, ackTimeoutMs?: number, startFrom?: 'latest' | 'earliest',
   *   tags?: string[], tagMatch?: 'any' | 'all'}} [options]
   * @returns {Promise<Array<{messageId: string, subject: string, properties: object, tags: string[],
   *   body: Uint8Array, text: string | undefined, times: number, receipt: string}>>}
   */
  async pull(subject, group, options = {}) {
    const request = {
      max_messages: options.maxMessages ?? 10,
      timeout_ms: options.timeoutMs ?? 1000,
    };
    if (options.ackTimeoutMs !== undefined) request.ack_timeout_ms = options.ackTimeoutMs;
    if (options.startFrom !== undefined) request.start_from = options.startFrom;
    if (options.tags !== undefined) request.tags = options.tags;
    if (options.tagMatch !== undefined) request.tag_match = options.tagMatch;
    if (this.consumerId !== undefined) request.consumer_id = this.consumerId;
    const doc = await this.#post(`/v1/subjects/${enc(subject)}/groups/${enc(group)}/pull`, request, request.timeout_ms);
    return doc.messages.map((m) => ({
      messageId: m.message_id,
      subject: m.subject,
      properties: m.properties,
      tags: m.tags,
      body: m.body !== undefined ? new TextEncoder().encode(m.body) : Buffer.from(m.body_base64, 'base64'),
      text: m.body,
      times: m.times,
      receipt: m.receipt,
    }));
  }

  /**
   * Acknowledge messages (by receipt, or the messages pull returned), through any gateway of the
   * cluster; resolves once the broker recorded them, with each receipt's status: acked, expired
   * (its ack timeout passed: it comes again), settled (acked or nacked before through another
   * gateway), unrecorded (send it again).
   * @param {Array<string | {receipt: string}>} receipts
   * @returns {Promise<Array<{receipt: string, status: string}>>}
   */
  async ack(receipts) {
    return (await this.#post('/v1/acks', { acks: receipts.map(receiptOf) })).results;
  }

  /**
   * Fail messages: each comes back after its group's back-off with `times` + 1, and after the
   * group's retries goes to its dead letters.
   * @param {Array<string | {receipt: string}>} receipts
   * @returns {Promise<Array<{receipt: string, status: string}>>}
   */
  async nack(receipts) {
    return (await this.#post('/v1/acks', { nacks: receipts.map(receiptOf) })).results;
  }

  async #post(path, doc, longPollMs = 0) {
    let resp;
    try {
      resp = await fetch(this.gateway + path, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify(doc),
        signal: AbortSignal.timeout(this.timeoutMs + longPollMs),
      });
    } catch (err) {
      throw new QmqError('NETWORK', 0, `cannot reach the gateway at ${this.gateway}: ${err.cause?.message ?? err.message}`);
    }
    const text = await resp.text();
    let answer;
    try {
      answer = JSON.parse(text);
    } catch {
      throw new QmqError('BAD_ANSWER', resp.status, `the gateway answered HTTP ${resp.status} with no JSON: ${text.slice(0, 200)}`);
    }
    if (resp.status !== 200) {
      const error = answer?.error ?? {};
      throw new QmqError(error.code ?? 'HTTP_ERROR', resp.status, error.message ?? text.slice(0, 200));
    }
    return answer;
  }
}

function receiptOf(r) {
  if (typeof r === 'string') return r;
  if (r && typeof r.receipt === 'string') return r.receipt;
  throw new TypeError(`a receipt must be a string or a pulled message, got ${JSON.stringify(r)}`);
}

function toWire(message) {
  if (typeof message === 'string' || message instanceof Uint8Array) message = { body: message };
  if (message === null || typeof message !== 'object') {
    throw new TypeError(`a message must be a string, bytes or an object, got ${JSON.stringify(message)}`);
  }
  const out = {};
  if (message.body instanceof Uint8Array) out.body_base64 = Buffer.from(message.body).toString('base64');
  else if (message.body !== undefined) out.body = message.body;
  if (message.properties !== undefined) out.properties = message.properties;
  if (message.tags !== undefined) out.tags = message.tags;
  if (message.messageId !== undefined) out.message_id = message.messageId;
  if (message.delayMs !== undefined) out.delay_ms = message.delayMs;
  if (message.deliverAt !== undefined) {
    out.deliver_at = message.deliverAt instanceof Date ? message.deliverAt.toISOString() : message.deliverAt;
  }
  return out;
}
