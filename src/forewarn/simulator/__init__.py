"""A stand-in for IMDS Scheduled Events over real HTTP, for demos, drills and tests."""

from __future__ import annotations

from collections.abc import Sequence

from forewarn.simulator.scenarios import SCENARIOS, Scenario, ScenarioError, load_scenario
from forewarn.simulator.server import SimulatorServer
from forewarn.simulator.timeline import Faults, Simulator, parse_fault

__all__ = ["SCENARIOS", "Faults", "Scenario", "ScenarioError", "Simulator", "SimulatorServer", "load_scenario",
           "start_simulator"]


def start_simulator(scenario: str, speed: float = 1.0, faults: Sequence[str] = (), seed: int | None = None,
                    rate_limit: int | None = 5, host: str = "127.0.0.1", port: int = 0) -> SimulatorServer:
    """Load a scenario (built-in name or file), set its faults and serve it in the background.

    Both `forewarn simulate` and `forewarn run --simulate` start it this way. Raises ValueError for an
    unknown scenario or a bad fault, OSError when the address cannot be listened on.
    """
    injected = Faults(seed=seed)
    for spec in faults:
        parse_fault(spec, injected)
    simulator = Simulator(load_scenario(scenario), speed=speed, faults=injected, rate_limit=rate_limit)
    return SimulatorServer(simulator, host, port).serve_in_background()
