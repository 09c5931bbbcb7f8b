"""Strict offline validation of rendered Kubernetes objects.

Built-in kinds go through ``kubernetes_validate`` in strict mode (unknown fields are
errors). Custom kinds go through ``jsonschema`` against their CRD's ``openAPIV3Schema``
from ``<repo>/../shared/crds``, made strict the way the API server's strict field
validation is: an object schema that lists its properties and does not preserve unknown
fields refuses any other key. A kind with neither schema is an error, never a pass.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

__all__ = ["KUBE_VERSION", "CRDSchemas", "SchemaMissingError", "validate_object"]

KUBE_VERSION = "1.30.0"


class SchemaMissingError(AssertionError):
    """No schema is known for an object's apiVersion and kind."""


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """Forbid unknown fields in every object schema that names its properties."""
    out = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        match node:
            case dict():
                if (
                    "properties" in node
                    and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")
                ):
                    node["additionalProperties"] = False
                for value in node.values():
                    walk(value)
            case list():
                for value in node:
                    walk(value)

    walk(out)
    return out


@dataclass(frozen=True, slots=True)
class CRDSchemas:
    """(apiVersion, kind) -> a strict jsonschema validator, for every served CRD version."""

    validators: dict[tuple[str, str], jsonschema.protocols.Validator]

    @classmethod
    def load(cls, crds_dir: Path) -> CRDSchemas:
        validators: dict[tuple[str, str], jsonschema.protocols.Validator] = {}
        for path in sorted(crds_dir.glob("*.yaml")):
            for crd in yaml.load_all(path.read_text(), Loader=yaml.CSafeLoader):
                if not crd or crd.get("kind") != "CustomResourceDefinition":
                    continue
                group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
                for version in crd["spec"]["versions"]:
                    if not version.get("served", False):
                        continue
                    schema = _strict(version["schema"]["openAPIV3Schema"])
                    validator_cls = jsonschema.validators.validator_for(
                        schema, default=jsonschema.Draft7Validator
                    )
                    validators[(f"{group}/{version['name']}", kind)] = validator_cls(schema)
        return cls(validators)

    def errors(self, obj: dict[str, Any]) -> Iterator[str] | None:
        """Error messages for obj, or None when no CRD describes its kind."""
        validator = self.validators.get((obj.get("apiVersion", ""), obj.get("kind", "")))
        if validator is None:
            return None
        return (
            f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}"
            for e in validator.iter_errors(obj)
        )


def validate_object(obj: dict[str, Any], crds: CRDSchemas) -> list[str]:
    """All schema errors of one rendered object; raises SchemaMissingError for unknown kinds."""
    crd_errors = crds.errors(obj)
    if crd_errors is not None:
        return list(crd_errors)
    try:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    except kubernetes_validate.SchemaNotFoundError as exc:
        raise SchemaMissingError(
            f"no schema for {obj.get('apiVersion')}/{obj.get('kind')}: add its CRD to shared/crds"
        ) from exc
    except kubernetes_validate.ValidationError as exc:
        return [f"{'.'.join(str(p) for p in exc.path)}: {exc.message}"]
    return []
