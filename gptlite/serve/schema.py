"""The checks a response_format's JSON schema passes before the grammar engine (llguidance) sees it, so that what the
engine cannot take is a plain 400 instead of its crash, its panic or its failure halfway through an output.

llguidance is native code. Fed a schema past what it was built for, it may fail in ways that no message of its own
explains: a chain of a thousand `$ref`s overflows its stack and kills the process; a schema that is its own
definition (`{"$ref": "#"}`, `$defs` that refer to each other in a loop) fails at the first token with
"NoExtensionBias"; a pattern of nested counted repetitions (`^(a{1,1000}){1000}$`) fails after the output's first
characters with "too many expressions constructed"; a very large schema may trip one of its assertions. `check_schema`
walks the schema once, following its local `$ref`s, and refuses each of these with the value, the limit and the
fix; what it lets through is still checked by llguidance, whose own messages are plain for everything else (an
unknown type, an unsatisfiable range, a pattern that does not parse).
"""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import unquote

MAX_SCHEMA_CHARS = 256 * 1024  # the schema's compact JSON text; OpenAI caps a schema's strings at 120,000 characters
MAX_SCHEMA_DEPTH = 64  # subschemas nested in one another, following $refs (OpenAI allows 10 levels of objects)
MAX_SCHEMA_WALK = 100_000  # subschemas visited by the walk, each $ref's target once per path that reaches it
MAX_PATTERN_REPEATS = 500  # the product of the counts of repetitions nested in one another in a pattern

# keywords whose value is one subschema, a list of them, or an object whose values are subschemas
ONE = ("additionalProperties", "items", "contains", "propertyNames", "not", "if", "then", "else")
ONE += ("unevaluatedProperties", "unevaluatedItems", "additionalItems")
MANY = ("anyOf", "allOf", "oneOf", "prefixItems")
NAMED = ("properties", "patternProperties", "dependentSchemas")
# keywords that stand for the schema itself: a loop made of these alone is a schema defined as itself
SAME = ("$ref", "allOf")


def check_schema(schema: Any) -> None:
    """ValueError naming the problem, the limit and the fix, for a schema the grammar engine must not be given (see
    the module docstring)."""
    size = len(json.dumps(schema, ensure_ascii=False, separators=(",", ":")))
    if size > MAX_SCHEMA_CHARS:
        raise ValueError(
            f"the schema is {size:,} characters of JSON, over this server's limit of {MAX_SCHEMA_CHARS:,}; "
            "send a smaller schema (fewer properties, shorter enums and descriptions)"
        )
    Walk(schema).run()


class Walk:
    """One depth-first walk of a schema from its root through its subschemas and its local $refs' targets, each
    path stopping where it would enter a subschema it is already inside (a recursive schema)."""

    def __init__(self, root: Any):
        self.root = root
        self.visited = 0

    def run(self) -> None:
        # the path: (the subschema, its location, (the keyword that led into it, whether every instance of the
        # subschema above it holds an instance of it)) from the root down
        self.check_keywords(self.root, "#")
        stack = [(self.root, "#", None, iter(self.children(self.root, "#")))]
        on_path = {id(self.root): 0}
        while stack:
            node, where, _, children = stack[-1]
            step = next(children, None)
            if step is None:
                stack.pop()
                on_path.pop(id(node), None)
                continue
            child, child_where, keyword, held = step
            if id(child) in on_path:  # a loop back to a schema on the path: recursion, fine unless it adds nothing
                self.check_loop(stack[on_path[id(child)] :], (keyword, held), child_where)
                continue
            self.visited += 1
            if self.visited > MAX_SCHEMA_WALK:
                raise ValueError(
                    f"the schema expands to more than {MAX_SCHEMA_WALK:,} subschemas once its $refs are followed; "
                    "send a smaller schema, or one whose definitions refer to fewer others"
                )
            if len(stack) >= MAX_SCHEMA_DEPTH:
                raise ValueError(
                    f"the schema nests more than {MAX_SCHEMA_DEPTH} subschemas deep at {child_where} (its $refs "
                    "followed); send a flatter schema"
                )
            self.check_keywords(child, child_where)
            on_path[id(child)] = len(stack)
            stack.append((child, child_where, (keyword, held), iter(self.children(child, child_where))))

    def check_keywords(self, node: Any, where: str) -> None:
        """A subschema's own keywords that the grammar engine may not survive: its pattern, its patternProperties'
        patterns."""
        if not isinstance(node, dict):
            return
        if isinstance(node.get("pattern"), str):
            check_pattern(node["pattern"], f"{where}/pattern")
        if isinstance(node.get("patternProperties"), dict):
            for pattern in node["patternProperties"]:
                check_pattern(pattern, f"{where}/patternProperties")

    def children(self, node: Any, where: str):
        """(subschema, its location, the keyword that holds it, whether every instance of node holds an instance of
        it) for each subschema of node, its $ref's target last. Held in every instance: a $ref's target and an
        allOf's parts (node is also each of them), a required property of an object, an item of an array that must
        have it (minItems)."""
        if not isinstance(node, dict):
            return
        for keyword in ONE:
            if isinstance(node.get(keyword), (dict, bool)):
                yield node[keyword], f"{where}/{keyword}", keyword, keyword == "items" and min_items(node) > 0
            elif keyword == "items" and isinstance(node.get(keyword), list):  # the draft-7 form of prefixItems
                for i, s in enumerate(node[keyword]):
                    yield s, f"{where}/items/{i}", keyword, i < min_items(node)
        for keyword in MANY:
            if isinstance(node.get(keyword), list):
                for i, s in enumerate(node[keyword]):
                    # allOf: every part; prefixItems: the items an array must have; anyOf, oneOf: the output's choice
                    held = keyword == "allOf" or (keyword == "prefixItems" and i < min_items(node))
                    yield s, f"{where}/{keyword}/{i}", keyword, held
        for keyword in NAMED:
            if isinstance(node.get(keyword), dict):
                named = required_properties(node) if keyword == "properties" else set()
                yield from ((s, f"{where}/{keyword}/{k}", keyword, k in named) for k, s in node[keyword].items())
        ref = node.get("$ref")
        if isinstance(ref, str):
            target = resolve(self.root, ref)
            if target is not None:
                yield target, ref, "$ref", True

    def check_loop(self, loop: list[tuple], last: tuple[str, bool], back: str) -> None:
        """A path from a subschema back to itself: refused when every step on it is a $ref or an allOf, so that the
        schema is defined as itself and no JSON can follow it; and when every step on it is held in every instance
        (a required property, an item an array must have), so that every output would nest without end: none is
        finite."""
        steps = [entry[2] for entry in loop[1:]] + [last]
        places = " -> ".join([entry[1] for entry in loop] + [back])
        if all(keyword in SAME for keyword, _ in steps):
            raise ValueError(
                f"the schema refers to itself with no JSON in between ({places}), so no output can follow it; "
                "give the loop a type, or put the recursion inside properties or items"
            )
        if all(required for _, required in steps):
            raise ValueError(
                f"the schema requires itself inside itself ({places}): every output would nest without end, so no "
                "finite JSON follows it; make the recursion optional (leave the property out of required, or let "
                "the array be empty)"
            )


def required_properties(node: dict) -> set[str]:
    """The properties every instance of an object schema has: its `required`, where it can only be an object (a
    schema of no type also takes a number, which has no properties)."""
    names = node.get("required")
    if only_type(node) != "object" or not isinstance(names, list):
        return set()
    return {name for name in names if isinstance(name, str)}


def min_items(node: dict) -> int:
    """The items every instance of an array schema has (its minItems, where it can only be an array), else 0."""
    count = node.get("minItems")
    if only_type(node) != "array" or not isinstance(count, int) or isinstance(count, bool):
        return 0
    return count


def only_type(node: dict) -> str | None:
    """The one JSON type a schema allows, where its `type` names one."""
    kind = node.get("type")
    if isinstance(kind, list) and len(kind) == 1:
        kind = kind[0]
    return kind if isinstance(kind, str) else None


def resolve(root: Any, ref: str) -> Any | None:
    """The subschema a local $ref ("#", "#/$defs/name", JSON pointer escapes included) points at; None for another
    document's, or a pointer to nothing (llguidance says which)."""
    if not ref.startswith("#"):
        return None
    node = root
    pointer = unquote(ref[1:])
    if not pointer:
        return root
    if not pointer.startswith("/"):  # an anchor ("#name"): llguidance resolves those itself
        return None
    for part in pointer[1:].split("/"):
        key = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return None
    return node if isinstance(node, (dict, bool)) else None


def check_pattern(pattern: str, where: str) -> None:
    """ValueError for a pattern whose nested counted repetitions multiply past MAX_PATTERN_REPEATS (such as
    (a{1,100}){100}): the grammar engine's lexer builds an expression for each way through them. A pattern Python
    cannot parse is left to llguidance, which says what is wrong with it."""
    try:
        parsed = re_parser().parse(pattern)
    except (re.error, RecursionError, OverflowError, ValueError):
        return
    repeats = nested_repeats(parsed)
    if repeats > MAX_PATTERN_REPEATS:
        raise ValueError(
            f"the pattern at {where} ({shorten(pattern)}) nests repetitions whose counts multiply to {repeats:,}, "
            f"over this server's limit of {MAX_PATTERN_REPEATS}; write it with fewer or smaller nested counts "
            "(e.g. a{1,1000} instead of (a{1,10}){100})"
        )


def re_parser():
    """Python's regular-expression parser (`re._parser`, `sre_parse` before Python 3.11)."""
    try:
        from re import _parser
    except ImportError:  # Python 3.10
        import sre_parse as _parser
    return _parser


def nested_repeats(items) -> int:
    """The largest product of the counts of repetitions nested in one another in a parsed pattern: a{1,5} inside
    (...){10} is 50. A count is a repetition's maximum, or its minimum where it has none (so ?, * and + count 1);
    a repetition with nothing counted inside it is no nesting (a{1,100000} is 1)."""
    best = 1
    for op, arg in items:
        for sub, count in parts(op, arg):
            inner = chain(sub)
            if count > 1 and inner > 1:
                best = max(best, count * inner)
            best = max(best, nested_repeats(sub))
    return best


def chain(items) -> int:
    """The largest product of the counts of repetitions nested in one another, one repetition alone included."""
    best = 1
    for op, arg in items:
        for sub, count in parts(op, arg):
            best = max(best, count * chain(sub))
    return best


def parts(op, arg) -> list[tuple]:
    """The parsed sub-patterns of one item of a parsed pattern, each with its repetition count (1: not repeated)."""
    parser = re_parser()
    if op in (parser.MAX_REPEAT, parser.MIN_REPEAT, getattr(parser, "POSSESSIVE_REPEAT", None)):
        low, high, sub = arg
        return [(sub, max(low, 1) if high == parser.MAXREPEAT else max(high, 1))]
    if op is parser.SUBPATTERN:
        return [(arg[-1], 1)]
    if op is parser.BRANCH:
        return [(branch, 1) for branch in arg[1]]
    if op is getattr(parser, "ATOMIC_GROUP", None):
        return [(arg, 1)]
    return []


def shorten(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
