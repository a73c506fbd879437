"""Dated corpus snapshots and a tiny char-gpt spec for the retrain tests."""
from __future__ import annotations

import random
from pathlib import Path

WORDS = ["the", "model", "trains", "on", "newest", "data", "and", "only", "a", "better", "one", "wins",
         "champion", "challenger", "snapshot", "quick", "brown", "fox", "jumps", "over", "lazy", "dog"]


def corpus(seed: int, n_words: int = 700) -> str:
    """Text over one fixed character set (every word appears first), so every snapshot has the same vocabulary."""
    rng = random.Random(seed)
    words = WORDS + [rng.choice(WORDS) for _ in range(n_words)]
    lines = [" ".join(words[i:i + 9]) for i in range(0, len(words), 9)]
    return "\n".join(lines) + "\n"


def publish(root: Path, version: str, seed: int, name: str = "input.txt") -> Path:
    d = root / version
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text(corpus(seed))
    return d / name


def tiny_chargpt(data_uri: str, experiment: str = "retrain-tests") -> str:
    return f"""
identity: {{experiment: {experiment}, owner: tester, team: platform, purpose: exercise scheduled retraining in tests}}
recipe: {{name: char-gpt, params: {{n_layer: 1, n_embd: 16, n_head: 2, block_size: 16}}}}
data: {{uri: "{data_uri}", val_fraction: 0.2}}
optim: {{lr: 0.01, batch_size: 8, seed: 0, schedule: constant}}
resources: {{work_pool: cpu-local, procs_per_node: 1}}
stages:
  smoke: {{max_steps: 2, max_samples: 64}}
  canary: {{max_steps: 12}}
  full: {{max_steps: 40}}
checkpoint: {{every_steps: 50, async_save: false}}
tracking: {{log_every: 10}}
"""
