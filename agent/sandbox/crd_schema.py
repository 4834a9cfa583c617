"""The project's CRDs as the sandbox's API server applies them: each custom resource's
``openAPIV3Schema`` (from the CRDs ``make manifests`` copies into this package), and the
structural pruning a real API server does on create, update and patch: unknown fields dropped
(and reported), nulls of non-nullable fields dropped, wrong types and values outside an enum
reported as the 422 the server would answer."""
from __future__ import annotations

import pathlib
from typing import Any, Callable

#: The project's CRDs, copied from deploy/crds by ``make manifests`` (shipped with the package).
CRD_DIR = pathlib.Path(__file__).resolve().parent / "crds"


def _load_schemas() -> dict[str, dict[str, Any]]:
    """openAPIV3Schema of the project's CRDs, by plural."""
    import yaml

    return {crd["spec"]["names"]["plural"]: crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
            for crd in (yaml.safe_load(path.read_text()) for path in sorted(CRD_DIR.glob("*.yaml")))}


SCHEMAS = _load_schemas()
_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list),
}
_DROP = object()


def prune(value: Any, schema: dict[str, Any], path: str, dropped: list[str], errors: list[str],
           root: bool = False) -> Any:
    """``value`` as the API server stores it under a structural ``schema``."""
    if value is None:
        return None if schema.get("nullable") else _DROP
    kind = schema.get("type")
    if kind and not _TYPES.get(kind, lambda v: True)(value):
        errors.append(f"{path or '<root>'}: Invalid value: {value!r}: must be of type {kind}")
        return value
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: Unsupported value: {value!r}: supported values: {schema['enum']}")
        return value
    if isinstance(value, list):
        items = schema.get("items") or {}
        kept = [prune(v, items, f"{path}[{i}]", dropped, errors) for i, v in enumerate(value)]
        return [v for v in kept if v is not _DROP]
    if not isinstance(value, dict):
        return value
    properties = schema.get("properties") or {}
    extra = schema.get("additionalProperties")
    keep_unknown = schema.get("x-kubernetes-preserve-unknown-fields") or extra is True
    out: dict[str, Any] = {}
    for key, item in value.items():
        where = f"{path}.{key}" if path else key
        if root and key in ("apiVersion", "kind", "metadata"):
            out[key] = item
        elif key in properties:
            kept = prune(item, properties[key], where, dropped, errors)
            if kept is not _DROP:
                out[key] = kept
        elif isinstance(extra, dict):
            kept = prune(item, extra, where, dropped, errors)
            if kept is not _DROP:
                out[key] = kept
        elif keep_unknown:
            out[key] = item
        else:
            dropped.append(where)
    return out
