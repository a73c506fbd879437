"""The unit stage: training-code checks every recipe must pass before anything trains.

Run by the ladder as ``pytest <this file>`` with TRAINGATE_SPEC pointing at the
resolved spec. Each test is a property a broken model or loss would violate.
"""

from __future__ import annotations

import io
import os

import pytest
import torch
import yaml

from traingate.job import envvars
from traingate.recipes import get_recipe
from traingate.runtime import rng
from traingate.spec import parse_spec

BATCH = 4


@pytest.fixture(scope="module")
def recipe():
    path = os.environ.get(envvars.UNIT_SPEC)
    if not path:
        pytest.fail(f"{envvars.UNIT_SPEC} is not set: point it at a resolved spec file")
    with open(path) as f:
        spec = parse_spec(yaml.safe_load(f))
    return get_recipe(spec)


@pytest.fixture(scope="module")
def data(recipe):
    return recipe.load_data()


def _model(recipe, seed=0):
    rng.seed_all(seed)
    return recipe.build_model()


def test_same_seed_builds_identical_model_and_loss(recipe, data):
    train, _ = data
    batch = train.batch(range(BATCH))
    a, b = _model(recipe), _model(recipe)
    for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), f"parameter {na} differs between two builds with the same seed"
    a.eval(), b.eval()
    assert torch.equal(recipe.loss(a, batch), recipe.loss(b, batch))


def test_forward_backward_shapes_and_dtypes(recipe, data):
    train, _ = data
    batch = train.batch(range(BATCH))
    model = _model(recipe)
    loss = recipe.loss(model, batch)
    assert loss.dim() == 0, f"loss must be a scalar, got shape {tuple(loss.shape)}"
    assert loss.dtype.is_floating_point
    loss.backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.shape == p.shape and p.grad.dtype == p.dtype, name


def test_loss_is_finite(recipe, data):
    train, _ = data
    loss = recipe.loss(_model(recipe), train.batch(range(BATCH)))
    assert torch.isfinite(loss), f"initial loss is {loss.item()}"


def test_every_trainable_parameter_gets_a_nonzero_gradient(recipe, data):
    train, _ = data
    model = _model(recipe)
    recipe.loss(model, train.batch(range(min(len(train), 16)))).backward()
    dead = [
        n for n, p in model.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.abs().sum() > 0)
    ]
    assert not dead, f"parameters with no gradient (disconnected or dead): {dead}"


def test_loss_depends_on_the_model_outputs(recipe, data):
    # Zeroing every weight must change the loss: a loss computed from constants would not move.
    train, _ = data
    batch = train.batch(range(BATCH))
    model = _model(recipe)
    model.eval()
    before = recipe.loss(model, batch).item()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.0)
    assert recipe.loss(model, batch).item() != before


def test_one_optimizer_step_lowers_the_loss_on_its_batch(recipe, data):
    train, _ = data
    batch = train.batch(range(min(len(train), 16)))
    model = _model(recipe)
    model.eval()  # no dropout: compare like with like
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    before = recipe.loss(model, batch)
    before.backward()
    opt.step()
    with torch.no_grad():
        assert recipe.loss(model, batch).item() < before.item()


def test_save_load_round_trip_is_exact(recipe, data):
    train, _ = data
    batch = train.batch(range(BATCH))
    model = _model(recipe)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    other = _model(recipe, seed=123)
    other.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    model.eval(), other.eval()
    assert torch.equal(recipe.loss(model, batch), recipe.loss(other, batch))
