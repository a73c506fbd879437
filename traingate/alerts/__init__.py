"""Alert rules: pure functions from metric series to a firing, and the `alerts:` spec section they read.

- :mod:`traingate.alerts.rules` — the rules, their spec section (the RunSpec's ``alerts``), ``evaluate``.

It imports only :mod:`traingate.specbase`: the RunSpec, the training process (its loss-spike guard),
the StageJob (the checkpoint interval), the supervisor and the live view all read it.
"""
