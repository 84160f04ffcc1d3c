"""hf_scale.clusters.slurm: the SLURM target's sbatch script (its runs under stand-ins of srun/scontrol are in
tests/generators/test_generators.py, beside the launch scripts they run; a real SLURM's in tests/slurm)."""

from __future__ import annotations

from hf_scale.clusters.slurm import sbatch_script
from hf_scale.config.presets import get_preset


def test_sbatch_uses_one_task_per_node_and_requeues_on_exit_75():
    text = sbatch_script(get_preset("fsdp2_hybrid_multinode"), "run", header="h")
    for directive in (
        "--nodes=2",
        "--ntasks-per-node=1",
        "--gpus-per-node=8",
        "--signal=USR1@120",
        "--requeue",
    ):
        assert f"#SBATCH {directive}\n" in text
    assert "scontrol show hostnames \"$SLURM_JOB_NODELIST\" | awk 'NR == 1'" in text
    assert 'if [ "$status" -eq 75 ]; then' in text and 'scontrol requeue "$SLURM_JOB_ID"' in text
    assert "srun" in text and "launch/run.accelerate.sh" in text
