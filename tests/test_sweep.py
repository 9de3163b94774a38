"""mpi_scripts/sweep.py's grid expansion: seeds, schedule options, the learning-rate search and
its choice, on hand-written grids (no training)."""
import argparse
import json
import math
import os

import pytest

from mpi_scripts import sweep

NO_OVERRIDES = argparse.Namespace(models=None, workers=None, epochs=None, output=None, data=None, methods=None)


def grid_of(tmp_path, text):
    path = tmp_path / "g.yaml"
    path.write_text(text)
    return sweep.load_grid(str(path), NO_OVERRIDES)


GRID = """
workers: [4]
epochs: 30
seeds: [1, 2, 3]
schedule: {anneal: 4, early_stop: 3, warmup_steps: 29}
lr_search: {values: [5, 10, 20], epochs: 2}
methods:
  - spec: none
  - spec: topk:density=0.01
  - spec: sbc:density=0.01
    seeds: [1]
  - spec: qsgd:levels=4
    lr: 7.5
"""


def test_seeds_are_seed_major_and_methods_may_list_their_own(tmp_path):
    cells = sweep.cells_of(grid_of(tmp_path, GRID))
    assert [c.name for c in cells] == [
        "small-np4-none-seed1", "small-np4-topk_density_0.01-seed1",
        "small-np4-sbc_density_0.01-seed1", "small-np4-qsgd_levels_4-seed1",
        "small-np4-none-seed2", "small-np4-topk_density_0.01-seed2", "small-np4-qsgd_levels_4-seed2",
        "small-np4-none-seed3", "small-np4-topk_density_0.01-seed3", "small-np4-qsgd_levels_4-seed3"]
    first = cells[0]
    assert first.args[:6] == ["--anneal", "4", "--early-stop", "3", "--warmup-steps", "29"]
    assert first.args[-2:] == ["--seed", "1"] and cells[4].args[-2:] == ["--seed", "2"]
    assert first.lr is None and cells[3].lr == 7.5     # searched vs the method's own value
    assert first.epochs == 30


def test_single_seed_grid_keeps_the_old_cell_names(tmp_path):
    cells = sweep.cells_of(grid_of(tmp_path, "workers: [2]\nseed: 5\nlr: 10\nmethods:\n  - spec: none\n"))
    assert [c.name for c in cells] == ["small-np2-none"]
    assert cells[0].args == ["--seed", "5"] and cells[0].lr == 10.0


def test_search_cells_cover_every_searched_method_and_value(tmp_path):
    search = sweep.search_cells_of(grid_of(tmp_path, GRID))
    assert [c.name for c in search] == [f"small-np4-{m}-lr{v}" for m in ("none", "topk_density_0.01", "sbc_density_0.01")
                                        for v in (5, 10, 20)]
    assert {c.epochs for c in search} == {2} and all(c.args[-2:] == ["--seed", "1"] for c in search)


def fake_result(root, name, best):
    os.makedirs(root / "search" / name)
    (root / "search" / name / "results.json").write_text(json.dumps({"best_val_ppl": best}))


def test_choose_lr_takes_the_lowest_validation_perplexity_and_skips_incomplete_searches(tmp_path):
    grid = grid_of(tmp_path, GRID)
    search = sweep.search_cells_of(grid)
    for lr, best in (("5", 400.0), ("10", 310.0), ("20", math.inf)):      # 20 diverged
        fake_result(tmp_path, f"small-np4-none-lr{lr}", best)
    fake_result(tmp_path, "small-np4-topk_density_0.01-lr5", 500.0)       # 10 and 20 not run yet
    for lr in ("5", "10", "20"):                                            # every value failed
        os.makedirs(tmp_path / "search" / f"small-np4-sbc_density_0.01-lr{lr}")
        (tmp_path / "search" / f"small-np4-sbc_density_0.01-lr{lr}" / "failed").touch()
    chosen = sweep.choose_lr(str(tmp_path), search)
    assert chosen["small-np4-none"]["chosen"] == 10.0
    assert chosen["small-np4-none"]["values"]["5"] == 400.0
    assert "small-np4-topk_density_0.01" not in chosen
    assert chosen["small-np4-sbc_density_0.01"]["chosen"] is None
    cells = sweep.cells_of(grid)
    sweep.resolve_lr(cells, chosen)
    assert [c.lr for c in cells if c.spec == "none"] == [10.0, 10.0, 10.0]
    assert all(c.lr is None for c in cells if c.spec.startswith(("topk", "sbc")))
    with pytest.raises(ValueError, match="lr search first"):
        next(c for c in cells if c.spec.startswith("topk")).command("x", None)


@pytest.mark.parametrize("text, match", [
    ("methods:\n  - spec: none\n    seeds: [1]\n", "grid 'seeds"),
    ("seeds: []\nmethods:\n  - spec: none\n", "non-empty list"),
    ("schedule: {patience: 3}\nmethods:\n  - spec: none\n", "unknown schedule key"),
    ("lr_search: {values: [0]}\nmethods:\n  - spec: none\n", "positive numbers"),
    ("lr_search: [5, 10]\nmethods:\n  - spec: none\n", "lr_search must be a mapping"),
    ("methods:\n  - spec: none\n    lrs: 3\n", "each method must be"),
])
def test_bad_grids_name_the_fix(tmp_path, text, match):
    with pytest.raises(ValueError, match=match):
        grid_of(tmp_path, text)
