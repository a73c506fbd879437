"""The fill experiment (traingate.capacity.fill): best fit against fragmentation gradient descent.

Job sizes come from generated traces (traingate.capacity.trace.generate, seed 0, 10,000 jobs) whose
small jobs ask for a fraction of one GPU (Weng et al. NSDI'22: most PAI jobs do) as well as 1-8
whole GPUs, and whose large (gang) jobs take a quarter or half of an 8-node pool; two mixes of
fractions: "halves and quarters" (0.25, 0.5, 0.75) and "tenths" (0.1 to 0.9, as a GPU-sharing
trace writes them in thousandths); and a trace of fractions only (0.3, 0.4, 0.6, 0.7; no whole-GPU
jobs). Each runs on a pool of NODES nodes x 8 GPUs, RUNS runs per placement (the same arrivals for
both). Reported: the share of the pool's GPUs left unallocated and fragmented (free, usable by no
job size of the trace) at 90%, 95% and 100% arrived demand, and the demand at which the first job
found no room. TRAINGATE_BENCH_FILL_NODES / _RUNS change the size.
"""
from __future__ import annotations

import os
import time

from traingate.capacity.fill import Placement, fill
from traingate.capacity.trace import TraceParams, generate

NODES = int(os.environ.get("TRAINGATE_BENCH_FILL_NODES", "100"))
RUNS = int(os.environ.get("TRAINGATE_BENCH_FILL_RUNS", "10"))
WHOLE = ((1, 0.20), (2, 0.08), (4, 0.06), (8, 0.06))  # the rest of the small jobs' sizes
MIXES = {
    "halves and quarters": ((0.25, 0.2), (0.5, 0.3), (0.75, 0.1)),
    "tenths": tuple((k / 10, 0.6 / 9) for k in range(1, 10)),
    "0.3, 0.4, 0.6, 0.7 only": ((0.3, 0.3), (0.4, 0.2), (0.6, 0.3), (0.7, 0.2)),
}


def main() -> str:
    lines = [
        f"| fractions | placement | unallocated at 90% / 95% / 100% | fragmented at 90% / 95% / 100% "
        f"| first job without room | CPU s per run ({NODES} nodes) |",
        "|---|---|---|---|---|---|",
    ]
    for mix, fractions in MIXES.items():
        only = mix.endswith("only")  # no whole-GPU or gang jobs: every GPU is shared
        rows = generate(
            TraceParams(
                n_jobs=10_000,
                capacity=64,
                gpus_per_node=8,
                small_sizes=fractions if only else fractions + WHOLE,
                large_fraction=0.0 if only else TraceParams.large_fraction,
            )
        )
        asks = [float(r["gpus"]) for r in rows]
        for placement in Placement:
            c0 = time.process_time()
            c = fill("p", NODES, 8, asks, placement, runs=RUNS, seed=0)
            cpu = (time.process_time() - c0) / RUNS
            u = " / ".join(f"{c.unallocated[i]:.2%}" for i in (89, 94, 99))
            f = " / ".join(f"{c.fragmented[i]:.2%}" for i in (89, 94, 99))
            lines.append(f"| {mix} | {placement} | {u} | {f} | {c.first_failure:.1%} arrived | {cpu:.2f} |")
            print(lines[-1], flush=True)
    return "\n".join(lines) + "\n"
