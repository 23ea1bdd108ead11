"""Find the IMDS endpoint of a VM outside a virtual network (`--imds-endpoint discover`).

Such VMs learn the Azure wireserver address from DHCP option 245. On Linux the address is already on
disk: the Azure Linux agent writes it to /var/lib/waagent/WireServerEndpoint, dhclient keeps it in its
lease files as `option unknown-245 a8:3f:81:10;`, and systemd-networkd (and NetworkManager's internal
client) as `OPTION_245=A83F8110`. Reading those files needs no privileges and sends nothing on the
network; when none has it, the usual link-local address is the answer.
"""

from __future__ import annotations

import ipaddress
import logging
import re
from collections.abc import Iterable
from pathlib import Path

from forewarn.imds.client import DEFAULT_ENDPOINT

log = logging.getLogger(__name__)

WAAGENT_FILE = "var/lib/waagent/WireServerEndpoint"
LEASE_GLOBS = (
    "var/lib/dhcp/dhclient*.lease*",
    "var/lib/dhclient/*.lease*",
    "var/lib/NetworkManager/*.lease",
    "var/lib/NetworkManager/dhclient-*.lease",
    "run/systemd/netif/leases/*",
)

_DHCLIENT_245 = re.compile(r"option\s+unknown-245\s+([0-9a-fA-F]{1,2}(?::[0-9a-fA-F]{1,2}){3})\s*;")
_NETWORKD_245 = re.compile(r"^(?:OPTION|PRIVATE)_245=([0-9a-fA-F]{8})\s*$", re.MULTILINE)


def _usable(address: str) -> str | None:
    try:
        ip = ipaddress.IPv4Address(address.strip())
    except ValueError:
        return None
    return None if ip.is_unspecified or ip.is_multicast else str(ip)


def address_from_lease(text: str) -> str | None:
    """The option-245 address in a dhclient or systemd-networkd lease file's text, if any.

    dhclient appends leases, so the last match in the file is the newest.
    """
    matches = _DHCLIENT_245.findall(text)
    if matches:
        return _usable(".".join(str(int(part, 16)) for part in matches[-1].split(":")))
    hex_matches = _NETWORKD_245.findall(text)
    if hex_matches:
        raw = bytes.fromhex(hex_matches[-1])
        return _usable(".".join(str(b) for b in raw))
    return None


def _lease_files(root: Path) -> Iterable[Path]:
    found: list[Path] = []
    for pattern in LEASE_GLOBS:
        found.extend(path for path in root.glob(pattern) if path.is_file())
    # The most recently written lease is the one in force.
    return sorted(found, key=lambda path: path.stat().st_mtime, reverse=True)


def discover_endpoint(root: Path = Path("/")) -> str:
    """The IMDS base URL for this VM: from option 245 when published on disk, else the default."""
    waagent = root / WAAGENT_FILE
    try:
        address = _usable(waagent.read_text(encoding="ascii", errors="replace"))
    except OSError:
        address = None
    if address:
        log.info("IMDS endpoint discovered from %s: %s", waagent, address)
        return f"http://{address}"
    for lease in _lease_files(root):
        try:
            address = address_from_lease(lease.read_text(encoding="utf-8", errors="replace"))
        except OSError:
            continue
        if address:
            log.info("IMDS endpoint discovered from DHCP option 245 in %s: %s", lease, address)
            return f"http://{address}"
    log.info("no DHCP option 245 found on disk; using %s", DEFAULT_ENDPOINT)
    return DEFAULT_ENDPOINT
