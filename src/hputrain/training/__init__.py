"""The training loop and what it calls: trainer.py (the loop, top to bottom), evaluation.py
(evaluate and predict), intervals.py (when to log, evaluate and save; the best checkpoint),
loss.py (the token mean of the global batch), optim.py (AdamW and the schedule), metrics.py
(ready-made compute_metrics), telemetry.py (throughput and FLOPs), signals.py (SIGINT and SIGTERM noted for the ranks'
agreement), report.py (plots of a run)."""
