"""char-gpt: a small decoder-only transformer, character level, on a text corpus given by URI.

The default corpus ships inside the package (an excerpt of the Python language
reference), so the recipe works offline on a fresh machine.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from traingate.recipes.base import Recipe, TensorData, device_of
from traingate.recipes.facts import CharGPTFacts, CharGPTParams


class Block(nn.Module):
    def __init__(self, p: CharGPTParams):
        super().__init__()
        self.ln1 = nn.LayerNorm(p.n_embd)
        self.attn = nn.MultiheadAttention(p.n_embd, p.n_head, dropout=p.dropout, batch_first=True)
        self.ln2 = nn.LayerNorm(p.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(p.n_embd, 4 * p.n_embd), nn.GELU(), nn.Linear(4 * p.n_embd, p.n_embd), nn.Dropout(p.dropout)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    mask: torch.Tensor  # a buffer (register_buffer): moves with the module, not a parameter

    def __init__(self, p: CharGPTParams, vocab_size: int):
        super().__init__()
        self.block_size = p.block_size
        self.tok = nn.Embedding(vocab_size, p.n_embd)
        self.pos = nn.Embedding(p.block_size, p.n_embd)
        self.blocks = nn.ModuleList(Block(p) for _ in range(p.n_layer))
        self.ln_f = nn.LayerNorm(p.n_embd)
        self.head = nn.Linear(p.n_embd, vocab_size, bias=False)
        mask = torch.triu(torch.full((p.block_size, p.block_size), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for b in self.blocks:
            x = b(x, self.mask[:t, :t])
        return self.head(self.ln_f(x))


class CharGPT(CharGPTFacts, Recipe):
    def load_data(self) -> tuple[TensorData, TensorData]:
        text = self._read()
        stoi = {c: i for i, c in enumerate(self.vocab())}
        ids = torch.tensor([stoi[c] for c in text], dtype=torch.long)
        bs = self.params.block_size
        n = self._windows()
        windows = ids[: n * bs + 1].unfold(0, bs + 1, bs)  # non-overlapping (bs+1)-windows sharing one char
        n_val = max(1, int(round(n * self.spec.data.val_fraction)))
        train, val = windows[: n - n_val], windows[n - n_val :]
        return TensorData((train[:, :-1].contiguous(), train[:, 1:].contiguous())), TensorData(
            (val[:, :-1].contiguous(), val[:, 1:].contiguous())
        )

    def build_model(self) -> nn.Module:
        return GPT(self.params, len(self.vocab()))

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, y = batch
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    @torch.no_grad()
    def evaluate(self, model: nn.Module, data: TensorData, batch_size: int) -> dict[str, Any]:
        total, count = 0.0, 0
        for start in range(0, len(data), batch_size):
            x, y = data.batch(range(start, min(start + batch_size, len(data))), device_of(model))
            logits = model(x)
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum").item()
            count += y.numel()
        val_loss = total / count
        return {"val_loss": val_loss, "val_bits_per_char": val_loss / math.log(2), "sample": self.sample(model, 120)}

    @torch.no_grad()
    def sample(self, model: nn.Module, n: int, seed: int = 0) -> str:
        vocab = self.vocab()
        g = torch.Generator().manual_seed(seed)
        idx = torch.zeros(1, 1, dtype=torch.long, device=device_of(model))
        for _ in range(n):
            logits = model(idx[:, -self.params.block_size :])[:, -1]
            # Drawn on the CPU with a CPU generator: the same sample on every device.
            nxt = torch.multinomial(F.softmax(logits, -1).cpu(), 1, generator=g).to(idx.device)
            idx = torch.cat([idx, nxt], 1)
        return "".join(vocab[i] for i in idx[0].tolist())
