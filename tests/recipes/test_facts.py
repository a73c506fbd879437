"""A built-in recipe's facts (params, samples, model size) agree with its training code, without importing torch."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tgtest import PYTHON, ROOT, TINY_DIGITS
from traingate.ladder.preflight import check_spec
from traingate.recipes import get_recipe
from traingate.recipes.facts import recipe_facts
from traingate.spec import SpecError, load_spec_text

CHARGPT = TINY_DIGITS.replace(
    "recipe: {name: digits-cnn, params: {channels: 8, hidden: 32}}", "recipe: {name: char-gpt, params: {}}"
)


@pytest.mark.parametrize(
    ("text", "sets"),
    [
        (TINY_DIGITS, []),
        (TINY_DIGITS, ["recipe.params={channels: 3, hidden: 7}"]),
        (CHARGPT, ["recipe.params={max_chars: 3000}"]),
        (CHARGPT, ["recipe.params={max_chars: 500, n_layer: 3, n_embd: 24, n_head: 3, block_size: 9}"]),
    ],
    ids=["digits", "digits-small", "chargpt", "chargpt-3-layers"],
)
def test_tensor_sizes_are_the_built_models_parameters_and_samples_the_loaded_data(text, sets):
    spec = load_spec_text(text, sets)
    facts, recipe = recipe_facts(spec), get_recipe(spec)
    assert facts.tensor_sizes() == [p.numel() for p in recipe.build_model().parameters()]
    assert facts.check_data() == len(recipe.load_data()[0])
    assert facts.tokens_per_sample() == recipe.tokens_per_sample()


def test_a_model_too_large_for_memory_is_refused_by_its_counted_size():
    spec = load_spec_text(TINY_DIGITS, ["recipe.params={channels: 4, hidden: 100000000}"])
    with pytest.raises(SpecError, match=r"recipe.params = .*: the model has 1.39e\+10 parameters, .*make the model"):
        check_spec(spec)


def test_an_unknown_recipe_is_refused_in_one_line_naming_the_built_in_ones():
    spec = load_spec_text(TINY_DIGITS.replace("name: digits-cnn", "name: resnet"))
    with pytest.raises(SpecError, match=r"recipe.name = 'resnet': unknown recipe; use one of \['char-gpt', "):
        recipe_facts(spec)


def test_checking_a_built_in_recipes_spec_imports_no_torch():
    code = (
        "import json, sys\n"
        "from tgtest import TINY_DIGITS\n"
        "from traingate.ladder.preflight import check_spec\n"
        "from traingate.spec import load_spec_text\n"
        "check_spec(load_spec_text(TINY_DIGITS))\n"
        "check_spec(load_spec_text(TINY_DIGITS.replace('name: digits-cnn, params: {channels: 8, hidden: 32}', "
        "'name: char-gpt, params: {max_chars: 20000}')))\n"
        "print(json.dumps('torch' in sys.modules))\n"
    )
    p = subprocess.run(
        [PYTHON, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120, check=False
    )
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) is False


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT / 'tests'}{os.pathsep}{ROOT}"}
