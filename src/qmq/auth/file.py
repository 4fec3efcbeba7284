"""The auth file (``--auth-file``): the apps, their secret hashes and what each may do.

```toml
[apps.shop]
secret_hash = "scrypt$..."        # `qmq auth hash`
produce = ["order.*"]             # subject patterns (qmq.auth.permissions)
consume = ["order.*:billing"]     # subject:group patterns
[apps.ops]
secret_hash = "scrypt$..."
admin = true                      # reset-offset, dead letters, promote, cluster and route changes
[apps.qmq-cluster]
secret_hash = "scrypt$..."
cluster = true                    # the servers' own identity: register, heartbeat, replicate
```
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from qmq.auth.permissions import Grants, parse_consume_patterns, parse_patterns
from qmq.auth.secrets import SecretHash, parse_secret_hash
from qmq.common.errors import ConfigError

APPS_MAX = 10_000
APP_CODE_CHARS_MAX = 200
_APP_KEYS = frozenset({"secret_hash", "produce", "consume", "admin", "cluster"})


@dataclass(frozen=True, slots=True)
class App:
    code: str
    secret: SecretHash
    grants: Grants


@dataclass(frozen=True, slots=True)
class AuthConfig:
    """The apps of one auth file, by app code."""

    apps: dict[str, App]
    source: str

    def app(self, code: str) -> App | None:
        return self.apps.get(code)


def check_app_code(code: object) -> str:
    if not isinstance(code, str) or not code or len(code) > APP_CODE_CHARS_MAX or not code.isprintable():
        raise ConfigError(
            f"app code {code!r} must be a non-empty printable string of at most {APP_CODE_CHARS_MAX} characters"
        )
    return code


def load_auth_file(path: Path) -> AuthConfig:
    """Read and check an auth file; ConfigError naming the file, the app and the key at fault."""
    where = f"auth file {str(path)!r}"
    try:
        with open(path, "rb") as fh:
            doc = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{where} does not exist") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where} is not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{where} cannot be read: {exc.strerror or exc}") from None
    return parse_auth(doc, where)


def parse_auth(doc: dict[str, object], where: str) -> AuthConfig:
    unknown = sorted(set(doc) - {"apps"})
    if unknown:
        raise ConfigError(f"{where}: unknown table(s) {', '.join(unknown)}; an auth file holds [apps.<code>] tables")
    apps_doc = doc.get("apps", {})
    if not isinstance(apps_doc, dict):
        raise ConfigError(f"{where}: apps must be tables, [apps.<code>]")
    if len(apps_doc) > APPS_MAX:
        raise ConfigError(f"{where} has {len(apps_doc)} apps; the limit is {APPS_MAX}")
    apps = {}
    for code, table in apps_doc.items():
        check_app_code(code)
        at = f"{where}, [apps.{code}]"
        if not isinstance(table, dict):
            raise ConfigError(f"{at} must be a table")
        extra = sorted(set(table) - _APP_KEYS)
        if extra:
            raise ConfigError(f"{at}: unknown key(s) {', '.join(extra)}; known keys: {', '.join(sorted(_APP_KEYS))}")
        if "secret_hash" not in table:
            raise ConfigError(f"{at} has no secret_hash; make one with `qmq auth hash`")
        flags = {}
        for key in ("admin", "cluster"):
            value = table.get(key, False)
            if not isinstance(value, bool):
                raise ConfigError(f"{at}: {key} = {value!r} must be true or false")
            flags[key] = value
        grants = Grants(
            produce=parse_patterns(table.get("produce", []), f"{at} produce"),
            consume=parse_consume_patterns(table.get("consume", []), f"{at} consume"),
            admin=flags["admin"],
            cluster=flags["cluster"],
        )
        apps[code] = App(code, parse_secret_hash(table["secret_hash"], at), grants)
    return AuthConfig(apps, where)
