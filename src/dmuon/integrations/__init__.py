"""Glue between dmuon and training frameworks; each submodule imports its framework on demand.

``dmuon.dedicate_params`` calls :func:`activate_installed_glue`, so a script that uses HF Trainer,
Accelerate or DeepSpeed needs no extra line; torchtitan's glue is imported explicitly
(``from dmuon.integrations import torchtitan``), since it is reached through torchtitan's own config.
"""

from __future__ import annotations

import sys
import warnings

from .. import engines

__all__ = ["activate_installed_glue"]


def activate_installed_glue() -> None:
    """Install the Trainer/Accelerate glue (``dmuon.integrations.hf``) when the script already imported
    transformers or accelerate, and the DeepSpeed glue (``dmuon.integrations.deepspeed``) when it imported
    deepspeed; never imports any of them itself, so a plain PyTorch script pays nothing.

    Example::

        import transformers, dmuon
        dmuon.dedicate_params(model, mesh, predicate)    # calls this: Trainer now knows dmuon models
    """
    if "deepspeed" in sys.modules:
        try:
            from . import deepspeed  # noqa: F401  (importing installs the glue)
        except (ImportError, RuntimeError) as e:
            warnings.warn(f"dmuon: DeepSpeed glue not installed: {e}", stacklevel=3)
    if "transformers" not in sys.modules and "accelerate" not in sys.modules:
        return
    try:
        from . import hf  # noqa: F401  (importing installs the glue)
    except (ImportError, RuntimeError) as e:
        warnings.warn(f"dmuon: Trainer/Accelerate glue not installed: {e}", stacklevel=3)


engines.register_glue(activate_installed_glue)  # dmuon.Muon's build calls it too
