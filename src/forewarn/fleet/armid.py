"""Azure Resource Manager (ARM) resource IDs: split, compare, build.

An ARM ID names one resource by a path:
`/subscriptions/{s}/resourceGroups/{rg}/providers/{Namespace}/{type}/{name}[/{type}/{name}...]`. An
extension resource hangs below another one with a second `/providers/...` part; a scheduled event is one:
`{target ID}/providers/Microsoft.Maintenance/scheduledevents/{EventId}`.

ARM treats IDs without regard to case (ARG lower-cases some of them, Event Grid keeps the case the
resource was created with), so `ArmId` values compare case-insensitively while keeping the spelling they
were given in for display. IDs arrive from central feeds, so every one is bounded and checked before use.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from forewarn.imds.document import shown

#: Longest ID accepted (characters). Real ones stay well below: a subscription GUID, a resource group
#: name (at most 90), and a few type/name pairs of at most a few dozen characters each.
MAX_ARM_ID_LENGTH = 1024
#: Most path segments accepted: room for a child of a child of an extension resource.
MAX_SEGMENTS = 32
#: Longest single segment (a name or a type).
MAX_SEGMENT_LENGTH = 260

SCHEDULED_EVENTS_NAMESPACE = "Microsoft.Maintenance"
SCHEDULED_EVENTS_TYPE = "scheduledevents"
COMPUTE_NAMESPACE = "Microsoft.Compute"
VIRTUAL_MACHINES = "virtualMachines"
VIRTUAL_MACHINE_SCALE_SETS = "virtualMachineScaleSets"
AVAILABILITY_SETS = "availabilitySets"

# Characters that cannot be part of a segment: controls would corrupt logs and labels, and these would
# change the meaning of a URL built from the ID (the acknowledge call is a POST to the event's ID).
_BAD_SEGMENT = re.compile(r"[\x00-\x1f\x7f?#%\\]")


class ArmIdError(ValueError):
    """The text is not an ARM resource ID; the message says what is wrong with it."""


@dataclass(frozen=True, eq=False)
class ArmId:
    """One ARM resource ID, split. Equality and hashing ignore case, as ARM does.

    `types` and `names` pair up: `("virtualMachineScaleSets", "virtualMachines")` with `("web", "3")` is
    instance 3 of scale set web. `parent` is set for an extension resource: the resource it hangs below.
    """

    subscription_id: str
    resource_group: str | None
    namespace: str
    types: tuple[str, ...]
    names: tuple[str, ...]
    parent: ArmId | None = None

    @property
    def name(self) -> str:
        return self.names[-1]

    @property
    def resource_type(self) -> str:
        """`Namespace/type[/childType...]`, e.g. `Microsoft.Compute/virtualMachines`."""
        return "/".join((self.namespace, *self.types))

    def is_type(self, namespace: str, *types: str) -> bool:
        """True when this resource is of `namespace/types...`, compared without regard to case."""
        return (self.namespace.lower() == namespace.lower()
                and tuple(t.lower() for t in self.types) == tuple(t.lower() for t in types))

    def __str__(self) -> str:
        pairs = "".join(f"/{kind}/{name}" for kind, name in zip(self.types, self.names, strict=True))
        tail = f"/providers/{self.namespace}{pairs}"
        if self.parent is not None:
            return f"{self.parent}{tail}"
        group = f"/resourceGroups/{self.resource_group}" if self.resource_group is not None else ""
        return f"/subscriptions/{self.subscription_id}{group}{tail}"

    @property
    def key(self) -> str:
        """The normalised ID in lower case: what two spellings of one resource have in common."""
        return str(self).lower()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ArmId) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)


def _segment(text: str, what: str, where: str) -> str:
    if not text:
        raise ArmIdError(f"{where}: {what} is empty")
    if len(text) > MAX_SEGMENT_LENGTH:
        raise ArmIdError(f"{where}: {what} is longer than {MAX_SEGMENT_LENGTH} characters")
    if _BAD_SEGMENT.search(text):
        raise ArmIdError(f"{where}: {what} {shown(text)} holds a control character or one of ? # % \\")
    return text


def is_valid_name(name: str) -> bool:
    """True when `name` can stand as one segment of an ARM ID (no slash, no control character)."""
    return 0 < len(name) <= MAX_SEGMENT_LENGTH and "/" not in name and not _BAD_SEGMENT.search(name)


def parse_arm_id(text: str) -> ArmId:
    """Split an ARM resource ID. Raises ArmIdError for anything that is not one.

    Accepted: `/subscriptions/{s}[/resourceGroups/{rg}]/providers/{ns}/{type}/{name}...`, any number of
    further `/providers/{ns}/{type}/{name}...` parts (extension resources), keywords in any case, and one
    trailing slash. A subscription or resource group alone is not a resource ID here.
    """
    if not isinstance(text, str):
        raise ArmIdError(f"an ARM ID must be a string, got {type(text).__name__}")
    where = f"ARM ID {shown(text)}"
    if len(text) > MAX_ARM_ID_LENGTH:
        raise ArmIdError(f"ARM ID of {len(text)} characters is longer than {MAX_ARM_ID_LENGTH}")
    body = text.strip()
    if body.endswith("/"):
        body = body[:-1]
    if not body.startswith("/"):
        raise ArmIdError(f"{where} must start with /subscriptions/")
    parts = body[1:].split("/")
    if len(parts) > MAX_SEGMENTS:
        raise ArmIdError(f"{where} has more than {MAX_SEGMENTS} segments")
    if "" in parts:
        raise ArmIdError(f"{where} has an empty segment (//)")
    if len(parts) < 2 or parts[0].lower() != "subscriptions":
        raise ArmIdError(f"{where} must start with /subscriptions/{{subscription id}}")
    subscription = _segment(parts[1], "the subscription", where)
    rest = parts[2:]
    group: str | None = None
    if rest and rest[0].lower() == "resourcegroups":
        if len(rest) < 2:
            raise ArmIdError(f"{where}: resourceGroups has no name after it")
        group = _segment(rest[1], "the resource group", where)
        rest = rest[2:]
    if not rest:
        raise ArmIdError(f"{where} names no resource (no /providers/{{namespace}}/{{type}}/{{name}})")

    result: ArmId | None = None
    while rest:
        if rest[0].lower() != "providers":
            raise ArmIdError(f"{where}: expected /providers/ where {shown(rest[0])} is")
        end = next((i for i in range(2, len(rest)) if rest[i].lower() == "providers" and i % 2 == 0), len(rest))
        chunk, rest = rest[1:end], rest[end:]
        if not chunk:
            raise ArmIdError(f"{where}: providers has no namespace after it")
        namespace = _segment(chunk[0], "the provider namespace", where)
        pairs = chunk[1:]
        if not pairs:
            raise ArmIdError(f"{where}: provider {shown(namespace)} has no resource type and name after it")
        if len(pairs) % 2:
            raise ArmIdError(f"{where}: resource type {shown(pairs[-1])} has no name after it")
        types = tuple(_segment(t, "a resource type", where) for t in pairs[0::2])
        names = tuple(_segment(n, "a resource name", where) for n in pairs[1::2])
        result = ArmId(subscription, group, namespace, types, names, parent=result)
    assert result is not None
    return result


def as_arm_id(value: str | ArmId) -> ArmId:
    return value if isinstance(value, ArmId) else parse_arm_id(value)


def same_resource(a: str | ArmId, b: str | ArmId) -> bool:
    """True when `a` and `b` name the same resource: ARM IDs compare without regard to case.

    Raises ArmIdError when either is not an ARM ID, so a typo never reads as "a different resource".
    """
    return as_arm_id(a) == as_arm_id(b)


def scheduled_event_id(resource_id: str | ArmId, event_id: str) -> str:
    """The ARM ID of scheduled event `event_id` on the VM, scale set or availability set `resource_id`."""
    target = as_arm_id(resource_id)
    name = _segment(event_id, "the EventId", f"EventId {shown(event_id)}")
    if "/" in name:
        raise ArmIdError(f"EventId {shown(event_id)} holds a slash")
    return str(ArmId(target.subscription_id, target.resource_group, SCHEDULED_EVENTS_NAMESPACE,
                     (SCHEDULED_EVENTS_TYPE,), (name,), parent=target))


def split_scheduled_event_id(text: str) -> tuple[ArmId, str]:
    """The target resource and the EventId of a scheduled event's ARM ID.

    Raises ArmIdError when `text` is not an ARM ID, or is one of something other than a scheduled event.
    """
    event = parse_arm_id(text)
    if not event.is_type(SCHEDULED_EVENTS_NAMESPACE, SCHEDULED_EVENTS_TYPE) or event.parent is None:
        raise ArmIdError(f"ARM ID {shown(text)} is not a scheduled event "
                         f"(.../providers/{SCHEDULED_EVENTS_NAMESPACE}/{SCHEDULED_EVENTS_TYPE}/{{EventId}})")
    return event.parent, event.name


def is_scheduled_event_id(text: str) -> bool:
    """A cheap test, without a full parse: does `text` look like a scheduled event's ARM ID?"""
    marker = f"/providers/{SCHEDULED_EVENTS_NAMESPACE}/{SCHEDULED_EVENTS_TYPE}/".lower()
    return isinstance(text, str) and marker in text.lower()


def vm_id(subscription_id: str, resource_group: str, name: str) -> str:
    """The ARM ID of virtual machine `name` in the given subscription and resource group."""
    where = f"VM name {shown(name)}"
    if not is_valid_name(name):
        raise ArmIdError(f"{where} cannot be part of an ARM ID")
    return str(ArmId(_segment(subscription_id, "the subscription", where),
                     _segment(resource_group, "the resource group", where),
                     COMPUTE_NAMESPACE, (VIRTUAL_MACHINES,), (name,)))
