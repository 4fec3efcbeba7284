"""The wire protocol: frames, request and status codes, the message and record codecs.

Sans-IO: bytes in, frames out, and back. Nothing here touches a socket or asyncio.
"""
