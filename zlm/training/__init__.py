"""Training: one path from options to a run - `plan` (source + Options -> a frozen RunSpec,
with the defaults rule in `defaults`, its `speed_probe`, `--init-from` in `init_from` and
presets in `presets`), `runner` (train here or in N processes; `zlm.train`), and the
`Trainer` (trainer) with its window step (step); what `auto` resolved to (resolve), the run
directory's files (run_dir), everything that resumes (state), learning-rate schedules
(schedule), processes and parallelism applied from outside the model (distributed,
launch, graphs).

May import: zlm.core, zlm.model, zlm.data, zlm.errors, zlm.version. Never zlm.inference.
"""
