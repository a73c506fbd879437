"""Fit y = 3x - 1 with a linear layer. Written the way a lot of research code is, knowing nothing of
traingate: argparse, its own log format, torch.save of a dict every --save-every steps, --resume PATH."""
import argparse
import os
import time

import torch


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--steps-per-epoch", type=int, default=20)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--out", required=True, help="where checkpoints go")
    p.add_argument("--resume", default=None, help="a checkpoint to continue from")
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--data", default="data/points.csv")
    args = p.parse_args()

    torch.manual_seed(0)
    x = torch.tensor([[float(v)] for v in open(args.data).read().split()])
    y = 3 * x - 1
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    start = 0
    if args.resume:
        state = torch.load(args.resume)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"]
        print(f"=> resumed from {args.resume} (step {start})", flush=True)
    os.makedirs(args.out, exist_ok=True)
    for step in range(start + 1, args.steps + 1):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        epoch = (step - 1) // args.steps_per_epoch + 1
        print(f"epoch {epoch} step {step} | loss {loss.item():.4f}", flush=True)
        if step % args.save_every == 0 or step == args.steps:
            tmp = os.path.join(args.out, "last.pt.tmp")
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, tmp)
            os.replace(tmp, os.path.join(args.out, "last.pt"))
        time.sleep(args.sleep)
    print("done", flush=True)


if __name__ == "__main__":
    main()
