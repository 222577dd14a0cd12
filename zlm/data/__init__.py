"""Data: text in, token arrays out.

Owns reading text (textio), tokenizers, the corpus catalog, `zlm prepare` (prepare, passes),
opening a prepared DATA_DIR (dataset), cutting it into training streams (streams), and the
pinned benchmark corpora built from Debian packages (benchmark_corpora, sword).
May import: zlm.errors, zlm.version. Only streams (batches as tensors) imports torch;
preparing a corpus does not need it.
"""
