#!/usr/bin/env python3
"""Counts steps, saves state.json every 10 steps and evaluates there: 'eval step N val_loss X', X falling as
1/N. --resume continues from state.json. It knows nothing of traingate."""
import argparse
import json
import os
import time


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--resume", action="store_true")
    args = p.parse_args()
    path = os.path.join(args.out, "state.json")
    step = 0
    if args.resume and os.path.exists(path):
        with open(path) as f:
            step = json.load(f)["step"]
        print(f"resumed at step {step}", flush=True)
    while step < args.steps:
        step += 1
        time.sleep(0.03)
        print(f"train step {step}", flush=True)
        if step % 10 == 0:
            print(f"eval step {step} val_loss {1.0 / step:.6f}", flush=True)
            with open(path + ".tmp", "w") as f:
                json.dump({"step": step}, f)
            os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
