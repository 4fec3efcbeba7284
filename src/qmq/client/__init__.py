"""The Python SDK: connection, meta discovery, producer, consumer and the blocking facade.

The asyncio classes are re-exported by ``qmq.aio``; the blocking ones by ``qmq``. This
package imports only ``qmq.common`` and ``qmq.protocol``.
"""
