"""bench/sharded.py judges ours against one process within the float-order spread of a
reference run as ours runs: where ours steps its shards on another device than it computes
on (staged), so does the reference whose spread is the tolerance."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"

CHECK = """
import argparse, json, sys
sys.path.insert(0, {bench!r})
import torch
import sharded
from unbroken.comm.placement import Placement

args = argparse.Namespace(dim=16, layers=1, steps=3, batch=8, nodes=4, device="cpu")
stepped = []
make = sharded.adamw
def recording(groups):
    stepped.extend(p for g in groups for p in g["params"])
    return make(groups)
sharded.adamw = recording
plain = sharded.reference(args, 4)
whole = sharded.reference(args, 1)
model_params = len(stepped) // 2
stepped.clear()
staged = Placement(stage=True, reason="staged on the CPU")
mirrored = sharded.reference(args, 4, staged)
print(json.dumps({{
    "equal": all(torch.equal(plain[k], mirrored[k]) for k in plain),
    "moved": any(float((plain[k] - whole[k]).abs().max()) > 0 for k in plain),
    "held_on": sorted({{str(p.device) for p in stepped}}),
    "steps_copies": len(stepped) == model_params and all(not isinstance(p, torch.nn.Parameter) for p in stepped),
    "said": sharded.describe_reference(args, staged),
    "plain_said": sharded.describe_reference(args, sharded.placement_of(0, 4, "cpu")),
}}))
"""


def test_the_spread_of_a_staged_run_is_measured_stepping_as_ours_does(tmp_path: Path) -> None:
    script = tmp_path / "check.py"
    script.write_text(CHECK.format(bench=str(BENCH)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "UB_BENCH_RESULTS": ""}
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["equal"], "on the CPU, stepping a copy of the parameters must give the same bits"
    assert out["moved"], "the slices' float order moves the model: the spread is not zero"
    assert out["steps_copies"] and out["held_on"] == ["cpu"], out
    assert "AdamW on the CPU as ours" in out["said"] and "summed in 4 slices" in out["said"]
    assert "AdamW" not in out["plain_said"]
