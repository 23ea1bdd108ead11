from __future__ import annotations

import os
from pathlib import Path

from forewarn.imds.discovery import address_from_lease, discover_endpoint

DHCLIENT_LEASE = """lease {
  interface "eth0";
  fixed-address 10.0.0.4;
  option subnet-mask 255.255.255.0;
  option unknown-245 a8:3f:81:10;
  option dhcp-server-identifier 168.63.129.16;
}
lease {
  interface "eth0";
  fixed-address 10.0.0.4;
  option unknown-245 a8:3f:81:11;
}
"""

NETWORKD_LEASE = """# This is private data. Do not parse.
ADDRESS=10.1.0.5
NETMASK=255.255.255.0
SERVER_ADDRESS=168.63.129.16
OPTION_245=A83F8112
"""


def write(root: Path, relative: str, text: str, mtime: float | None = None) -> Path:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


def test_dhclient_lease_takes_the_newest_option_245() -> None:
    assert address_from_lease(DHCLIENT_LEASE) == "168.63.129.17"


def test_systemd_networkd_lease() -> None:
    assert address_from_lease(NETWORKD_LEASE) == "168.63.129.18"


def test_lease_without_option_245_gives_nothing() -> None:
    assert address_from_lease("lease {\n  option routers 10.0.0.1;\n}\n") is None


def test_waagent_file_wins(tmp_path: Path) -> None:
    write(tmp_path, "var/lib/waagent/WireServerEndpoint", "168.63.129.16\n")
    write(tmp_path, "var/lib/dhcp/dhclient.eth0.leases", DHCLIENT_LEASE)
    assert discover_endpoint(tmp_path) == "http://168.63.129.16"


def test_dhclient_lease_file(tmp_path: Path) -> None:
    write(tmp_path, "var/lib/dhcp/dhclient.eth0.leases", DHCLIENT_LEASE)
    assert discover_endpoint(tmp_path) == "http://168.63.129.17"


def test_newest_lease_file_wins(tmp_path: Path) -> None:
    write(tmp_path, "var/lib/dhclient/dhclient-eth0.lease", DHCLIENT_LEASE, mtime=1_000)
    write(tmp_path, "run/systemd/netif/leases/2", NETWORKD_LEASE, mtime=2_000)
    assert discover_endpoint(tmp_path) == "http://168.63.129.18"


def test_networkmanager_lease(tmp_path: Path) -> None:
    write(tmp_path, "var/lib/NetworkManager/internal-1234-eth0.lease", NETWORKD_LEASE)
    assert discover_endpoint(tmp_path) == "http://168.63.129.18"


def test_garbage_in_waagent_file_falls_through(tmp_path: Path) -> None:
    write(tmp_path, "var/lib/waagent/WireServerEndpoint", "not an address")
    assert discover_endpoint(tmp_path) == "http://169.254.169.254"


def test_nothing_on_disk_falls_back_to_link_local(tmp_path: Path) -> None:
    assert discover_endpoint(tmp_path) == "http://169.254.169.254"
