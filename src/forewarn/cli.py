"""The `forewarn` command line: run, simulate, events, version.

User mistakes end with exit 2 and one line naming the option, file or value; only a real bug shows a
traceback (exit 1).
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
import platform
import sys
import threading
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any, NoReturn

from forewarn import DEFAULT_API_VERSION, __version__
from forewarn.config import (
    FLEET_OPTIONS,
    REQUEST_TIMEOUT,
    RUN_OPTIONS,
    SEED,
    SPEED,
    ConfigError,
    add_options,
    argument_type,
    check_environment,
    listen_address,
    parse_listen_address,
    read_text_file,
    redact_url,
    resolve,
    resolve_fleet,
)
from forewarn.imds.client import ImdsClient, ImdsError
from forewarn.imds.document import API_VERSIONS, Document, DocumentError
from forewarn.logs import setup_logging
from forewarn.retry import with_retries

log = logging.getLogger("forewarn")

SIMULATOR_LISTEN = "127.0.0.1:8169"


class _Parser(argparse.ArgumentParser):
    """No abbreviated long options, on every parser and subparser: `--simul` is refused rather than read as
    `--simulate`, so an abbreviation that works today cannot change its meaning when an option is added."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_arguments(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """`parser.parse_args`, except that an unrecognized argument is reported by the (sub)command it was given
    to, with that command's usage and its nearest flag: argparse's subparsers hand unknown arguments up, and
    the top-level parser printed its own usage for `forewarn run --polll-interval 1`."""
    words = list(sys.argv[1:] if argv is None else argv)
    args, extras = parser.parse_known_args(words)
    if not extras:
        return args
    first = len(words) - 1 - words[::-1].index(extras[0])
    owner, siblings, start = parser, [], 0
    while True:
        subcommands = next((action for action in owner._actions
                            if isinstance(action, argparse._SubParsersAction)), None)
        name = getattr(args, subcommands.dest, None) if subcommands is not None else None
        if subcommands is None or name not in words[start:first]:
            break
        start = words.index(name, start) + 1
        owner = subcommands.choices[name]
        siblings = [other for other in subcommands.choices.values() if other is not owner]
    hints = [hint for hint in (_flag_hint(owner, siblings, extra) for extra in extras) if hint]
    owner.error(f"unrecognized arguments: {' '.join(extras)}" + "".join(f"; {hint}" for hint in hints))


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    """The documented long flags of `parser`."""
    return [flag for action in parser._actions if action.help != argparse.SUPPRESS
            for flag in action.option_strings if flag.startswith("--")]


def _flag_hint(parser: argparse.ArgumentParser, siblings: Sequence[argparse.ArgumentParser], given: str) -> str:
    """For an unrecognized `given` (a flag, perhaps with =VALUE): whose flag it is when another subcommand has it
    (`fleet --poll-interval`), else "did you mean" the nearest flag of `parser`; "" when neither."""
    if not given.startswith("--"):
        return ""
    flag = given.split("=", 1)[0]
    owners = [other.prog for other in siblings if flag in _flags(other)]
    if owners:
        return f"{flag} is an option of {' and '.join(owners)}"
    found = difflib.get_close_matches(flag, _flags(parser), n=1)
    return f"did you mean {found[0]}?" if found else ""


#: The options of `run` that the one-shot commands (events, approve, policy explain) take as well: the same
#: table, names, variables and checks, so `FOREWARN_IMDS_ENDPOINT` means one thing everywhere.
IMDS_OPTIONS = tuple(option for option in RUN_OPTIONS if option.name in ("imds-endpoint", "api-version",
                                                                        "imds-timeout"))


def _endpoint_options(parser: argparse.ArgumentParser) -> None:
    add_options(parser, IMDS_OPTIONS)
    # The spelling these commands had before they shared run's options; kept so that scripts still work.
    parser.add_argument("--timeout", dest="imds_timeout", type=argument_type(REQUEST_TIMEOUT),
                        default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="forewarn", description="Advance warning of Azure VM maintenance: IMDS Scheduled "
                     "Events as Prometheus metrics and CloudEvents records.")
    parser.add_argument("--version", action="version", version=f"forewarn {__version__}",
                        help="print forewarn's version and exit (`forewarn version` says more)")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    run = commands.add_parser("run", help="the collector: poll IMDS, serve metrics, forward records",
                              description="Poll IMDS Scheduled Events and publish metrics and records. Every "
                              "option can also be set as FOREWARN_<OPTION> or in the --config file.")
    run.add_argument("--config", metavar="FILE", help="YAML file of option names and values [env FOREWARN_CONFIG]")
    add_options(run, [o for o in RUN_OPTIONS if o.name != "simulate"])
    simulate_option = next(o for o in RUN_OPTIONS if o.name == "simulate")
    run.add_argument("--simulate", dest="simulate", nargs="?", const="tour", default=argparse.SUPPRESS,
                     metavar="SCENARIO", help=simulate_option.help + f" [env {simulate_option.env}]")

    fleet = commands.add_parser("fleet", help="the central service: many VMs' events from Resource Graph and "
                                "Event Grid (preview feeds)",
                                description="Read the Scheduled Events Azure publishes centrally (Resource Graph "
                                "snapshots, Event Grid deliveries through a Storage queue or pushed to "
                                "--eventgrid-path) for many VMs and publish the same records and metrics as `run` "
                                "(docs/fleet.md); --simulate runs it against a built-in simulated fleet instead of "
                                "Azure. Every option can also be set as FOREWARN_<OPTION> or in the --config file.")
    fleet.add_argument("--config", metavar="FILE", help="YAML file of option names and values [env FOREWARN_CONFIG]")
    add_options(fleet, [o for o in FLEET_OPTIONS if o.name != "simulate"])
    fleet_simulate = next(o for o in FLEET_OPTIONS if o.name == "simulate")
    fleet.add_argument("--simulate", dest="simulate", nargs="?", const="tour", default=argparse.SUPPRESS,
                       metavar="SCENARIO", help=fleet_simulate.help_text)
    fleet.add_argument("--list", action="store_true", help="list the built-in fleet scenarios of --simulate and exit")

    sim = commands.add_parser("simulate", help="the IMDS simulator alone, as an HTTP server",
                              description="Serve a simulated IMDS (Scheduled Events and instance metadata).")
    sim.add_argument("scenario", nargs="?", default="tour",
                     help="built-in scenario name or a YAML/JSON scenario file (default: tour)")
    sim.add_argument("--listen-address", type=argument_type(listen_address), default=SIMULATOR_LISTEN,
                     metavar="HOST:PORT", help=f"where to serve: HOST:PORT, :PORT or [IPv6]:PORT; port 0 picks a "
                     f"free port, logged at start (default {SIMULATOR_LISTEN})")
    sim.add_argument("--speed", type=argument_type(SPEED), default=1.0, metavar="FACTOR",
                     help=f"how much faster than real time the scenario runs, {SPEED.valid} (default 1)")
    sim.add_argument("--fault", action="append", default=[], metavar="KIND:VALUE",
                     help="inject faults: 500:0.1, 429:0.05, 410:0.02, reset:0.05, malformed:0.01, "
                     "timeout:0.01, latency:0.2, slow-first:30 (repeatable)")
    sim.add_argument("--seed", type=argument_type(SEED), default=None,
                     help=f"random seed for fault injection, {SEED.valid}")
    sim.add_argument("--no-rate-limit", action="store_true", help="do not answer 429 beyond 5 requests/s")
    sim.add_argument("--list", action="store_true", help="list the built-in scenarios and exit")
    sim.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))

    events = commands.add_parser("events", help="one look at the current Scheduled Events",
                                 description="Fetch the Scheduled Events document once and print it.")
    _endpoint_options(events)
    events.add_argument("--output", choices=("table", "json"), default="table", help="table (default) or json")
    events.add_argument("--vm-name", metavar="NAME", help="mark events that affect this VM")

    approve = commands.add_parser("approve", help="approve scheduled events by hand (StartRequests)",
                                  description="Start scheduled events now: one StartRequests POST with every id. "
                                  "Each id must be in the current document.")
    approve.add_argument("event_ids", nargs="+", metavar="EVENT_ID")
    _endpoint_options(approve)

    policy = commands.add_parser("policy", help="check or explain an approval policy")
    policy_commands = policy.add_subparsers(dest="policy_command", metavar="SUBCOMMAND", parser_class=_Parser)
    check = policy_commands.add_parser("check", help="validate a policy file")
    check.add_argument("file")
    check.add_argument("--no-command-check", dest="check_commands", action="store_false",
                       help="do not require hook commands to exist here (checking a policy for other machines)")
    check.add_argument("--fleet", action="store_true", help="a policy for forewarn fleet (its match keys)")
    explain = policy_commands.add_parser("explain", help="what the policy would do with each event, and why")
    explain.add_argument("file")
    explain.add_argument("--fleet", action="store_true",
                         help="a policy for forewarn fleet, explained for the events of --rows")
    explain.add_argument("--rows", metavar="ROWS.json",
                         help="with --fleet: Resource Graph rows of scheduled events (a JSON array, or a reply "
                         "with data, as `az graph query` prints)")
    explain.add_argument("--document", metavar="DOC.json",
                         help="a Scheduled Events document to explain (default: the current one from IMDS)")
    explain.add_argument("--vm-name", metavar="NAME",
                         help="this VM's name as in Resources (default: IMDS compute.name)")
    _endpoint_options(explain)

    commands.add_parser("version", help="version, API version, Python version")
    return parser


def cmd_version() -> int:
    print(f"forewarn {__version__}")
    print(f"scheduled events api-version {DEFAULT_API_VERSION} (supported: {', '.join(API_VERSIONS)})")
    print(f"python {platform.python_version()} ({platform.python_implementation()}, {sys.platform})")
    return 0


def _ago(seconds: float) -> str:
    sign = "in " if seconds >= 0 else ""
    suffix = "" if seconds >= 0 else " ago"
    seconds = abs(int(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        text = f"{days}d{hours}h"
    elif hours:
        text = f"{hours}h{minutes:02d}m"
    elif minutes:
        text = f"{minutes}m{secs:02d}s"
    else:
        text = f"{secs}s"
    return sign + text + suffix


def _printable(text: str) -> str:
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)


def format_table(document: Document, vm_name: str | None, now: datetime) -> str:
    """The document as a plain-text table for people."""
    lines = [f"DocumentIncarnation {document.incarnation}: {len(document.events)} event(s)"]
    if not document.events:
        return lines[0] + "\n"
    header = ("EVENT ID", "TYPE", "STATUS", "SOURCE", "NOT BEFORE", "DURATION", "RESOURCES", "DESCRIPTION")
    rows = []
    for event in document.events:
        if event.not_before is not None:
            not_before = (event.not_before.strftime("%Y-%m-%d %H:%M:%SZ") + " ("
                          + _ago((event.not_before - now).total_seconds()) + ")")
        else:
            not_before = "-"
        duration = "-" if event.duration_seconds is None else (
            "unknown" if event.duration_seconds < 0 else f"{event.duration_seconds}s")
        resources = ",".join(f"*{r}" if vm_name and r == vm_name else r for r in event.resources) or "-"
        description = event.description or ""
        rows.append((event.event_id, event.event_type, event.status, event.source or "-", not_before, duration,
                     resources, description[:60] + ("..." if len(description) > 60 else "")))
    # Strings come from IMDS: escape control characters so a reply cannot move the cursor or forge lines.
    shown = [tuple(_printable(str(cell)) for cell in row) for row in rows]
    widths = [max(len(str(row[i])) for row in [header, *shown]) for i in range(len(header))]
    lines.append("")
    for row in [header, *shown]:
        lines.append("  ".join(str(cell).ljust(widths[i]) for i, cell in enumerate(row)).rstrip())
    if vm_name:
        lines.append(f"\n* = this VM ({vm_name})")
    return "\n".join(lines) + "\n"


def _client_for(args: argparse.Namespace) -> ImdsClient:
    settings = resolve(args, IMDS_OPTIONS)
    endpoint = settings.imds_endpoint
    if endpoint == "discover":
        from forewarn.imds.discovery import discover_endpoint

        endpoint = discover_endpoint()
    # The first request may take up to two minutes while IMDS switches Scheduled Events on.
    return ImdsClient(endpoint, settings.api_version, timeout=settings.imds_timeout,
                      first_timeout=max(settings.imds_timeout, 120))


class CommandFailed(Exception):
    """A one-shot command could not do its job (exit 1); the message says why."""


def _current_document(client: ImdsClient) -> Document:
    try:
        return with_retries(client.get_scheduled_events)
    except ImdsError as exc:
        raise CommandFailed(f"cannot read Scheduled Events from {redact_url(client.endpoint)}: {exc}") from None
    except DocumentError as exc:
        raise CommandFailed(f"IMDS reply is not a valid Scheduled Events document: {exc}") from None


def cmd_events(args: argparse.Namespace) -> int:
    client = _client_for(args)
    try:
        document = _current_document(client)
    finally:
        client.close()
    if args.output == "json":
        print(json.dumps(dict(document.raw), indent=2))
    else:
        sys.stdout.write(format_table(document, args.vm_name, datetime.now(timezone.utc)))
    return 0


def cmd_approve(args: argparse.Namespace) -> int:
    client = _client_for(args)
    try:
        known = {event.event_id: event for event in _current_document(client).events}
        unknown = [event_id for event_id in args.event_ids if event_id not in known]
        if unknown:
            listed = ", ".join(known) or "none"
            raise CommandFailed(f"not in the current document: {', '.join(unknown)} (current events: {listed})")
        started = [event_id for event_id in args.event_ids if known[event_id].status != "Scheduled"]
        if started:
            raise CommandFailed(f"already started, nothing to approve: {', '.join(started)}")
        try:
            with_retries(lambda: client.start_events(args.event_ids))
        except ImdsError as exc:
            raise CommandFailed(f"IMDS at {redact_url(client.endpoint)} refused the approval: {exc}") from None
    finally:
        client.close()
    for event_id in args.event_ids:
        event = known[event_id]
        print(f"approved {event_id} ({event.event_type} of {', '.join(event.resources) or '-'})")
    return 0


def cmd_policy(args: argparse.Namespace) -> int:
    from forewarn.approval.policy import PolicyError, decide, load_policy

    if args.policy_command is None:
        raise ConfigError("policy needs a subcommand: check or explain")
    try:
        # explain answers "what would it decide", also on a laptop without the VMs' hook programs.
        policy = load_policy(args.file, check_commands=args.policy_command == "check" and args.check_commands,
                             fleet=args.fleet)
    except PolicyError as exc:
        print(f"forewarn policy: {exc}", file=sys.stderr)
        return 2
    if args.policy_command == "check":
        mode = "fleet mode" if args.fleet else f"leader mode {policy.leader_mode}"
        print(f"{args.file}: OK ({len(policy.rules)} rule(s), {mode}{', dry run' if policy.dry_run else ''})")
        # Hook targets as the log shows them: a webhook as scheme://host/... (its path or query is a token).
        for checked in policy.rules:
            for hook in checked.prepare:
                print(f"  prepare hook {hook.name} of rule {checked.name}: {hook.target()}")
            if checked.node:
                print(f"  node actions of rule {checked.name} (on_failure: {checked.on_failure}): "
                      + "; ".join(action.describe() for action in checked.node))
        for hook in policy.recover:
            print(f"  recover hook {hook.name}: {hook.target()}")
        return 0
    if args.fleet:
        return _explain_fleet(args, policy)
    vm_name = args.vm_name
    if args.document:
        from forewarn.imds.document import parse_document

        text = read_text_file(args.document, "--document")
        try:
            document = parse_document(text)
        except DocumentError as exc:
            raise ConfigError(f"--document {args.document}: {exc}") from None
    else:
        client = _client_for(args)
        try:
            document = _current_document(client)
            if not vm_name:
                try:
                    vm_name = client.get_compute().name
                except (ImdsError, DocumentError) as exc:
                    raise CommandFailed(f"cannot read this VM's name ({exc}); pass --vm-name") from None
        finally:
            client.close()
    now = datetime.now(timezone.utc).timestamp()
    print(f"policy {args.file}, VM {vm_name or '(unknown: pass --vm-name)'}, incarnation {document.incarnation}, "
          f"{len(document.events)} event(s)")
    for event in document.events:
        decision = decide(policy, event, vm_name, now, now)
        rule = decision.rule  # the rule the approver would name in its record
        print(f"\n{event.event_id}  {event.event_type} {event.status} source={event.source or '-'} "
              f"resources={','.join(event.resources) or '-'}")
        for miss in decision.skipped:
            print(f"  skipped  {miss}")
        print(f"  matched  {rule.name if rule else '(no rule)'}")
        if rule is not None and rule.node:
            where = "this VM's node (--node-name)" if event.affects(vm_name) else \
                "none: the event does not affect this VM"
            print(f"  node     {'; '.join(action.describe() for action in rule.node)} -> {where}, before the "
                  f"decision (on_failure: {rule.on_failure})")
        print(f"  decision {decision.action.upper()}: {decision.reason}")
        if rule is not None and rule.prepare and decision.action != "hold":
            print(f"  prepare  {', '.join(f'{hook.name} ({hook.target()})' for hook in rule.prepare)} "
                  "must succeed first")
    return 0


def _explain_fleet(args: argparse.Namespace, policy: Any) -> int:
    """`policy explain --fleet --rows ROWS.json`: each Resource Graph row's event, where it is, and the decision."""
    from forewarn.approval.policy import decide
    from forewarn.fleet.approval import place_of
    from forewarn.fleet.feed import FeedError, parse_resource_graph_row
    from forewarn.imds.reply import ReplyError, decode_reply

    if not args.rows:
        raise ConfigError("policy explain --fleet needs --rows ROWS.json (Resource Graph rows of scheduled events)")
    try:
        value, _ = decode_reply(read_text_file(args.rows, "--rows").encode())
    except ReplyError as exc:
        raise ConfigError(f"--rows {args.rows}: {exc}") from None
    rows = value.get("data") if isinstance(value, dict) else value
    if not isinstance(rows, list):
        raise ConfigError(f"--rows {args.rows}: expected a JSON array of rows, or an object with data")
    now = datetime.now(timezone.utc).timestamp()
    print(f"policy {args.file} (fleet mode), {len(rows)} row(s)")
    for index, row in enumerate(rows):
        try:
            fleet_event = parse_resource_graph_row(row)
        except FeedError as exc:
            print(f"\nrow {index}: skipped: {exc}")
            continue
        event, place = fleet_event.event, place_of(fleet_event)
        decision = decide(policy, event, None, now, now, place)
        print(f"\n{event.event_id}  {event.event_type} {event.status} on {fleet_event.resource_id}")
        print(f"  where    subscription {place.subscription_id}, resource group {place.resource_group}"
              f"{f', scale set {place.scale_set}' if place.scale_set else ''}, VMs {','.join(place.vms) or '-'}")
        for miss in decision.skipped:
            print(f"  skipped  {miss}")
        print(f"  matched  {decision.rule.name if decision.rule else '(no rule)'}")
        print(f"  decision {decision.action.upper()}: {decision.reason}")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from forewarn.signals import handle_signals, ignore_stop_signals
    from forewarn.simulator import SCENARIOS, start_simulator

    if args.list:
        for name, scenario in SCENARIOS.items():
            print(f"{name:24} {scenario.summary}")
        return 0
    setup_logging("text", args.log_level)
    host, port = parse_listen_address(args.listen_address)
    try:
        server = start_simulator(args.scenario, args.speed, args.fault, seed=args.seed,
                                 rate_limit=None if args.no_rate_limit else 5, host=host or "0.0.0.0", port=port)  # noqa: S104
    except OSError as exc:
        raise ConfigError(f"--listen-address {args.listen_address}: cannot listen ({exc.strerror or exc})") \
            from None
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    stop = threading.Event()
    handle_signals(stop)
    log.info("IMDS simulator: scenario %s at %gx speed on %s (admin API under /admin)",
             server.simulator.scenario.name, args.speed, server.url)
    stop.wait()
    server.stop()
    ignore_stop_signals()
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from forewarn.agent import run_agent

    notes = check_environment(os.environ, "run")
    settings = resolve(args, RUN_OPTIONS)
    setup_logging(settings.log_format, settings.log_level)
    for note in notes:
        log.warning("%s", note)
    log.info("forewarn %s starting with %s", __version__,
             json.dumps({k: v for k, v in settings.redacted().items()}, sort_keys=True))
    return run_agent(settings)


def cmd_fleet(args: argparse.Namespace) -> int:
    from forewarn.fleet.service import run_fleet

    if args.list:
        from forewarn.simulator.fleet import FLEET_SCENARIOS

        for name, scenario in FLEET_SCENARIOS.items():
            print(f"{name:24} {scenario.summary}")
        return 0
    notes = check_environment(os.environ, "fleet")
    settings = resolve_fleet(args)
    setup_logging(settings.log_format, settings.log_level)
    for note in notes:
        log.warning("%s", note)
    return run_fleet(settings)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parse_arguments(parser, argv)
    handlers: dict[str, Any] = {
        "run": cmd_run,
        "fleet": cmd_fleet,
        "simulate": cmd_simulate,
        "events": cmd_events,
        "approve": cmd_approve,
        "policy": cmd_policy,
        "version": lambda _args: cmd_version(),
    }
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(handlers[args.command](args))
    except ConfigError as exc:
        print(f"forewarn {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except CommandFailed as exc:
        print(f"forewarn {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0




if __name__ == "__main__":
    raise SystemExit(main())
