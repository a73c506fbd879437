"""char-gpt: a small decoder-only transformer, character level, on a text corpus given by URI.

The default corpus ships inside the package (an excerpt of the Python language
reference), so the recipe works offline on a fresh machine.
"""

from __future__ import annotations

import codecs
import hashlib
import math
from importlib import resources
from pathlib import Path
from typing import Any

import fsspec
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from traingate.places import check_local_data
from traingate.recipes.base import Recipe, TensorData, device_of
from traingate.redact import redact
from traingate.secrets import resolve
from traingate.spec import SpecError
from traingate.storage import storage_failure, storage_options

# char-gpt keeps the text, its ids and its windows in memory: ~40 bytes per character of corpus.
MAX_CORPUS_BYTES = 256 << 20


def default_corpus_uri() -> str:
    return Path(str(resources.files("traingate.recipes") / "corpus" / "python_reference.txt")).as_uri()


class CharGPTParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    block_size: int = Field(default=64, ge=2)
    n_layer: int = Field(default=2, ge=1)
    n_head: int = Field(default=4, ge=1)
    n_embd: int = Field(default=64, ge=1)
    dropout: float = Field(default=0.0, ge=0, lt=1)
    max_chars: int | None = Field(default=None, ge=2, description="use only the first N characters")


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


class CharGPT(Recipe):
    name = "char-gpt"
    Params = CharGPTParams
    params: CharGPTParams

    def __init__(self, spec):
        super().__init__(spec)

        if self.params.n_embd % self.params.n_head:
            raise SpecError(
                f"recipe.params.n_embd = {self.params.n_embd}: must be divisible by "
                f"n_head = {self.params.n_head}; change one of them"
            )
        self._text: str | None = None

    def data_uri(self) -> str:
        return self.spec.data.uri or default_corpus_uri()

    def _read(self) -> str:
        if self._text is None:
            uri = self.data_uri()
            shown = redact(uri)
            real = resolve(uri, field="data.uri")
            # A UTF-8 character is at most 4 bytes: with max_chars, only the prefix that holds them is read.
            limit = 4 * self.params.max_chars if self.params.max_chars else None
            try:
                fs, path = fsspec.core.url_to_fs(real, **storage_options(real))
                if real.startswith("file:") or "://" not in real:
                    check_local_data("data.uri", shown, path, dir_ok=False)
                info = fs.info(path)
                if info["type"] == "directory":
                    raise SpecError(
                        f"data.uri = {shown!r}: is a directory; char-gpt reads one UTF-8 text file, "
                        "point data.uri at it"
                    )
                if info["type"] != "file":
                    raise SpecError(
                        f"data.uri = {shown!r}: is not a regular file ({info['type']}), so it cannot be read to "
                        "its end; point data.uri at a UTF-8 text file"
                    )
                size = int(info.get("size") or 0)
                if limit is None and size > MAX_CORPUS_BYTES:
                    raise SpecError(
                        f"data.uri = {shown!r}: is {size / 2**20:.0f} MiB; char-gpt holds its corpus in memory "
                        f"(~40 bytes per character) and takes at most {MAX_CORPUS_BYTES >> 20} MiB; set "
                        "recipe.params.max_chars to train on a prefix, or use a smaller corpus"
                    )
                raw = fs.cat_file(path, start=0, end=limit) if limit is not None else fs.cat_file(path)
            except FileNotFoundError:
                raise SpecError(
                    f"data.uri = {shown!r}: corpus file not found; point data.uri at a UTF-8 text file"
                ) from None
            except Exception as e:  # noqa: BLE001 - storage errors become one line; anything else is re-raised
                why = storage_failure(e)
                if why is None:
                    raise
                raise SpecError(f"data.uri = {shown!r}: {why}") from None
            try:
                # Universal newlines, as text-mode reading gave: the corpus (and its hash) is unchanged.
                whole = limit is None or len(raw) < limit
                # A prefix may end inside a character: the incremental decoder keeps that tail out.
                text = codecs.getincrementaldecoder("utf-8")().decode(raw, final=whole)
                text = text.replace("\r\n", "\n").replace("\r", "\n")
            except UnicodeDecodeError as e:
                raise SpecError(
                    f"data.uri = {shown!r}: not UTF-8 text (byte {e.start} is {raw[e.start]:#04x}); "
                    "char-gpt trains on a text corpus, point data.uri at a UTF-8 text file"
                ) from None
            if "\x00" in text:
                raise SpecError(
                    f"data.uri = {shown!r}: holds NUL bytes, so it is binary, not a text corpus; point "
                    "data.uri at a UTF-8 text file"
                )
            if self.params.max_chars:
                text = text[: self.params.max_chars]
            self._text = text
        return self._text

    def data_snapshot(self) -> str:
        return hashlib.sha256(self._read().encode()).hexdigest()

    def _windows(self) -> int:
        return (len(self._read()) - 1) // self.params.block_size

    def check_data(self) -> int:
        n = self._windows()
        n_val = max(1, int(round(n * self.spec.data.val_fraction)))
        if n - n_val < 1:
            raise SpecError(
                f"data.uri = {self.data_uri()!r}: corpus has {len(self._read())} chars, too few for "
                f"block_size {self.params.block_size}; use a larger corpus or a smaller block_size"
            )
        return n - n_val

    def vocab(self) -> list[str]:
        return sorted(set(self._read()))

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

    def tokens_per_sample(self) -> int:
        return self.params.block_size

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
