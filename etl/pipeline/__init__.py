"""Running lakeshard: the stage registry, the checks before Spark, the runner (lock,
ledger, progress, report) and what a run prints. Sits above the jobs it runs."""
