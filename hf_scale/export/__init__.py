"""`hf-scale export CHECKPOINT_DIR OUT_DIR`: a training checkpoint -> a Hugging Face model directory.

:mod:`~hf_scale.export.command` registers the command and writes the model (built on the meta device, filled
one tensor at a time, written beside OUT_DIR and renamed into place); :mod:`~hf_scale.export.sources` reads the
weights of each checkpoint format lazily.
"""

from hf_scale.export.command import export, register, run_export

__all__ = ["export", "register", "run_export"]
