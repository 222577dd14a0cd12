"""scripts/speaker-names: a play's valid and test BPC divided among the name lines of speakers
train has, of speakers it lacks, and the rest (docs/results.md, tiny Shakespeare's test split)."""

from __future__ import annotations

import json
import random
import subprocess
import sys

from conftest import run_script, script_refusal, train_run, write_char_dataset
from zlm.core.config import TrainConfig
from zlm.data.dataset import Dataset
from zlm.model.lm import ModelConfig

WORDS = "thou art my lord and i shall go hence to the king with news of war".split()


def play(speakers: list[str], speeches: int, rng: random.Random) -> str:
    """Speeches after blank lines, each opened by "NAME:"; one verse line ends in a colon
    ("Hear me:"), which is no name line because no blank line comes before it."""
    out = ["so it goes.\n"]
    for i in range(speeches):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 9))).capitalize() for _ in range(2)]
        if i % 5 == 0:
            lines.insert(1, "Hear me:")
        out.append(f"\n{speakers[i % len(speakers)]}:\n" + "\n".join(lines) + "\n")
    return "".join(out)


def test_speaker_names_divides_each_split_among_seen_and_unseen_name_lines(tmp_path):
    rng = random.Random(0)
    parts = [play(["ALICE", "BOB", "Servant"], 150, rng),  # train
             play(["ALICE", "CAROL"], 20, rng),  # valid: CAROL is new
             play(["BOB", "DAVE", "First Lord"], 21, rng)]  # test: DAVE and First Lord are new
    text = "".join(parts)
    n = len(text)
    split = ((len(parts[0]) + 0.5) / n, len(parts[1]) / n, len(parts[2]) / n)  # cut exactly between the parts
    data = Dataset.open(write_char_dataset(tmp_path / "data", text, split))
    assert [data.tokenizer.decode(data.tokens(s)) for s in ("train", "valid", "test")] == parts
    run = tmp_path / "run"
    train_run(run, data, ModelConfig(vocab_size=data.vocab_size, hidden=16, embed=8),
              TrainConfig(batch_size=4, bptt=16, max_steps=10, eval_every=10, log_every=100, eval_streams=4))

    lines = run_script("speaker-names", run, "--streams", "4", timeout=300).splitlines()
    assert lines[0].endswith(": 3 speakers in train")
    rows = [[c.strip().replace(",", "").rstrip("%") for c in line.strip("|").split("|")]
            for line in lines if line.startswith("| valid") or line.startswith("| test")]
    assert [(r[0], r[2]) for r in rows] == [(s, p) for s in ("valid", "test")
                                            for p in ("other", "seen names", "unseen names")]
    for split, part_text, speeches, unseen in (("valid", parts[1], 20, {"CAROL": 10}),
                                                ("test", parts[2], 21, {"DAVE": 7, "First Lord": 7})):
        r = [row for row in rows if row[0] == split]
        (tmp_path / f"{split}.txt").write_text(part_text, encoding="utf-8")
        evaluated = subprocess.run([sys.executable, "-m", "zlm", "eval", str(run), "--file", str(tmp_path / f"{split}.txt"),
                                    "--batch-size", "4", "--json"], capture_output=True, text=True, timeout=300)
        assert evaluated.returncode == 0, evaluated.stderr
        bpc = json.loads(evaluated.stdout)["bpc"]
        assert abs(float(r[0][1]) - bpc) <= 0.0005  # the split's BPC is zlm eval's
        assert abs(sum(float(x[6]) for x in r) - bpc) <= 0.002  # the parts add up to it
        assert sum(int(x[3]) for x in r) == len(part_text)  # every character, once
        name_chars = {name: k * (len(name) + 2) for name, k in unseen.items()}  # "NAME:\n" per speech
        assert int(r[2][3]) == sum(name_chars.values())
        seen_lines = speeches - sum(unseen.values())
        assert int(r[1][3]) > 0 and seen_lines > 0
        listed = next(line for line in lines if line.startswith(f"{split}: "))
        assert listed == f"{split}: {len(unseen)} speakers not in train: " + ", ".join(
            f"{name} ({c})" for name, c in sorted(name_chars.items(), key=lambda kv: -kv[1]))


def test_speaker_names_refuses_a_text_that_is_no_play(tmp_path):
    data = Dataset.open(write_char_dataset(tmp_path / "data", "no speeches here, only prose.\n" * 300))
    run = tmp_path / "run"
    train_run(run, data, ModelConfig(vocab_size=data.vocab_size, hidden=16, embed=8),
              TrainConfig(batch_size=4, bptt=16, max_steps=2, eval_every=2, log_every=100, eval_streams=4))
    out, err = script_refusal("speaker-names", run)
    assert out == "" and "has no speaker lines" in err and len(err.strip().splitlines()) == 1
