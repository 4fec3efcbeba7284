"""Storage of the realtime broker: segment files, the message log, consume logs, the action
log, consumer progress, checkpoints and recovery. Synchronous and asyncio-free: the broker
calls it on its event loop and runs only fsync on a worker thread.
"""
