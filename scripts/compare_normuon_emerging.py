"""dmuon's NorMuon against NVIDIA Emerging-Optimizers' ``AdaptiveMuon(moment2_method="normuon")``, one matrix on
one CPU process, and what differs. Not part of the suite: Emerging-Optimizers needs Python >= 3.12 and is not a
dependency.

    pip download --no-deps --python-version 3.12 --only-binary=:all: -d /tmp/eo "emerging-optimizers==0.3.0"
    python -m zipfile -e /tmp/eo/emerging_optimizers-0.3.0-py3-none-any.whl /tmp/eo/src
    PYTHONPATH=$PWD python scripts/compare_normuon_emerging.py /tmp/eo/src

On Python 3.11 the script supplies ``typing.override`` (3.12's, a no-op decorator) before importing it.

Both are set to the same algorithm where they have a switch for it: Keller Jordan's coefficients, 5 steps,
Nesterov, decoupled decay, the norm-preserving form with Moonshot's scale (dmuon: ``rms_target=None,
adjust_lr_fn="match_rms_adamw"``; Emerging-Optimizers: ``scale_mode="spectral", extra_scale_factor=0.2``). What
stays different is printed per case: Emerging-Optimizers runs Newton-Schulz in float32 (dmuon's "direct" form
is torch's bfloat16 iteration), averages the second moment along the longer dimension (a wide matrix's
*columns*; dmuon and the paper: always rows, one value per output neuron) and divides by ``rsqrt(max(v, eps))``
(dmuon and the paper: ``sqrt(v) + eps``).
"""

from __future__ import annotations

import sys
import typing

import torch

from dmuon.optim.normuon import NorMuonHParams, normuon_update_batch_
from dmuon.optim.update import muon_update_


def main(path: str) -> None:
    if not hasattr(typing, "override"):
        typing.override = lambda f: f  # type: ignore[attr-defined]
    sys.path.insert(0, path)
    from emerging_optimizers.orthogonalized_optimizers.adaptive_muon import AdaptiveMuon
    from emerging_optimizers.orthogonalized_optimizers.muon import Muon as EOMuon

    kj = (3.4445, -4.7750, 2.0315)
    common = dict(lr=0.01, momentum=0.95, weight_decay=0.1, nesterov=True, coefficient_type="simple", num_ns_steps=5,
                  scale_mode="spectral", extra_scale_factor=0.2, fp32_matmul_prec="highest")
    for shape in ((96, 48), (48, 96)):
        diffs = {}
        for algorithm in ("muon", "normuon"):
            torch.manual_seed(0)
            w0 = torch.randn(shape) * shape[1] ** -0.5
            grads = [torch.randn(shape) for _ in range(10)]
            ref = torch.nn.Parameter(w0.clone())
            eo = (AdaptiveMuon([ref], moment2_method="normuon", beta2=0.95, eps=1e-8, **common)
                  if algorithm == "normuon" else EOMuon([ref], **common))
            mine, buf, v = w0.clone(), torch.zeros(shape), torch.zeros(shape[0], 1)
            # the Muon baseline (dmuon's Muon update reads the same record) measures the Newton-Schulz precision alone
            hp = NorMuonHParams(lr=0.01, momentum=0.95, weight_decay=0.1, nesterov=True, ns_coefficients=kj,
                                rms_target=None, adjust_lr_fn="match_rms_adamw", ns_backend="direct")
            for g in grads:
                ref.grad = g.clone()
                eo.step()
                if algorithm == "normuon":
                    normuon_update_batch_([mine], [g.clone()], [buf], [v], hp)
                else:
                    muon_update_(mine, g.clone(), buf, hp)
            diffs[algorithm] = ((mine - ref.detach()).norm() / (ref.detach() - w0).norm()).item()
        print(f"{shape}: |dmuon - EO| / |EO's total step| over 10 steps: Muon {diffs['muon']:.2e} (Newton-Schulz in "
              f"bfloat16 vs float32), NorMuon {diffs['normuon']:.2e}")


if __name__ == "__main__":
    main(sys.argv[1])
