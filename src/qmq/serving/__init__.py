"""What every server role shares: frame connections, request dispatch and its error answers,
group commit, periodic jobs, registration with the meta server, request-header checks, the
shell of a role that takes frames and keeps a store (``server.FrameServer``: listening,
/metrics and /health, the ready line, the steps of an ordered shutdown), and the process
runner (signals, exit codes).

Roles (broker, delay server) import this package, never one another.
"""
