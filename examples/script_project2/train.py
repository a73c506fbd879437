#!/usr/bin/env python3
"""A dependency-free trainer (plain Python SGD on a 2-feature regression) with its own JSON-lines log and
checkpoint files ckpt_000040.pt (JSON inside, whatever the suffix says); --resume-from-latest picks the
highest-numbered one in --ckpt-dir. It has never heard of traingate."""
import argparse
import glob
import json
import os
import random
import sys
import time


def latest(ckpt_dir):
    files = sorted(glob.glob(os.path.join(ckpt_dir, "ckpt_*.pt")))
    return files[-1] if files else None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--resume-from-latest", action="store_true")
    p.add_argument("--max-steps", type=int, default=80)
    p.add_argument("--ckpt-interval", type=int, default=20)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--data", default="data.csv")
    args = p.parse_args()

    rows = [tuple(map(float, line.split(","))) for line in open(args.data) if line.strip()]
    w, b, step = [0.0, 0.0], 0.0, 0
    rng = random.Random(0)
    if args.resume_from_latest and (path := latest(args.ckpt_dir)):
        with open(path) as f:
            state = json.load(f)
        w, b, step = state["w"], state["b"], state["step"]
        rng.setstate((state["rng"][0], tuple(state["rng"][1]), state["rng"][2]))
        sys.stderr.write(f"resuming from {path} at step {step}\n")
    os.makedirs(args.ckpt_dir, exist_ok=True)
    while step < args.max_steps:
        x1, x2, y = rows[rng.randrange(len(rows))]
        err = w[0] * x1 + w[1] * x2 + b - y
        w = [w[0] - 0.05 * err * x1, w[1] - 0.05 * err * x2]
        b -= 0.05 * err
        step += 1
        print(json.dumps({"step": step, "loss": round(err * err, 6), "time": round(time.time(), 3)}), flush=True)
        if step % args.ckpt_interval == 0:
            path = os.path.join(args.ckpt_dir, f"ckpt_{step:06d}.pt")
            with open(path + ".tmp", "w") as f:
                json.dump({"w": w, "b": b, "step": step, "rng": rng.getstate()}, f)
            os.replace(path + ".tmp", path)
            for old in sorted(glob.glob(os.path.join(args.ckpt_dir, "ckpt_*.pt")))[:-args.keep]:
                os.remove(old)
        time.sleep(args.sleep)


if __name__ == "__main__":
    main()
