"""Tools built on training and inference: benchmarks (bench), learning curves (curves, plot),
comparing runs (compare), whole experiments (recipes) and inspecting a checkpoint (info).

May import every zlm layer below it; only the CLI imports tools.
"""
