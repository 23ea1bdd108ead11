"""Settings for `forewarn run`: one table of options, read from flags, environment and a config file.

Precedence, highest first: command-line flag, `FOREWARN_<OPTION>` environment variable, the YAML
config file (`--config`, keys as the long option names), the default. Values are checked when read and
a bad one stops start-up with a message naming where it came from and what would be valid.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

from forewarn import DEFAULT_API_VERSION
from forewarn.imds.client import DEFAULT_ENDPOINT
from forewarn.imds.document import API_VERSIONS

ENV_PREFIX = "FOREWARN_"
S = TypeVar("S", bound="Settings")
DEFAULT_LISTEN = ":9465"


class ConfigError(ValueError):
    """A setting is unusable; the message names the option, its source and what would be valid."""


def default_state_dir() -> str:
    """systemd's StateDirectory when set, else the platform's place for service state."""
    if os.environ.get("STATE_DIRECTORY"):
        return os.environ["STATE_DIRECTORY"].split(":")[0]
    if os.name == "nt":
        return str(Path(os.environ.get("PROGRAMDATA", r"C:\ProgramData")) / "forewarn")
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
        return str(Path(base) / "forewarn")
    return "/var/lib/forewarn"


@dataclass(frozen=True)
class Number:
    """A finite number from `low` to `high` (both allowed); `whole` for counts and sizes.

    Used as an option's converter and, through `argument_type`, as an argparse `type`. NaN and infinity
    never pass: a NaN compares false with every bound, so it would slip through a plain `value < low` and
    then turn a sleep or a deadline into a hang or a crash far from the option that caused it.
    """

    low: float
    high: float
    whole: bool = False
    unit: str = ""
    why_low: str = ""              # said when the value is below `low`, e.g. the limit it protects

    @property
    def valid(self) -> str:
        """The range as people read it, e.g. "0.2 to 3600 seconds"; shown in help and in errors."""
        kind = "whole number " if self.whole else ""
        unit = f" {self.unit}" if self.unit else ""
        return f"{kind}{_plain(self.low)} to {_plain(self.high)}{unit}"

    def __call__(self, text: str) -> float | int:
        text = text.strip()
        if self.whole:
            # int() would take "1_000" and Python's float() spellings would pass through float(); only digits.
            if not re.fullmatch(r"[+-]?[0-9]{1,30}", text):
                raise ValueError(f"not a whole number; valid: {self.valid}")
            value: float | int = int(text)
        else:
            try:
                value = float(text)
            except ValueError:
                raise ValueError(f"not a number; valid: {self.valid}") from None
            if not math.isfinite(value):
                raise ValueError(f"not a finite number; valid: {self.valid}")
        if value < self.low:
            why = f" ({self.why_low})" if self.why_low else ""
            raise ValueError(f"must be at least {_plain(self.low)}{why}; valid: {self.valid}")
        if value > self.high:
            raise ValueError(f"must be at most {_plain(self.high)}; valid: {self.valid}")
        return value


def _plain(number: float) -> str:
    """1024 rather than 1024.0 or 1.024e+03: ranges are read by people and compared by tests."""
    return str(int(number)) if float(number).is_integer() else repr(float(number))


def argument_type(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """`convert` as an argparse `type`: argparse shows only the message of an ArgumentTypeError (any other
    ValueError becomes "invalid <function name> value"), so carry the converter's reason over."""
    def checked(text: str) -> Any:
        try:
            return convert(text)
        except (ValueError, TypeError) as exc:
            raise argparse.ArgumentTypeError(f"{shown(text)} is not valid ({exc})") from None
    return checked


SECONDS = "seconds"
# The lower bound: IMDS allows 5 requests per second per VM, for every caller on it together. The upper
# bounds here catch unit mistakes (milliseconds typed as seconds); they are no advice: a poll interval
# longer than the notice IMDS gives (30 s at most for a Spot eviction, 5 to 15 min for most events)
# already loses warnings.
POLL_INTERVAL = Number(0.2, 3600, unit=SECONDS, why_low="IMDS allows 5 requests per second per VM")
BACKOFF = Number(0.2, 3600, unit=SECONDS)
REQUEST_TIMEOUT = Number(0.1, 600, unit=SECONDS)
SPEED = Number(0.01, 10_000)
SEED = Number(0, 2**32 - 1, whole=True)


def _api_version(text: str) -> str:
    if text not in API_VERSIONS:
        raise ValueError(f"valid: {', '.join(API_VERSIONS)}")
    return text


def _choice(*values: str) -> Callable[[str], str]:
    def convert(text: str) -> str:
        if text not in values:
            raise ValueError(f"valid: {', '.join(values)}")
        return text
    return convert


def parse_listen_address(text: str) -> tuple[str, int]:
    """`HOST:PORT`, `:PORT` (all interfaces) or `[IPV6]:PORT`; port 0 lets the system pick a free one."""
    expected = "expected HOST:PORT, :PORT or [IPv6]:PORT, HOST a name or IP address, PORT 0 to 65535 (0: any free)"
    match = re.fullmatch(r"(?:\[(?P<v6>[^\]]+)\]|(?P<host>[^:\[\]]*)):(?P<port>\d{1,5})", text.strip())
    if not match or int(match["port"]) > 65535:
        raise ValueError(expected)
    host = match["v6"] or match["host"] or ""
    if match["v6"] is not None:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{expected}; {host!r} is not an IPv6 address") from None
    elif host and not _is_host_name(host):
        raise ValueError(expected)
    return host, int(match["port"])


def _is_host_name(host: str) -> bool:
    """An IPv4 address or a DNS name (RFC 1123 letters, digits, '-', '_', '.'; at most 253): anything else
    would fail only when the socket is bound, and a NUL or a 64-character label not even as an OSError."""
    if len(host) > 253:
        return False
    labels = host.rstrip(".").split(".")
    return all(re.fullmatch(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?", label) for label in labels)


def listen_address(text: str) -> str:
    parse_listen_address(text)
    return text


def endpoint_url(text: str) -> str:
    """An IMDS base URL `http[s]://HOST[:PORT]` (port 1 to 65535), or 'discover'."""
    if text == "discover":
        return text
    expected = "expected http://HOST[:PORT] or 'discover', PORT 1 to 65535"
    if any(ch.isspace() or not ch.isprintable() for ch in text):
        raise ValueError(expected)
    try:
        parts = urlsplit(text)
        port = parts.port   # reading it checks it: urllib raises ValueError for "abc" or 99999
    except ValueError:
        raise ValueError(expected) from None
    if parts.scheme not in ("http", "https") or not parts.hostname or (port is not None and not 1 <= port <= 65535):
        raise ValueError(expected)
    return text.rstrip("/")


def _directory(text: str) -> str:
    # An empty path used to mean "keep state in memory" while the state_writable metric said 1.
    if not text.strip():
        raise ValueError(f"empty; give a directory path, or leave the option out for the default "
                         f"({default_state_dir()}; with --simulate a temporary directory)")
    if "\0" in text:
        raise ValueError("a path cannot contain a NUL character")
    return text


def _web_config_file(text: str) -> str:
    # The file's content is checked when the agent starts (forewarn.web.config), with its keys named.
    if not text.strip() or "\0" in text:
        raise ValueError("expected the path of a web configuration file")
    return text


def _node_name(text: str) -> str:
    """A Kubernetes node name: a DNS subdomain (RFC 1123: lowercase letters, digits, '-' and '.', at most 253)."""
    if len(text) > 253 or not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*", text):
        raise ValueError("valid: a Kubernetes node name (lowercase letters, digits, '-' and '.', at most 253), "
                         "as `kubectl get nodes` shows it")
    return text


def _sinks(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _boolean(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected true or false")


def option_key(name: str) -> str:
    """An option's name as a field, variable or config file key: dashes and dots become underscores."""
    return name.replace("-", "_").replace(".", "_")


@dataclass(frozen=True)
class Option:
    name: str                      # long flag without dashes, e.g. "poll-interval"
    help: str
    default: Any = None
    convert: Callable[[str], Any] = str
    repeatable: bool = False       # flag may repeat; env var and file take a comma list / YAML list
    secret: bool = False
    metavar: str | None = None
    is_flag: bool = False
    aliases: tuple[str, ...] = ()  # other flag spellings (and config file keys), e.g. "web.listen-address"

    @property
    def dest(self) -> str:
        # Dotted names follow the Prometheus exporters' flags (--web.config.file); the field and the
        # variable use underscores: FOREWARN_WEB_CONFIG_FILE.
        return option_key(self.name)

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.dest.upper()

    @property
    def help_text(self) -> str:
        """The flag's help: what it does, the range of a number (from the converter, so it cannot drift) and
        its environment variable."""
        valid = f" ({self.convert.valid})" if isinstance(self.convert, Number) else ""
        return f"{self.help}{valid} [env {self.env}]"


RUN_OPTIONS: tuple[Option, ...] = (
    Option("imds-endpoint", "IMDS base URL, or 'discover' to read DHCP option 245 (VMs outside a VNET)",
           DEFAULT_ENDPOINT, endpoint_url, metavar="URL"),
    Option("api-version", "Scheduled Events API version", DEFAULT_API_VERSION, _api_version, metavar="V"),
    Option("poll-interval", "time between polls, decimals allowed", 1.0, POLL_INTERVAL, metavar="SECONDS"),
    Option("imds-timeout", "per-request timeout once IMDS has answered (the first request may take up "
           "to 120 s)", 2.0, REQUEST_TIMEOUT, metavar="SECONDS"),
    Option("imds-max-backoff", "the longest Retry-After honoured while IMDS answers 429, 503 or another retryable "
           "status; other failures are retried at the normal pace", 10.0, BACKOFF, metavar="SECONDS"),
    Option("imds-max-reply-bytes", "largest IMDS reply accepted; a longer one is an error and its connection "
           "is dropped", 4 * 1024 * 1024, Number(64 * 1024, 256 * 1024 * 1024, whole=True), metavar="BYTES"),
    Option("listen-address", "where /metrics, /healthz and /readyz are served: HOST:PORT, :PORT (all interfaces) "
           "or [IPv6]:PORT; port 0 picks a free port, logged at start", DEFAULT_LISTEN, listen_address,
           metavar="HOST:PORT", aliases=("web.listen-address",)),
    Option("web.config.file", "web configuration file in the Prometheus exporter-toolkit format: TLS, basic "
           "auth users, response headers; re-read when it or its certificates change", None, _web_config_file,
           metavar="FILE"),
    Option("web-read-timeout", "time a client of the web endpoints may take to send a request, and may "
           "stay idle between requests", 10.0, REQUEST_TIMEOUT, metavar="SECONDS"),
    Option("web-max-connections", "web connections served at once (each has a worker thread); more wait in "
           "the listen queue", 16, Number(1, 1024, whole=True), metavar="N"),
    Option("web-max-request-bytes", "largest request (line and headers) the web endpoints accept", 16384,
           Number(1024, 1024 * 1024, whole=True), metavar="BYTES"),
    Option("drain-timeout", "on stop, how long the sinks (in parallel) may take to deliver what is waiting; "
           "the rest stays in the outbox; 0 does not wait", 10.0, Number(0, 600, unit=SECONDS), metavar="SECONDS"),
    Option("vm-name", "this VM's name as in Resources (default: instance metadata compute.name)", None,
           metavar="NAME"),
    Option("state-dir", "directory where state and the outbox survive restarts (default: the service state "
           "directory; with --simulate a temporary one)", None, _directory, metavar="PATH"),
    Option("sink", "where records go: stdout, file:PATH, eventhubs, otlp, webhook, slack, teams, template, "
           "logs-ingestion (repeatable)", ["stdout"],
           str, repeatable=True, metavar="SPEC"),
    Option("eventhubs-connection-string", "Event Hubs connection string; from the environment or the config "
           "file only, never a flag (visible in ps)", None, secret=True, metavar="CONNSTR"),
    Option("eventhubs-connection-string-file", "file holding the Event Hubs connection string", None,
           metavar="PATH"),
    Option("eventhubs-namespace", "Event Hubs namespace (e.g. myns.servicebus.windows.net), with Azure AD auth",
           None, metavar="HOST"),
    Option("eventhubs-name", "event hub name (with --eventhubs-namespace, or when the connection string has no "
           "EntityPath)", None, metavar="NAME"),
    Option("eventhubs-client-id", "client id of a user-assigned managed identity", None, metavar="ID"),
    Option("otlp-endpoint", "OTLP endpoint (default: OTEL_EXPORTER_OTLP_[LOGS_]ENDPOINT, else the SDK default)",
           None, metavar="URL"),
    Option("otlp-protocol", "grpc or http/protobuf (default: OTEL_EXPORTER_OTLP_[LOGS_]PROTOCOL, else "
           "http/protobuf)", None, _choice("grpc", "http/protobuf")),
    # Notification sinks (docs/notifications.md). Their URLs hold the key: variable or file only.
    *(option for kind, what in (("webhook", "webhook (CloudEvents over HTTP)"),
                                ("slack-webhook", "Slack incoming webhook"),
                                ("teams-webhook", "Teams Workflows webhook"), ("template", "template sink endpoint"))
      for option in (
          Option(f"{kind}-url", f"{what} URL; from the environment or the config file only, never a flag (it "
                 "holds the key)", None, secret=True, metavar="URL"),
          Option(f"{kind}-url-file", f"file holding the {what} URL", None, metavar="PATH"))),
    Option("webhook-mode", "CloudEvents HTTP content mode of --sink webhook: structured or binary", "structured",
           _choice("structured", "binary")),
    Option("template-file", "Jinja2 template of the JSON body --sink template posts (sandboxed, checked at "
           "start)", None, metavar="FILE"),
    *(option for kind, rate in (("webhook", 0.0), ("slack", 1.0), ("teams", 1.0), ("template", 0.0))
      for option in (
          Option(f"{kind}-filter", f"which records --sink {kind} posts: types=Reboot,Redeploy changes=added,"
                 "updated,removed,approved this-vm (default: all)", None, metavar="FILTER"),
          Option(f"{kind}-rate-limit", f"most messages a second --sink {kind} posts; 0: no limit", rate,
                 Number(0, 10_000), metavar="PER_SECOND"))),
    Option("notify-link", "link shown in Slack, Teams and template messages (a dashboard, a runbook)", None,
           metavar="URL"),
    Option("logs-endpoint", "Azure Monitor data collection endpoint (logs ingestion URL) for --sink "
           "logs-ingestion", None, metavar="URL"),
    Option("logs-rule-id", "immutable id of the data collection rule (dcr-...)", None, metavar="ID"),
    Option("logs-stream", "stream of the data collection rule", "Custom-ForewarnEvents", metavar="NAME"),
    Option("logs-client-id", "client id of a user-assigned managed identity for --sink logs-ingestion", None,
           metavar="ID"),
    Option("policy", "approval policy file (YAML); without one nothing is ever approved", None, metavar="FILE"),
    Option("dry-run", "decide and record approvals and node actions, but send no StartRequests and write nothing "
           "to the Kubernetes API", False, _boolean, is_flag=True),
    Option("node-name", "the Kubernetes node this instance acts on, for a policy with node actions (DaemonSet: "
           "from spec.nodeName)", None, _node_name, metavar="NAME"),
    Option("kubeconfig", "kubeconfig file for node actions (default: the in-cluster service account, else "
           "KUBECONFIG or ~/.kube/config)", None, metavar="PATH"),
    Option("outbox-max-records", "records kept for delivery: beyond it run drops the oldest, fleet waits for the "
           "sinks", 100_000,
           Number(100, 10_000_000, whole=True), metavar="N"),
    Option("ready-window", "/readyz fails when no poll succeeded for this long", 60.0,
           Number(1, 86_400, unit=SECONDS), metavar="SECONDS"),
    Option("probe.lb-lead-time", "/probe/lb answers 503 from this long before the NotBefore of an event that "
           "takes this VM down, so a load balancer drains it", 300.0, Number(0, 86_400, unit=SECONDS),
           metavar="SECONDS"),
    Option("probe.lb-freeze-threshold", "/probe/lb drains for a Freeze only when its DurationInSeconds is above "
           "this (shorter pauses end before a load balancer notices)", 30.0, Number(0, 86_400, unit=SECONDS),
           metavar="SECONDS"),
    Option("compute-refresh", "time between reads of instance metadata", 3600.0, Number(10, 86_400, unit=SECONDS),
           metavar="SECONDS"),
    Option("log-format", "text or json", "text", _choice("text", "json")),
    Option("log-level", "debug, info, warning or error", "info", _choice("debug", "info", "warning", "error")),
    Option("simulate", "run against the built-in IMDS simulator, with this scenario (default: tour)",
           None, metavar="SCENARIO"),
    Option("speed", "with --simulate: how much faster than real time the scenario runs", 1.0, SPEED,
           metavar="FACTOR"),
    Option("fault", "with --simulate: inject IMDS faults, e.g. 500:0.1, reset:0.05, latency:0.2 "
           "(repeatable)", [], str, repeatable=True, metavar="KIND:VALUE"),
)


@dataclass(frozen=True)
class Settings:
    """The checked settings of one command, typed: the one object that reaches the code.

    Every field is an option of the table above (a test keeps the two in step); `resolve` fills each from
    its flag, variable, config file or default. `sources` says where each value came from.
    """

    imds_endpoint: str
    api_version: str
    poll_interval: float
    imds_timeout: float
    imds_max_backoff: float
    imds_max_reply_bytes: int
    listen_address: str
    web_config_file: str | None
    web_read_timeout: float
    web_max_connections: int
    web_max_request_bytes: int
    drain_timeout: float
    vm_name: str | None
    state_dir: str | None
    sink: list[str]
    eventhubs_connection_string: str | None
    eventhubs_connection_string_file: str | None
    eventhubs_namespace: str | None
    eventhubs_name: str | None
    eventhubs_client_id: str | None
    otlp_endpoint: str | None
    otlp_protocol: str | None
    webhook_url: str | None
    webhook_url_file: str | None
    slack_webhook_url: str | None
    slack_webhook_url_file: str | None
    teams_webhook_url: str | None
    teams_webhook_url_file: str | None
    template_url: str | None
    template_url_file: str | None
    webhook_mode: str
    template_file: str | None
    webhook_filter: str | None
    webhook_rate_limit: float
    slack_filter: str | None
    slack_rate_limit: float
    teams_filter: str | None
    teams_rate_limit: float
    template_filter: str | None
    template_rate_limit: float
    notify_link: str | None
    logs_endpoint: str | None
    logs_rule_id: str | None
    logs_stream: str
    logs_client_id: str | None
    policy: str | None
    dry_run: bool
    node_name: str | None
    kubeconfig: str | None
    outbox_max_records: int
    ready_window: float
    probe_lb_lead_time: float
    probe_lb_freeze_threshold: float
    compute_refresh: float
    log_format: str
    log_level: str
    simulate: str | None
    speed: float
    fault: list[str]
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    @property
    def values(self) -> dict[str, Any]:
        """Every option's value by its name (dashes as underscores), for code that looks options up."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "sources"}

    def redacted(self, options: Sequence[Option] = RUN_OPTIONS) -> dict[str, Any]:
        """The effective settings, safe to log: secrets hidden, credentials stripped from URLs."""
        secret = {option.dest for option in options if option.secret}
        shown: dict[str, Any] = {}
        for key, value in self.values.items():
            if key in secret and value:
                shown[key] = "<redacted>"
            elif isinstance(value, str):
                shown[key] = redact_url(value)
            elif isinstance(value, list):
                shown[key] = [redact_url(v) if isinstance(v, str) else v for v in value]
            else:
                shown[key] = value
        return shown


#: `run`'s options that `forewarn fleet` takes as they are: the web server, the state dir and outbox, every
#: sink, logging, --speed of a simulation. The IMDS, VM, approval and IMDS simulator options are the per-VM
#: agent's (fleet mode has its own --simulate, in FLEET_ONLY).
FLEET_SHARED = tuple(option for option in RUN_OPTIONS if option.name not in (
    "imds-endpoint", "api-version", "poll-interval", "imds-timeout", "imds-max-backoff", "imds-max-reply-bytes",
    "vm-name", "policy", "dry-run", "node-name", "kubeconfig", "probe.lb-lead-time", "probe.lb-freeze-threshold",
    "compute-refresh", "simulate", "fault"))
_GUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_MANAGEMENT_GROUP = re.compile(r"[A-Za-z0-9_.()-]{1,90}")
#: ARM's rule for resource group names (Microsoft.Resources naming rules): 1 to 90 letters (Unicode ones
#: too), digits, `_ . - ( )`, not ending in a period. It also keeps a name safe inside a KQL string literal.
_RESOURCE_GROUP = re.compile(r"[\w.()-]{0,89}[\w()-]")


def _subscription_id(text: str) -> str:
    if not _GUID.fullmatch(text.strip()):
        raise ValueError(f"{text!r} is not a subscription id (a GUID)")
    return text.strip().lower()


def _management_group(text: str) -> str:
    if not _MANAGEMENT_GROUP.fullmatch(text.strip()):
        raise ValueError(f"{text!r} is not a management group id (letters, digits, -_.() up to 90)")
    return text.strip()


def _resource_group(text: str) -> str:
    if not _RESOURCE_GROUP.fullmatch(text.strip()):
        raise ValueError("a resource group name is 1 to 90 letters, digits and _ . - ( ), not ending in '.'")
    return text.strip()


def _https_url(text: str) -> str:
    url = endpoint_url(text)
    if not url.startswith("https://"):
        raise ValueError(f"{safe_url(url)} must be https: a bearer token goes with every request")
    return url


def _queue_url(text: str) -> str:
    expected = "expected https://ACCOUNT.queue.core.windows.net/QUEUE"
    if text == "discover" or any(ch.isspace() or not ch.isprintable() for ch in text):
        raise ValueError(expected)
    try:
        url = endpoint_url(text)
    except ValueError:
        raise ValueError(expected) from None
    if not [segment for segment in urlsplit(url).path.split("/") if segment]:
        raise ValueError(expected + " (the queue's name is missing)")
    return url


def _route_path(text: str) -> str:
    if not re.fullmatch(r"/[A-Za-z0-9._~/-]{1,200}", text) or text in ("/metrics", "/healthz", "/readyz"):
        raise ValueError(f"{text!r}: a path of the web server such as /eventgrid (not /metrics, /healthz, /readyz)")
    return text


FLEET_ONLY: tuple[Option, ...] = (
    Option("subscription", "a subscription whose scheduled events Resource Graph lists (repeatable)", [],
           _subscription_id, repeatable=True, metavar="ID"),
    Option("management-group", "a management group whose subscriptions Resource Graph lists (repeatable)", [],
           _management_group, repeatable=True, metavar="ID"),
    Option("resource-group", "only events of VMs in this resource group, from every source (repeatable; with "
           "--subscription or --management-group, within them)", [], _resource_group, repeatable=True,
           metavar="NAME"),
    Option("arm-endpoint", "Azure Resource Manager base URL (sovereign clouds, tests)", "https://management.azure.com",
           _https_url, metavar="URL"),
    Option("arm-client-id", "client id of a user-assigned managed identity for Resource Graph (default: "
           "azure-identity's DefaultAzureCredential: workload identity, managed identity, ...)", None, metavar="ID"),
    Option("arm-timeout", "deadline of one Resource Graph request, connect to last byte", 30.0, REQUEST_TIMEOUT,
           metavar="SECONDS"),
    Option("arm-max-reply-bytes", "largest Resource Graph reply accepted", 16 * 1024 * 1024,
           Number(64 * 1024, 256 * 1024 * 1024, whole=True), metavar="BYTES"),
    Option("resource-graph-api-version", "api-version of the Resource Graph query", "2024-04-01", metavar="V"),
    Option("reconcile-interval", "time between Resource Graph snapshots (the throttling headers are the real "
           "limit)", 300.0, Number(1, 86_400, unit=SECONDS), metavar="SECONDS"),
    Option("metrics-max-vms", "most VMs whose per-VM series /metrics shows (those of the first events by status "
           "and NotBefore; the aggregates count every VM, azure_scheduled_events_per_vm_left_out the rest); 0: "
           "all", 10_000, Number(0, 10_000_000, whole=True), metavar="VMS"),
    Option("queue-url", "the Storage queue an Event Grid subscription delivers to: https://ACCOUNT.queue.core."
           "windows.net/QUEUE (with the connection string, only its last segment, the queue's name, is used)",
           None, _queue_url, metavar="URL"),
    Option("queue-connection-string", "Storage connection string for --queue-url; from the environment or the "
           "config file only, never a flag (default: azure-identity)", None, secret=True, metavar="CONNSTR"),
    Option("queue-connection-string-file", "file holding the Storage connection string", None, metavar="PATH"),
    Option("queue-client-id", "client id of a user-assigned managed identity for the queue", None, metavar="ID"),
    Option("queue-visibility-timeout", "how long a received message stays hidden while its change is committed",
           60.0, Number(1, 3600, unit=SECONDS), metavar="SECONDS"),
    Option("queue-poll-interval", "wait after a receive that found the queue empty: the most a message waits "
           "before it is read (each empty receive is a billed transaction: about 2.6 million a month at 1 s)", 1.0,
           Number(0.1, 60, unit=SECONDS), metavar="SECONDS"),
    Option("eventgrid-path", "serve Event Grid push deliveries on this path of the web server (e.g. /eventgrid; "
           "HTTPS with --web.config.file); off when unset", None, _route_path, metavar="PATH"),
    Option("eventgrid-secret", "the shared secret Event Grid's webhook URL carries; from the environment or the "
           "config file only, never a flag", None, secret=True, metavar="SECRET"),
    Option("eventgrid-secret-file", "file holding the Event Grid shared secret", None, metavar="PATH"),
    Option("lease-name", "the coordination.k8s.io Lease that makes one replica the active one; unset: this "
           "instance is the only one and always active", None, _node_name, metavar="NAME"),
    Option("lease-namespace", "namespace of the Lease (default: the pod's own, from its service account)", None,
           _node_name, metavar="NAMESPACE"),
    Option("lease-seconds", "how long a Lease holder that stopped renewing keeps it: the longest takeover", 15.0,
           Number(2, 300, unit=SECONDS), metavar="SECONDS"),
    Option("kubeconfig", "kubeconfig file for the Lease (default: the in-cluster service account, else "
           "KUBECONFIG or ~/.kube/config)", None, metavar="PATH"),
    Option("policy", "approval policy file (YAML, fleet mode's match keys): the events it approves are "
           "acknowledged through ARM; without one nothing is ever acknowledged", None, metavar="FILE"),
    Option("dry-run", "decide and record approvals, but send no acknowledgement", False, _boolean, is_flag=True),
    Option("acknowledge-api-version", "api-version of the Maintenance RP's acknowledge call (a preview; "
           "2025-10-01-preview and later have the list form, which approves a scale set's events in one call)",
           "2025-10-01-preview", metavar="V"),
    Option("simulate", "run against a built-in simulated fleet, with this scenario (default: tour; --list shows "
           "them): Resource Graph and ARM stand-ins on loopback, Event Grid pushes to --eventgrid-path", None,
           metavar="SCENARIO"),
)
FLEET_OPTIONS = FLEET_SHARED + FLEET_ONLY


@dataclass(frozen=True)
class FleetSettings(Settings):
    """The settings of `forewarn fleet`: `run`'s shared ones (FLEET_SHARED) and its own (FLEET_ONLY)."""

    subscription: list[str] = field(default_factory=list)
    management_group: list[str] = field(default_factory=list)
    resource_group: list[str] = field(default_factory=list)
    arm_endpoint: str = "https://management.azure.com"
    arm_client_id: str | None = None
    arm_timeout: float = 30.0
    arm_max_reply_bytes: int = 16 * 1024 * 1024
    resource_graph_api_version: str = "2024-04-01"
    reconcile_interval: float = 300.0
    metrics_max_vms: int = 10_000
    queue_url: str | None = None
    queue_connection_string: str | None = None
    queue_connection_string_file: str | None = None
    queue_client_id: str | None = None
    queue_visibility_timeout: float = 60.0
    queue_poll_interval: float = 1.0
    eventgrid_path: str | None = None
    eventgrid_secret: str | None = None
    eventgrid_secret_file: str | None = None
    lease_name: str | None = None
    lease_namespace: str | None = None
    lease_seconds: float = 15.0
    acknowledge_api_version: str = "2025-10-01-preview"


#: The FOREWARN_* variables that name no option and are still forewarn's: the --config file, and the event
#: variables a command hook gets (forewarn.approval.hooks; a hook may well run forewarn itself).
OTHER_VARIABLES = ("FOREWARN_CONFIG", "FOREWARN_HOOK", "FOREWARN_RULE", "FOREWARN_EVENT_ID", "FOREWARN_EVENT_TYPE",
                   "FOREWARN_EVENT_STATUS", "FOREWARN_EVENT_SOURCE", "FOREWARN_NOT_BEFORE", "FOREWARN_DURATION",
                   "FOREWARN_RESOURCES", "FOREWARN_VM_NAME")


#: The names the kubelet gives a pod for each Service with a cluster IP in its namespace ("service links",
#: pkg/kubelet/envvars): NAME_SERVICE_HOST, NAME_SERVICE_PORT, NAME_SERVICE_PORT_<PORT NAME>, and Docker's link
#: forms NAME_PORT, NAME_PORT_<PORT>_<PROTOCOL> and its _PROTO, _PORT and _ADDR. The value each form takes is
#: checked too, so that a misspelt option which merely ends in _PORT is still refused.
_SERVICE_LINK = re.compile(r"[A-Z_][A-Z0-9_]*?_(?:(?P<host>SERVICE_HOST)|(?P<port>SERVICE_PORT(?:_[A-Z0-9_]+)?)"
                           r"|(?P<url>PORT(?:_[0-9]+_(?:TCP|UDP|SCTP))?)"
                           r"|PORT_[0-9]+_(?:TCP|UDP|SCTP)_(?:(?P<proto>PROTO)|(?P<number>PORT)|(?P<addr>ADDR)))")


def is_service_link(name: str, value: str) -> bool:
    """Whether `name`=`value` has the form of a variable Kubernetes sets for a Service (_SERVICE_LINK)."""
    match = _SERVICE_LINK.fullmatch(name)
    if match is None:
        return False
    kind = match.lastgroup
    if kind in ("port", "number"):
        return value.isdigit()
    if kind == "proto":
        return value in ("tcp", "udp", "sctp")
    address = value
    if kind == "url":
        scheme, _, address = value.partition("://")
        address, _, port = address.rpartition(":")
        if scheme not in ("tcp", "udp", "sctp") or not port.isdigit():
            return False
        address = address.removeprefix("[").removesuffix("]")
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return False
    return True


def check_environment(environ: Mapping[str, str], command: str) -> list[str]:
    """The FOREWARN_* variables of `environ` that `forewarn run` or `forewarn fleet` (`command`) will not read.

    A variable no forewarn command reads is a ConfigError naming the nearest option: a misspelt one would
    otherwise leave its option at the default without a word (FOREWARN_DRY_RUNN: a real drain instead of a
    dry run), as an unknown key of --config is refused. An option of the other command is only a note for the
    log (returned): one environment often serves both, as a shared env file or a chart's common values do. So
    is a variable Kubernetes made for a Service whose name starts with "forewarn" (is_service_link): refusing
    it would stop every forewarn pod of the namespace, restart after restart, over someone else's Service.
    """
    own, other = ("run", "fleet") if command == "run" else ("fleet", "run")
    tables = {"run": RUN_OPTIONS, "fleet": FLEET_OPTIONS}
    mine = {option.env: option for option in tables[own]}
    theirs = {option.env: option for option in tables[other] if option.env not in mine}
    unknown: list[str] = []
    notes: list[str] = []
    links: list[str] = []
    for name in sorted(environ):
        if not name.upper().startswith(ENV_PREFIX) or name in mine or name in OTHER_VARIABLES:
            continue
        if name in theirs:
            notes.append(f"{name} is an option of forewarn {other} (--{theirs[name].name}); forewarn {own} "
                         "ignores it")
            continue
        if is_service_link(name, environ[name]):
            links.append(name)
            continue
        unknown.append(name + _nearest_variable(name, own, mine, other, theirs))
    if links:
        notes.append(f"{', '.join(links)}: the form of the variables Kubernetes sets for each Service of the pod's "
                     f"namespace (service links), not forewarn's; forewarn {own} ignores "
                     f"{'them' if len(links) > 1 else 'it'} (enableServiceLinks: false in the pod spec leaves "
                     "them out)")
    if unknown:
        raise ConfigError(f"unknown variable{'s' if len(unknown) > 1 else ''} {'; '.join(unknown)}: a FOREWARN_ "
                          "variable names an option of forewarn run or fleet (their --help), so a misspelt one is "
                          "refused rather than ignored")
    return notes


def _nearest_variable(name: str, own: str, mine: Mapping[str, Option], other: str,
                      theirs: Mapping[str, Option]) -> str:
    """" (did you mean FOREWARN_X, --x?)" for the option whose variable is nearest to `name` (the command's own
    on a tie), or "" when none is near."""
    found = _nearest_option(name.upper().removeprefix(ENV_PREFIX), [(own, mine.values()), (other, theirs.values())])
    if found is None:
        return ""
    command, option = found
    return f" (did you mean {option.env}, --{option.name}{'' if command == own else f' of forewarn {command}'}?)"


def _nearest_key(key: str, options: Sequence[Option]) -> str:
    """For an unknown key of --config: " (an option of forewarn fleet, ...)" when it is the other command's, else
    " (did you mean x?)" for the nearest option (the command's own on a tie), or "" when none is near."""
    own, other = ("fleet", "run") if options is FLEET_OPTIONS else ("run", "fleet")
    mine = {option.dest for option in options}
    theirs = [option for option in (RUN_OPTIONS if other == "run" else FLEET_OPTIONS) if option.dest not in mine]
    for option in theirs:
        if option.dest == option_key(key).lower():
            return f" (an option of forewarn {other}, which forewarn {own} does not take)"
    found = _nearest_option(key, [(own, options), (other, theirs)])
    if found is None:
        return ""
    command, option = found
    return f" (did you mean {option.name}{'' if command == own else f' of forewarn {command}'}?)"


def _nearest_option(key: str, tables: Sequence[tuple[str, Iterable[Option]]]) -> tuple[str, Option] | None:
    """The command and option whose name is nearest to `key` (any case, dashes or underscores), searched in
    `tables` (command, its options) in order: an earlier table wins a tie. None when none is near: difflib's
    ratio under 0.6, the cutoff argparse's own suggestions and the flags' hints use."""
    import difflib  # only on these error paths

    wanted = option_key(key).lower()
    best: tuple[float, str, Option] | None = None
    for command, options in tables:
        for option in options:
            score = difflib.SequenceMatcher(None, wanted, option.dest).ratio()
            if score >= 0.6 and (best is None or score > best[0]):
                best = (score, command, option)
    return None if best is None else best[1:]


def safe_url(url: str) -> str:
    """A URL as `scheme://host[:port]/...`, for secrets that are whole URLs (webhooks): their path, query
    and user info often hold the token."""
    try:
        parts = urlsplit(url)
        port = f":{parts.port}" if parts.port else ""
        host = parts.hostname or "?"
    except ValueError:
        return f"{url.split(':', 1)[0] if '://' in url else '?'}://?/..."
    return f"{parts.scheme or '?'}://{host}{port}/..."


def redact_url(text: str) -> str:
    """Hide user info and query strings (SAS tokens, webhook keys) in anything that looks like a URL."""
    for prefix in ("", "file:"):
        body = text[len(prefix):]
        if "://" in body:
            parts = urlsplit(body)
            netloc = parts.netloc
            if "@" in netloc:
                netloc = "<redacted>@" + netloc.rsplit("@", 1)[1]
            query = "<redacted>" if parts.query else ""
            return prefix + urlunsplit((parts.scheme, netloc, parts.path, query, ""))
    return text


def shown(raw: Any) -> str:
    """A refused value as it may appear in an error: quoted, with URL credentials and queries hidden (a URL
    too broken to split loses everything after the scheme)."""
    if isinstance(raw, str) and "://" in raw:
        try:
            raw = redact_url(raw)
        except ValueError:
            raw = raw.split("://", 1)[0] + "://<redacted>"
    return repr(raw)


def add_options(parser: argparse.ArgumentParser, options: Sequence[Option]) -> None:
    """Flags for `options`, with defaults left out so that an absent flag can be told apart."""
    for option in options:
        flags = [f"--{name}" for name in (option.name, *option.aliases)]
        if option.is_flag:
            parser.add_argument(*flags, dest=option.dest, action="store_true", default=argparse.SUPPRESS,
                                help=option.help_text)
        elif option.repeatable:
            parser.add_argument(*flags, dest=option.dest, action="append", metavar=option.metavar,
                                default=argparse.SUPPRESS, help=option.help_text)
        else:
            parser.add_argument(*flags, dest=option.dest, metavar=option.metavar, default=argparse.SUPPRESS,
                                help=option.help_text)


def read_text_file(path: str, what: str, secret: bool = False) -> str:
    """A file given by the user, as UTF-8 text; ConfigError naming `what` (the option) and the file otherwise.
    The first undecodable byte and its offset point the user at the spot (left out for a secret's file)."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot read ({exc.strerror or exc})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        byte = "" if secret else f"byte 0x{data[exc.start]:02x} "
        raise ConfigError(f"{what} {path}: not UTF-8 text ({byte}at offset {exc.start})") from None


def _load_file(path: str) -> dict[str, Any]:
    from forewarn.yamlerrors import YamlSyntaxError, load_yaml  # YAML only with --config: it costs memory

    text = read_text_file(path, "--config")
    try:
        data = load_yaml(text, f"--config {path}")
    except YamlSyntaxError as exc:
        raise ConfigError(str(exc)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of option names to values")
    return data


def _convert(option: Option, raw: Any, source: str) -> Any:
    try:
        if option.repeatable:
            items = _sinks(raw) if isinstance(raw, str) else list(raw)
            return [_convert_one(option, str(item), source) for item in items]
        if option.is_flag:
            return _boolean(raw)
        return option.convert(str(raw))
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{source}: {shown(raw)} is not valid for --{option.name} ({exc})") from None


def _convert_one(option: Option, item: str, source: str) -> Any:
    """One value of a repeatable option: an error shows that value, not the whole list."""
    try:
        return option.convert(item)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{source}: {shown(item)} is not valid for --{option.name} ({exc})") from None


def _fresh(default: Any) -> Any:
    """A default that cannot be shared between Settings (the list defaults are mutable)."""
    return list(default) if isinstance(default, list) else default


#: Secrets that may come from a file named by the option `<name>-file`.
SECRET_FILES = ("eventhubs_connection_string", "webhook_url", "slack_webhook_url", "teams_webhook_url",
                "template_url", "queue_connection_string", "eventgrid_secret")


def resolve(args: argparse.Namespace, options: Sequence[Option] = RUN_OPTIONS,
            environ: Mapping[str, str] | None = None) -> Settings:
    """Merge flags, environment, config file and defaults into checked Settings."""
    return _resolve(args, options, environ, Settings)


def resolve_fleet(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> FleetSettings:
    """The same for `forewarn fleet`, from FLEET_OPTIONS."""
    return _resolve(args, FLEET_OPTIONS, environ, FleetSettings)


def _resolve(args: argparse.Namespace, options: Sequence[Option], environ: Mapping[str, str] | None,
             into: type[S]) -> S:
    environ = os.environ if environ is None else environ
    flags = vars(args)
    config_path = flags.get("config") or environ.get(ENV_PREFIX + "CONFIG")
    from_file = _load_file(config_path) if config_path else {}
    # The file is run's or fleet's: the one-shot commands (IMDS_OPTIONS, a part of run's) read run's file and
    # leave the rest of it to run.
    table = FLEET_OPTIONS if options is FLEET_OPTIONS else RUN_OPTIONS
    by_key = {option.dest: option for option in table}
    aliases = {option_key(alias): option.dest for option in table for alias in option.aliases}
    unknown = [str(key) for key in from_file
               if aliases.get(option_key(str(key)), option_key(str(key))) not in by_key]
    if unknown:
        hints = [f"{key!r}{_nearest_key(key, table)}" for key in unknown]
        valid = "" if all(hint.endswith(")") for hint in hints) else "; valid: " + ", ".join(
            option.name for option in table)
        raise ConfigError(f"--config {config_path}: unknown option{'s' if len(unknown) > 1 else ''} "
                          f"{'; '.join(hints)}{valid}")
    file_values = {aliases.get(option_key(str(key)), option_key(str(key))): value for key, value in from_file.items()}

    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for option in options:
        if option.secret and option.dest in flags:
            raise ConfigError(f"--{option.name} on the command line is visible to every user through ps; set "
                              f"{option.env} or put it in a file")
        if option.dest in flags:
            raw, source = flags[option.dest], f"--{option.name}"
            if option.repeatable:
                raw = [item for value in raw for item in _sinks(value)] if option.name == "sink" else raw
        elif option.env in environ:
            raw, source = environ[option.env], option.env
        elif option.dest in file_values:
            raw, source = file_values[option.dest], f"--config {config_path} ({option.name})"
        else:
            values[option.dest] = _fresh(option.default)
            sources[option.dest] = "default"
            continue
        values[option.dest] = raw if (option.is_flag and isinstance(raw, bool)) else _convert(option, raw, source)
        sources[option.dest] = source
    for secret in SECRET_FILES:  # a secret's file fills the secret when the variable did not
        secret_file = values.get(secret + "_file")
        if secret_file and not values.get(secret):
            flag = "--" + secret.replace("_", "-") + "-file"
            values[secret] = read_text_file(secret_file, flag, secret=True).strip()
            sources[secret] = f"{flag} {secret_file}"
    if "state_dir" in values and values["state_dir"] is None and not values.get("simulate"):
        values["state_dir"] = default_state_dir()
    for option in RUN_OPTIONS:  # options this command does not take keep their defaults
        values.setdefault(option.dest, _fresh(option.default))
    return into(**values, sources=sources)
