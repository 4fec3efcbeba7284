"""Auth files for tests of a cluster with authentication: the cluster's own app ``qmq-cluster``
(``cluster = true``, its secret the servers' ``$QMQ_SECRET``) and an admin app ``ops``, plus
whatever apps a test adds as TOML."""

from __future__ import annotations

from pathlib import Path

from qmq.auth.secrets import hash_secret


def write_auth_file(path: Path, cluster_secret: str, ops_secret: str, apps: str = "", *, ops_grants: str = "") -> Path:
    """Write the auth file at ``path`` and return it; ``ops_grants`` adds lines to ``[apps.ops]``."""
    path.write_text(
        f"""
[apps.qmq-cluster]
secret_hash = "{hash_secret(cluster_secret, log2_n=8)}"
cluster = true
[apps.ops]
secret_hash = "{hash_secret(ops_secret, log2_n=8)}"
admin = true
{ops_grants}
{apps}
"""
    )
    return path
