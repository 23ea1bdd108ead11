"""Instance metadata (`/metadata/instance/compute`): who this VM is, for labels and record sources."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

#: API version used for `/metadata/instance/compute`; any GA version carries the fields read here.
COMPUTE_API_VERSION = "2021-02-01"


@dataclass(frozen=True)
class VmInfo:
    """What forewarn knows about its own VM. Unknown values are empty strings, as IMDS reports them."""

    name: str = ""
    vm_id: str = ""
    resource_id: str = ""
    vm_scale_set: str = ""
    resource_group: str = ""
    subscription_id: str = ""
    location: str = ""
    zone: str = ""
    vm_size: str = ""
    priority: str = ""
    os_type: str = ""

    def with_name(self, name: str | None) -> VmInfo:
        """The same identity under an explicit name (`--vm-name` beats instance metadata)."""
        if not name:
            return self
        return VmInfo(**{**asdict(self), "name": name})

    def known(self) -> dict[str, str]:
        """The non-empty fields, for records (every record carries them: asdict's deep copy was a fifth of the
        poller's CPU for a changed document)."""
        return {field.name: value for field in fields(self) if (value := getattr(self, field.name))}


_COMPUTE_FIELDS = {
    "name": "name",
    "vm_id": "vmId",
    "resource_id": "resourceId",
    "vm_scale_set": "vmScaleSetName",
    "resource_group": "resourceGroupName",
    "subscription_id": "subscriptionId",
    "location": "location",
    "zone": "zone",
    "vm_size": "vmSize",
    "priority": "priority",
    "os_type": "osType",
}


def parse_compute(data: Mapping[str, Any]) -> VmInfo:
    """Build `VmInfo` from a decoded compute reply; fields of the wrong type are read as unknown."""
    values = {}
    for attr, key in _COMPUTE_FIELDS.items():
        value = data.get(key, "")
        values[attr] = value if isinstance(value, str) else ""
    return VmInfo(**values)
