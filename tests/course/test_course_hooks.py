"""rose carries nothing for its course or its tests: a learner's piece enters through the
interfaces any user's would (a block manager class given to LLMEngine, a cache given to
the model, a function passed in), never through a hook that exists only for them.

Read from the source of rosetrainer/ and roseinfer/ (ast, not regexes over text):
- an environment variable is read only for a setting a user sets (the list below);
- nothing names the course;
- no member of one of rose's own Protocols is probed with getattr(obj, name, default)
  or hasattr: whoever implements the protocol has the member.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("rosetrainer", "roseinfer")
# Environment variables a user sets (and what for); nothing else is read.
USER_SETTINGS = {
    "TIKTOKEN_CACHE_DIR": "where tiktoken keeps its encodings",
    "WORLD_SIZE": "torchrun's process count",
    "RANK": "torchrun's process rank",
    "LOCAL_RANK": "torchrun's rank on this machine",
    "ROSE_KERNEL_CACHE": "where compiled kernels are kept",
    "CC": "the C compiler for the kernels",
    "PYTHONPATH": "passed on to the grammar helper process",
    "FORWARDED_ALLOW_IPS": "uvicorn's trusted proxies",
    "OMP_NUM_THREADS": "a fixed count of CPU threads (rosetrainer/threads.py)",
}


def sources() -> dict[Path, ast.Module]:
    return {
        path: ast.parse(path.read_text(), str(path))
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
    }


def is_environ(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ"


def environment_reads(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, variable) for os.environ.get(X), os.environ[X], os.getenv(X), X in os.environ;
    X as "?" when it is not a string literal."""

    def name(node: ast.AST) -> str:
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else "?"

    reads = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            if isinstance(func, ast.Attribute) and (
                (func.attr == "get" and is_environ(func.value)) or func.attr == "getenv"
            ):
                reads.append((node.lineno, name(node.args[0])))
        elif isinstance(node, ast.Subscript) and is_environ(node.value):
            reads.append((node.lineno, name(node.slice)))
        elif isinstance(node, ast.Compare) and any(map(is_environ, node.comparators)):
            reads.append((node.lineno, name(node.left)))
    return reads


def protocol_members(trees: dict[Path, ast.Module]) -> set[str]:
    """Every member named in a class of rose's that derives from typing.Protocol."""
    members = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(
                isinstance(base, ast.Name) and base.id == "Protocol" for base in node.bases
            ):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        members.add(item.name)
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        members.add(item.target.id)
    return members


def probes(tree: ast.Module, members: set[str]) -> list[tuple[int, str]]:
    """(line, member) for getattr(obj, "member", default) and hasattr(obj, "member")."""
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        probing = (node.func.id == "getattr" and len(node.args) == 3) or (
            node.func.id == "hasattr" and len(node.args) == 2
        )
        attribute = node.args[1] if probing else None
        if isinstance(attribute, ast.Constant) and attribute.value in members:
            found.append((node.lineno, attribute.value))
    return found


def test_environment_variables_are_read_only_for_user_settings() -> None:
    unknown = [
        f"{path.relative_to(ROOT)}:{line} reads {variable}"
        for path, tree in sources().items()
        for line, variable in environment_reads(tree)
        if variable not in USER_SETTINGS
    ]
    assert not unknown, unknown


def test_nothing_names_the_course() -> None:
    mentions = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in sources()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\b(rose)?course\b", line, re.IGNORECASE)
    ]
    assert not mentions, mentions


def test_no_protocol_member_is_probed() -> None:
    trees = sources()
    members = protocol_members(trees)
    assert {"cache_version", "prepare", "update", "cached_prefix"} <= members  # (it reads them)
    found = [
        f"{path.relative_to(ROOT)}:{line} probes {member}"
        for path, tree in trees.items()
        for line, member in probes(tree, members)
    ]
    assert not found, found


def test_the_checks_find_what_they_look_for() -> None:
    """Each check fails on the hook it exists for (as the scheduler and the engine's
    config once had them)."""
    hooked = ast.parse(
        'import os\nrecord = os.environ.get("ROSE_RECORD_WRITES", "") == "1"\n'
        'version = getattr(manager, "cache_version", None)\n'
        'seen = "ROSE_X" in os.environ or os.getenv("ROSE_Y") or os.environ["ROSE_Z"]\n'
    )
    found = sorted(variable for _, variable in environment_reads(hooked))
    assert found == ["ROSE_RECORD_WRITES", "ROSE_X", "ROSE_Y", "ROSE_Z"]
    assert probes(hooked, {"cache_version"}) == [(3, "cache_version")]
