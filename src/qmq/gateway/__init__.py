"""The HTTP gateway role: HTTP in, the asyncio SDK out (docs/gateway.md)."""
