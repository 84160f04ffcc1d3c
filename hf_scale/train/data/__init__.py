"""The data path: load the sources, detect the format, tokenize with label masking, pack, collate; the embedded
demo model and dataset. Imports nothing from the other rooms of hf_scale.train."""
