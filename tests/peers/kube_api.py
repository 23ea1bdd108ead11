"""KubeApi: a strict stand-in for the Kubernetes API server, over real HTTP on 127.0.0.1.

No API server can be installed here, so forewarn's node actions are tested at the HTTP boundary: the real
client library (lightkube, the official `kubernetes`) talks to this server, which answers the way the API
server does for the few resources forewarn touches, and is stricter than a lenient fake would be:

- every object written (a create or update body, the object a patch produces) is validated against the
  official OpenAPI schemas that the `kubernetes-validate` package ships (strict: an unknown field is an
  error), plus the API server's own checks on the fields forewarn writes (label and annotation syntax,
  taint effects and uniqueness, the rules for events.k8s.io/v1 Events, Lease durations); a failure is
  422 Invalid with the field and the reason;
- patches by Content-Type: JSON merge patch (RFC 7386), strategic merge patch driven by the schemas'
  `x-kubernetes-patch-strategy` / `x-kubernetes-patch-merge-key` (so `status.conditions` merges by `type`
  and `spec.taints`, which has no strategy, is REPLACED), JSON patch (RFC 6902, `test` included);
  server-side apply (application/apply-patch+yaml) is refused with 415, like any other type;
- metadata.resourceVersion: one counter for every write; a PUT or patch carrying a stale one gets 409
  Conflict; a write that changes nothing keeps the version (as etcd does);
- RBAC: with a ClusterRole (and Role) file, a request its rules do not grant gets 403 Forbidden, checked
  like the RBAC authorizer (verb, API group, resource or resource/subresource, resourceNames, namespace of
  a Role); requests need the kubeconfig's bearer token (401 otherwise);
- the Eviction subresource: policy/v1 Eviction bodies; a PodDisruptionBudget selecting the pod with no
  disruptions allowed answers 429 TooManyRequests with the API server's Status (its cause names the PDB);
  otherwise the PDB's disruptionsAllowed is decremented and the pod deleted;
- `dryRun=All` validates and answers but stores nothing.

Where it differs from a real API server, on purpose (all in the direction of catching mistakes):
- an unknown field is always 422 Invalid; the real server answers 400 with `fieldValidation=Strict` and by
  default (`Warn`) DROPS the field with a Warning header, so the write would silently lose it;
- an events.k8s.io/v1 Event must name what it is about (`regarding`); the server would accept one without;
- items of a list carry no kind/apiVersion (as the real server sends them); there is no watch (400), no
  protobuf, no core/v1 Events, no server-side apply.
- a pod being deleted disappears after grace * `grace_scale` seconds of the injected clock (0: at once,
  the default); until then it has metadata.deletionTimestamp.
- NoExecute taints: when a node is written with one, every pod on it that does not tolerate it (mirror pods
  aside) is deleted with its own grace period, as the taint manager does; `tolerationSeconds` is not timed
  (a toleration with it counts as tolerating). `taint_evictions` lists them, `deletions` the pods deleted
  through DELETE (with the grace asked).
- pods carry spec.priority / priorityClassName as given to add_pod; there is no PriorityClass admission.
- PodDisruptionBudget status is not computed by a controller: disruptionsAllowed starts at
  max_unavailable, each eviction takes one, and `set_pdb_allowed` sets it.

Interface: as /work/briefs/k8s-standin.md gives it, nothing changed. Added: KubeApi(namespaces=, grace_scale=,
clock=) and use as a context manager; kubeconfig(admin=, namespace=); add_node(conditions=, provider_id=);
add_pod(phase=); pod(), pdb(), update_node(); fail_next(message=); Request.json(); `namespace_pods` is
accepted and unused. An eviction's deleteOptions.gracePeriodSeconds replaces the pod's own grace period,
longer or shorter, as the API server does. Then: fail_always() and recover() (an API that keeps failing
until it recovers); KubeApi(tls=True) serving HTTPS with a certificate of its own test CA (`ca_pem`;
kubeconfig() then carries certificate-authority-data), and service_account(dir) writing token, ca.crt and
namespace as a kubelet mounts them (the token is the RBAC-checked one). Then, all opt-in: KubeApi(tokens=)
more RBAC-checked bearer tokens (one per client, so a test can tell whose request it was: `Request.token`),
and kubeconfig(token=); KubeApi(list_delay={"nodes": 1.0}) answers a LIST of those resources that many seconds
late, with the list as it was when the request came (a large list on a busy API server; other requests are
served meanwhile); `Request.at`, when it came (time.monotonic()); `node_versions`, every version of every node
as stored, and node_history() / unschedulable_history() over them, so a change undone a moment later still
shows.

Use:
    api = KubeApi(cluster_role=Path("deploy/.../clusterrole.yaml"))
    api.add_node("node-1"); api.add_pod("default", "web-1", "node-1", labels={"app": "web"})
    kubeconfig = api.kubeconfig(tmp_path / "kubeconfig")       # server=api.url, a token user
    ...                                                         # the code under test
    api.node("node-1")["spec"]["unschedulable"]; api.evictions; api.events(); api.stop()
"""

from __future__ import annotations

import base64
import copy
import datetime
import json
import re
import secrets
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import jsonschema
import jsonschema.protocols
import referencing
import yaml
from kubernetes_validate.utils import schema_contents

from forewarn.web.server import HttpServer, Response
from forewarn.web.server import Request as HttpRequest

from peers.pki import Authority

K8S_VERSION = "1.32.0"  # the same schemas as tests/test_kubernetes.py
TOKEN = "forewarn-stand-in-token"  # the kubeconfig's user: RBAC applies to it
ADMIN_TOKEN = "stand-in-admin-token"  # kubeconfig(admin=True): a cluster administrator, no RBAC check
USER = "system:serviceaccount:forewarn:forewarn"
MAX_BODY_BYTES = 3 * 1024 * 1024  # the API server's request size limit

JSON = dict[str, Any]


# --- the resources served ------------------------------------------------------------------------

@dataclass(frozen=True)
class Kind:
    """One resource type: its REST name, group, version, kind, scope, and the subresources served."""

    plural: str
    group: str
    version: str
    kind: str
    namespaced: bool
    subresources: tuple[str, ...] = ()
    status: bool = False  # has a status subresource: the main resource ignores status changes, and back
    unconditional_update: bool = True  # a PUT without metadata.resourceVersion is allowed
    field_labels: tuple[str, ...] = ()

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def group_resource(self) -> str:
        """How the API server names the resource in messages: `nodes`, `leases.coordination.k8s.io`."""
        return f"{self.plural}.{self.group}" if self.group else self.plural


KINDS = [
    Kind("nodes", "", "v1", "Node", False, ("status",), status=True, field_labels=("spec.unschedulable",)),
    Kind("pods", "", "v1", "Pod", True, ("status", "eviction"), status=True,
         field_labels=("spec.nodeName", "spec.restartPolicy", "spec.schedulerName", "spec.serviceAccountName",
                       "spec.hostNetwork", "status.phase", "status.podIP", "status.nominatedNodeName")),
    Kind("poddisruptionbudgets", "policy", "v1", "PodDisruptionBudget", True, ("status",), status=True),
    Kind("events", "events.k8s.io", "v1", "Event", True,
         field_labels=("reason", "type", "reportingController", "regarding.kind", "regarding.name",
                       "regarding.namespace", "regarding.uid")),
    Kind("leases", "coordination.k8s.io", "v1", "Lease", True, unconditional_update=False),
]
BY_PATH = {(k.group, k.version, k.plural): k for k in KINDS}
EVICTION = ("policy/v1", "Eviction")


# --- errors answered as Status objects ------------------------------------------------------------

REASONS = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound", 405: "MethodNotAllowed",
           406: "NotAcceptable", 409: "Conflict", 410: "Expired", 415: "UnsupportedMediaType", 422: "Invalid",
           429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable", 504: "Timeout"}


class ApiError(Exception):
    """A failure answered as the API server does: a `kind: Status` body with code, reason and message."""

    def __init__(self, code: int, message: str, reason: str | None = None, details: JSON | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason or REASONS.get(code, "Unknown")
        self.details = details
        self.headers = dict(headers or {})

    def status(self) -> JSON:
        body: JSON = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                      "message": self.message, "reason": self.reason, "code": self.code}
        if self.details is not None:
            body["details"] = self.details
        return body


def not_found(kind: Kind, name: str) -> ApiError:
    return ApiError(404, f'{kind.group_resource} "{name}" not found',
                    details={"name": name, "group": kind.group, "kind": kind.plural})


def conflict(kind: Kind, name: str) -> ApiError:
    return ApiError(409, f'Operation cannot be fulfilled on {kind.group_resource} "{name}": the object has been '
                         "modified; please apply your changes to the latest version and try again",
                    "Conflict", {"name": name, "group": kind.group, "kind": kind.plural})


def invalid(kind_name: str, group: str, name: str, errors: list[tuple[str, str]]) -> ApiError:
    """422 Invalid listing each (field, problem), as `Node "n1" is invalid: spec.taints[0].effect: ...`."""
    text = "; ".join(f"{path}: {problem}" if path else problem for path, problem in errors)
    causes = [{"reason": "FieldValueInvalid", "message": problem, "field": path} for path, problem in errors]
    return ApiError(422, f'{kind_name} "{name}" is invalid: {text}', "Invalid",
                    {"name": name, "group": group, "kind": kind_name, "causes": causes})


# --- the recorded requests -------------------------------------------------------------------------

@dataclass
class Request:
    """One request as received, and the status it was answered with."""

    method: str
    path: str
    query: dict[str, str]  # each parameter's last value
    headers: dict[str, str]  # names lower-cased
    body: bytes
    status: int = 0
    at: float = field(default_factory=time.monotonic)  # when it came

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None

    @property
    def token(self) -> str:
        """The bearer token it carried ("" without one): which client sent it, with KubeApi(tokens=)."""
        value = self.headers.get("authorization", "")
        return value[len("Bearer "):] if value.startswith("Bearer ") else ""


@dataclass
class _Failure:
    method: str
    path: re.Pattern[str]
    status: int
    message: str
    persistent: bool = False  # fail_always: every matching request, until recover()


class _TlsGate:
    """The web server's Gate for HTTPS with a fixed certificate and no authentication of its own (the API
    checks bearer tokens itself)."""

    tls_enabled = True

    def __init__(self, context: ssl.SSLContext) -> None:
        self._context = context

    def tls_context(self) -> ssl.SSLContext | None:
        return self._context

    def check(self, request: HttpRequest) -> Response | None:
        return None

    def headers(self) -> Mapping[str, str]:
        return {}


# --- schema validation -----------------------------------------------------------------------------

_SCHEMA_DIR = f"kubernetes-json-schema/v{K8S_VERSION}-local-strict"
_RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$")


def _is_rfc3339(value: object) -> bool:
    if not isinstance(value, str):
        return True
    if not _RFC3339.match(value):
        return False
    try:
        datetime.datetime.fromisoformat(value.upper().replace("Z", "+00:00"))
    except ValueError:
        return False
    return True


@cache
def _definitions() -> JSON:
    return schema_contents(f"{_SCHEMA_DIR}/_definitions.json", K8S_VERSION)  # type: ignore[no-any-return]


def _schema_file(api_version: str, kind: str) -> str:
    # kubernetes-validate's naming: the group's first label and the version, `events.k8s.io/v1` -> `events-v1`
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    return f"{kind.lower()}-{group_version}.json"


@cache
def _top_schema(api_version: str, kind: str) -> JSON:
    return schema_contents(f"{_SCHEMA_DIR}/{_schema_file(api_version, kind)}", K8S_VERSION)  # type: ignore[no-any-return]


@cache
def _validator(api_version: str, kind: str) -> jsonschema.protocols.Validator:
    """The same validation as `kubernetes_validate.validate(doc, K8S_VERSION, strict=True)`, built once per
    kind (it reloads 1.3 MB of definitions on every call), and with RFC 3339 times checked: the API server
    refuses a body whose time it cannot parse."""
    schema = _top_schema(api_version, kind)
    registry: referencing.Registry[Any] = referencing.Registry()
    registry = referencing.Resource.from_contents(schema) @ registry
    registry = referencing.Resource.from_contents(_definitions()) @ registry
    formats = jsonschema.FormatChecker(formats=())
    formats.checks("date-time")(_is_rfc3339)
    return jsonschema.Draft202012Validator(schema, registry=registry, format_checker=formats)


def schema_errors(obj: JSON) -> list[tuple[str, str]]:
    """(field, problem) for every way `obj` breaks its kind's OpenAPI schema."""
    found = []
    for error in _validator(obj["apiVersion"], obj["kind"]).iter_errors(obj):
        path = ".".join(str(p) if not isinstance(p, int) else f"[{p}]" for p in error.absolute_path)
        found.append((path.replace(".[", "["), error.message))
    return sorted(found)


def _resolve(schema: JSON | None) -> JSON | None:
    """Follow a `$ref` (possibly inside allOf) into the definitions."""
    while schema is not None:
        ref = schema.get("$ref") or next((s.get("$ref") for s in schema.get("allOf", []) if "$ref" in s), None)
        if not ref:
            return schema
        name = ref.rsplit("/", 1)[-1]
        schema = {**_definitions()["$defs"][name], **{k: v for k, v in schema.items() if k.startswith("x-")}}
    return None


_TIME = "io.k8s.apimachinery.pkg.apis.meta.v1.Time"
_MICRO_TIME = "io.k8s.apimachinery.pkg.apis.meta.v1.MicroTime"


def normalize_times(value: Any, schema: JSON | None) -> Any:
    """Times as the API server writes them back: a Time in whole seconds, a MicroTime with exactly six digits
    of fraction, both in UTC with `Z` (it decodes them into Go times and encodes them again)."""
    ref = (schema or {}).get("$ref", "")
    if isinstance(value, str) and ref.endswith((_TIME, _MICRO_TIME)):
        parsed = datetime.datetime.fromisoformat(value.upper().replace("Z", "+00:00"))
        utc = parsed.astimezone(datetime.timezone.utc)
        return utc.strftime("%Y-%m-%dT%H:%M:%S.%fZ" if ref.endswith(_MICRO_TIME) else "%Y-%m-%dT%H:%M:%SZ")
    resolved = _resolve(schema) if schema is not None else None
    if resolved is None:
        return value
    if isinstance(value, dict):
        return {k: normalize_times(v, _field_schema(resolved, k)) for k, v in value.items()}
    if isinstance(value, list):
        return [normalize_times(v, resolved.get("items")) for v in value]
    return value


def _field_schema(schema: JSON | None, key: str) -> JSON | None:
    schema = _resolve(schema)
    if schema is None:
        return None
    props = schema.get("properties")
    if isinstance(props, dict) and key in props:
        return props[key]  # type: ignore[no-any-return]
    extra = schema.get("additionalProperties")
    return extra if isinstance(extra, dict) else None


# --- semantic checks the API server makes beyond the schema ----------------------------------------

_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
TOTAL_ANNOTATION_BYTES = 256 * 1024
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


def qualified_name_problem(key: str) -> str | None:
    """Why `key` is not a Kubernetes qualified name (`prefix/name`, as label and annotation keys), or None."""
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        return "prefix part must be a lowercase RFC 1123 subdomain of at most 253 characters"
    if not name or len(name) > 63 or not _NAME.match(name):
        return ("name part must consist of at most 63 alphanumeric characters, '-', '_' or '.', and must start "
                "and end with an alphanumeric character")
    return None


def label_value_problem(value: object) -> str | None:
    if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
        return ("a valid label must be an empty string or consist of at most 63 alphanumeric characters, '-', "
                "'_' or '.', and must start and end with an alphanumeric character")
    return None


def _metadata_errors(obj: JSON) -> list[tuple[str, str]]:
    meta = obj.get("metadata") or {}
    errors = []
    name = meta.get("name")
    if isinstance(name, str) and (len(name) > 253 or not _DNS_SUBDOMAIN.match(name)):
        errors.append(("metadata.name", f'Invalid value: "{name}": a lowercase RFC 1123 subdomain must consist of '
                                        "lower case alphanumeric characters, '-' or '.'"))
    for key, value in (meta.get("labels") or {}).items():
        if problem := qualified_name_problem(key):
            errors.append(("metadata.labels", f'Invalid value: "{key}": {problem}'))
        if problem := label_value_problem(value):
            errors.append((f"metadata.labels.{key}", f'Invalid value: "{value}": {problem}'))
    annotations = meta.get("annotations") or {}
    for key in annotations:
        if problem := qualified_name_problem(key.lower()):
            errors.append(("metadata.annotations", f'Invalid value: "{key}": {problem}'))
    size = sum(len(k) + len(v or "") for k, v in annotations.items())
    if size > TOTAL_ANNOTATION_BYTES:
        errors.append(("metadata.annotations", f"Too long: may not be more than {TOTAL_ANNOTATION_BYTES} bytes"))
    return errors


def _node_errors(node: JSON) -> list[tuple[str, str]]:
    errors = []
    seen = set()
    for i, taint in enumerate((node.get("spec") or {}).get("taints") or []):
        where = f"spec.taints[{i}]"
        key, effect = taint.get("key") or "", taint.get("effect") or ""
        if problem := qualified_name_problem(key):
            errors.append((f"{where}.key", f'Invalid value: "{key}": {problem}'))
        if problem := label_value_problem(taint.get("value") or ""):
            errors.append((f"{where}.value", f'Invalid value: "{taint.get("value")}": {problem}'))
        if effect not in TAINT_EFFECTS:
            errors.append((f"{where}.effect", f'Unsupported value: "{effect}": supported values: '
                                              + ", ".join(f'"{e}"' for e in TAINT_EFFECTS)))
        if (key, effect) in seen:
            errors.append(("spec.taints", f'Duplicate value: "{key}:{effect}": taints must be unique by key '
                                          "and effect pair"))
        seen.add((key, effect))
    return errors


def _event_errors(event: JSON) -> list[tuple[str, str]]:
    """pkg/apis/core/validation/events.go for an Event created through events.k8s.io/v1."""
    errors = []
    namespace = (event.get("metadata") or {}).get("namespace", "")
    regarding = event.get("regarding")
    if not regarding:
        errors.append(("regarding", "Required value: the object this event is about (stand-in rule)"))
    elif regarding.get("namespace") and regarding["namespace"] != namespace:
        errors.append(("involvedObject.namespace", f'Invalid value: "{regarding["namespace"]}": does not match '
                                                   "event.namespace"))
    elif not regarding.get("namespace") and namespace not in ("default", "kube-system"):
        # An event about a cluster-scoped object (a Node) must live in default or kube-system.
        errors.append(("involvedObject.namespace", 'Invalid value: "": does not match event.namespace'))
    if not event.get("eventTime"):
        errors.append(("eventTime", "Required value"))
    controller = event.get("reportingController") or ""
    if not controller:
        errors.append(("reportingController", "Required value"))
    elif problem := qualified_name_problem(controller):
        errors.append(("reportingController", f'Invalid value: "{controller}": {problem}'))
    for name, limit in (("reportingInstance", 128), ("action", 128), ("reason", 128)):
        value = event.get(name) or ""
        if not value:
            errors.append((name, "Required value"))
        elif len(value) > limit:
            errors.append((name, f"Invalid value: can have at most {limit} characters"))
    if len((event.get("note") or "").encode()) > 1024:
        errors.append(("note", "Invalid value: can have at most 1024 characters"))
    if event.get("type") not in ("Normal", "Warning"):
        errors.append(("type", f"Invalid value: \"{event.get('type') or ''}\": has invalid value"))
    for name in ("deprecatedFirstTimestamp", "deprecatedLastTimestamp", "deprecatedCount", "deprecatedSource"):
        if event.get(name):
            errors.append((name, "Invalid value: needs to be unset"))
    return errors


def _lease_errors(lease: JSON) -> list[tuple[str, str]]:
    errors = []
    spec = lease.get("spec") or {}
    if spec.get("leaseDurationSeconds") is not None and spec["leaseDurationSeconds"] <= 0:
        errors.append(("spec.leaseDurationSeconds", "Invalid value: must be greater than 0"))
    if spec.get("leaseTransitions") is not None and spec["leaseTransitions"] < 0:
        errors.append(("spec.leaseTransitions", "Invalid value: must be greater than or equal to 0"))
    return errors


_KIND_CHECKS: dict[str, Callable[[JSON], list[tuple[str, str]]]] = {
    "Node": _node_errors, "Event": _event_errors, "Lease": _lease_errors}


def validate(obj: JSON) -> JSON:
    """Raise 422 Invalid unless `obj` passes the schema and the API server's checks; return it as the server
    would store it (times normalized)."""
    errors = schema_errors(obj)
    if not errors:  # a body that breaks the schema may not have the shapes the checks below expect
        kind_check = _KIND_CHECKS.get(obj["kind"])
        errors = _metadata_errors(obj) + (kind_check(obj) if kind_check else [])
    if errors:
        meta = obj.get("metadata") or {}
        group = obj["apiVersion"].rpartition("/")[0]
        raise invalid(obj["kind"], group, str(meta.get("name") or meta.get("generateName") or ""), errors)
    return normalize_times(obj, _top_schema(obj["apiVersion"], obj["kind"]))  # type: ignore[no-any-return]


# --- patches -------------------------------------------------------------------------------------------

class PatchError(Exception):
    """A patch that cannot be applied; `code` is what the API server answers (400 malformed, 422 failed)."""

    def __init__(self, message: str, code: int = 400) -> None:
        super().__init__(message)
        self.code = code


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: objects merge, `null` deletes, anything else (lists too) replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def strategic_merge_patch(original: Any, patch: Any, schema: JSON | None) -> Any:
    """Kubernetes strategic merge patch, driven by the OpenAPI schema: maps merge (`null` deletes), a list
    whose field has `x-kubernetes-patch-strategy: merge` merges by its `x-kubernetes-patch-merge-key` (or
    as a set of primitives without one), every other list is replaced. Directives: `$patch: replace|delete|
    merge` (in a map or a list item), `$retainKeys`, `$deleteFromPrimitiveList/<field>`,
    `$setElementOrder/<field>`."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    directive = patch.get("$patch")
    if directive not in (None, "merge", "replace", "delete"):
        raise PatchError(f"Unknown patch type: {directive!r}")
    if directive == "replace":
        return strategic_merge_patch({}, {k: v for k, v in patch.items() if k != "$patch"}, schema)
    if directive == "delete":
        return None
    result = copy.deepcopy(original) if isinstance(original, dict) else {}
    orders: dict[str, list[Any]] = {}
    for key, value in patch.items():
        if key in ("$patch", "$retainKeys"):
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            name = key.partition("/")[2]
            if not isinstance(value, list):
                raise PatchError("invalid patch format for $deleteFromPrimitiveList: expected a list")
            result[name] = [item for item in result.get(name) or [] if item not in value]
            continue
        if key.startswith("$setElementOrder/"):
            if not isinstance(value, list):
                raise PatchError("invalid patch format for $setElementOrder: expected a list")
            orders[key.partition("/")[2]] = value
            continue
        sub = _field_schema(schema, key)
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict):
            merged = strategic_merge_patch(result.get(key), value, sub)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
        elif isinstance(value, list):
            result[key] = _merge_list(result.get(key), value, sub)
        else:
            result[key] = value
    for name, order in orders.items():
        result[name] = _reorder(result.get(name) or [], order, _field_schema(schema, name))
    retain = patch.get("$retainKeys")
    if retain is not None:
        if not isinstance(retain, list):
            raise PatchError("invalid patch format for $retainKeys: expected a list")
        result = {k: v for k, v in result.items() if k in retain}
    return result


def _merge_list(original: Any, patch: list[Any], schema: JSON | None) -> list[Any]:
    schema = _resolve(schema) if schema is not None else None
    strategy = (schema or {}).get("x-kubernetes-patch-strategy", "")
    items = [item for item in patch if not (isinstance(item, dict) and item.get("$patch") == "replace")]
    if "merge" not in strategy.split(",") or len(items) != len(patch):
        # Replaced: an atomic list (like spec.taints), or `$patch: replace` asked for it.
        return [strategic_merge_patch({}, item, None) if isinstance(item, dict) else item for item in items]
    current = list(original) if isinstance(original, list) else []
    key = (schema or {}).get("x-kubernetes-patch-merge-key")
    if key is None:  # a set of primitives (finalizers)
        return current + [item for i, item in enumerate(items) if item not in current and item not in items[:i]]
    item_schema = (schema or {}).get("items")
    for item in items:
        if not isinstance(item, dict) or key not in item:
            raise PatchError(f"map: {item!r} does not contain declared merge key: {key}")
        found = [i for i, old in enumerate(current) if isinstance(old, dict) and old.get(key) == item[key]]
        if item.get("$patch") == "delete":
            current = [old for i, old in enumerate(current) if i not in found]
        elif found:
            current[found[0]] = strategic_merge_patch(current[found[0]], item, item_schema)
        else:
            current.append(strategic_merge_patch({}, item, item_schema))
    return current


def _reorder(items: list[Any], order: list[Any], schema: JSON | None) -> list[Any]:
    key = (_resolve(schema) or {}).get("x-kubernetes-patch-merge-key")

    def ident(item: Any) -> Any:
        return item.get(key) if key and isinstance(item, dict) else item

    wanted = [ident(o) for o in order]
    listed = sorted((i for i in items if ident(i) in wanted), key=lambda i: wanted.index(ident(i)))
    return listed + [i for i in items if ident(i) not in wanted]


def _json_equal(a: Any, b: Any) -> bool:
    """JSON equality: True is not 1, 1 is 1.0."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def _pointer(path: Any) -> list[str]:
    if not isinstance(path, str) or (path and not path.startswith("/")):
        raise PatchError(f"invalid JSON pointer: {path!r}", 422)
    return [t.replace("~1", "/").replace("~0", "~") for t in path.split("/")[1:]] if path else []


def _index(container: list[Any], token: str, *, append: bool = False) -> int:
    if append and token == "-":
        return len(container)
    if not re.fullmatch(r"0|[1-9][0-9]*", token):
        raise PatchError(f"invalid array index: {token!r}", 422)
    index = int(token)
    if index > len(container) or (index == len(container) and not append):
        raise PatchError(f"array index out of bounds: {index}", 422)
    return index


def _parent(doc: Any, tokens: list[str], path: Any) -> Any:
    node = doc
    for token in tokens[:-1]:
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list):
            node = node[_index(node, token)]
        else:
            raise PatchError(f"doc is missing path: {path}", 422)
    return node


def _get(doc: Any, path: Any) -> Any:
    tokens = _pointer(path)
    if not tokens:
        return doc
    parent = _parent(doc, tokens, path)
    if isinstance(parent, dict) and tokens[-1] in parent:
        return parent[tokens[-1]]
    if isinstance(parent, list):
        return parent[_index(parent, tokens[-1])]
    raise PatchError(f"doc is missing path: {path}", 422)


def _add(doc: Any, path: Any, value: Any) -> Any:
    tokens = _pointer(path)
    if not tokens:
        return value
    parent = _parent(doc, tokens, path)
    if isinstance(parent, dict):
        parent[tokens[-1]] = value
    elif isinstance(parent, list):
        parent.insert(_index(parent, tokens[-1], append=True), value)
    else:
        raise PatchError(f"doc is missing path: {path}", 422)
    return doc


def _remove(doc: Any, path: Any) -> Any:
    tokens = _pointer(path)
    if not tokens:
        raise PatchError("cannot remove the whole document", 422)
    parent = _parent(doc, tokens, path)
    if isinstance(parent, dict) and tokens[-1] in parent:
        del parent[tokens[-1]]
    elif isinstance(parent, list):
        del parent[_index(parent, tokens[-1])]
    else:
        raise PatchError(f"Unable to remove nonexistent key: {tokens[-1]}: missing value", 422)
    return doc


def json_patch(doc: Any, operations: Any) -> Any:
    """RFC 6902 JSON patch: add, remove, replace, move, copy, test; a failed `test` fails the whole patch."""
    if not isinstance(operations, list):
        raise PatchError("json: cannot unmarshal object into Go value of type jsonpatch.Patch")
    doc = copy.deepcopy(doc)
    for op in operations:
        if not isinstance(op, dict) or not isinstance(op.get("op"), str):
            raise PatchError(f"Unexpected kind: {op!r}", 422)
        kind, path = op["op"], op.get("path")
        if kind != "remove" and kind in ("add", "replace", "test") and "value" not in op:
            raise PatchError(f"missing value for {kind} operation at {path}", 422)
        if kind == "add":
            doc = _add(doc, path, copy.deepcopy(op["value"]))
        elif kind == "remove":
            doc = _remove(doc, path)
        elif kind == "replace":
            _get(doc, path)
            doc = _add(_remove(doc, path), path, copy.deepcopy(op["value"])) if _pointer(path) else op["value"]
        elif kind in ("move", "copy"):
            source = op.get("from")
            value = copy.deepcopy(_get(doc, source))
            if kind == "move":
                if isinstance(source, str) and isinstance(path, str) and path.startswith(source + "/"):
                    raise PatchError(f"cannot move {source} into its own child {path}", 422)
                doc = _remove(doc, source)
            doc = _add(doc, path, value)
        elif kind == "test":
            if not _json_equal(_get(doc, path), op["value"]):
                raise PatchError(f"testing value {path} failed: test failed", 422)
        else:
            raise PatchError(f"Unexpected kind: {kind}", 422)
    return doc


PATCH_TYPES = ("application/json-patch+json", "application/merge-patch+json", "application/apply-patch+yaml",
               "application/strategic-merge-patch+json")


# --- RBAC ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rule:
    verbs: frozenset[str]
    api_groups: frozenset[str]
    resources: frozenset[str]
    resource_names: frozenset[str]
    namespace: str | None  # a Role's namespace; None for a ClusterRole

    def grants(self, verb: str, group: str, resource: str, namespace: str, name: str) -> bool:
        """The RBAC authorizer's rule match (plugin/pkg/auth/authorizer/rbac/rbac.go)."""
        if self.namespace is not None and self.namespace != namespace:
            return False
        if not ({verb, "*"} & self.verbs and {group, "*"} & self.api_groups):
            return False
        sub = resource.partition("/")[2]
        if not ({resource, "*"} & self.resources or (sub and f"*/{sub}" in self.resources)):
            return False
        return not self.resource_names or name in self.resource_names


def load_rules(path: Path) -> list[Rule]:
    """Every rule of the ClusterRoles and Roles in a YAML file, or in the *.yaml files of a directory (a
    kustomize component). Bindings are taken for granted: the stand-in's user holds every role found."""
    files = sorted([*path.glob("*.yaml"), *path.glob("*.yml")]) if path.is_dir() else [path]
    rules = []
    for file in files:
        for doc in yaml.safe_load_all(file.read_text()):
            if not isinstance(doc, dict) or doc.get("kind") not in ("ClusterRole", "Role"):
                continue
            namespace = (doc.get("metadata") or {}).get("namespace", "default") if doc["kind"] == "Role" else None
            for rule in doc.get("rules") or []:
                if rule.get("nonResourceURLs"):
                    continue
                rules.append(Rule(frozenset(rule.get("verbs") or []), frozenset(rule.get("apiGroups") or []),
                                  frozenset(rule.get("resources") or []), frozenset(rule.get("resourceNames") or []),
                                  namespace))
    if not rules:
        raise ValueError(f"{path}: no ClusterRole or Role with rules")
    return rules


# --- selectors -------------------------------------------------------------------------------------------

def _split_selector(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in text:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    if current.strip():
        parts.append(current.strip())
    return parts


def label_matcher(selector: str) -> Callable[[Mapping[str, str]], bool]:
    """A label selector as `kubectl -l` takes it: k=v, k==v, k!=v, k, !k, k in (a,b), k notin (a,b)."""
    tests: list[tuple[str, str, frozenset[str]]] = []  # (key, operator, values)
    for term in _split_selector(selector):
        if m := re.fullmatch(r"([^\s=!]+)\s+(in|notin)\s+\(([^)]*)\)", term):
            tests.append((m[1], m[2], frozenset(v.strip() for v in m[3].split(","))))
        elif m := re.fullmatch(r"([^\s=!]+)\s*(==|=|!=)\s*([^\s=!,]*)", term):
            tests.append((m[1], "notin" if m[2] == "!=" else "in", frozenset([m[3]])))
        elif m := re.fullmatch(r"!\s*([^\s=!]+)", term):
            tests.append((m[1], "!", frozenset()))
        elif re.fullmatch(r"[^\s=!(),]+", term):
            tests.append((term, "exists", frozenset()))
        else:
            raise ApiError(400, f"unable to parse requirement: {term!r}")

    def test(labels: Mapping[str, str], key: str, op: str, values: frozenset[str]) -> bool:
        if op == "exists" or op == "!":
            return (key in labels) == (op == "exists")
        return (labels.get(key) in values) == (op == "in")  # notin and != also match a missing label

    return lambda labels: all(test(labels, *t) for t in tests)


def _field_value(obj: JSON, label: str) -> str:
    node: Any = obj
    for part in label.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, bool):
        return "true" if node else "false"
    return "" if node is None else str(node)


def field_matcher(kind: Kind, selector: str) -> Callable[[JSON], bool]:
    """A field selector: comma-separated k=v, k==v, k!=v on the fields the API server indexes for the kind."""
    tests = []
    for term in _split_selector(selector):
        m = re.fullmatch(r"([^=!]+)(==|=|!=)(.*)", term)
        if not m:
            raise ApiError(400, f"invalid field selector: {term!r}")
        label, op, value = m[1].strip(), m[2], m[3].strip()
        if label not in ("metadata.name", "metadata.namespace", *kind.field_labels):
            raise ApiError(400, f'field label not supported: {label}')
        tests.append((label, op == "!=", value))
    return lambda obj: all((_field_value(obj, label) == value) != negate for label, negate, value in tests)


def selector_matches(selector: JSON | None, labels: Mapping[str, str]) -> bool:
    """A metav1.LabelSelector (matchLabels, matchExpressions); an empty one matches everything."""
    if selector is None:
        return False
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if (op == "In" and labels.get(key) not in values) or (op == "NotIn" and labels.get(key) in values):
            return False
        if (op == "Exists" and key not in labels) or (op == "DoesNotExist" and key in labels):
            return False
    return True


def _tolerated(tolerations: list[JSON], taint: JSON) -> bool:
    """core/v1 Toleration.ToleratesTaint: the effect matches (or is empty), and the key with Exists (an empty
    key with Exists tolerates everything) or the key and value with Equal (the default operator)."""
    for toleration in tolerations:
        if toleration.get("effect") not in (None, "", taint.get("effect")):
            continue
        operator = toleration.get("operator") or "Equal"
        if not toleration.get("key"):
            if operator == "Exists":
                return True
            continue
        if toleration["key"] != taint.get("key"):
            continue
        if operator == "Exists" or (toleration.get("value") or "") == (taint.get("value") or ""):
            return True
    return False


# --- the server ----------------------------------------------------------------------------------------

def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class _Target:
    """What a request path names."""

    kind: Kind
    namespace: str
    name: str
    subresource: str


@dataclass
class _Reply:
    status: int
    body: Any
    headers: dict[str, str] = field(default_factory=dict)


class KubeApi:
    """The stand-in server, started on construction; `stop()` ends it. See the module docstring."""

    def __init__(self, cluster_role: Path | None = None, *, namespace_pods: object = None,
                 namespaces: Iterable[str] | None = None, grace_scale: float = 0.0,
                 clock: Callable[[], float] = time.monotonic, tls: bool = False, tokens: Iterable[str] = (),
                 list_delay: Mapping[str, float] | None = None) -> None:
        """`cluster_role`: the ClusterRole YAML (or a directory of YAML files) whose rules decide 403; None
        allows everything. `namespace_pods`: reserved by the shared interface, unused. `namespaces`: the
        namespaces that exist (with default and kube-system): creating anything elsewhere is 404 `namespaces
        "x" not found`, as on a real cluster; None: every namespace exists. `grace_scale`: a deleted pod goes
        away after its grace period times this, in seconds of `clock` (0: at once). `tls`: serve HTTPS with
        a server certificate (for 127.0.0.1 and localhost) of a CA made for this server, `ca_pem`. `tokens`:
        more bearer tokens accepted as the RBAC-checked service account (kubeconfig(token=)), so that the
        requests of several clients can be told apart (`Request.token`). `list_delay`: resource (plural) ->
        seconds a LIST of it is answered late, with the items as they were when it came."""
        self.rules = load_rules(cluster_role) if cluster_role is not None else None
        self.namespaces = None if namespaces is None else {"default", "kube-system", *namespaces}
        self.grace_scale = grace_scale
        self.clock = clock
        self.requests: list[Request] = []
        self.evictions: list[tuple[str, str, int | None]] = []
        self.deletions: list[tuple[str, str, int | None]] = []  # pods deleted through DELETE, with the grace asked
        self.taint_evictions: list[tuple[str, str]] = []  # pods the taint manager deleted (NoExecute)
        self.tokens = frozenset((TOKEN, *tokens))
        self.list_delay = dict(list_delay or {})
        #: Every version of every node as stored, in order: (time.monotonic(), a copy of the node).
        self.node_versions: list[tuple[float, JSON]] = []
        self._objects: dict[tuple[str, str, str], JSON] = {}  # (plural, namespace, name) -> object
        self._going: dict[tuple[str, str], float] = {}  # pods being deleted: (namespace, name) -> when gone
        self._failures: list[_Failure] = []
        self._version = 0
        self._lock = threading.RLock()
        self.ca_pem: bytes | None = None
        gate = None
        if tls:
            authority = Authority("kube-api-stand-in-ca")
            self.ca_pem = authority.pem
            gate = _TlsGate(authority.server_context("kube-apiserver"))
        # A long read timeout: it also ends idle keep-alive connections, which clients reuse between calls.
        self._server = HttpServer("127.0.0.1", 0, read_timeout=300.0, max_body_bytes=MAX_BODY_BYTES,
                                  max_request_bytes=65536, name="kube-api", server_version="kube-api-stand-in",
                                  gate=gate)
        self._server.route("/", self._serve, methods=None, prefix=True)
        self._server.start()
        self.url = self._server.url
        self.port = int(self._server.server_address[1])

    def stop(self) -> None:
        self._server.stop()

    def __enter__(self) -> KubeApi:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- what tests set up and look at -------------------------------------------------------------
    def kubeconfig(self, path: Path, *, admin: bool = False, namespace: str = "default",
                   token: str | None = None) -> Path:
        """Write a kubeconfig for this server (a bearer token: the RBAC-checked service account, `token` if
        given (one of KubeApi(tokens=)), or with `admin` a user the ClusterRole does not limit; with TLS, the CA
        as certificate-authority-data) and return its path."""
        if token is not None and token not in self.tokens:
            raise ValueError(f"token {token!r} is not one of KubeApi(tokens=)")
        user = "admin" if admin else "forewarn"
        cluster: JSON = {"server": self.url}
        if self.ca_pem is not None:
            cluster["certificate-authority-data"] = base64.b64encode(self.ca_pem).decode()
        config = {
            "apiVersion": "v1", "kind": "Config", "preferences": {},
            "clusters": [{"name": "stand-in", "cluster": cluster}],
            "users": [{"name": user, "user": {"token": ADMIN_TOKEN if admin else token or TOKEN}}],
            "contexts": [{"name": "stand-in", "context": {"cluster": "stand-in", "user": user,
                                                          "namespace": namespace}}],
            "current-context": "stand-in",
        }
        path.write_text(yaml.safe_dump(config))
        return path

    def service_account(self, directory: Path, *, namespace: str = "forewarn") -> Path:
        """Write `token` (the RBAC-checked one), `ca.crt` (this server's CA; TLS only) and `namespace` into
        `directory`, as the kubelet mounts a pod's service account, and return it. The server itself is
        KUBERNETES_SERVICE_HOST=127.0.0.1, KUBERNETES_SERVICE_PORT=`port`."""
        if self.ca_pem is None:
            raise ValueError("an in-cluster service account needs KubeApi(tls=True): the client speaks HTTPS")
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "token").write_text(TOKEN)
        (directory / "ca.crt").write_bytes(self.ca_pem)
        (directory / "namespace").write_text(namespace)
        return directory

    def add_node(self, name: str, labels: Mapping[str, str] | None = None,
                 taints: Iterable[Mapping[str, Any]] = (), unschedulable: bool = False,
                 annotations: Mapping[str, str] | None = None, *,
                 conditions: Iterable[Mapping[str, Any]] = (), provider_id: str | None = None) -> None:
        """A Ready node. `conditions` are added to the kubelet's usual four (e.g. NPD's VMEventScheduled)."""
        now = _now()
        base = [{"type": t, "status": "False", "reason": f"Kubelet{r}", "message": "ok",
                 "lastHeartbeatTime": now, "lastTransitionTime": now}
                for t, r in (("MemoryPressure", "HasSufficientMemory"), ("DiskPressure", "HasNoDiskPressure"),
                             ("PIDPressure", "HasSufficientPID"))]
        base.append({"type": "Ready", "status": "True", "reason": "KubeletReady",
                     "message": "kubelet is posting ready status", "lastHeartbeatTime": now,
                     "lastTransitionTime": now})
        spec: JSON = {"providerID": provider_id} if provider_id else {}
        if unschedulable:
            spec["unschedulable"] = True
        if taints:
            spec["taints"] = [dict(t) for t in taints]
        node = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "labels": dict(labels if labels is not None else
                                                          {"kubernetes.io/hostname": name,
                                                           "kubernetes.io/os": "linux"}),
                             **({"annotations": dict(annotations)} if annotations else {})},
                "spec": spec,
                "status": {"conditions": base + [dict(c) for c in conditions],
                           "addresses": [{"type": "Hostname", "address": name}]}}
        self._seed(KINDS[0], node)

    def add_pod(self, namespace: str, name: str, node: str, labels: Mapping[str, str] | None = None,
                owner_kind: str | None = None, mirror: bool = False, local_storage: bool = False,
                grace: int = 30, *, phase: str = "Running", priority: int | None = None,
                priority_class: str | None = None, tolerations: Iterable[Mapping[str, Any]] = ()) -> None:
        """A running pod on `node`: owned by a controller of `owner_kind` ("DaemonSet", "ReplicaSet"...),
        or a static pod's mirror (owned by the Node, with the config.mirror annotation). `priority` and
        `priority_class` as admission sets them (spec.priority from the PriorityClass named); `tolerations`
        as in the pod spec."""
        meta: JSON = {"name": name, "namespace": namespace, "labels": dict(labels or {})}
        if owner_kind:
            group = "batch/v1" if owner_kind == "Job" else "apps/v1"
            meta["ownerReferences"] = [{"apiVersion": group, "kind": owner_kind, "name": f"{name}-owner",
                                        "uid": str(uuid.uuid4()), "controller": True, "blockOwnerDeletion": True}]
        if mirror:
            meta["annotations"] = {"kubernetes.io/config.mirror": secrets.token_hex(16),
                                   "kubernetes.io/config.source": "file"}
            meta["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node", "name": node,
                                        "uid": self._uid("nodes", "", node), "controller": True}]
        spec: JSON = {"nodeName": node, "terminationGracePeriodSeconds": grace,
                      "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}]}
        if priority is not None:
            spec["priority"] = priority
        if priority_class is not None:
            spec["priorityClassName"] = priority_class
        if tolerations:
            spec["tolerations"] = [dict(t) for t in tolerations]
        if local_storage:
            spec["volumes"] = [{"name": "scratch", "emptyDir": {}}]
            spec["containers"][0]["volumeMounts"] = [{"name": "scratch", "mountPath": "/scratch"}]
        ready = "True" if phase == "Running" else "False"
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec,
               "status": {"phase": phase, "conditions": [{"type": "Ready", "status": ready}]}}
        self._seed(KINDS[1], pod)

    def add_pdb(self, namespace: str, name: str, selector_labels: Mapping[str, str],
                max_unavailable: int = 0) -> None:
        """A PodDisruptionBudget over the pods with these labels; disruptionsAllowed starts at max_unavailable."""
        with self._lock:
            healthy = sum(1 for pod in self._list(KINDS[1], namespace)
                          if all(pod["metadata"].get("labels", {}).get(k) == v for k, v in selector_labels.items()))
        pdb = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
               "metadata": {"name": name, "namespace": namespace, "generation": 1},
               "spec": {"selector": {"matchLabels": dict(selector_labels)}, "maxUnavailable": max_unavailable},
               "status": {"disruptionsAllowed": max_unavailable, "currentHealthy": healthy,
                          "desiredHealthy": max(0, healthy - max_unavailable), "expectedPods": healthy,
                          "observedGeneration": 1}}
        self._seed(KINDS[2], pdb)

    def set_pdb_allowed(self, namespace: str, name: str, disruptions_allowed: int) -> None:
        with self._lock:
            pdb = self._objects[("poddisruptionbudgets", namespace, name)]
            pdb["status"]["disruptionsAllowed"] = disruptions_allowed
            self._bump(pdb)

    def update_node(self, name: str, change: Callable[[JSON], None]) -> None:
        """Change a node as someone else would (an administrator, the AKS remediator): `change` edits it."""
        with self._lock:
            node = copy.deepcopy(self._objects[("nodes", "", name)])
            change(node)
            node = validate(node)
            self._objects[("nodes", "", name)] = node
            self._bump(node)
            self._taint_evictions(node)

    def node(self, name: str) -> JSON:
        with self._lock:
            return copy.deepcopy(self._objects[("nodes", "", name)])

    def pod(self, namespace: str, name: str) -> JSON | None:
        with self._lock:
            self._purge()
            found = self._objects.get(("pods", namespace, name))
            return copy.deepcopy(found) if found else None

    def pdb(self, namespace: str, name: str) -> JSON:
        with self._lock:
            return copy.deepcopy(self._objects[("poddisruptionbudgets", namespace, name)])

    def node_history(self, name: str) -> list[tuple[float, JSON]]:
        """Every version of node `name` as stored, oldest first: (time.monotonic(), the node)."""
        with self._lock:
            return [(at, copy.deepcopy(node)) for at, node in self.node_versions if node["metadata"]["name"] == name]

    def unschedulable_history(self, name: str) -> list[bool]:
        """Every value node `name`'s spec.unschedulable took, in order (a repeat of the value before is not
        listed again; absent counts as False)."""
        values: list[bool] = []
        for _, node in self.node_history(name):
            value = bool((node.get("spec") or {}).get("unschedulable"))
            if not values or values[-1] != value:
                values.append(value)
        return values

    def pods(self) -> list[JSON]:
        with self._lock:
            self._purge()
            return copy.deepcopy(self._list(KINDS[1], None))

    def events(self) -> list[JSON]:
        with self._lock:
            return copy.deepcopy(self._list(KINDS[3], None))

    def leases(self) -> list[JSON]:
        with self._lock:
            return copy.deepcopy(self._list(KINDS[4], None))

    def fail_next(self, method: str, path_regex: str, status: int, message: str = "injected failure") -> None:
        """Answer the next request with this method whose path matches (re.search) with a Status of
        `status`, doing nothing else. Several may be queued; each is used once."""
        with self._lock:
            self._failures.append(_Failure(method.upper(), re.compile(path_regex), status, message))

    def fail_always(self, method: str, path_regex: str, status: int, message: str = "injected failure") -> None:
        """Answer every request with this method whose path matches (re.search) with a Status of `status`,
        doing nothing else, until `recover()`: an API server (or etcd) that is down for a while."""
        with self._lock:
            self._failures.append(_Failure(method.upper(), re.compile(path_regex), status, message, persistent=True))

    def recover(self) -> None:
        """End every fail_always (failures queued with fail_next stay)."""
        with self._lock:
            self._failures = [failure for failure in self._failures if not failure.persistent]

    # --- storage ----------------------------------------------------------------------------------
    def _seed(self, kind: Kind, obj: JSON) -> None:
        meta = obj["metadata"]
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", _now())
        obj = validate(obj)  # the stand-in's own objects are real ones too
        with self._lock:
            if self.namespaces is not None and meta.get("namespace"):
                self.namespaces.add(meta["namespace"])
            self._objects[(kind.plural, meta.get("namespace", ""), meta["name"])] = obj
            self._bump(obj)

    def _bump(self, obj: JSON) -> None:
        self._version += 1
        obj["metadata"]["resourceVersion"] = str(self._version)
        if obj.get("kind") == "Node":
            self.node_versions.append((time.monotonic(), copy.deepcopy(obj)))

    def _uid(self, plural: str, namespace: str, name: str) -> str:
        with self._lock:
            found = self._objects.get((plural, namespace, name))
        return str(found["metadata"]["uid"]) if found else str(uuid.uuid4())

    def _list(self, kind: Kind, namespace: str | None) -> list[JSON]:
        found = [obj for (plural, ns, _), obj in self._objects.items()
                 if plural == kind.plural and (namespace is None or ns == namespace)]
        return sorted(found, key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"]))

    def _purge(self) -> None:
        now = self.clock()
        for key, when in list(self._going.items()):
            if when <= now:
                del self._going[key]
                self._objects.pop(("pods", *key), None)
                self._version += 1

    def _taint_evictions(self, node: JSON) -> None:
        """The taint manager (NoExecute taint-based eviction): every pod on `node` that does not tolerate one of
        its NoExecute taints is deleted with its own grace period, as a delete without options would. Mirror
        pods stay (the kubelet would recreate them at once). A toleration with tolerationSeconds counts as
        tolerating (the stand-in does not delete it later)."""
        taints = [t for t in (node.get("spec") or {}).get("taints") or [] if t.get("effect") == "NoExecute"]
        if not taints:
            return
        for pod in self._list(KINDS[1], None):
            meta = pod["metadata"]
            if pod["spec"].get("nodeName") != node["metadata"]["name"] or "deletionTimestamp" in meta:
                continue
            if "kubernetes.io/config.mirror" in (meta.get("annotations") or {}):
                continue
            if all(_tolerated(pod["spec"].get("tolerations") or [], taint) for taint in taints):
                continue
            self.taint_evictions.append((meta["namespace"], meta["name"]))
            self._delete_pod(pod, int(pod["spec"].get("terminationGracePeriodSeconds", 30)))

    def _delete_pod(self, pod: JSON, grace: int) -> None:
        meta = pod["metadata"]
        key = (meta["namespace"], meta["name"])
        if self.grace_scale <= 0 or grace <= 0:
            self._objects.pop(("pods", *key), None)
            self._going.pop(key, None)
            self._version += 1
            return
        if key in self._going:  # already terminating: a shorter grace may only bring the end closer
            self._going[key] = min(self._going[key], self.clock() + grace * self.grace_scale)
            return
        deadline = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=grace)
        meta["deletionTimestamp"] = deadline.strftime("%Y-%m-%dT%H:%M:%SZ")
        meta["deletionGracePeriodSeconds"] = grace
        self._going[key] = self.clock() + grace * self.grace_scale
        self._bump(pod)

    # --- HTTP -------------------------------------------------------------------------------------
    def _serve(self, http: HttpRequest) -> Response:
        split = urlsplit(http.target)
        query = {k: v[-1] for k, v in parse_qs(split.query, keep_blank_values=True).items()}
        record = Request(http.method, split.path, query, {k.lower(): v for k, v in http.headers.items()},
                         http.body)
        try:
            with self._lock:
                self._purge()
                reply = self._answer(record)
        except ApiError as error:
            reply = _Reply(error.code, error.status(), error.headers)
        if reply.status == 200 and (delay := self._list_delay(record)):
            time.sleep(delay)   # outside the lock: the API serves other requests meanwhile
        record.status = reply.status
        with self._lock:
            self.requests.append(record)
        return Response(reply.status, json.dumps(reply.body).encode(), "application/json", reply.headers)

    def _list_delay(self, request: Request) -> float:
        """How late a LIST is answered (list_delay), 0 for any other request."""
        if request.method != "GET" or request.query.get("watch") in ("1", "true") or not self.list_delay:
            return 0.0
        try:
            target = self._target(request.path)
        except ApiError:
            return 0.0
        return 0.0 if target.name else self.list_delay.get(target.kind.plural, 0.0)

    def _answer(self, request: Request) -> _Reply:
        if request.token not in self.tokens | {ADMIN_TOKEN}:
            raise ApiError(401, "Unauthorized")
        accept = request.headers.get("accept", "*/*")
        if not any(t.split(";")[0].strip() in ("application/json", "*/*", "application/*") for t in accept.split(",")):
            raise ApiError(406, f"only application/json is served, not {accept}")
        for failure in self._failures:
            if failure.method == request.method and failure.path.search(request.path):
                if not failure.persistent:
                    self._failures.remove(failure)
                raise ApiError(failure.status, failure.message,
                               headers={"Retry-After": "1"} if failure.status == 429 else None)
        if request.query.get("dryRun", "All") != "All":
            raise ApiError(400, f'dryRun: Unsupported value: "{request.query["dryRun"]}": supported values: "All"')
        if request.query.get("fieldValidation", "Strict") not in ("Ignore", "Warn", "Strict"):
            raise ApiError(400, "fieldValidation: Unsupported value: must be one of Ignore, Warn, Strict")
        if len(request.query.get("fieldManager", "")) > 128:
            raise ApiError(422, "fieldManager: Too long: must have at most 128 bytes")
        discovery = self._discovery(request.path)
        if discovery is not None:
            if request.method != "GET":
                raise ApiError(405, "the server does not allow this method on the requested resource")
            return _Reply(200, discovery)
        target = self._target(request.path)
        verb = self._verb(request, target)
        self._authorize(request, verb, target)
        return self._dispatch(request, verb, target)

    def _target(self, path: str) -> _Target:
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "v1"]:
            group, version, rest = "", "v1", parts[2:]
        elif parts[0] == "apis" and len(parts) >= 3:
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            raise ApiError(404, "the server could not find the requested resource")
        namespace = ""
        if len(rest) >= 3 and rest[0] == "namespaces":
            namespace, rest = rest[1], rest[2:]
        kind = BY_PATH.get((group, version, rest[0])) if rest else None
        if kind is None or len(rest) > 3 or (namespace and not kind.namespaced):
            raise ApiError(404, "the server could not find the requested resource")
        name = rest[1] if len(rest) > 1 else ""
        sub = rest[2] if len(rest) > 2 else ""
        if sub and sub not in kind.subresources:
            raise ApiError(404, "the server could not find the requested resource")
        return _Target(kind, namespace, name, sub)

    @staticmethod
    def _verb(request: Request, target: _Target) -> str:
        if request.method == "GET":
            if target.name:
                return "get"
            return "watch" if request.query.get("watch") in ("1", "true") else "list"
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(request.method)
        if verb is None:
            raise ApiError(405, "the server does not allow this method on the requested resource")
        if verb == "delete" and not target.name:
            return "deletecollection"
        return verb

    def _authorize(self, request: Request, verb: str, target: _Target) -> None:
        if self.rules is None or request.headers.get("authorization") == f"Bearer {ADMIN_TOKEN}":
            return
        kind, resource = target.kind, target.kind.plural + (f"/{target.subresource}" if target.subresource else "")
        if any(rule.grants(verb, kind.group, resource, target.namespace, target.name) for rule in self.rules):
            return
        scope = f'in the namespace "{target.namespace}"' if target.namespace else "at the cluster scope"
        named = f'{kind.group_resource} "{target.name}"' if target.name else kind.group_resource
        raise ApiError(403, f'{named} is forbidden: User "{USER}" cannot {verb} resource "{resource}" in API '
                            f'group "{kind.group}" {scope}', "Forbidden",
                       {"name": target.name, "group": kind.group, "kind": kind.plural})

    def _dispatch(self, request: Request, verb: str, target: _Target) -> _Reply:
        kind, sub = target.kind, target.subresource
        dry = "dryRun" in request.query
        if sub == "eviction":
            if verb != "create":
                raise ApiError(405, "the server does not allow this method on the requested resource")
            return self._evict(request, target, dry)
        if verb == "list":
            if sub:
                raise ApiError(405, "the server does not allow this method on the requested resource")
            return _Reply(200, self._list_reply(request, target))
        if verb == "watch":
            raise ApiError(400, "watch is not supported by the stand-in: list again instead")
        if verb == "create":
            if target.name:
                raise ApiError(405, "the server does not allow this method on the requested resource")
            return self._create(request, target, dry)
        current = self._objects.get((kind.plural, target.namespace, target.name))
        if current is None:
            raise not_found(kind, target.name)
        if verb == "get":
            return _Reply(200, copy.deepcopy(current))
        if verb == "update":
            return self._write(target, current, self._body(request, kind), dry, check_version=True)
        if verb == "patch":
            return self._write(target, current, self._patched(request, target, current), dry, check_version=True)
        if verb == "delete" and not sub:
            return self._delete(request, target, current, dry)
        raise ApiError(405, "the server does not allow this method on the requested resource")

    # --- the verbs --------------------------------------------------------------------------------
    def _body(self, request: Request, kind: Kind | None, expect: tuple[str, str] | None = None) -> JSON:
        content_type = request.headers.get("content-type", "application/json").split(";")[0].strip()
        try:
            if content_type == "application/json":
                body = json.loads(request.body)
            elif content_type in ("application/yaml", "application/vnd.kubernetes.yaml"):
                body = yaml.safe_load(request.body)
            else:
                raise ApiError(415, f'the body of the request was in an unknown format ("{content_type}") - '
                                    "accepted media types include: application/json, application/yaml")
        except (ValueError, yaml.YAMLError) as error:
            raise ApiError(400, f"the body of the request could not be decoded: {error}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body of the request must be a JSON object")
        api_version, kind_name = expect or ((kind.api_version, kind.kind) if kind else ("", ""))
        # Like the API server's decoder: the endpoint's kind and version fill in what the body leaves out.
        body.setdefault("apiVersion", api_version)
        body.setdefault("kind", kind_name)
        if body.get("apiVersion") != api_version or body.get("kind") != kind_name:
            raise ApiError(400, f"the API version and kind in the body ({body.get('apiVersion')}, "
                                f"{body.get('kind')}) do not match the expected ({api_version}, {kind_name})")
        if not isinstance(body.get("metadata", {}), dict):
            raise ApiError(400, "metadata must be an object")
        return body

    def _create(self, request: Request, target: _Target, dry: bool) -> _Reply:
        kind = target.kind
        if self.namespaces is not None and kind.namespaced and target.namespace not in self.namespaces:
            raise ApiError(404, f'namespaces "{target.namespace}" not found', "NotFound",
                           {"name": target.namespace, "kind": "namespaces"})
        obj = self._body(request, kind)
        meta = obj.setdefault("metadata", {})
        if kind.namespaced:
            if meta.get("namespace") not in (None, "", target.namespace):
                raise ApiError(400, "the namespace of the provided object does not match the namespace sent on "
                                    "the request")
            meta["namespace"] = target.namespace
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = f"{meta['generateName']}{secrets.token_hex(3)[:5]}"
        if not meta.get("name"):
            raise invalid(kind.kind, kind.group, "", [("metadata.name", "Required value: name or generateName "
                                                                        "is required")])
        if meta.get("resourceVersion"):
            raise ApiError(500, "resourceVersion should not be set on objects to be created")
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = _now()
        obj = validate(obj)
        meta = obj["metadata"]
        key = (kind.plural, target.namespace, meta["name"])
        if key in self._objects:
            raise ApiError(409, f'{kind.group_resource} "{meta["name"]}" already exists', "AlreadyExists",
                           {"name": meta["name"], "group": kind.group, "kind": kind.plural})
        if dry:
            meta["resourceVersion"] = ""
            return _Reply(201, obj)
        self._objects[key] = obj
        self._bump(obj)
        return _Reply(201, copy.deepcopy(obj))

    def _patched(self, request: Request, target: _Target, current: JSON) -> JSON:
        content_type = request.headers.get("content-type", "").split(";")[0].strip()
        if content_type not in PATCH_TYPES or content_type == "application/apply-patch+yaml":
            raise ApiError(415, f'the body of the request was in an unknown format ("{content_type}") - accepted '
                                "media types include: application/json-patch+json, application/merge-patch+json, "
                                "application/strategic-merge-patch+json (no server-side apply in the stand-in)")
        try:
            patch = json.loads(request.body)
        except ValueError as error:
            raise ApiError(400, f"the patch could not be decoded: {error}") from None
        try:
            if content_type == "application/json-patch+json":
                result = json_patch(current, patch)
            elif not isinstance(patch, dict):
                raise PatchError("the patch must be a JSON object")
            elif content_type == "application/merge-patch+json":
                result = merge_patch(current, patch)
            else:
                result = strategic_merge_patch(current, patch, _top_schema(target.kind.api_version, target.kind.kind))
        except PatchError as error:
            raise ApiError(error.code, str(error)) from None
        if not isinstance(result, dict):
            raise ApiError(422, "the patched object is not a JSON object")
        return result

    def _write(self, target: _Target, current: JSON, new: JSON, dry: bool, *, check_version: bool) -> _Reply:
        """An update or a patch: the checks the API server makes, then the new object stored (or not)."""
        kind = target.kind
        meta = new.get("metadata")
        if not isinstance(meta, dict):
            raise ApiError(400, "metadata must be an object")
        if new.get("apiVersion") != kind.api_version or new.get("kind") != kind.kind:
            raise ApiError(400, f"the API version and kind in the body ({new.get('apiVersion')}, {new.get('kind')})"
                                f" do not match the expected ({kind.api_version}, {kind.kind})")
        if meta.get("name") != target.name:
            raise ApiError(400, f"the name of the object ({meta.get('name')}) does not match the name on the URL "
                                f"({target.name})")
        if kind.namespaced and meta.get("namespace") not in (None, "", target.namespace):
            raise ApiError(400, "the namespace of the provided object does not match the namespace sent on the "
                                "request")
        version = meta.get("resourceVersion")
        if check_version and version and version != current["metadata"]["resourceVersion"]:
            raise conflict(kind, target.name)
        if not version and not kind.unconditional_update:
            raise invalid(kind.kind, kind.group, target.name,
                          [("metadata.resourceVersion", "Invalid value: 0x0: must be specified for an update")])
        if meta.get("uid") not in (None, current["metadata"]["uid"]):
            raise ApiError(409, f"Precondition failed: UID in precondition: {meta['uid']}, UID in object meta: "
                                f"{current['metadata']['uid']}", "Conflict")
        new = copy.deepcopy(new)
        # What the server owns, and what the other half of a status subresource may not change.
        for owned in ("uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "generation"):
            if owned in current["metadata"]:
                new["metadata"][owned] = current["metadata"][owned]
            else:
                new["metadata"].pop(owned, None)
        if kind.namespaced:
            new["metadata"]["namespace"] = target.namespace
        if target.subresource == "status":
            new = {**copy.deepcopy(current), "status": new.get("status")}
            if new["status"] is None:
                del new["status"]
        elif kind.status:
            new.pop("status", None)
            if "status" in current:
                new["status"] = copy.deepcopy(current["status"])
        new = validate(new)
        new["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
        if new == current or dry:
            return _Reply(200, new)
        self._objects[(kind.plural, target.namespace, target.name)] = new
        self._bump(new)
        if kind.plural == "nodes":
            self._taint_evictions(new)
        return _Reply(200, copy.deepcopy(new))

    def _delete(self, request: Request, target: _Target, current: JSON, dry: bool) -> _Reply:
        kind = target.kind
        options: JSON = {}
        if request.body:
            try:
                options = json.loads(request.body)
            except ValueError as error:
                raise ApiError(400, f"the DeleteOptions could not be decoded: {error}") from None
            if not isinstance(options, dict):
                raise ApiError(400, "the DeleteOptions must be a JSON object")
        preconditions = options.get("preconditions") or {}
        if preconditions.get("resourceVersion") not in (None, current["metadata"]["resourceVersion"]):
            raise conflict(kind, target.name)
        if preconditions.get("uid") not in (None, current["metadata"]["uid"]):
            raise conflict(kind, target.name)
        if dry or "All" in (options.get("dryRun") or []):
            return _Reply(200, copy.deepcopy(current))
        if kind.plural == "pods":
            grace = options.get("gracePeriodSeconds", request.query.get("gracePeriodSeconds"))
            if grace is not None and (not str(grace).lstrip("-").isdigit() or int(grace) < 0):
                raise invalid("DeleteOptions", "", "", [("gracePeriodSeconds", f"Invalid value: {grace}: must be "
                                                         "greater than or equal to 0")])
            self.deletions.append((target.namespace, target.name, int(grace) if grace is not None else None))
            self._delete_pod(current, int(grace) if grace is not None else
                             int(current["spec"].get("terminationGracePeriodSeconds", 30)))
            if ("pods", target.namespace, target.name) in self._objects:
                return _Reply(200, copy.deepcopy(current))
        else:
            del self._objects[(kind.plural, target.namespace, target.name)]
            self._version += 1
        return _Reply(200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                            "details": {"name": target.name, "group": kind.group, "kind": kind.plural,
                                        "uid": current["metadata"]["uid"]}})

    def _list_reply(self, request: Request, target: _Target) -> JSON:
        kind = target.kind
        items = self._list(kind, target.namespace if kind.namespaced and target.namespace else None)
        if selector := request.query.get("labelSelector"):
            labels = label_matcher(selector)
            items = [o for o in items if labels(o["metadata"].get("labels") or {})]
        if selector := request.query.get("fieldSelector"):
            fields = field_matcher(kind, selector)
            items = [o for o in items if fields(o)]
        start = int(request.query["continue"]) if request.query.get("continue", "").isdigit() else 0
        limit = int(request.query["limit"]) if request.query.get("limit", "").isdigit() else 0
        page = items[start:start + limit] if limit else items[start:]
        meta: JSON = {"resourceVersion": str(self._version)}
        if limit and start + limit < len(items):
            meta["continue"] = str(start + limit)
            meta["remainingItemCount"] = len(items) - start - limit
        # As the API server sends them: the items of a list carry no kind or apiVersion.
        bare = [{k: copy.deepcopy(v) for k, v in o.items() if k not in ("kind", "apiVersion")} for o in page]
        return {"kind": f"{kind.kind}List", "apiVersion": kind.api_version, "metadata": meta, "items": bare}

    def _evict(self, request: Request, target: _Target, dry: bool) -> _Reply:
        eviction = self._body(request, None, EVICTION)
        validate(eviction)
        meta = eviction.get("metadata") or {}
        if meta.get("name") != target.name:
            raise ApiError(400, "name in URL does not match name in Eviction object")
        if meta.get("namespace") not in (None, "", target.namespace):
            raise ApiError(400, "namespace in URL does not match namespace in Eviction object")
        pods = target.kind
        pod = self._objects.get(("pods", target.namespace, target.name))
        if pod is None:
            raise not_found(pods, target.name)
        options = eviction.get("deleteOptions") or {}
        dry = dry or "All" in (options.get("dryRun") or [])
        preconditions = options.get("preconditions") or {}
        if preconditions.get("resourceVersion") not in (None, pod["metadata"]["resourceVersion"]) or \
                preconditions.get("uid") not in (None, pod["metadata"]["uid"]):
            raise conflict(pods, target.name)
        grace = options.get("gracePeriodSeconds")
        # Terminal, pending or already terminating pods are deleted without asking the budgets.
        ignore_budget = (pod["status"].get("phase") in ("Succeeded", "Failed", "Pending")
                         or "deletionTimestamp" in pod["metadata"])
        labels = pod["metadata"].get("labels") or {}
        budgets = [] if ignore_budget else [
            b for b in self._list(self._kind("poddisruptionbudgets"), target.namespace)
            if selector_matches(b["spec"].get("selector"), labels)]
        if len(budgets) > 1:
            raise ApiError(500, "This pod has more than one PodDisruptionBudget, which the eviction subresource "
                                "does not support.")
        if budgets:
            budget = budgets[0]
            status = budget.setdefault("status", {})
            if status.get("disruptionsAllowed", 0) <= 0:
                cause = (f"The disruption budget {budget['metadata']['name']} needs {status.get('desiredHealthy', 0)}"
                         f" healthy pods and has {status.get('currentHealthy', 0)} currently")
                raise ApiError(429, "Cannot evict pod as it would violate the pod's disruption budget.",
                               "TooManyRequests", {"causes": [{"reason": "DisruptionBudget", "message": cause}]})
            if not dry:
                status["disruptionsAllowed"] -= 1
                status.setdefault("disruptedPods", {})[target.name] = _now()
                self._bump(budget)
        if not dry:
            self.evictions.append((target.namespace, target.name, grace))
            self._delete_pod(pod, int(grace) if grace is not None else
                             int(pod["spec"].get("terminationGracePeriodSeconds", 30)))
        return _Reply(201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201})

    @staticmethod
    def _kind(plural: str) -> Kind:
        return next(k for k in KINDS if k.plural == plural)

    # --- discovery --------------------------------------------------------------------------------
    def _discovery(self, path: str) -> JSON | None:
        path = "/" + path.strip("/")
        if path == "/version":
            return {"major": "1", "minor": "32", "gitVersion": f"v{K8S_VERSION}", "platform": "linux/amd64"}
        if path == "/api":
            return {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}
        groups = sorted({(k.group, k.version) for k in KINDS if k.group})
        if path == "/apis":
            return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
                {"name": g, "versions": [{"groupVersion": f"{g}/{v}", "version": v}],
                 "preferredVersion": {"groupVersion": f"{g}/{v}", "version": v}} for g, v in groups]}
        for group, version in [("", "v1"), *groups]:
            if path == (f"/apis/{group}/{version}" if group else "/api/v1"):
                resources = []
                for k in KINDS:
                    if (k.group, k.version) != (group, version):
                        continue
                    verbs = ["create", "delete", "deletecollection", "get", "list", "patch", "update"]
                    resources.append({"name": k.plural, "singularName": k.kind.lower(), "namespaced": k.namespaced,
                                      "kind": k.kind, "verbs": verbs})
                    for sub in k.subresources:
                        resources.append({"name": f"{k.plural}/{sub}", "singularName": "", "namespaced": k.namespaced,
                                          "kind": "Eviction" if sub == "eviction" else k.kind,
                                          "verbs": ["create"] if sub == "eviction" else ["get", "patch", "update"]})
                return {"kind": "APIResourceList", "apiVersion": "v1",
                        "groupVersion": f"{group}/{version}" if group else version, "resources": resources}
        return None
