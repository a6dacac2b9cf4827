"""The simulator: the real Scheduler in virtual time, a runner that computes nothing, a step-time predictor."""

from twophase.sim.simulator import SimRequest, SimResult, Simulator, VirtualClock

__all__ = ["SimRequest", "SimResult", "Simulator", "VirtualClock"]
