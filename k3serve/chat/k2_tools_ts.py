"""K2.5 tool declaration as TypeScript-style text (chat_format_examples.md §5, K2.5-b).

Layout: `# Tools`, blank line, `## functions`, `namespace functions {`, per tool an optional
`// description` then `type <name> = (_: {...}) => any;`, closing `}` and a newline. Object fields
are one per line, required ones first then optional (`key?:`), each group alphabetical; integers
print as `number`; enums as literal unions; string/number/array bounds as `// k: v` comments;
`$defs` become `interface` blocks and `$ref: "#"` points at a root `interface parameters`.
Unsupported schema shapes raise ValueError; the caller then falls back to JSON.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

_INDENT = "  "
_CONSTRAINTS = {"string": ("maxLength", "minLength", "pattern"), "number": ("maximum", "minimum"),
                "integer": ("maximum", "minimum"), "array": ("maxItems", "minItems")}
_UNION = {"string": "string", "number": "number", "integer": "number", "boolean": "boolean", "null": "null",
          "object": "{}", "array": "Array<any>"}


def _comment(text: str, indent: str) -> str:
    return "\n".join(f"{indent}// {line}" if line else "" for line in text.split("\n"))


class _Converter:
    def __init__(self, parameters: Mapping[str, Any]):
        self.defs: dict[str, Any] = {}
        self.self_ref = False
        self.root = parameters

    def docs(self, schema: Any, indent: str) -> str:
        """Comment lines (description, then sorted bounds) that precede a field or array item."""
        if not isinstance(schema, Mapping):
            return ""
        lines = []
        if schema.get("description"):
            lines.append(_comment(schema["description"], indent))
        kind = schema.get("type")
        plain = not ({"$ref", "anyOf", "enum"} & schema.keys()) and isinstance(kind, str)
        found = sorted((k, schema[k]) for k in _CONSTRAINTS.get(kind, ()) if k in schema) if plain else []
        if found:
            lines.append(indent + "// " + ", ".join(f"{k}: {v}" for k, v in found))
        return "".join(line + "\n" for line in lines)

    def type_of(self, schema: Any, indent: str) -> str:
        if isinstance(schema, bool):
            return "any" if schema else "null"
        if not isinstance(schema, Mapping):
            raise ValueError(f"invalid JSON schema {schema!r}")
        if "$ref" in schema:
            ref = schema["$ref"]
            if ref == "#":
                self.self_ref = True
                return "parameters"
            if isinstance(ref, str) and ref.startswith("#/$defs/") and ref.split("/")[-1] in self.defs:
                return ref.split("/")[-1]
            raise ValueError(f"unsupported $ref {ref!r}")
        if "anyOf" in schema:
            return " | ".join(self.type_of(s, indent) for s in schema["anyOf"])
        if "enum" in schema:
            return " | ".join(f'"{e}"' if isinstance(e, str) else str(e) for e in schema["enum"])
        kind = schema.get("type")
        if kind is None:
            if schema:
                raise ValueError(f"schema without type: {schema!r}")
            return "any"
        if isinstance(kind, list):
            return " | ".join(_UNION[k] for k in kind)
        if kind == "object":
            return self.object(schema, indent)
        if kind == "array":
            item = schema.get("items") or {}
            docs = self.docs(item, indent + _INDENT)
            if docs:
                return f"Array<\n{docs}{indent}{_INDENT}{self.type_of(item, indent + _INDENT)}\n{indent}>"
            return f"Array<{self.type_of(item, indent)}>"
        return "number" if kind == "integer" else str(kind)

    def fields(self, schema: Mapping[str, Any], indent: str, *, root_interface: bool = False) -> list[str]:
        if isinstance(schema.get("$defs"), Mapping):
            self.defs.update(schema["$defs"])
        props = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        order = sorted(k for k in props if k in required) + sorted(k for k in props if k not in required)
        if root_interface:
            # The reference lists a self-referencing root in key order, without the extra-keys line.
            order = list(props)
        out = []
        for key in order:
            prop = props[key]
            text = self.docs(prop, indent + _INDENT)
            if isinstance(prop, Mapping) and prop.get("default") is not None:
                d = prop["default"]
                text += f"{indent}{_INDENT}// Default: {repr(d) if isinstance(d, int | float | bool) else json.dumps(d, ensure_ascii=False)}\n"
            opt = "" if key in required else "?"
            out.append(f"{text}{indent}{_INDENT}{key}{opt}: {self.type_of(prop, indent + _INDENT)}")
        extra = schema.get("additionalProperties")
        if extra is not None and not root_interface:
            kind = "any" if extra is True else "never" if extra is False else self.type_of(extra, indent + _INDENT)
            out.append(f"{indent}{_INDENT}[k: string]: {kind}")
        return out

    def object(self, schema: Mapping[str, Any], indent: str) -> str:
        fields = self.fields(schema, indent)
        return "{\n" + ",\n".join(fields) + "\n" + indent + "}" if fields else "{}"


def _function(fn: Mapping[str, Any]) -> str:
    conv = _Converter(fn.get("parameters") or {})
    params = conv.object(conv.root, "")
    blocks = []
    if conv.self_ref:
        fields = conv.fields(conv.root, "", root_interface=True)
        blocks.append("interface parameters {" + ("\n" + ",\n".join(fields) + "\n" if fields else "") + "}")
    for name, schema in dict(conv.defs).items():
        desc = _comment(schema["description"], "") + "\n" if isinstance(schema, Mapping) and schema.get("description") else ""
        blocks.append(f"{desc}interface {name} {conv.type_of(schema, '')}")
    if fn.get("description"):
        blocks.append(_comment(fn["description"], ""))
    blocks.append(f"type {fn['name']} = (_: {'parameters' if conv.self_ref else params}) => any;")
    return "\n".join(b for b in blocks if b)


def tools_to_typescript(tools: list[Mapping[str, Any]]) -> str:
    """The `tools_ts_str` text for key-sorted OpenAI tools (non-function tools are skipped)."""
    functions = [_function(t["function"]) for t in tools if t.get("type") == "function" and t.get("function")]
    text = "# Tools\n\n"
    if functions:
        text += "## functions\nnamespace functions {\n" + "\n".join(functions) + "\n}\n"
    return text
