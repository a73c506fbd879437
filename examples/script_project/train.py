"""An ordinary training script that knows nothing about traingate.

It trains a logistic-regression classifier on a synthetic two-blob dataset and
prints one line per step. If MLflow's standard variables are set it logs there too
(traingate sets MLFLOW_TRACKING_URI and MLFLOW_RUN_ID, so this lands in the stage's run).
"""
import argparse
import os

import torch

from model import Classifier, make_data


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    torch.manual_seed(args.seed)
    x, y = make_data(512, seed=args.seed)
    model = Classifier(x.shape[1])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    run = None
    if os.environ.get("MLFLOW_RUN_ID"):
        import mlflow

        run = mlflow.start_run(run_id=os.environ["MLFLOW_RUN_ID"])
    for step in range(1, args.steps + 1):
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        acc = ((model(x) > 0).float() == y).float().mean().item()
        print(f"step {step} loss {loss.item():.6f} acc {acc:.4f}", flush=True)
        if run is not None and step % 10 == 0:
            import mlflow

            mlflow.log_metrics({"script_loss": loss.item(), "script_acc": acc}, step=step)
    if run is not None:
        import mlflow

        mlflow.end_run()


if __name__ == "__main__":
    main()
