"""train.py's contract with everything that hands it values: the values a launcher's config fixes and how they
reconcile with train.py's flags (launch_values)."""
