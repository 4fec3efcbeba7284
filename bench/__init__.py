"""qmq's benchmark harness: qmq and its peers (RabbitMQ, NATS JetStream, Redis Streams)
measured by the same workloads in the same run on the same machine.

`python -m bench run` is the one entry point; see bench/README.md.
"""
