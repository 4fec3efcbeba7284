"""Configuration, limits, clocks, errors and logging shared by every role. Imports nothing of qmq."""
