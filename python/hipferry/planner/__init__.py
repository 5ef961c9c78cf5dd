"""hipferry.plan: say what fits on this machine and pick it (docs/planner.md).

machine.py measures the machine once (cached), profile.py measures the model on
one batch, optim/footprint.py says what each home of the optimizer state costs, and
planner.py estimates every candidate, picks one and builds it."""
from .machine import measure_machine
from .measure import StepRecord, run_steps
from .planner import Applied, Candidate, Plan, PlanError, choose, plan
from .rss import HighWater, rss_bytes

__all__ = ["plan", "Plan", "PlanError", "Applied", "Candidate", "choose", "measure_machine", "HighWater", "rss_bytes",
           "StepRecord", "run_steps"]
