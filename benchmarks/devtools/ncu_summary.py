"""Summarise an Nsight Compute raw CSV (`ncu -i X.ncu-rep --page raw --csv`): per kernel the
duration, DRAM throughput, occupancy, issue activity and the top warp-stall reasons.

    python -m benchmarks.devtools.ncu_summary decode_raw.csv
"""

from __future__ import annotations

import csv
import re
import sys

COLUMNS = [
    ("us", "gpu__time_duration.sum", 1e-3),
    ("dram%", "dram__throughput.avg.pct_of_peak_sustained_elapsed", 1),
    ("dramGB/s", "dram__bytes_read.sum.per_second", 1),
    ("dramMB", "dram__bytes_read.sum", 1),
    ("L2hit%", "lts__t_sector_hit_rate.pct", 1),
    ("occ%", "sm__warps_active.avg.pct_of_peak_sustained_active", 1),
    ("issue%", "smsp__issue_active.avg.pct_of_peak_sustained_active", 1),
    ("grid", "launch__grid_size", 1),
    ("regs", "launch__registers_per_thread", 1),
    ("smemB", "launch__shared_mem_per_block", 1),
    ("blk/SM", "launch__occupancy_limit_shared_mem", 1),
]
STALL = re.compile(
    r"smsp__average_warps?_\w*issue_stalled_(\w+?)_per_issue_active\.ratio$|smsp__pcsamp_warps_issue_stalled_(\w+)$"
)


def _num(v: str) -> float | None:
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return None


def main(path: str):
    with open(path) as f:
        rows = list(csv.reader(line for line in f if not line.startswith("==")))
    if len(rows) < 3:
        print(f"{path}: no kernels")
        return
    head, units, data = rows[0], rows[1], rows[2:]
    col = {h: i for i, h in enumerate(head)}
    name_i = col.get("Kernel Name", col.get("Function Name", 0))
    for r in data:
        name = r[name_i][:60]
        vals = []
        for label, metric, scale in COLUMNS:
            i = col.get(metric)
            v = _num(r[i]) if i is not None else None
            unit = units[i] if i is not None else ""
            if v is not None and metric.endswith("duration.sum") and unit == "usecond":
                scale = 1
            if v is not None and metric.endswith("per_second") and unit.startswith("Tbyte"):
                v, scale = v * 1000, 1
            vals.append(f"{label}={v * scale:.4g}" if v is not None else f"{label}=?")
        print(name, " ".join(vals))
        stalls = []
        for h, i in col.items():
            mt = STALL.match(h)
            if mt and (v := _num(r[i])) is not None and not h.endswith("_not_issued"):
                stalls.append((v, (mt.group(1) or mt.group(2)) + (" (samples)" if mt.group(2) else "")))
        stalls.sort(reverse=True)
        print("   stalls:", ", ".join(f"{s}={v:.3g}" for v, s in stalls[:8]))


if __name__ == "__main__":
    main(sys.argv[1])
