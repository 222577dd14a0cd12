"""`zlm.atomic.building`: a directory is replaced only once its new version is whole."""

from __future__ import annotations

import pytest

from zlm.atomic import building


def test_building_swaps_in_the_finished_directory(tmp_path):
    out = tmp_path / "deep" / "out"
    with building(out) as tmp:
        assert tmp.parent == out.parent and tmp.name.startswith(".out.tmp-") and not any(tmp.iterdir())
        (tmp / "a").write_text("new")
    assert (out / "a").read_text() == "new" and [p.name for p in out.parent.iterdir()] == ["out"]
    with building(out) as tmp:  # an existing directory is replaced whole
        (tmp / "b").write_text("newer")
    assert [p.name for p in out.iterdir()] == ["b"] and [p.name for p in out.parent.iterdir()] == ["out"]


def test_building_keeps_the_old_directory_when_the_block_fails(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "good").write_text("kept")
    with pytest.raises(KeyboardInterrupt), building(out) as tmp:
        (tmp / "half").write_text("written")
        raise KeyboardInterrupt
    assert [p.name for p in out.iterdir()] == ["good"] and [p.name for p in tmp_path.iterdir()] == ["out"]
