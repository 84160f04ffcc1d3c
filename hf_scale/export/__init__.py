"""Turning a training checkpoint into a Hugging Face model directory (the command: hf_scale.commands.export):
checkpoint_readers reads each checkpoint format's weights lazily; qlora merges a QLoRA adapter."""
