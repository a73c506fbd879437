"""What is trained: model + data + loss + eval, registered by name.

A recipe is an object with the methods of :class:`Recipe`. Two built-in recipes
(``digits-cnn``, ``char-gpt``) live in the registry; ``script`` is not a recipe
object but a launch kind handled by the stage launcher (an unmodified command).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from traingate.spec import SpecError

if TYPE_CHECKING:
    from traingate.recipes.base import Recipe
    from traingate.spec import RunSpec

SCRIPT = "script"


def _registry() -> dict[str, type[Recipe]]:
    # Importing the package (for recipes.script, say) must not import torch: the Slurm batch step and the
    # supervisor read script metrics through it and never build a model.
    from traingate.recipes import chargpt, digits  # lazy: torch

    return {digits.DigitsCNN.name: digits.DigitsCNN, chargpt.CharGPT.name: chargpt.CharGPT}


def recipe_names() -> list[str]:
    return sorted([*_registry(), SCRIPT])


def get_recipe(spec: RunSpec) -> Recipe:
    """The recipe object for a spec, its params validated (raises SpecError)."""

    name = spec.recipe.name
    if name == SCRIPT:
        raise SpecError("recipe 'script' runs a command, not a built-in recipe; use traingate.recipes.script")
    cls = _registry().get(name)
    if cls is None:
        raise SpecError(f"recipe.name = {name!r}: unknown recipe; use one of {recipe_names()}")
    return cls(spec)


__all__ = ["get_recipe", "recipe_names", "SCRIPT"]
