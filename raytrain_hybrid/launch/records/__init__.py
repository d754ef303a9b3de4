"""The run's records: its run directory's files (metrics.jsonl, summary.json, driver.log,
TensorBoard), the progress events and what the driver shows of them, the output directory's
lease, MLflow / W&B tracking. Imports launch.plan at most, never launch.runtime."""
