"""zlm: character-level language modelling with zoneout LSTMs.

The library is generic and has no command-line dependencies: the Typer app lives in
`zlm.cli` (the repository's `cli/` folder) and the rich renderer in `zlm.progress`.
"""

__version__ = "0.1.0"
