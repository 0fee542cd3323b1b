"""Backend finalizers. Each imports its tracking library lazily, at finalization time, and only
if the program itself imported it."""
