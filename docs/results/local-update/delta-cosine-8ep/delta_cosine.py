"""Round-to-round geometry of the averaged pseudo-gradient Δ̄ in a train_lm.py local-update run.

A diagnostic for docs/results/local-update/README.md ("Why outer momentum stalls the
transformer"), for the ``average`` and ``diloco`` wrappers (not CO2, whose update lands one round
late). It wraps the public ``hvdcomp.local.LocalUpdate.step`` and reads the public ``rounds``,
``anchors`` (θ_start) and ``pseudo_gradients`` (after a round: the averaged Δ̄, float32). For each
round r it records, on rank 0:

* ``norm``: ‖Δ̄_r‖₂ over all parameters;
* ``lag1`` … ``lag8``: cos(Δ̄_r, Δ̄_{r−k});
* ``update_norm`` and ``update_cos``: the outer step's move of θ_start this round,
  u_r = θ_start(before) − θ_start(after), its norm and cos(u_r, Δ̄_r) (averaging: u_r = Δ̄_r).

Usage, from the repository root under mpirun (see run.sh):
``python docs/results/local-update/delta-cosine-8ep/delta_cosine.py OUT.json -- <train_lm.py args>``
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.getcwd(), "mpi_scripts"))
import hvdcomp.local  # noqa: E402
import train_lm  # noqa: E402


def flat(tensors):
    """One float32 host vector of a name -> tensor dict's values (in the dict's order)."""
    return torch.cat([t.detach().float().flatten().cpu() for t in tensors.values()])


def main():
    out_path, argv = sys.argv[1], sys.argv[sys.argv.index("--") + 1:]
    history, rows = [], []
    original = hvdcomp.local.LocalUpdate.step
    cos = torch.nn.functional.cosine_similarity

    def step(self, closure=None):
        before, start = self.rounds, flat(self.anchors)
        loss = original(self, closure)
        if self.rounds != before:
            delta = flat(self.pseudo_gradients)
            update = start - flat(self.anchors)
            row = {"round": self.rounds, "norm": delta.norm().item(), "update_norm": update.norm().item(),
                   "update_cos": cos(update, delta, dim=0).item()}
            for k in range(1, min(8, len(history)) + 1):
                row[f"lag{k}"] = cos(delta, history[-k], dim=0).item()
            rows.append(row)
            history.append(delta)
            del history[:-8]
        return loss

    hvdcomp.local.LocalUpdate.step = step
    train_lm.main(argv)
    if os.environ.get("OMPI_COMM_WORLD_RANK", "0") == "0":
        with open(out_path, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
