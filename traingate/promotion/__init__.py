"""Promotion: which model a registered name's aliases point at.

- :mod:`~traingate.promotion.aliases`: model names, and aliases moved by compare-and-set under one lock.
- :mod:`~traingate.promotion.register`: the full stage's final model registered as ``candidate``.
- :mod:`~traingate.promotion.champion`: champion/challenger, the retrain's ``champion`` alias.
"""
