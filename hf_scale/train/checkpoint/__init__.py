"""Everything written to OUTPUT_DIR: the layout on disk, checkpoints published atomically and verified, checksums,
the output-directory lock, resharding on resume, preemption, and the final save with its proof."""
