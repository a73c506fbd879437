"""Alert rules: pure functions from metric series to a firing (see :mod:`traingate.monitor.rules`)."""
