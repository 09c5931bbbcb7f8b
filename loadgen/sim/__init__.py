"""Discrete-event simulator of a Baton cluster driving the real router."""

from loadgen.sim.run import SimConfig, SimResult, simulate, simulate_specs

__all__ = ["SimConfig", "SimResult", "simulate", "simulate_specs"]
