"""benchmarks/adaptive_lm.py without running a cell: each contender's train_lm.py arguments (the
same schedule for everyone, the warm-up fraction as freeze_step), its launch environment, and the
table built from finished cells (bytes per step over the whole run, ratio to Adam, seeds)."""
import argparse
import json
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import adaptive_lm  # noqa: E402


def settings(tmp_path, **kw):
    a = argparse.Namespace(output=str(tmp_path), rates=["local"], contenders=adaptive_lm.CONTENDERS, seeds=[1, 2],
                           np=4, steps=200, epochs=2, epoch_steps=100, batch_size=32, lr=1e-3, lr_warmup=20, clip=0.25,
                           warmup_fraction=0.15, zeroone_args="", data="corpus.txt", python="python",
                           netem="netem_mpi.sh", netem_prefix="x", timeout=60.0, force=False, table_only=False)
    vars(a).update(max_wait_quiet=0.0, load_limit=0.0, **kw)
    return a


def test_contender_arguments_and_environment(tmp_path):
    a = settings(tmp_path)
    common = adaptive_lm.cell_args("adam", 3, "OUT", a)
    assert common[common.index("--epochs") + 1] == "2" and common[common.index("--max-steps") + 1] == "100"
    assert common[common.index("--seed") + 1] == "3" and common[common.index("--warmup-steps") + 1] == "20"
    assert common[common.index("--clip") + 1] == "0.25"
    assert adaptive_lm.contender_args("onebit-adam", a) == ["--optimizer", "onebit-adam", "--freeze-step", "30"]
    assert adaptive_lm.contender_args("onebit-adam-exact", a) == [
        "--optimizer", "onebit-adam", "--freeze-step", "30", "--optimizer-args", "momentum_averaging=exact"]
    zo = adaptive_lm.contender_args("zeroone-adam", a)
    assert zo[:4] == ["--optimizer", "zeroone-adam", "--freeze-step", "30"]
    assert zo[-1] == "var_update_scaler=16,local_step_scaler=30,local_step_clipper=16"
    assert adaptive_lm.contender_args("adam-topk", a)[-1] == "topk:density=0.01"
    assert adaptive_lm.contender_env("adam-fp16-ring")["OMPI_MCA_coll_tuned_allreduce_algorithm"] == "4"
    assert adaptive_lm.contender_env("onebit-adam") == {}
    # the -ring ablations: the same train_lm arguments, launched with the ring allreduce
    assert adaptive_lm.contender_args("onebit-adam-ring", a) == ["--optimizer", "onebit-adam", "--freeze-step", "30"]
    assert adaptive_lm.contender_args("zeroone-adam-ring", a) == zo
    assert adaptive_lm.contender_args("adam-ring", a) == ["--optimizer", "adam"]
    assert adaptive_lm.contender_env("zeroone-adam-ring")["OMPI_MCA_coll_tuned_allreduce_algorithm"] == "4"
    with pytest.raises(ValueError, match="unknown contender 'sgd-ring'"):
        adaptive_lm.contender_args("sgd-ring", a)
    cmd = adaptive_lm.Runner(a).command("local", "adam-fp16-ring", 1, "OUT")
    assert cmd[:6] == ["mpirun", "-np", "4", "--oversubscribe", "--bind-to", "none"]
    assert "OMPI_MCA_coll_tuned_use_dynamic_rules=1" in cmd
    with pytest.raises(ValueError, match="unknown contender"):
        adaptive_lm.contender_args("sgd", a)


def _cell(tmp_path, name, seed, sent_per_step, ppl):
    d = tmp_path / "cells" / "local" / f"{name}-s{seed}"
    d.mkdir(parents=True)
    res = {"epochs": [{"steps": 100, "val_ppl": ppl + 10}, {"steps": 100, "val_ppl": ppl}], "test_ppl": ppl + 1,
           "run_bytes": {"bytes_sent": {"mean": 200 * sent_per_step}, "dense_bytes": {"mean": 200 * 4000.0}},
           "per_step": {"wall": {"mean": 0.5}}}
    (d / "results.json").write_text(json.dumps(res))


def test_table_from_finished_cells(tmp_path):
    a = settings(tmp_path, contenders=["adam", "onebit-adam"])
    for seed, ppl in ((1, 100.0), (2, 104.0)):
        _cell(tmp_path, "adam", seed, 4000.0, ppl)
        _cell(tmp_path, "onebit-adam", seed, 800.0, ppl + 2)
    rows = adaptive_lm.table(a)["rates"]["local"]
    assert rows["adam"]["ratio_vs_adam"] == 1.0 and rows["onebit-adam"]["ratio_vs_adam"] == 5.0
    # (the one summary of every script: median and sample standard deviation too; sqrt(((102-104)² + (106-104)²) / 1))
    assert rows["onebit-adam"]["val_ppl"] == {"mean": 104.0, "median": 104.0, "std": math.sqrt(8.0), "min": 102.0,
                                              "max": 106.0, "n": 2}
    assert rows["adam"]["bytes_per_step"]["mean"] == 4000.0 and rows["adam"]["steps"] == 200
    md = adaptive_lm.markdown(a)
    assert "| onebit-adam | 0.8 KB | 5.0x | 0.500 | 104.0 (102.0-106.0) | 105.0 | 2 |" in md
    assert f"Command: `{adaptive_lm.invocation()}`" in md  # (no cell recorded its command line)
    for name, seed, argv in (("adam", 1, ["--seeds", "1"]), ("onebit-adam", 1, ["--seeds", "1"]),
                             ("adam", 2, ["--seeds", "2", "3"])):
        (tmp_path / "cells" / "local" / f"{name}-s{seed}" / "run.json").write_text(
            json.dumps({"invocation": adaptive_lm.invocation(argv)}))
    md = adaptive_lm.markdown(a)  # the command lines that ran the cells, each once, in table order
    assert ("Command: `python benchmarks/adaptive_lm.py --seeds 1`\n"
            "Command: `python benchmarks/adaptive_lm.py --seeds 2 3`\n") in md
    # adam 102 (100-104): 104 <= 102 + 4 meets the one-sided spread; 5x >= 4x
    assert ("- onebit-adam: >= 4x fewer bytes than adam fp32 over the run (5.0x): met; val ppl 104.0 within "
            "adam's 102.0 + its seed spread (4.0): met") in md


def test_targets_missed_and_not_judged(tmp_path):
    a = settings(tmp_path, contenders=["adam", "onebit-adam", "zeroone-adam"])
    for seed, ppl in ((1, 100.0), (2, 104.0)):
        _cell(tmp_path, "adam", seed, 4000.0, ppl)
        _cell(tmp_path, "onebit-adam", seed, 1100.0, ppl + 5)   # 3.6x; mean 107 > 106
        _cell(tmp_path, "zeroone-adam", seed, 250.0, ppl)       # 16x
    lines = "\n".join(adaptive_lm.targets(adaptive_lm.table(a)["rates"]["local"]))
    assert "onebit-adam: >= 4x fewer bytes than adam fp32 over the run (3.6x): missed" in lines
    assert "val ppl 107.0 within adam's 102.0 + its seed spread (4.0): missed" in lines
    assert "zeroone-adam: >= 15x fewer bytes than adam fp32 over the run (16.0x): met" in lines
    one = adaptive_lm.table(settings(tmp_path, contenders=["adam", "zeroone-adam"], seeds=[1]))["rates"]["local"]
    assert "(0.0): not judged (adam has one seed)" in "\n".join(adaptive_lm.targets(one))


def test_emulated_links_give_netem_every_setting_it_reads(tmp_path):
    """Under netem every NETEM_* variable is a string (a None NETEM_DIR crashed the first run at
    bring-up), and the ranks are launched by netem_mpi.sh with the cell environment exported."""
    a = settings(tmp_path, rates=["100mbit"], netem_prefix="hvdadapt")
    runner = adaptive_lm.Runner(a)
    assert runner.netem.netem_env["NETEM_DIR"] == "/tmp/hvdadapt"
    assert all(isinstance(v, str) for v in runner.netem.netem_env.values())
    cmd = runner.command("100mbit", "onebit-adam", 2, "OUT")
    assert cmd[:5] == ["bash", "netem_mpi.sh", "mpirun", "-n", "4"] and "HOROVOD_CYCLE_TIME" in cmd
    assert cmd[cmd.index("--seed") + 1] == "2"
