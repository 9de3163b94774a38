#!/usr/bin/env python
"""Bandwidth-limited benchmark driver: emulated hosts (network namespaces, tc-shaped links), one
rank per host, Open MPI over TCP; every contender at every link rate, one launch per cell.

Uses ``../shared/tools/netem_mpi.sh`` (``--netem``): ``up N`` creates hosts h1..hN (10.77.0.1..N),
``shape RATE`` sets every link to RATE (full duplex, tbf), ``mpirun -n K ... -- prog`` starts
mpirun in h1 with ranks on h1..hK, ``down`` removes everything. Teardown runs on normal exit, on
exceptions and on SIGINT/SIGTERM/SIGHUP.

Benches (``--bench``):

* ``e2e`` (default): ``benchmarks/e2e_lm.py`` for each contender; results in
  ``OUTPUT/cells/<rate>/<contender-slug>.json`` (``-np<N>`` is appended to the slug when N != 4);
* ``comm``: ``benchmarks/comm_lm.py`` (communication only, alpha-beta sweep) at each ``--np``
  (default 2 and 4); results in ``OUTPUT/cells/<rate>/comm-np<N>.json``.

Every cell runs under a timeout (``--timeout`` seconds, default estimated from the model, link
rate and step counts; passed to netem_mpi.sh as NETEM_TIMEOUT too) and gets the same environment
(``CELL_ENV`` plus ``--env``; exported to every rank with ``mpirun -x``). A contender's own settings
(:func:`peers.launch_env`, e.g. Open MPI's ring allreduce for ``horovod-ring:*``) go to its
``mpirun`` only, as ``-x KEY=VALUE``; the driver checks afterwards that every rank saw them and
that no other contender did (``driver.env_check``). A failed or timed-out cell
still gets a JSON: ``status: "failed"``, the error lines and the tail of its output (the whole
output is in the ``.log`` next to it). Finished cells (ok or failed) are skipped when the driver is
run again, unless ``--force`` (rerun all) or ``--retry-failed``. ``OUTPUT/run.json`` holds the
settings, commands and per-cell status.

Example (the full grid; see benchmarks/README.md)::

    python benchmarks/netem_e2e.py --output runs/netem-e2e --model medium
"""
from __future__ import annotations

import argparse
import datetime
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional

import hygiene
import peers

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
from hvdcomp.launch import MPI_ENV  # noqa: E402  (the one definition of the launch environment)
from mpi_scripts.results import read_json, write_json  # noqa: E402

DEFAULT_NETEM = os.path.normpath(os.path.join(ROOT, "..", "shared", "tools", "netem_mpi.sh"))
DEFAULT_PYTHON = os.path.join(ROOT, ".venv", "bin", "python")
log = logging.getLogger("netem_e2e")

DEFAULT_CONTENDERS = [
    "hvdcomp:none", "hvdcomp:fp16", "hvdcomp:topk:density=0.01", "hvdcomp:topk:density=0.001",
    "hvdcomp:dgc:density=0.01", "hvdcomp:dgc:density=0.001", "hvdcomp:qsgd", "hvdcomp:powersgd:rank=2",
    "horovod:none", "horovod:fp16", "horovod-ring:none", "horovod-ring:fp16", "ddp:none", "ddp:fp16",
    "ddp:powersgd",
]
DEFAULT_RATES = ["none", "1gbit", "100mbit", "10mbit"]
#: the same for every contender (ranks outnumber cores: yield instead of busy-polling)
CELL_ENV = {k: v for k, v in {**MPI_ENV, "HOROVOD_CYCLE_TIME": "20"}.items()
            if k != "OMPI_MCA_rmaps_base_oversubscribe"}  # (one rank per emulated host)
#: rough seconds of forward+backward+update per step on this 2-core machine (4 ranks), for timeouts
COMPUTE_SECONDS = {"small": 2.0, "medium": 5.0, "large": 12.0, "transformer": 3.0}
#: LSTM hidden size per --model (the LSTM sizes; see hvdcomp.lm.MODEL_SIZES)
HIDDEN = {"small": 100, "medium": 300, "large": 500}
#: --model choices: the LSTM sizes, and bench_models' transformer encoder (synthetic data)
MODELS = sorted(HIDDEN) + ["transformer"]


class Interrupted(Exception):
    """SIGTERM / SIGHUP received."""


# ---- small helpers -----------------------------------------------------------------------------
def rate_bps(rate: str) -> Optional[float]:
    """``"100mbit"`` -> 1e8 bit/s; ``"none"`` -> None (unlimited).

    Raises:
        ValueError: anything else.
    """
    if rate == "none":
        return None
    m = re.fullmatch(r"([0-9.]+)\s*([kmg]?)bit", rate.lower())
    if not m:
        raise ValueError(f"bad rate {rate!r}: use none or e.g. 10gbit, 1gbit, 100mbit, 500kbit")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def slug(contender: str) -> str:
    """File-name form of a contender: ``hvdcomp:topk:density=0.01`` -> ``hvdcomp_topk_density-0.01``."""
    return re.sub(r"[^A-Za-z0-9.\-]+", "_", contender.replace("=", "-")).strip("_")


def model_parameters(model: str, vocab: int = 10000, layers: int = 2) -> int:
    """Parameters of the worker's model: LSTMLM (tied embedding, 2 layers): V·H + L·(8H² + 8H);
    the transformer: counted on ``bench_models.Transformer`` itself (imports torch)."""
    if model == "transformer":
        import bench_models

        return sum(p.numel() for p in bench_models.make_model(model).parameters())
    h = HIDDEN[model]
    return vocab * h + layers * (8 * h * h + 8 * h)


def error_lines(text: str, limit: int = 8) -> List[str]:
    """Lines that explain a failure: exception messages first (``...Error: ...``, C++ ``what():``,
    gloo/MPI aborts), then other lines mentioning an error; backtrace frames are left out."""
    strong = re.compile(r"(\w+(Error|Exception)\b|what\(\):|doesn't match|EnforceNotMet|Segmentation fault|"
                        r"Killed|FATAL|timed out|signal \d+)")
    weak = re.compile(r"(error|abort|fail)", re.IGNORECASE)
    frame = re.compile(r"^\[[^\]]+\] \[ *\d+\] ")  # "[h1:123] [ 3] /lib/...": a backtrace frame
    first: List[str] = []
    second: List[str] = []
    for line in (ln.strip() for ln in text.splitlines()):
        if not line or frame.match(line):
            continue
        for bucket, pat in ((first, strong), (second, weak)):
            if pat.search(line):
                if line not in first and line not in second:
                    bucket.append(line)
                break
    return (first[-limit:] + second[-limit:])[:limit]


# ---- the driver --------------------------------------------------------------------------------
def add_quiet_arguments(p: argparse.ArgumentParser) -> None:
    """``--max-wait-quiet`` and ``--load-limit``, read by :meth:`Driver.run_cell` (and by every
    driver built on it: netem_local.py, adaptive_lm.py)."""
    p.add_argument("--max-wait-quiet", type=float, default=600.0,
                   help="seconds to wait before a cell for the load average to drop to the core count; a cell "
                        "started on a loaded machine is marked loaded (hygiene.py) and left out of verdicts")
    p.add_argument("--load-limit", type=float, default=0.0,
                   help="load average above which a cell counts as loaded (0: the number of cores); a test "
                        "of the harness itself, which times nothing, raises it")


class Driver:
    """Owns the namespaces, the running cell and run.json."""

    def __init__(self, args):
        self.args = args
        self.proc: Optional[subprocess.Popen] = None
        self.hosts = args.hosts or max(args.np)  # one rank per host, or --hosts nodes of several
        self.netem_env = {"NETEM_PYTHON": args.python, "NETEM_SKIP_INSTALL": "1",
                          "NETEM_PREFIX": args.netem_prefix,
                          "NETEM_DIR": args.netem_dir or f"/tmp/{args.netem_prefix}"}
        self.cell_env = {**CELL_ENV, **dict(kv.split("=", 1) for kv in args.env)}
        self.run_path = os.path.join(args.output, "run.json")
        old = read_json(self.run_path) or {}
        self.run = {
            "bench": args.bench,
            "argv": sys.argv,
            "settings": {k: v for k, v in vars(args).items()},
            "cell_env": self.cell_env,
            "netem_env": self.netem_env,
            "started": datetime.datetime.now().isoformat(timespec="seconds"),
            "cpu": hygiene.cpu_identity(),  # (per-cell load states are under each cell's "machine")
            "cells": old.get("cells", {}),
            "history": old.get("history", []) + ([{k: old.get(k) for k in ("started", "finished", "argv", "cpu")}]
                                                  if old else []),
        }
        self.up = False

    # -- netem --
    def netem(self, *cmd: str, timeout: float = 300, env: Optional[Dict[str, str]] = None) -> None:
        full = ["bash", self.args.netem, *cmd]
        log.info("$ %s", " ".join(map(shlex.quote, full)))
        subprocess.run(full, check=True, timeout=timeout, env={**self.base_env(), **self.netem_env, **(env or {})})

    def base_env(self) -> Dict[str, str]:
        """The driver's environment without stray HOROVOD_* / OMPI_MCA_* settings (every cell gets
        exactly CELL_ENV)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "OMPI_MCA_"))}
        return {**env, **self.cell_env}

    def namespace_pids(self) -> List[int]:
        pids = []
        for i in range(1, self.hosts + 1):
            res = subprocess.run(["ip", "netns", "pids", f"{self.args.netem_prefix}-h{i}"],
                                 capture_output=True, text=True)
            pids += [int(p) for p in res.stdout.split() if p.isdigit()]
        return pids

    def kill_leftovers(self, grace: float = 5.0) -> None:
        """SIGKILL processes still running inside our emulated hosts (ours: we created them) after
        ``grace`` seconds for them to exit by themselves."""
        deadline = time.perf_counter() + grace
        while self.namespace_pids() and time.perf_counter() < deadline:
            time.sleep(0.5)
        for pid in self.namespace_pids():
            try:
                os.kill(pid, signal.SIGKILL)
                log.warning("killed leftover process %d in the emulated hosts", pid)
            except ProcessLookupError:
                pass

    def bring_up(self) -> None:
        stray = [h for h in os.environ if h.startswith(("HOROVOD_", "OMPI_MCA_")) and h not in self.cell_env]
        if stray:
            log.warning("not passed to cells (every cell gets the same CELL_ENV; use --env): %s", stray)
        self.up = True  # even a partial `up` must be torn down
        self.netem("up", str(self.hosts), timeout=120)

    def tear_down(self) -> None:
        """Stop the running cell and remove the namespaces (further signals are ignored meanwhile)."""
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        if self.proc is not None and self.proc.poll() is None:
            self.stop_proc()
        if self.up:
            try:
                self.netem("down", timeout=120)
            except Exception as e:  # noqa: BLE001 - keep tearing down, report
                log.error("netem down failed: %s", e)
            self.up = False

    def stop_proc(self) -> None:
        """End the running cell: its process group, then whatever is left in the namespaces."""
        proc = self.proc
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        self.kill_leftovers()

    # -- cells --
    def cells(self) -> List[dict]:
        """(rate, np, name, worker args) of every cell, in run order."""
        a, out = self.args, []
        for rate in a.rates:
            slow = rate in a.slow_rates
            for np_ in a.np:
                if a.bench == "comm":
                    budget = a.comm_budget_slow if slow else a.comm_budget
                    wargs = [os.path.join(HERE, "comm_lm.py"), "--model", a.model, "--reps", str(a.comm_reps),
                             "--budget", str(budget), "--max-call-seconds", str(a.comm_max_call),
                             "--methods", *a.methods]
                    out.append({"rate": rate, "np": np_, "name": f"comm-np{np_}", "contender": "comm",
                                "args": wargs + shlex.split(a.worker_args), "slow": slow})
                    continue
                for c in a.contenders:
                    wargs = [os.path.join(HERE, "e2e_lm.py"), "--contender", c, "--model", a.model,
                             "--steps", str(a.steps_slow if slow else a.steps),
                             "--warmup", str(a.warmup_slow if slow else a.warmup),
                             "--eval-every", str(a.eval_every), "--compute-ref-steps", str(a.compute_ref_steps)]
                    if a.data:
                        wargs += ["--data", a.data]
                    name = slug(c) + ("" if np_ == 4 else f"-np{np_}")
                    out.append({"rate": rate, "np": np_, "name": name, "contender": c,
                                "args": wargs + shlex.split(a.worker_args), "slow": slow})
        return out

    def timeout_for(self, cell: dict) -> float:
        """Seconds allowed for one cell (``--timeout``, else an estimate with a 3x margin)."""
        a = self.args
        if a.timeout:
            return a.timeout
        bps, n = rate_bps(cell["rate"]), cell["np"]
        dense = 0.0 if bps is None else 2 * (n - 1) / n * 4 * model_parameters(a.model) * 8 / bps
        compute = COMPUTE_SECONDS[a.model]
        if a.bench == "comm":
            budget = a.comm_budget_slow if cell["slow"] else a.comm_budget
            return 600 + (len(a.methods) + 15) * 1.5 * budget + 10 * dense
        steps = (a.steps_slow + a.warmup_slow) if cell["slow"] else (a.steps + a.warmup)
        evals = 1 + (steps // a.eval_every + 1 if a.eval_every else 0)
        return 240 + 3 * (steps * (compute + dense) + a.compute_ref_steps * compute + evals * compute)

    def contender_env(self, cell: dict) -> Dict[str, str]:
        """This cell's own environment on top of CELL_ENV (:func:`peers.launch_env`; none for comm)."""
        return {} if cell["contender"] == "comm" else peers.launch_env(cell["contender"])

    def mpirun_command(self, cell: dict, out_json: str) -> List[str]:
        """``netem_mpi.sh mpirun`` for one cell: CELL_ENV exported by name (``-x KEY``, values from the
        launch environment), the contender's own settings by value (``-x KEY=VALUE``, visible in
        the command and in run.json)."""
        xs = [t for k in sorted(self.cell_env) for t in ("-x", k)]
        xs += [t for k, v in sorted(self.contender_env(cell).items()) for t in ("-x", f"{k}={v}")]
        return ["bash", self.args.netem, "mpirun", "-n", str(cell["np"]), *xs,
                *shlex.split(self.args.mpirun_args), "--", self.args.python, *cell["args"], "--output", out_json]

    def launch(self, cmd: List[str], env: Dict[str, str], out_json: str, log_path: str, timeout: float) -> dict:
        """Run one mpirun command; output to ``log_path``. Returns returncode, timed_out, hung_at_exit.

        ``timeout`` is enforced twice: by netem_mpi.sh (NETEM_TIMEOUT, fires first) and here (+60 s).
        A job that wrote an ok results JSON but has not exited ``--exit-grace`` seconds later is
        stopped (``hung_at_exit``; its results are kept).
        """
        t0, timed_out, hung, results_at = time.perf_counter(), False, False, None
        with open(log_path, "w") as logf:
            self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                         start_new_session=True)
            while True:
                try:
                    rc = self.proc.wait(timeout=2)
                    break
                except subprocess.TimeoutExpired:
                    now = time.perf_counter()
                    if results_at is None and (read_json(out_json) or {}).get("status") == "ok":
                        results_at = now
                    timed_out = now - t0 > timeout + 60
                    hung = results_at is not None and now - results_at > self.args.exit_grace
                    if timed_out or hung:
                        self.stop_proc()
                        rc = self.proc.returncode
                        break
        self.proc = None
        if hung:
            log.warning("results written, but the job did not exit within %.0f s: stopped", self.args.exit_grace)
        return {"returncode": rc, "timed_out": (timed_out or rc in (124, 137)) and not hung,
                "hung_at_exit": hung, "elapsed_s": time.perf_counter() - t0}

    def run_cell(self, cell: dict) -> dict:
        """Launch one cell (up to ``--attempts`` times while it fails); returns its run.json entry."""
        a = self.args
        cdir = os.path.join(a.output, "cells", cell["rate"])
        out_json = os.path.abspath(os.path.join(cdir, cell["name"] + ".json"))
        log_path = os.path.join(cdir, cell["name"] + ".log")
        os.makedirs(cdir, exist_ok=True)
        timeout = self.timeout_for(cell)
        cmd = self.mpirun_command(cell, out_json)
        env = {**self.base_env(), **self.netem_env, "NETEM_TIMEOUT": str(int(timeout))}
        attempts: List[dict] = []
        limit = a.load_limit or None
        machine_before = hygiene.wait_quiet(a.max_wait_quiet, log=log.warning, limit=limit)
        for attempt in range(1, a.attempts + 1):
            if os.path.exists(out_json):
                os.remove(out_json)
            log.info("cell %s/%s (np %d, timeout %.0f s, attempt %d/%d): %s", cell["rate"], cell["name"],
                     cell["np"], timeout, attempt, a.attempts, " ".join(map(shlex.quote, cmd)))
            run = self.launch(cmd, env, out_json, log_path, timeout)
            with open(log_path, errors="replace") as f:
                output = f.read()
            res = read_json(out_json)
            if res is not None and res.get("status") == "ok":
                attempts.append({**run, "status": "ok"})
                break
            if run["timed_out"]:
                reason = f"timed out after {timeout:.0f} s"
            elif run["returncode"] == 0:
                reason = "exit status 0 but no results JSON"
            else:
                reason = f"exit status {run['returncode']}"
            res = {"status": "failed", "contender": cell["contender"], "bench": a.bench, "model": a.model,
                   "reason": reason,
                   "error": error_lines(output), "output_tail": output[-a.tail_chars:]}
            attempts.append({**run, "status": "failed", "reason": reason, "error": res["error"][-3:]})
            self.kill_leftovers()
            if attempt < a.attempts:
                os.replace(log_path, f"{log_path[:-4]}.attempt{attempt}.log")
                log.warning("cell %s/%s failed (%s): retrying", cell["rate"], cell["name"], reason)
        elapsed = sum(r["elapsed_s"] for r in attempts)
        machine = {"before": machine_before, "after": hygiene.machine_state(),
                   "loaded": hygiene.is_loaded(machine_before, limit)}
        res["driver"] = {"machine": machine, "command": cmd, "cell_env": self.cell_env, "netem_timeout_s": int(timeout),
                         **{k: attempts[-1][k] for k in ("returncode", "timed_out", "hung_at_exit")},
                         "elapsed_s": elapsed, "attempts": attempts, "log": os.path.abspath(log_path),
                         "rate": cell["rate"], "np": cell["np"]}
        if res["status"] == "ok":
            res["driver"]["env_check"] = self.check_env(res, cell)
        write_json(out_json, res)
        entry = {"status": res["status"], "rate": cell["rate"], "np": cell["np"], "contender": cell["contender"],
                 "json": os.path.relpath(out_json, a.output), "elapsed_s": round(elapsed, 1),
                 "attempts": len(attempts), "hung_at_exit": attempts[-1]["hung_at_exit"],
                 "loaded": machine["loaded"], "load_before": machine_before["load_1min"],
                 "command": " ".join(map(shlex.quote, cmd))}
        if res["status"] == "ok" and a.bench == "e2e":
            entry["step_median_s"] = res["timing"]["step"]["median"]
            entry["comm_critical_s"] = res["timing"]["comm_critical_seconds"]
            ppl = res.get("final_val_ppl")
            log.info("cell %s/%s ok in %.0f s: %.3f s/step (median), compute-only %.3f s, val ppl %.1f",
                     cell["rate"], cell["name"], elapsed, entry["step_median_s"],
                     (res["timing"]["compute_reference"] or {}).get("median", float("nan")),
                     float("nan") if ppl is None else ppl)
        elif res["status"] == "ok":
            log.info("cell %s/%s ok in %.0f s", cell["rate"], cell["name"], elapsed)
        else:
            entry["reason"], entry["error"] = res["reason"], res["error"][-3:]
            log.error("cell %s/%s FAILED (%s): %s", cell["rate"], cell["name"], res["reason"],
                      " | ".join(res["error"][-3:]) or "(no error line; see the log)")
        return entry

    def check_env(self, res: dict, cell: dict) -> dict:
        """Did CELL_ENV and the contender's own settings reach every rank, and did no rank get
        another contender's settings (the worker records each rank's environment)?"""
        env = res.get("env", {})
        want = {**self.cell_env, **self.contender_env(cell)}
        missing = {k: v for k, v in want.items() if k != "PYTHONUNBUFFERED" and env.get(k) != v}
        foreign = {} if cell["contender"] == "comm" else {
            k: env[k] for k in peers.foreign_env_keys(cell["contender"]) if k in env and k not in want}
        ok = not missing and not foreign and res.get("env_same_on_all_ranks", False)
        if not ok:
            log.warning("environment check failed: missing/different %s, another contender's %s, same on "
                        "all ranks: %s", missing, foreign, res.get("env_same_on_all_ranks"))
        return {"ok": ok, "missing_or_different": missing, "foreign": foreign,
                "same_on_all_ranks": res.get("env_same_on_all_ranks")}

    def save_run(self, finished: bool = False) -> None:
        if finished:
            self.run["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
        write_json(self.run_path, self.run)

    def main(self) -> int:
        a = self.args
        cells = self.cells()
        todo = []
        for cell in cells:
            key = f"{cell['rate']}/{cell['name']}"
            old = read_json(os.path.join(a.output, "cells", cell["rate"], cell["name"] + ".json"))
            done = old is not None and (old.get("status") == "ok" or not a.retry_failed)
            if done and not a.force:
                log.info("skip %s (%s; --force to rerun%s)", key, old.get("status"),
                         ", --retry-failed" if old.get("status") != "ok" else "")
                self.run["cells"].setdefault(key, {"status": old.get("status"), "rate": cell["rate"],
                                                   "np": cell["np"], "contender": cell["contender"]})
            else:
                todo.append(cell)
        log.info("%d cells, %d to run, output %s", len(cells), len(todo), a.output)
        if a.dry_run:
            for cell in todo:
                print(" ".join(map(shlex.quote, self.mpirun_command(cell, "OUT.json"))),
                      f"# timeout {self.timeout_for(cell):.0f} s")
            return 0
        os.makedirs(a.output, exist_ok=True)
        self.save_run()
        if not todo:
            return 0
        failed = 0
        try:
            self.bring_up()
            shaped = None
            for cell in todo:
                if cell["rate"] != shaped:
                    self.netem("shape", cell["rate"], timeout=60)
                    shaped = cell["rate"]
                entry = self.run_cell(cell)
                failed += entry["status"] != "ok"
                self.run["cells"][f"{cell['rate']}/{cell['name']}"] = entry
                self.save_run()
        finally:
            self.tear_down()
            self.save_run(finished=True)
        log.info("done: %d cells run, %d failed; %s", len(todo), failed, self.run_path)
        return 1 if failed else 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--bench", choices=["e2e", "comm"], default="e2e")
    p.add_argument("--output", default="runs/netem-e2e", help="results directory")
    p.add_argument("--rates", nargs="+", default=DEFAULT_RATES, help="link rates (none = unshaped)")
    p.add_argument("--contenders", nargs="+", default=DEFAULT_CONTENDERS, help="e2e contenders")
    p.add_argument("--methods", nargs="+", default=None,
                   help="comm bench: hvdcomp specs (default: the hvdcomp contenders' specs)")
    p.add_argument("--np", nargs="+", type=int, default=None, help="ranks (default 4; comm: 2 4)")
    p.add_argument("--hosts", type=int, default=0,
                   help="emulated hosts (0: one per rank); ranks are placed round robin, those on one "
                        "host talk through shared memory (unshaped), e.g. --np 8 --hosts 2: 2 nodes x 4")
    p.add_argument("--model", default="medium", choices=MODELS,
                   help="LSTM size (corpus), or transformer (bench_models' encoder, synthetic data)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per e2e cell")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps per e2e cell")
    p.add_argument("--steps-slow", type=int, default=4, help="timed steps at --slow-rates")
    p.add_argument("--warmup-slow", type=int, default=1, help="warm-up steps at --slow-rates")
    p.add_argument("--slow-rates", nargs="*", default=["10mbit"], help="rates using the -slow step counts")
    p.add_argument("--eval-every", type=int, default=0, help="validation every E steps (0: at the end)")
    p.add_argument("--compute-ref-steps", type=int, default=3, help="communication-free reference steps")
    p.add_argument("--data", default=None, help="corpus for e2e_lm.py (default: Tiny Shakespeare)")
    p.add_argument("--comm-reps", type=int, default=10, help="comm bench: repetitions per case")
    p.add_argument("--comm-budget", type=float, default=60.0, help="comm bench: seconds per case")
    p.add_argument("--comm-budget-slow", type=float, default=20.0, help="comm bench: seconds per case, slow rates")
    p.add_argument("--comm-max-call", type=float, default=20.0, help="comm bench: --max-call-seconds")
    p.add_argument("--worker-args", default="", help="extra arguments for the worker script (one string)")
    p.add_argument("--mpirun-args", default="", help="extra mpirun options (one string), e.g. "
                   "'--mca coll_tuned_use_dynamic_rules 1 --mca coll_tuned_allreduce_algorithm 4'")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for every cell (exported to all ranks)")
    p.add_argument("--timeout", type=float, default=0, help="seconds per cell (0: estimated per cell)")
    p.add_argument("--attempts", type=int, default=1,
                   help="launches per cell while it fails (every attempt is recorded)")
    add_quiet_arguments(p)
    p.add_argument("--exit-grace", type=float, default=60.0,
                   help="seconds a job may take to exit after writing its results before it is stopped")
    p.add_argument("--tail-chars", type=int, default=6000, help="output kept in a failed cell's JSON")
    p.add_argument("--force", action="store_true", help="rerun finished cells")
    p.add_argument("--retry-failed", action="store_true", help="rerun cells that failed before")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--netem", default=DEFAULT_NETEM, help="path of netem_mpi.sh")
    p.add_argument("--netem-prefix", default="hvde2e", help="namespace prefix (NETEM_PREFIX)")
    p.add_argument("--netem-dir", default=None, help="helper files (NETEM_DIR; default /tmp/<prefix>)")
    p.add_argument("--python", default=DEFAULT_PYTHON if os.path.exists(DEFAULT_PYTHON) else sys.executable,
                   help="python with torch, horovod, mpi4py (used on every rank)")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    args.np = args.np or ([2, 4] if args.bench == "comm" else [4])
    args.output = os.path.abspath(args.output)
    if args.methods is None:
        args.methods = [c.split(":", 1)[1] for c in args.contenders if c.startswith("hvdcomp:")]
    for r in args.rates:
        try:
            rate_bps(r)
        except ValueError as e:
            p.error(str(e))
    bad = [kv for kv in args.env if "=" not in kv]
    if bad:
        p.error(f"--env wants KEY=VALUE, got {bad}")
    if min(args.np) < 1 or args.steps < 1 or args.steps_slow < 1 or args.attempts < 1:
        p.error("--np, --steps, --steps-slow and --attempts must be >= 1")
    if not os.path.exists(args.netem):
        p.error(f"--netem {args.netem} does not exist")
    for c in args.contenders:
        try:
            peers.split(c)
        except ValueError as e:
            p.error(str(e))
        clash = sorted(set(kv.split("=", 1)[0] for kv in args.env) & set(peers.launch_env(c)))
        if clash:
            p.error(f"--env sets {clash}, which contender {c} sets for itself: drop them from --env")
    if args.model == "transformer" and (args.eval_every or args.data):
        p.error("--model transformer trains on synthetic data (no validation): use --eval-every 0, no --data")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="[%(asctime)s netem_e2e] %(message)s", datefmt="%H:%M:%S")
    if os.geteuid() != 0 and not args.dry_run:
        log.error("netem_mpi.sh needs root (network namespaces, tc)")
        return 2
    driver = Driver(args)

    def on_signal(signum, _frame):
        raise Interrupted(f"signal {signal.Signals(signum).name}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        return driver.main()
    except (Interrupted, KeyboardInterrupt) as e:
        log.error("interrupted (%s): namespaces torn down; rerun the same command to resume", e or "SIGINT")
        return 130


if __name__ == "__main__":
    sys.exit(main())
