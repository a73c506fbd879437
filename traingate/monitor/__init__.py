"""The live view of a stage: the alert rules (:mod:`traingate.alerts`) evaluated as it runs, the watch
dashboard, the rules' inputs read back from a run, and notifications."""
