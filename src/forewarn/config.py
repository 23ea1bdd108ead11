"""Settings for `forewarn run`: one table of options, read from flags, environment and a config file.

Precedence, highest first: command-line flag, `FOREWARN_<OPTION>` environment variable, the YAML
config file (`--config`, keys as the long option names), the default. Values are checked when read and
a bad one stops start-up with a message naming where it came from and what would be valid.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import yaml

from forewarn import DEFAULT_API_VERSION
from forewarn.imds.client import DEFAULT_ENDPOINT
from forewarn.imds.document import API_VERSIONS
from forewarn.yamlerrors import yaml_problem

ENV_PREFIX = "FOREWARN_"
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


def _positive(kind: Callable[[str], Any], minimum: float = 0.0) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        value = kind(text)
        if value <= minimum:
            raise ValueError(f"must be greater than {minimum:g}")
        return value
    return convert


def _poll_interval(text: str) -> float:
    value = float(text)
    # IMDS allows 5 requests per second per VM, for every caller on it together.
    if value < 0.2:
        raise ValueError("must be at least 0.2 (IMDS allows 5 requests per second per VM)")
    return value


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
    """`HOST:PORT`, `:PORT` (all interfaces) or `[IPV6]:PORT`."""
    match = re.fullmatch(r"(?:\[(?P<v6>[^\]]+)\]|(?P<host>[^:\[\]]*)):(?P<port>\d{1,5})", text.strip())
    if not match or int(match["port"]) > 65535:
        raise ValueError("expected HOST:PORT, :PORT or [IPv6]:PORT")
    return (match["v6"] or match["host"] or ""), int(match["port"])


def _listen(text: str) -> str:
    parse_listen_address(text)
    return text


def _endpoint(text: str) -> str:
    if text == "discover":
        return text
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("expected http://HOST[:PORT] or 'discover'")
    return text.rstrip("/")


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

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.dest.upper()


RUN_OPTIONS: tuple[Option, ...] = (
    Option("imds-endpoint", "IMDS base URL, or 'discover' to read DHCP option 245 (VMs outside a VNET)",
           DEFAULT_ENDPOINT, _endpoint, metavar="URL"),
    Option("api-version", "Scheduled Events API version", DEFAULT_API_VERSION, _api_version, metavar="V"),
    Option("poll-interval", "seconds between polls (decimals allowed, at least 0.2)", 1.0, _poll_interval,
           metavar="SECONDS"),
    Option("imds-timeout", "per-request timeout once IMDS has answered (the first request may take up "
           "to 120 s)", 2.0, _positive(float), metavar="SECONDS"),
    Option("imds-max-backoff", "longest wait between polls while IMDS keeps failing", 10.0,
           _positive(float), metavar="SECONDS"),
    Option("imds-max-reply-bytes", "largest IMDS reply accepted; a longer one is an error and its connection "
           "is dropped", 4 * 1024 * 1024, _positive(int), metavar="BYTES"),
    Option("listen-address", "where /metrics, /healthz and /readyz are served", DEFAULT_LISTEN, _listen,
           metavar="HOST:PORT"),
    Option("web-read-timeout", "seconds a client of the web endpoints may take to send a request, and may "
           "stay idle between requests", 10.0, _positive(float), metavar="SECONDS"),
    Option("web-max-connections", "web connections served at once (each has a worker thread); more wait in "
           "the listen queue", 16, _positive(int), metavar="N"),
    Option("web-max-request-bytes", "largest request (line and headers) the web endpoints accept", 16384,
           _positive(int), metavar="BYTES"),
    Option("drain-timeout", "on stop, how long the sinks (in parallel) may take to deliver what is waiting; "
           "the rest stays in the outbox", 10.0, _positive(float), metavar="SECONDS"),
    Option("vm-name", "this VM's name as in Resources (default: instance metadata compute.name)", None,
           metavar="NAME"),
    Option("state-dir", "where state and the outbox survive restarts", None, metavar="PATH"),
    Option("sink", "where records go: stdout, file:PATH, eventhubs, otlp (repeatable)", ["stdout"],
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
    Option("policy", "approval policy file (YAML); without one nothing is ever approved", None, metavar="FILE"),
    Option("dry-run", "decide and record approvals, but send no StartRequests", False, _boolean, is_flag=True),
    Option("outbox-max-records", "records kept for delivery before the oldest are dropped", 100_000,
           _positive(int), metavar="N"),
    Option("ready-window", "/readyz fails when no poll succeeded for this long", 60.0, _positive(float),
           metavar="SECONDS"),
    Option("compute-refresh", "seconds between reads of instance metadata", 3600.0, _positive(float),
           metavar="SECONDS"),
    Option("log-format", "text or json", "text", _choice("text", "json")),
    Option("log-level", "debug, info, warning or error", "info", _choice("debug", "info", "warning", "error")),
    Option("simulate", "run against the built-in IMDS simulator, with this scenario (default: tour)",
           None, metavar="SCENARIO"),
    Option("speed", "with --simulate: how much faster than real time the scenario runs", 1.0,
           _positive(float), metavar="FACTOR"),
    Option("fault", "with --simulate: inject IMDS faults, e.g. 500:0.1, reset:0.05, latency:0.2 "
           "(repeatable)", [], str, repeatable=True, metavar="KIND:VALUE"),
)


@dataclass(frozen=True)
class Settings:
    values: Mapping[str, Any]
    sources: Mapping[str, str] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None

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


def add_options(parser: argparse.ArgumentParser, options: Sequence[Option]) -> None:
    """Flags for `options`, with defaults left out so that an absent flag can be told apart."""
    for option in options:
        flag = f"--{option.name}"
        env_help = f" [env {option.env}]"
        if option.is_flag:
            parser.add_argument(flag, dest=option.dest, action="store_true", default=argparse.SUPPRESS,
                                help=option.help + env_help)
        elif option.repeatable:
            parser.add_argument(flag, dest=option.dest, action="append", metavar=option.metavar,
                                default=argparse.SUPPRESS, help=option.help + env_help)
        else:
            parser.add_argument(flag, dest=option.dest, metavar=option.metavar, default=argparse.SUPPRESS,
                                help=option.help + env_help)


def _load_file(path: str) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read ({exc.strerror or exc})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        line, column, problem = yaml_problem(exc)
        where = f" line {line}, column {column}" if line else ""
        raise ConfigError(f"--config {path}:{where}: not valid YAML ({problem})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of option names to values")
    return data


def _convert(option: Option, raw: Any, source: str) -> Any:
    try:
        if option.repeatable:
            items = _sinks(raw) if isinstance(raw, str) else list(raw)
            return [option.convert(str(item)) for item in items]
        if option.is_flag:
            return _boolean(raw)
        return option.convert(str(raw))
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{source}: {raw!r} is not valid for --{option.name} ({exc})") from None


def resolve(args: argparse.Namespace, options: Sequence[Option] = RUN_OPTIONS,
            environ: Mapping[str, str] | None = None) -> Settings:
    """Merge flags, environment, config file and defaults into checked Settings."""
    environ = os.environ if environ is None else environ
    flags = vars(args)
    config_path = flags.get("config") or environ.get(ENV_PREFIX + "CONFIG")
    from_file = _load_file(config_path) if config_path else {}
    by_key = {option.dest: option for option in options}
    unknown = [key for key in from_file if str(key).replace("-", "_") not in by_key]
    if unknown:
        raise ConfigError(f"--config {config_path}: unknown option {unknown[0]!r}; valid: "
                          + ", ".join(option.name for option in options))
    file_values = {str(key).replace("-", "_"): value for key, value in from_file.items()}

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
            values[option.dest] = option.default
            sources[option.dest] = "default"
            continue
        values[option.dest] = raw if (option.is_flag and isinstance(raw, bool)) else _convert(option, raw, source)
        sources[option.dest] = source
    secret_file = values.get("eventhubs_connection_string_file")
    if secret_file and not values.get("eventhubs_connection_string"):
        try:
            values["eventhubs_connection_string"] = Path(secret_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(f"--eventhubs-connection-string-file {secret_file}: cannot read "
                              f"({exc.strerror or exc})") from None
        sources["eventhubs_connection_string"] = f"--eventhubs-connection-string-file {secret_file}"
    if "state_dir" in values and values["state_dir"] is None and not values.get("simulate"):
        values["state_dir"] = default_state_dir()
    return Settings(values=values, sources=sources)


def fail(message: str) -> None:
    """Report a usage or configuration error the way argparse does, and exit 2."""
    print(f"forewarn: error: {message}", file=sys.stderr)
    raise SystemExit(2)
