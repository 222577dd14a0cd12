"""Inference: a checkpoint loaded into a ready model (load), `zlm eval` (evaluate) and its
`--dynamic` evaluation (dynamic), `zlm sample` (sample), per-token and per-character code
lengths (codelength), `zlm score` (score), `zlm compress` (rangecoder: the coder; symbols:
text <-> symbols with escapes; modelcoder: the shared encoder/decoder loop; compress: the
.zlmz container), `zlm export` (export), and the Python API `zlm.load` (language_model).

May import: zlm.core, zlm.model, zlm.data, zlm.errors, zlm.version, zlm.atomic. Never zlm.training.
"""
