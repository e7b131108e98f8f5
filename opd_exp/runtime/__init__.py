"""What every run needs around the math: errors, checkpoints, guards, processes, precision, files."""
