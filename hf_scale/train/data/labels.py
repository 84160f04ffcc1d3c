"""The label value the loss ignores: prompt tokens under completion-only loss, padding, the first token of each
packed example. -100 is the default ``ignore_index`` of torch's cross-entropy, which transformers' models and
collators use too. Its own module so that tokenization (pipeline.py) and packing (packing.py) share it without
importing each other."""

IGNORE_INDEX = -100
