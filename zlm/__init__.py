"""zlm: character-level language modelling with zoneout LSTMs.

The library is generic and has no command-line dependencies: the Typer app lives in
`zlm.cli` (the repository's `cli/` folder) and the rich renderer in `zlm.core.rich_display`.
The layers, lowest first: data, model, core, training | inference, tools (docs/architecture.md).
"""

from zlm.version import __version__

__all__ = ["__version__", "load", "train"]


def __getattr__(name: str):
    """`zlm.load(path)` (zlm.inference.language_model.load) and `zlm.train(source, ...)`
    (zlm.training.runner.train), imported on first use so that `import zlm` stays free of torch."""
    if name == "load":
        from zlm.inference.language_model import load

        return load
    if name == "train":
        from zlm.training.runner import train

        return train
    raise AttributeError(f"module 'zlm' has no attribute {name!r}")
