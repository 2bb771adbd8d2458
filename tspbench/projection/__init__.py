"""Paper scale without the hardware: analytic model, fake-tensor estimator, cost model."""
