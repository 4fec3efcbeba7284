"""The fault campaign: real qmq processes, real faults, and a checker that knows every
acknowledged send and every answered ack. ``python -m chaos run [--quick]``; see
docs/reliability.md."""
