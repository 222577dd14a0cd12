"""Training: typed config and presets (config, presets), the Trainer and its step (trainer),
what `auto` resolved to, stored once (resolve), the run directory's files (run_dir),
everything that resumes (state), learning-rate schedules (schedule), processes and
parallelism applied from outside the model (distributed, launch, graphs), and `zlm train`
end to end (runner).

May import: zlm.core, zlm.model, zlm.data, zlm.errors, zlm.version. Never zlm.inference.
"""
