"""train.py's implementation: arguments, data pipeline, embedded demo assets, both training loops."""
