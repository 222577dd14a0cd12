"""Tools built on training and inference: benchmarks (bench), learning curves (curves, plot),
comparing runs (compare), whole experiments (recipes, benchmark), zlm against everyday
compressors (compressors), inspecting a checkpoint (info) and this machine (environment).

May import every zlm layer below it; only the CLI imports tools.
"""
