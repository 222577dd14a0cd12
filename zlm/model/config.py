"""The model's configuration and the names of its cells, without torch.

`ModelConfig` is what config.json stores under "model"; `CELL_NAMES` are the values of
`--cell` and `KERNELS` the code a resolved choice runs (`zlm.model.cells.choose_cell`).
Reading them never imports torch, so `zlm info` and `--help` answer at once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from zlm.errors import UsageError

CELL_NAMES = ("auto", "fused", "reference", "plain")  # --cell
KERNELS = ("compiled", "python", "triton", "reference", "plain")  # what a resolved choice runs


@dataclass(frozen=True)
class ModelConfig:
    """Shape and regularisation of the model (stored in config.json)."""

    vocab_size: int = 0  # tokens; 0 only in presets, before the data is known
    hidden: int = 512  # units per LSTM layer
    layers: int = 1  # stacked zoneout LSTM layers
    embed: int = 128  # embedding width fed to the first layer
    zoneout_cell: float = 0.5  # z_c: probability a cell unit keeps its previous value
    zoneout_hidden: float = 0.05  # z_h: probability a hidden unit keeps its previous value
    dropout: float = 0.0  # non-recurrent dropout: embedding, between layers, before decoder

    def __post_init__(self):
        if self.vocab_size < 0:
            raise UsageError(f"vocab_size must be >= 1, got {self.vocab_size}")
        for name in ("hidden", "layers", "embed"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name} must be >= 1, got {getattr(self, name)}")
        for name in ("zoneout_cell", "zoneout_hidden", "dropout"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0:
                flag = "--" + name.replace("_", "-")
                raise UsageError(f"{flag} must be in [0, 1), got {v}")

    def to_dict(self) -> dict:
        return asdict(self)

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """The state_dict shapes of `ZoneoutLM(self)`, from the config alone: embedding, per
        layer torch.nn.LSTM's layout (gates i, f, g, o stacked) with one bias, decoder. What
        `zlm info` and loading check a checkpoint's tensors against without building a model
        (tests/cli/test_cli_startup.py holds it to the model)."""
        V, E, H = self.vocab_size, self.embed, self.hidden
        shapes: dict[str, tuple[int, ...]] = {"embedding.weight": (V, E)}
        for k in range(self.layers):
            shapes[f"layers.{k}.weight_ih"] = (4 * H, E if k == 0 else H)
            shapes[f"layers.{k}.weight_hh"] = (4 * H, H)
            shapes[f"layers.{k}.bias"] = (4 * H,)
        shapes["decoder.weight"] = (V, H)
        shapes["decoder.bias"] = (V,)
        return shapes
