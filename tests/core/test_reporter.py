"""The plain reporter's lines (zlm.core.reporter): what a piped `zlm train` prints."""

from __future__ import annotations

from zlm.core.reporter import PlainReporter


def test_the_summary_line_rounds_bpc_and_leaves_out_unset_values(capsys):
    PlainReporter().finish({"step": 625, "best_valid_bpc": 2.5990403894014262, "elapsed_s": 6.4,
                            "run": "runs/small", "overfit_at": 600, "interrupted": None})
    assert capsys.readouterr().out == "done: step 625 best_valid_bpc 2.5990 elapsed_s 6.4 run runs/small overfit_at 600\n"
