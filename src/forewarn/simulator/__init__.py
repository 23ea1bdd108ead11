"""A stand-in for IMDS Scheduled Events over real HTTP, for demos, drills and tests."""

from forewarn.simulator.scenarios import SCENARIOS, Scenario, ScenarioError, load_scenario
from forewarn.simulator.server import SimulatorServer
from forewarn.simulator.timeline import Faults, Simulator

__all__ = ["SCENARIOS", "Faults", "Scenario", "ScenarioError", "Simulator", "SimulatorServer", "load_scenario"]
