"""What training and inference both stand on: device and precision (precision), checkpoint
files (checkpoint), the scoring loop that validation and `zlm eval` share (eval_protocol),
metrics and their log (metrics), progress display (reporter; rich in rich_display, the
one library module that imports rich), the typed training options and configs (config) and
the run specification that config.json stores (spec).

May import: zlm.data, zlm.model, zlm.errors, zlm.version.
"""
