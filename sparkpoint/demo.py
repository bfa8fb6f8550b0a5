"""`make run` until the pipeline lands: checkpoint and restore a state on local storage."""
