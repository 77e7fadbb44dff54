"""JSON schemas that refer to themselves without end: found before the grammar library
sees them.

`{"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}` admits no JSON value: to
write an `a` one must first write an `a`. The grammar library compiles it anyway, into a
rule that derives nothing, and a request held to it could only end at once, its text
empty and its finish reason "stop" (or, under a property, stop after `{"x":`), which is
output reported complete that is not valid. The same holds for `a -> b -> a`, `allOf:
[itself]`, and a required property whose schema is such a cycle.

`dead_schema` finds them: which subschemas can hold a value at all (a least fixed point
over the schema's graph, $refs followed), then the first place that cannot, where it
matters: the root, or a property (or additional property) a value may name, whose key
could be written before the dead end shows. It answers only for cycles: a `false`
schema, a keyword it does not read, a $ref it cannot follow count as able to hold a
value, left to the library (which refuses what it finds unsatisfiable).
"""

from __future__ import annotations

from collections import deque
from typing import Any
from urllib.parse import unquote

# Keywords whose value is one subschema, or a list or a map of them (walked to find every
# subschema a $ref may point into); the ones that decide whether a value exists are
# read in `_requirements`.
ONE = ("additionalProperties", "items", "contains", "not", "if", "then", "else",
       "propertyNames", "unevaluatedItems", "unevaluatedProperties", "additionalItems")  # fmt: skip
LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")  # (items: a list in draft 4)
MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def dead_schema(schema: dict) -> str | None:
    """Where `schema` (its root or a property a value may hold) admits no value because it
    refers to itself without end, as a JSON pointer and a reason; None when no such place
    is found."""
    nodes = _subschemas(schema)
    requirements = {key: _requirements(node, schema) for key, node in nodes.items()}
    alive = _alive(requirements)
    if id(schema) not in alive:
        return "the schema (#) refers to itself without end: no JSON value matches it"
    for node in nodes.values():
        for keyword in ("properties", "patternProperties"):
            for name, sub in _dict(node.get(keyword)).items():
                if isinstance(sub, dict) and id(sub) not in alive:
                    what = "property" if keyword == "properties" else "pattern property"
                    return (
                        f"{what} {name!r} of {_pointer(schema, node)} refers to itself "
                        "without end: no value can follow its key"
                    )
        extra = node.get("additionalProperties")
        if isinstance(extra, dict) and id(extra) not in alive:
            return (
                f"additionalProperties of {_pointer(schema, node)} refers to itself without "
                "end: no value can follow a key"
            )
    return None


def _subschemas(schema: dict) -> dict[int, dict]:
    """Every dict subschema, by id, walked without recursion (a schema may be deep)."""
    found: dict[int, dict] = {}
    todo = [schema]
    while todo:
        node = todo.pop()
        if id(node) in found:
            continue
        found[id(node)] = node
        todo += _children(node)
    return found


def _children(node: dict) -> list[dict]:
    children: list[Any] = [node.get(k) for k in ONE]
    for k in LISTS:
        children += _list(node.get(k))
    for k in MAPS:
        children += _dict(node.get(k)).values()
    return [c for c in children if isinstance(c, dict)]


def _requirements(node: dict, root: dict) -> list[list[int]]:
    """What `node` needs to admit a value: every requirement (a list of node ids) must
    have one member that admits one. Subschemas that are not dicts (true, false), and
    what is not read here, need nothing."""

    def ids(schemas: list[Any]) -> list[int] | None:
        """One requirement: any of `schemas`; None (no requirement) if one is not a dict."""
        if not schemas or any(not isinstance(s, dict) for s in schemas):
            return None
        return [id(s) for s in schemas]

    needs = []
    ref = node.get("$ref")
    if isinstance(ref, str):
        target = _resolve(ref, root)
        if target is not None and target is not node:
            needs.append([id(target)])
        elif target is node:
            needs.append([id(node)])  # "#" at the root, or a $ref to itself
    for member in _list(node.get("allOf")):
        needs.append(ids([member]))
    for keyword in ("anyOf", "oneOf"):
        if isinstance(node.get(keyword), list):
            needs.append(ids(node[keyword]))
    properties = _dict(node.get("properties"))
    for name in _list(node.get("required")):
        if isinstance(name, str) and name in properties:
            needs.append(ids([properties[name]]))
    if _int(node.get("minItems")) > 0 and isinstance(node.get("items"), dict):
        needs.append(ids([node["items"]]))
    for member in _list(node.get("prefixItems"))[: _int(node.get("minItems"))]:
        needs.append(ids([member]))
    return [need for need in needs if need is not None]


def _alive(requirements: dict[int, list[list[int]]]) -> set[int]:
    """The nodes that admit a value: the least set closed under "every requirement has a
    member in it" (a worklist: each node is settled once, each requirement met once)."""
    waiting = {key: len(needs) for key, needs in requirements.items()}
    users: dict[int, list[tuple[int, int]]] = {}  # member -> (node, requirement index)
    for key, needs in requirements.items():
        for index, need in enumerate(needs):
            for member in need:
                users.setdefault(member, []).append((key, index))
    alive = {key for key, count in waiting.items() if count == 0}
    met: set[tuple[int, int]] = set()
    queue = deque(alive)
    while queue:
        member = queue.popleft()
        for key, index in users.get(member, ()):
            if (key, index) in met:
                continue
            met.add((key, index))
            waiting[key] -= 1
            if waiting[key] == 0 and key not in alive:
                alive.add(key)
                queue.append(key)
    return alive


def _resolve(ref: str, root: dict) -> dict | None:
    """A local $ref ("#", "#/$defs/a", JSON pointer escapes and %-encoding) as the
    subschema it names; None for anything else (an anchor, another document)."""
    if not ref.startswith("#") or (len(ref) > 1 and ref[1] != "/"):
        return None
    node: Any = root
    for part in ref[2:].split("/") if len(ref) > 1 else []:
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isascii() and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if isinstance(node, dict) else None


def _pointer(root: dict, node: dict) -> str:
    """`node`'s JSON pointer in `root` (breadth first: the shortest), for the message."""
    queue: deque[tuple[Any, str]] = deque([(root, "#")])
    seen: set[int] = set()
    while queue:
        here, path = queue.popleft()
        if here is node:
            return path
        if id(here) in seen:
            continue
        seen.add(id(here))
        items = here.items() if isinstance(here, dict) else enumerate(here)
        for key, value in items:
            if isinstance(value, (dict, list)):
                escaped = str(key).replace("~", "~0").replace("/", "~1")
                queue.append((value, f"{path}/{escaped}"))
    return "a subschema"


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


def _dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
