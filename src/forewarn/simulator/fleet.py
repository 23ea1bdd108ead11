"""A simulated fleet for `forewarn fleet --simulate`: Azure's central Scheduled Events feeds, on loopback.

Fleet mode reads what Azure publishes centrally (docs/fleet.md): Resource Graph rows, Event Grid deliveries,
and it approves through the Maintenance resource provider's acknowledge call. The simulated fleet plays Azure's
part for a built-in scenario, so that every part of fleet mode runs as it does against Azure:

- **Resource Graph and ARM** (`FleetStandIn`): `POST /providers/Microsoft.ResourceGraph/resources` answers
  the rows of the scenario's events in the subscriptions asked for, a minute behind (RESOURCE_GRAPH_LAG),
  paged as Resource Graph pages (`$top`, `$skipToken`), and
  `POST {target}/providers/Microsoft.Maintenance/scheduledevents[/{id}/acknowledge]` approves an event, which
  then starts START_DELAY scenario seconds later, as Azure starts an approved event early. Both check the
  bearer token, the api-version and the body, and refuse what ARM would refuse. The clients are fleet mode's
  own (forewarn.fleet.resourcegraph, forewarn.fleet.acknowledge), with their token cache.
- **Event Grid** (`EventGridPusher`): every status an event goes through (Scheduled, Started, Completed,
  Canceled) is delivered in the Event Grid schema to forewarn's own push route (`--eventgrid-path`, with its
  shared secret in the URL as a real subscription carries it), after the subscription validation handshake
  Event Grid makes first. A delivery that is not answered 200 is sent again later, as Event Grid retries; an
  event marked `delivered_twice` has each status delivered twice under one id, as Event Grid may repeat one.

Choices, and why:
- **The credential** is `SimulatedCredential`: azure-core's `get_token` shape, giving the stand-in's token (made
  at random at start) for the stand-in's scope and nothing else. azure-identity is not needed, so the
  simulator runs on the core install; the token still goes through fleet mode's token cache (`Tokens`).
- **Plain HTTP on loopback** for ARM: the stand-in listens on 127.0.0.1 only and its token is worthless
  elsewhere, so TLS would protect nothing, while making a certificate at start needs `cryptography`, which the
  core install lacks. The https-only rule stays for every endpoint a user gives (`--arm-endpoint`); only a simulated
  run passes `loopback_http`, which allows a loopback IP address and nothing else.
- **Push, not the queue**: a Storage queue would need a queue service stand-in (Azurite's part) and
  azure-storage-queue; the push route is forewarn's own web server, with the same boundary (`parse_event_grid`)
  and the same committer as the queue.

The parts: fleet_timeline.py (the scenarios and the timeline, with the feeds' wire shapes), fleet_azure.py (the
stand-in, the credential, the pusher) and this module (the whole simulation, started from FleetSettings).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from forewarn.config import ConfigError, FleetSettings, option_key
from forewarn.simulator.fleet_azure import EventGridPusher, FleetStandIn, SimulatedCredential
from forewarn.simulator.fleet_timeline import FLEET_SCENARIOS, FleetScenario, FleetTimeline, fleet_scenario

if TYPE_CHECKING:
    import tempfile

__all__ = ["FLEET_SCENARIOS", "FleetSimulation", "sample_messages", "start_fleet_simulation"]

log = logging.getLogger(__name__)


class FleetSimulation:
    """The stand-in, its credential and, once forewarn's web server listens, the Event Grid pusher."""

    def __init__(self, scenario: FleetScenario, speed: float) -> None:
        self.timeline = FleetTimeline(scenario, speed)
        token = secrets.token_urlsafe(32)
        self.stand_in = FleetStandIn(self.timeline, token).start()
        self.credential = SimulatedCredential(token, f"{self.stand_in.url}/.default")
        self.secret = secrets.token_hex(32)
        self.pusher: EventGridPusher | None = None
        self.scratch: tempfile.TemporaryDirectory[str] | None = None   # the state dir when none was given

    @property
    def url(self) -> str:
        return self.stand_in.url

    def push_to(self, url: str, secret: str) -> None:
        """Begin the scenario, with Event Grid's deliveries to `url` (fleet mode's push route, listening)."""
        self.timeline.begin()
        self.pusher = EventGridPusher(self.timeline, url, secret).start()

    def stop(self) -> None:
        if self.pusher is not None:
            self.pusher.stop()
        self.stand_in.stop()
        if self.scratch is not None:
            self.scratch.cleanup()


def sample_messages(scenario: str = "tour") -> tuple[dict[str, Any], dict[str, Any]]:
    """The first Event Grid delivery and the first Resource Graph row the simulator sends for `scenario`, as
    docs/fleet.md shows them: the start set to 2026-01-05 09:00:00 UTC and real time (speed 1)."""
    timeline = FleetTimeline(FLEET_SCENARIOS[scenario], 1.0,
                             clock=lambda: datetime(2026, 1, 5, 9, 0, tzinfo=timezone.utc).timestamp())
    spec = timeline.scenario.events[0]
    first = timeline.milestones(spec)[0]
    return timeline.event_grid_event(spec, first), timeline.row(spec, first.status)


#: Options that point fleet mode at Azure or Kubernetes: refused with --simulate, which plays Azure's part.
AZURE_OPTIONS = ("subscription", "management-group", "resource-group", "arm-endpoint", "arm-client-id", "queue-url",
                 "queue-connection-string", "queue-connection-string-file", "queue-client-id", "lease-name",
                 "lease-namespace", "kubeconfig")


def start_fleet_simulation(settings: FleetSettings) -> tuple[FleetSettings, FleetSimulation]:
    """Start the simulated fleet of `settings.simulate` and return the settings that point fleet mode at it:
    its subscriptions and ARM base, the push route (--eventgrid-path, default /eventgrid) with a secret made at
    start unless one was given, a snapshot every 5 s unless --reconcile-interval was given, and a temporary
    state dir (removed at stop) unless --state-dir was given. ConfigError for an option that points at Azure
    or Kubernetes, or an unknown scenario."""
    given = {key for key, source in settings.sources.items() if source != "default"}
    # Named as they were given: a flag, a FOREWARN_ variable or a key of the --config file.
    refused = [settings.sources[key] for key in (option_key(name) for name in AZURE_OPTIONS) if key in given]
    if refused:
        raise ConfigError(f"--simulate plays Azure's part with a fleet of its own: {', '.join(refused)} cannot go "
                          "with it (leave --simulate out to read Azure)")
    assert settings.simulate is not None
    try:
        scenario = fleet_scenario(settings.simulate)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    simulation = FleetSimulation(scenario, settings.speed)
    state_dir = settings.state_dir
    if state_dir is None:
        import tempfile  # only for a simulated run, as in `forewarn run --simulate`

        simulation.scratch = tempfile.TemporaryDirectory(prefix="forewarn-fleet-sim-", ignore_cleanup_errors=True)
        state_dir = simulation.scratch.name
    simulated = dataclasses.replace(
        settings, subscription=list(scenario.subscriptions), arm_endpoint=simulation.url, state_dir=state_dir,
        eventgrid_path=settings.eventgrid_path or "/eventgrid",
        eventgrid_secret=settings.eventgrid_secret or simulation.secret,
        reconcile_interval=settings.reconcile_interval if "reconcile_interval" in given else 5.0)
    log.info("fleet simulator: scenario %s at %gx speed, %d subscription(s); Resource Graph and ARM on %s (admin "
             "API: %s/admin/state); Event Grid pushes to %s", scenario.name, settings.speed,
             len(scenario.subscriptions), simulation.url, simulation.url, simulated.eventgrid_path)
    return simulated, simulation
