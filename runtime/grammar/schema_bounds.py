"""The rewrite that makes every JSON document of a schema end, before llguidance sees it.

Receives one document's JSON Schema (a request's ``response_format`` schema or
a tool's ``parameters``) and emits a copy (``SchemaBounds.rewrite``) in which
integers get 64-bit bounds and numbers a bounded integer part and at most ten
decimals where the schema leaves them open (llguidance bounds digits only
through ``minimum``/``maximum`` and a decimal ``multipleOf``), values the schema
leaves free (``{}``, ``true``, extra properties) get the same bounds through one
recursive definition, and, for closed documents (``strict: true``, tool
arguments), objects allow no properties the schema does not name. Raises
``ClientError`` (400) naming what cannot be bounded. Used by
``runtime.grammar.compiler``; no MLX, no llguidance calls.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from runtime.errors import ClientError

# Numbers where the schema leaves them open. llguidance bounds an integer's digits
# only through minimum/maximum (read as 64-bit floats: -2**63 itself cannot be
# built, so the lowest bound is the next float up) and a number's decimals only
# through a decimal multipleOf (1e-10 is the finest it accepts). Bounded numbers
# are written without an exponent.
INTEGER_MIN = -(2**63) + 1024
INTEGER_MAX = 2**63 - 1
NUMBER_LIMIT = 1e16  # |x| < 10**16: at most 16 digits before the point
NUMBER_STEP = 1e-10  # at most 10 decimals
# The definitions a rewritten schema refers to (an integer or a number the schema
# leaves unbounded, a value it leaves free): shared, llguidance builds each once.
SHARED_DEFINITIONS = {"integer": "x-bounded-integer", "number": "x-bounded-number",
                      "json": "x-bounded-json-value"}

# Keywords that describe a schema without constraining its instances.
_ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
    "writeOnly", "$schema", "$id", "$anchor", "$defs", "definitions", "discriminator",
})
# Keywords that restrict the types a typeless schema's instance may have (the
# restriction is bounded where it is defined: a $ref's target, each branch).
_RESTRICTING = frozenset({"enum", "const", "$ref", "anyOf", "oneOf", "allOf", "not"})
_OBJECT_KEYWORDS = frozenset({
    "properties", "required", "patternProperties", "additionalProperties", "minProperties",
    "maxProperties",
})
_ARRAY_KEYWORDS = frozenset({"items", "prefixItems", "minItems", "maxItems"})
_COMBINATORS = ("allOf", "anyOf", "oneOf")
_NAMED_SCHEMAS = ("properties", "patternProperties", "$defs", "definitions")


def _partial_members(node: Mapping, key: str) -> bool:
    """Whether ``node[key]``'s members are parts of a schema rather than whole ones:
    llguidance intersects them with each other (``allOf``) or with the keywords
    beside them, where our additions to both would meet (and could conflict)."""
    return key == "allOf" or bool(set(node) - _ANNOTATIONS - {key})


class SchemaBounds:
    """A copy of one document's schema whose every value ends, and, ``closed``,
    whose objects have no properties the schema does not name.

    * An integer the schema leaves unbounded on a side gets ``INTEGER_MIN`` /
      ``INTEGER_MAX`` there (the schema's own bound stays where it is tighter);
      a number gets ``|x| < NUMBER_LIMIT`` and, without a ``multipleOf`` of its
      own, ``multipleOf: NUMBER_STEP``. A schema whose own bounds lie outside
      these is a ClientError (its numbers could not be written).
    * A value the schema leaves free (``{}``, ``true``, an array's items, an
      object's extra properties) is any JSON value whose numbers are bounded as
      above. Where a schema is nothing but its type (and annotations), it refers to
      a definition of ``SHARED_DEFINITIONS`` instead of repeating it: llguidance
      builds a bounded number's regular expression each time it meets one (~1.5 ms).
      A ``oneOf`` branch keeps its bounds inline: llguidance proves the branches
      disjoint by their types, which it does not look up through a ``$ref``.
    * ``closed``: an object schema (one typed ``object`` or using object keywords)
      that leaves ``additionalProperties`` unspecified gets ``false``, its names
      completed by those its ``allOf`` (or ``anyOf``/``oneOf`` beside other
      keywords) members and ``$ref`` declare; ``patternProperties``, or a member
      allowing more, leaves it open. Without ``closed`` such properties are
      allowed (JSON Schema's default) and bounded as free values.
    * The members of ``allOf``, and of ``anyOf``/``oneOf`` beside other keywords,
      and the definitions those (or a ``$ref`` beside other keywords) refer to,
      are parts of a schema: left as written at their own level (their nested
      schemas are rewritten); the schema holding them is bounded and closed.
    """

    def __init__(self, root: dict, *, closed: bool, param: str):
        self.root, self.closed, self.param = root, closed, param
        defs = root.get("$defs", {})
        if not isinstance(defs, Mapping):
            raise ClientError(f"{param}.$defs must be an object", param=param)
        taken = set(defs)
        self.names = {}
        for kind, name in SHARED_DEFINITIONS.items():
            while name in taken:
                name += "_"
            self.names[kind] = name
        self.used: set[str] = set()
        self.extended: set[str] = set()
        self._find_extended(root)

    def rewrite(self) -> dict:
        out = self._node(self.root, partial=False)
        if "json" in self.used:
            self.used.add("number")
        if self.used:
            out = dict(out)
            out["$defs"] = {**(out.get("$defs") or {}), **{
                self.names[kind]: self._definition(kind) for kind in sorted(self.used)}}
        return out

    # ---------------------------------------------------------------- walking

    def _children(self, node: Mapping):
        """(key, sub-schema or list or mapping of them) that the rewrite descends into."""
        for key in (*_NAMED_SCHEMAS, "additionalProperties", "items", "additionalItems", "prefixItems",
                    *_COMBINATORS):
            if key in node:
                yield key, node[key]

    def _find_extended(self, node: Any) -> None:
        if not isinstance(node, Mapping):
            return
        ref = node.get("$ref")
        if isinstance(ref, str) and set(node) - _ANNOTATIONS - {"$ref"}:
            self.extended.add(ref)
        for key in _COMBINATORS:
            members = node.get(key)
            if isinstance(members, list) and _partial_members(node, key):
                self.extended.update(m["$ref"] for m in members
                                     if isinstance(m, Mapping) and isinstance(m.get("$ref"), str))
        for key, child in self._children(node):
            if key in _NAMED_SCHEMAS and isinstance(child, Mapping):
                child = list(child.values())
            for sub in child if isinstance(child, list) else (child,):
                self._find_extended(sub)

    def _node(self, node: Any, *, partial: bool = False, inline: bool = False) -> Any:
        if node is True:
            return node if partial else self._ref("json")
        if not isinstance(node, Mapping):
            return node  # false, or not a schema: llguidance says so
        out = dict(node)
        combined = any(isinstance(out.get(k), list) and _partial_members(out, k)
                       for k in _COMBINATORS)
        for key, child in self._children(node):
            if key in _NAMED_SCHEMAS[:2] and isinstance(child, Mapping):
                out[key] = {name: self._node(sub) for name, sub in child.items()}
            elif key in _NAMED_SCHEMAS[2:] and isinstance(child, Mapping):
                at_root = node is self.root
                out[key] = {name: self._node(sub, partial=at_root
                                             and f"#/{key}/{name}" in self.extended)
                            for name, sub in child.items()}
            elif key in _COMBINATORS and isinstance(child, list):
                # llguidance proves oneOf's branches disjoint by their types: not through a $ref
                out[key] = [self._node(m, partial=_partial_members(node, key),
                                       inline=key == "oneOf") for m in child]
            elif key in ("items", "prefixItems") and isinstance(child, list):
                out[key] = [self._node(m) for m in child]
            elif child is True and combined:
                pass  # free beside parts: left as written (see the class docstring)
            else:
                out[key] = self._node(child)
        if partial:
            return out
        keys = set(out)
        declared = out.get("type")
        types = {declared} if isinstance(declared, str) else (
            {t for t in declared if isinstance(t, str)} if isinstance(declared, list) else None)
        if not combined and not inline and keys - _ANNOTATIONS <= {"type"}:
            shared = self._shared(out, types)
            if shared is not None:
                return shared
        restricted = bool(keys & _RESTRICTING)

        def may_be(kind: str, keywords: frozenset) -> bool:
            if types is not None:
                return kind in types
            return not restricted or bool(keys & keywords)

        if types is not None and "number" in types or types is None and not restricted:
            self._bound(out, -NUMBER_LIMIT, NUMBER_LIMIT, exclusive=True, kind="a number")
            if not combined and "multipleOf" not in out:
                out["multipleOf"] = NUMBER_STEP
        elif types is not None and "integer" in types:
            self._bound(out, INTEGER_MIN, INTEGER_MAX, exclusive=False, kind="an integer")
        if may_be("array", _ARRAY_KEYWORDS) and "items" not in out and not combined:
            out["items"] = self._ref("json")
        speaks = self._is_object(out, ())
        if (speaks or may_be("object", _OBJECT_KEYWORDS)) and "additionalProperties" not in out:
            if self.closed and speaks and "patternProperties" not in out:
                names = self._names(out, ())
                if names is not None and isinstance(out.get("properties", {}), Mapping):
                    properties = dict(out.get("properties", {}))
                    for name in names:
                        properties.setdefault(name, True)
                    out["properties"] = properties
                    out["additionalProperties"] = False
            elif not combined:
                out["additionalProperties"] = self._ref("json")
        return out

    # ----------------------------------------------------------------- numbers

    def _bound(self, out: dict, low: float, high: float, *, exclusive: bool, kind: str) -> None:
        """Intersect the schema's bounds with ``low..high`` (open ends if ``exclusive``)."""
        lower = _own_bound(out, "minimum", "exclusiveMinimum", max)
        upper = _own_bound(out, "maximum", "exclusiveMaximum", min)
        if (lower is not None and _empty(lower, (high, exclusive))
                or upper is not None and _empty((low, exclusive), upper)):
            raise ClientError(
                f"{self.param}: {kind}'s bounds must overlap {low}..{high}, the values "
                "written with a bounded number of digits", param=self.param)
        if lower is None or _looser(lower, (low, exclusive), below=True):
            out.pop("minimum", None)
            out.pop("exclusiveMinimum", None)
            out["exclusiveMinimum" if exclusive else "minimum"] = low
        if upper is None or _looser(upper, (high, exclusive), below=False):
            out.pop("maximum", None)
            out.pop("exclusiveMaximum", None)
            out["exclusiveMaximum" if exclusive else "maximum"] = high

    # ------------------------------------------------------------------ objects

    def _is_object(self, node: Any, seen: tuple[str, ...]) -> bool:
        """Whether a schema (or, for its parts, one of them) speaks about objects."""
        if not isinstance(node, Mapping):
            return False
        declared = node.get("type")
        if declared == "object" or isinstance(declared, list) and "object" in declared:
            return True
        if set(node) & _OBJECT_KEYWORDS:
            return True
        parts = [m for key in _COMBINATORS if isinstance(node.get(key), list)
                 and _partial_members(node, key) for m in node[key]]
        ref = node.get("$ref")
        if isinstance(ref, str) and ref not in seen and set(node) - _ANNOTATIONS - {"$ref"}:
            parts.append(_resolve(self.root, ref))
            seen = (*seen, ref)
        for part in parts:
            if isinstance(part, Mapping) and isinstance(part.get("$ref"), str):
                if part["$ref"] in seen:
                    continue
                seen = (*seen, part["$ref"])
                part = _resolve(self.root, part["$ref"])
            if self._is_object(part, seen):
                return True
        return False

    def _names(self, node: Mapping, seen: tuple[str, ...]) -> list[str] | None:
        """The property names ``node`` declares, with those of its parts; ``None`` when
        a part allows more (or cannot be read)."""
        properties, required = node.get("properties"), node.get("required")
        names = [n for n in properties if isinstance(n, str)] if isinstance(properties, Mapping) \
            else []
        names += [n for n in required if isinstance(n, str)] if isinstance(required, list) else []
        parts = []
        ref = node.get("$ref")
        if isinstance(ref, str):
            parts.append(node)  # resolved below
        for key in _COMBINATORS:
            members = node.get(key)
            if isinstance(members, list) and _partial_members(node, key):
                parts.extend(members)
        for part in parts:
            if isinstance(part, Mapping) and isinstance(part.get("$ref"), str):
                ref = part["$ref"]
                if ref in seen:
                    continue
                target = _resolve(self.root, ref)
                if target is None:
                    return None
                seen = (*seen, ref)
                if part is not node:
                    sub = self._part_names(part, seen)
                    if sub is None:
                        return None
                    names += sub
                part = target
            if part is node:
                continue
            sub = self._part_names(part, seen)
            if sub is None:
                return None
            names += sub
        return list(dict.fromkeys(names))

    def _part_names(self, part: Any, seen: tuple[str, ...]) -> list[str] | None:
        if part is True or part is False:
            return []
        if not isinstance(part, Mapping):
            return None
        if "patternProperties" in part or part.get("additionalProperties", False) is not False:
            return None
        return self._names(part, seen)

    # --------------------------------------------------------------- free values

    def _shared(self, out: dict, types: set | None) -> dict | None:
        """A schema of nothing but a type (or none), as a shared definition, or None."""
        annotations = {k: v for k, v in out.items() if k != "type"}
        if types is None:
            return {**annotations, **self._ref("json")}
        numeric = types & {"integer", "number"}
        rest = types - numeric
        if not numeric or not rest <= {"null", "boolean", "string"}:
            return None
        ref = self._ref("number" if "number" in numeric else "integer")
        if not rest:
            return {**annotations, **ref}
        return {**annotations, "anyOf": [ref, {"type": sorted(rest)}]}

    def _ref(self, kind: str) -> dict:
        self.used.add(kind)
        return {"$ref": f"#/$defs/{self.names[kind]}"}

    def _definition(self, kind: str) -> dict:
        if kind == "integer":
            return {"type": "integer", "minimum": INTEGER_MIN, "maximum": INTEGER_MAX}
        if kind == "number":
            return {"type": "number", "exclusiveMinimum": -NUMBER_LIMIT,
                    "exclusiveMaximum": NUMBER_LIMIT, "multipleOf": NUMBER_STEP}
        ref = {"$ref": f"#/$defs/{self.names['json']}"}
        return {"anyOf": [
            {"type": "null"}, {"type": "boolean"}, {"type": "string"},
            {"$ref": f"#/$defs/{self.names['number']}"},
            {"type": "array", "items": ref},
            {"type": "object", "additionalProperties": ref},
        ]}


def _own_bound(node: Mapping, inclusive: str, exclusive: str, pick) -> tuple[float, bool] | None:
    """The schema's tighter bound on one side as (value, exclusive), or None."""
    found = [(node[k], k == exclusive) for k in (inclusive, exclusive)
             if isinstance(node.get(k), (int, float)) and not isinstance(node.get(k), bool)]
    if not found:
        return None
    value = pick(v for v, _ in found)
    return value, any(e for v, e in found if v == value)


def _empty(lower: tuple[float, bool], upper: tuple[float, bool]) -> bool:
    """Whether no value lies between two (value, exclusive) bounds."""
    return lower[0] > upper[0] or lower[0] == upper[0] and (lower[1] or upper[1])


def _looser(theirs: tuple[float, bool], ours: tuple[float, bool], *, below: bool) -> bool:
    """Whether the schema's bound admits more than ours (below: a lower bound)."""
    if theirs[0] != ours[0]:
        return theirs[0] < ours[0] if below else theirs[0] > ours[0]
    return ours[1] and not theirs[1]


def _resolve(root: Mapping, ref: str) -> Any:
    """A local ``$ref``'s target in ``root``, or None."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node: Any = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node
