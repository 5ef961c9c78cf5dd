"""Runs the bench's overlap rows (python -m hipferry bench optim, rows 'overlap on cpu') alone and prints them as JSON lines."""
import json, sys, types
import torch
from hipferry.bench.optim_overlap import overlap_rows
ctx = types.SimpleNamespace(quick=False, repeats=int(sys.argv[1]) if len(sys.argv) > 1 else 5)
rows, notes = [], []
overlap_rows(ctx, rows, notes, lambda msg: None)
for r in rows:
    print(json.dumps({k: r[k] for k in ("regime", "contender", "backward_s", "backward_end_to_step_end_s", "iteration_s", "committed", "redone")}))
