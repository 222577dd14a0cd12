"""`python -m zlm.cli ...`: the same app as the `zlm` command (for machines where the
console script is not on PATH)."""

from zlm.cli import app

app(prog_name="zlm")
