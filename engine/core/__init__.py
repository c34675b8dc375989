"""CPU-side bookkeeping of the step: requests, the paged KV-cache manager and the scheduler (no torch.cuda)."""
