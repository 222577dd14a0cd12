"""Inference: a checkpoint loaded into a ready model (load), `zlm eval` (evaluate), `zlm sample`
(sample), per-token and per-character code lengths (codelength), `zlm score` (score),
`zlm export` (export), and the Python API `zlm.load` (api).

May import: zlm.core, zlm.model, zlm.data, zlm.errors, zlm.version. Never zlm.training.
"""
