"""The constants that zlm's C++ kernels and the Python code around them share, defined once.

`zlm.model.cells.cpu_ext` passes `CONSTANTS` to the compiler as -D defines
(`compiler_defines`: ZLM_DECODER_TILE, ...), and csrc/kernels.h stops the build with
#error where one is missing, so the C++ never carries its own copy. Python reads them here,
without the extension: `zlm.model.cells.decoder_tiles` packs the Decoder's weights in its tile
layout, and `zlm.model.cells.masks.mix_words`, the torch expression of the mix16 mask
draw that runs where the extension does not (no compiler, CUDA), computes the same
splitmix64 words as csrc/mask_draw.cpp.
"""

from __future__ import annotations

# The Decoder (csrc/decoder.cpp): a weight (K, N) is packed as ceil(N / TILE)
# contiguous (K, TILE) tiles; a gate matrix's tile holds the pre-activations i, f, g, o of
# DECODER_UNITS hidden units side by side, so one thread finishes their step alone.
DECODER_TILE = 32
DECODER_UNITS = 8

# The mix16 zoneout mask draw (csrc/mask_draw.cpp, masks.py): MASK_BITS random bits per
# element, so a 64-bit splitmix64 word gives 64 // MASK_BITS elements.
MASK_BITS = 16
# splitmix64: state_i = seed + i * GAMMA; z = state_i; z = (z ^ z >> s1) * m1;
# z = (z ^ z >> s2) * m2; word = z ^ z >> s3, in 64-bit unsigned arithmetic.
SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
SPLITMIX_MIX = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)  # m1, m2
SPLITMIX_SHIFTS = (30, 27, 31)  # s1, s2, s3

assert DECODER_TILE == 4 * DECODER_UNITS, "a tile holds the four gates of its units"

CONSTANTS: dict[str, int] = {
    "DECODER_TILE": DECODER_TILE,
    "DECODER_UNITS": DECODER_UNITS,
    "MASK_BITS": MASK_BITS,
    "SPLITMIX_GAMMA": SPLITMIX_GAMMA,
    "SPLITMIX_MIX1": SPLITMIX_MIX[0],
    "SPLITMIX_MIX2": SPLITMIX_MIX[1],
    "SPLITMIX_SHIFT1": SPLITMIX_SHIFTS[0],
    "SPLITMIX_SHIFT2": SPLITMIX_SHIFTS[1],
    "SPLITMIX_SHIFT3": SPLITMIX_SHIFTS[2],
}


def compiler_defines() -> list[str]:
    """`CONSTANTS` as compiler flags: -DZLM_<NAME>=<value>, 64-bit values as unsigned hex."""
    return [f"-DZLM_{name}={value:#x}ull" if value >= 2**31 else f"-DZLM_{name}={value}"
            for name, value in CONSTANTS.items()]
