"""What every server role shares: frame connections, group commit, registration with the
meta server, request-header checks, and the process runner (ready line, signals, exit codes).

Roles (broker, delay server) import this package, never one another.
"""
