"""What a built-in recipe's spec means, without its training code: params, data, model size.

Each built-in recipe is two classes: its facts here (the ``Params`` it takes, where its data is and how
many training samples it holds, how many weights its model has) and its training code (``digits.py``,
``chargpt.py``: torch) that extends them. Validating a spec (``traingate validate``, the CLI before
``run``, a sweep's space) reads the facts alone, so the process that orchestrates imports no torch;
tests/recipes holds :meth:`RecipeFacts.tensor_sizes` equal to the built model's parameters.
"""

from __future__ import annotations

import codecs
import hashlib
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import fsspec
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from traingate.places import check_local_data
from traingate.recipes import SCRIPT
from traingate.redact import redact
from traingate.secrets import resolve
from traingate.spec import SpecError
from traingate.specbase import bool_for_number
from traingate.storage import storage_failure, storage_options

if TYPE_CHECKING:
    from traingate.spec import RunSpec


class RecipeFacts:
    """A built-in recipe's spec facts. Subclasses set ``name`` and ``Params``."""

    name: ClassVar[str]
    Params: ClassVar[type[BaseModel]]

    def __init__(self, spec: RunSpec):
        self.spec = spec
        for key, value in spec.recipe.params.items():
            field = self.Params.model_fields.get(key)
            why = bool_for_number(field.annotation, value) if field is not None else None
            if why:  # pydantic would take true/false as 1/0
                raise SpecError(f"recipe.params.{key} = {value!r}: {why}")
        try:
            self.params = self.Params.model_validate(spec.recipe.params)
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(p) for p in err["loc"])
            raise SpecError(
                f"recipe.params.{loc} = {err.get('input')!r}: {err['msg']} "
                f"(recipe {self.name!r} takes {sorted(self.Params.model_fields)})"
            ) from None

    def data_uri(self) -> str:
        """Where the data comes from (recorded with the run)."""
        raise NotImplementedError

    def check_data(self) -> int:
        """Cheaply confirm the data exists; return the number of training samples. Raises SpecError."""
        raise NotImplementedError

    def tensor_sizes(self) -> list[int]:
        """The element count of each of the model's parameter tensors, as ``build_model`` makes them."""
        raise NotImplementedError

    def tokens_per_sample(self) -> int:
        return 1


DIGITS_URI = "sklearn://load_digits"
DIGITS_SAMPLES = 1797  # scikit-learn's bundled digits: 8x8 images, 10 classes


class DigitsParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    channels: int = Field(default=16, ge=1)
    hidden: int = Field(default=64, ge=1)
    dropout: float = Field(default=0.1, ge=0, lt=1)


class DigitsFacts(RecipeFacts):
    name = "digits-cnn"
    Params = DigitsParams
    params: DigitsParams

    def data_uri(self) -> str:
        return self.spec.data.uri or DIGITS_URI

    def check_data(self) -> int:
        if self.data_uri() != DIGITS_URI:
            raise SpecError(f"data.uri = {self.spec.data.uri!r}: digits-cnn reads only {DIGITS_URI}; remove data.uri")
        return DIGITS_SAMPLES - max(1, int(round(DIGITS_SAMPLES * self.spec.data.val_fraction)))

    def tensor_sizes(self) -> list[int]:
        c, h = self.params.channels, self.params.hidden
        # conv1 (1 -> c, 3x3), conv2 (c -> 2c, 3x3), fc1 (2c x 4 x 4 -> h), fc2 (h -> 10): weight, bias each.
        return [c * 9, c, 2 * c * c * 9, 2 * c, 2 * c * 16 * h, h, h * 10, 10]


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


class CharGPTFacts(RecipeFacts):
    name = "char-gpt"
    Params = CharGPTParams
    params: CharGPTParams

    def __init__(self, spec: RunSpec):
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

    def tensor_sizes(self) -> list[int]:
        e, v = self.params.n_embd, len(self.vocab())
        # Per block: ln1 (2), attention in-projection (3e x e, 3e) and out-projection (e x e, e), ln2 (2),
        # MLP (e -> 4e -> e): weight, bias each.
        block = [e, e, 3 * e * e, 3 * e, e * e, e, e, e, 4 * e * e, 4 * e, 4 * e * e, e]
        # Token and position embeddings, the blocks, the final norm (2), the head (no bias).
        return [v * e, self.params.block_size * e, *block * self.params.n_layer, e, e, e * v]

    def tokens_per_sample(self) -> int:
        return self.params.block_size


# Every built-in recipe by name: its facts; the training code extending them is looked up only to train.
FACTS: dict[str, type[RecipeFacts]] = {DigitsFacts.name: DigitsFacts, CharGPTFacts.name: CharGPTFacts}


def recipe_facts(spec: RunSpec) -> RecipeFacts:
    """A built-in recipe's facts for a spec, its params validated (raises SpecError); no training code imported."""
    facts = FACTS.get(spec.recipe.name)
    if facts is None:
        raise SpecError(f"recipe.name = {spec.recipe.name!r}: unknown recipe; use one of {sorted([*FACTS, SCRIPT])}")
    return facts(spec)
