"""Build the API reference of qmq's public modules from their docstrings (pdoc), as HTML:

    .venv/bin/python scripts/api_reference.py [OUT]     # OUT defaults to site/api; open OUT/index.html

The build fails (exit 1, each problem on a line of stderr) on any warning pdoc gives (a
signature or annotation it cannot read, say) and on a broken reference: a docstring naming
``qmq.something`` that does not exist. tests/docs/test_api_reference.py runs it in CI.
"""

from __future__ import annotations

import importlib
import re
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pdoc
import pdoc.doc
import pdoc.extract
import pdoc.render

# What a user of qmq imports: the blocking SDK and the errors (qmq), the asyncio SDK (qmq.aio,
# qmq.aio.tx), transactional sends, idempotent checkers and the Spark data source. A package
# stands for itself and what it exports; its inner modules are the implementation. A spec
# starting with ! is a regular expression of module names to leave out (pdoc's syntax).
MODULES = (
    "qmq",
    r"!qmq\..*",
    "qmq.aio",
    "qmq.aio.tx",
    "qmq.tx",
    r"!qmq\.tx\..*",
    "qmq.idempotency",
    r"!qmq\.idempotency\..*",
    "qmq.spark",
    r"!qmq\.spark\..*",
)
DEFAULT_OUT = Path("site/api")
# ``qmq.x.y`` in double or single backticks: a reference to a module or a name of qmq
_REFERENCE = re.compile(r"`{1,2}(qmq(?:\.\w+)+)(?:\(\))?`{1,2}")
# Names in backticks that read like references and are not: message properties qmq sets.
_NOT_REFERENCES = frozenset({"qmq.error"})


def build(out: Path, specs: tuple[str, ...] = MODULES) -> list[str]:
    """Write the reference of ``specs`` (pdoc's module names and ``!`` exclusions) into ``out``;
    the problems found (empty: a clean build)."""
    pdoc.render.configure(docformat="restructuredtext", show_source=False, search=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        names = pdoc.extract.walk_specs(list(specs))
        for name in names:
            _resolve_lazy_exports(importlib.import_module(name))
        pdoc.pdoc(*specs, output_directory=out)
        modules = [pdoc.doc.Module.from_name(name) for name in names]
    problems = [f"pdoc: {w.category.__name__}: {w.message}" for w in caught]
    for doc in _documented(modules):
        for name in _REFERENCE.findall(doc.docstring):
            if name not in _NOT_REFERENCES and not _resolves(name):
                problems.append(f"{doc.fullname}: its docstring names {name}, which does not exist")
    return problems


def _resolve_lazy_exports(module: ModuleType) -> None:
    """Put the names of ``__all__`` a package imports on first use (``qmq.Producer``: the
    blocking SDK stays unloaded until asked for) into its namespace, where pdoc looks."""
    namespace = vars(module)
    for name in getattr(module, "__all__", ()):
        if name not in namespace:
            namespace[name] = getattr(module, name)


def _documented(modules: list[pdoc.doc.Module]) -> Iterator[pdoc.doc.Doc[object]]:
    """Every module, class, function and variable the reference shows."""
    stack: list[pdoc.doc.Doc[object]] = list(modules)
    seen: set[str] = set()
    while stack:
        doc = stack.pop()
        if doc.fullname in seen:
            continue
        seen.add(doc.fullname)
        yield doc
        if isinstance(doc, pdoc.doc.Namespace):
            stack.extend(doc.members.values())


def _resolves(name: str) -> bool:
    """Whether ``name`` is a module of qmq or a name in one (an attribute of an attribute ...)."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else DEFAULT_OUT
    problems = build(out)
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        print(f"api reference: {len(problems)} problem(s); nothing to publish", file=sys.stderr)
        return 1
    print(f"api reference: {out / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
