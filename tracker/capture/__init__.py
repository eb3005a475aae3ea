"""Capture: the Recorder and the hook functions that stream tensors into a hookline run."""
