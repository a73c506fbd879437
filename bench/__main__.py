"""`make bench`: run every bench/bench_*.py (or the ones named: python -m bench ladder checkpoint).

Each module has ``main() -> str`` that measures against a baseline in the same invocation
and returns a markdown table; results are printed and written to .traingate/bench/<name>.md.
"""
from __future__ import annotations

import importlib
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str]) -> int:
    names = argv or sorted(p.stem.removeprefix("bench_") for p in HERE.glob("bench_*.py"))
    out_dir = Path(os.environ.get("TRAINGATE_STATE_DIR", ".traingate")) / "bench"
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        mod = importlib.import_module(f"bench.bench_{name}")
        print(f"\n## bench {name}", flush=True)
        t0 = time.perf_counter()
        table = mod.main()
        print(table)
        print(f"({name}: {time.perf_counter() - t0:.0f} s)", flush=True)
        (out_dir / f"{name}.md").write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
