import torch
from torch import nn


class Classifier(nn.Module):
    def __init__(self, n_features: int):
        super().__init__()
        self.linear = nn.Linear(n_features, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).squeeze(-1)


def make_data(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = (torch.rand(n, generator=g) > 0.5).float()
    x = torch.randn(n, 4, generator=g) + (y[:, None] * 2 - 1) * 1.5
    return x, y
