"""Who may do what: app identities, secret hashing, permission checks, the challenge-response
handshake and the delay of repeated failed handshakes.

Sans-IO like ``qmq.protocol``: nothing here imports asyncio or touches a socket, so the servers'
connection layer (``qmq.serving``), the meta server's HTTP and the SDK share it.
"""
