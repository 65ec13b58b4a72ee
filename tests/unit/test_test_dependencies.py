"""A fresh clone's ``bash scripts/test.sh`` installs every third-party package the tests import:
each one is declared in ``pyproject.toml`` (the runtime dependencies or an extra that
scripts/test.sh installs), or is a direct requirement of one that is (a test that imports an
undeclared package fails at collection on a new machine, after minutes of installing)."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _name(requirement: str) -> str:
    """A requirement's distribution name, normalised (PEP 503)."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)).lower()


def _installed_extras() -> list[str]:
    """The extras scripts/test.sh installs (its ``pip install -e ".[...]"``)."""
    return re.search(r'-e "\.\[([^\]]+)\]"', (ROOT / "scripts/test.sh").read_text()).group(1).split(",")


def _declared() -> set[str]:
    """Distributions the test install brings: the declared ones and their direct requirements."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {_name(r) for r in project["dependencies"]}
    for extra in _installed_extras():
        names |= {_name(r) for r in project["optional-dependencies"][extra]}
    direct = set(names)
    for name in direct:
        try:
            names |= {_name(r) for r in metadata.requires(name) or () if "extra ==" not in r}
        except metadata.PackageNotFoundError:
            pass
    return names


def _imported_modules() -> set[str]:
    """Top-level third-party modules the test files import (anywhere in the file)."""
    found = set()
    for path in (ROOT / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return {m for m in found if m not in sys.stdlib_module_names and m not in ("samebits", "tests")}


def test_every_package_the_tests_import_is_installed_by_the_test_script():
    dists = metadata.packages_distributions()
    declared = _declared()
    missing = {}
    for module in sorted(_imported_modules()):
        names = {_name(d) for d in dists.get(module, [module])}
        if not names & declared:
            missing[module] = sorted(names)
    assert missing == {}, f"imported by tests but not in pyproject's test install: {missing}"
