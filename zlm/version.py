"""The zlm version: a leaf module that anything may import (checkpoints and datasets record it)."""

__version__ = "0.1.0"
