"""`areal-jax plan`: the inference:training device split, from the measured speed of a short calibration run.

`calibration.py` reads a finished run directory into per-role rates and per-step overheads,
`step_model.py` predicts the step time of an arrangement from them, `plan.py` combines calibrations
for a config into the table of every split and the recommendation.
"""
