"""Server-side printing in the sandbox's API server: ``kubectl get`` asks for a ``Table``, and the
server fills its columns from the CRDs' ``additionalPrinterColumns`` (and, for pods and nodes, the
columns people look for), as a real API server does."""
from __future__ import annotations

import datetime
from typing import Any, Callable

from .crd_schema import CRD_DIR


def _load_printer_columns() -> dict[str, list[dict[str, Any]]]:
    """additionalPrinterColumns of the project's CRDs, by plural."""
    import yaml

    columns = {}
    for path in sorted(CRD_DIR.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        columns[crd["spec"]["names"]["plural"]] = crd["spec"]["versions"][0].get("additionalPrinterColumns", [])
    return columns


_AGE = {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}
#: Server-side printing (``kubectl get`` asks for a Table) of our CRDs, as the API server does it,
#: and of pods and nodes in the columns people look for (``@…``: computed, see ``_COMPUTED``).
PRINTER_COLUMNS = {
    **_load_printer_columns(),
    "pods": [{"name": "Status", "type": "string", "jsonPath": ".status.phase"},
             {"name": "Node", "type": "string", "jsonPath": ".spec.nodeName"}, _AGE],
    "nodes": [{"name": "Status", "type": "string", "jsonPath": "@node-status"}, _AGE],
}


_COMPUTED: dict[str, Callable[[dict[str, Any]], Any]] = {
    "@node-status": lambda node: "Ready" + (",SchedulingDisabled" if (node.get("spec") or {}).get("unschedulable")
                                            else ""),
}


def _jsonpath(obj: Any, path: str) -> Any:
    """The subset of JSONPath used by printer columns: ``.a.b``, ``.a[*].b``."""
    values = [obj]
    for part in path.strip(".").split("."):
        name = part.removesuffix("[*]")
        values = [v.get(name) if isinstance(v, dict) else None for v in values]
        if part.endswith("[*]"):
            values = [item for v in values if isinstance(v, list) for item in v]
    values = [v for v in values if v is not None]
    if not values:
        return None
    return ",".join(str(v) for v in values) if len(values) > 1 or isinstance(values[0], (dict, list)) else values[0]


def _age(stamp: str | None) -> str:
    if not stamp:
        return "<unknown>"
    then = datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc)
    seconds = int((datetime.datetime.now(datetime.timezone.utc) - then).total_seconds())
    return f"{seconds}s" if seconds < 120 else f"{seconds // 60}m" if seconds < 7200 else f"{seconds // 3600}h"


def table(payload: dict[str, Any], columns: list[dict[str, Any]]) -> dict[str, Any]:
    items = payload["items"] if "items" in payload else [payload]
    definitions = [{"name": "Name", "type": "string", "format": "name", "description": "", "priority": 0}] + [
        {"name": c["name"], "type": c["type"], "format": c.get("format", ""), "description": c.get("description", ""),
         "priority": c.get("priority", 0)} for c in columns]
    rows = [{"cells": [item["metadata"]["name"]] + [
        _COMPUTED[c["jsonPath"]](item) if c["jsonPath"] in _COMPUTED else
        _age(_jsonpath(item, c["jsonPath"])) if c["type"] == "date" else _jsonpath(item, c["jsonPath"])
        for c in columns], "object": {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                                      "metadata": item["metadata"]}} for item in items]
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": payload.get("metadata", {}),
            "columnDefinitions": definitions, "rows": rows}
